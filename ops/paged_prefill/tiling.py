"""Host-side tiling of the paged prefill kernels: which kernel family serves a specialization, how query
heads pack into a tile, the warp-specialized kernel's shared-memory model, default configs and the config
space the autotuner may try. No TileLang here: this is plain arithmetic on the specialization."""

from __future__ import annotations

from ..common.hw import SMEM_BUDGET

HEAD_DIMS = (64, 128, 256)
BITS = {"float16": 16, "bfloat16": 16, "float32": 32, "float8_e4m3fn": 8}
# The gather kernel loads K/V by whole pages (TMA) from this page size on, and gathers rows below it
# (H200, same run, 16-row pages: rows 311 vs pages 250 TFLOP/s, each page copy with its own mbarrier).
PAGE_LOADS_FROM = 32
# The warp-specialized kernel takes pages from 16 rows (one mbarrier per stage for all its copies).
WS_PAGES_FROM = 16
WS_BLOCK_M = 128  # two consumer warpgroups of 64 query rows
# CTA pairs share K/V tiles by multicast from this page size on (H200: -5% at 32-row pages; none at 16, which
# take 8 copies per tile).
MULTICAST_PAGES_FROM = 32
WS_THREADS = 384  # producer warpgroup + 2 consumer warpgroups


def q_terms(dtype: str, fp8_compute: bool = False) -> int:
    """The e4m3 terms an 8-bit cache's FP8 scores split a q of `dtype` into: all its bits (8 significant in bf16,
    11 in fp16, 4 per term), or with `fp8_compute` one (q rounded to e4m3)."""
    if fp8_compute:
        return 1
    return 3 if dtype == "float16" else 2


def ws_smem_bytes(q_tiles: int, block_N: int, num_stages: int, head_dim: int, kv_bits: int = 16,
                  v_widen: int = 1, dtype: str = "bfloat16", fp8_compute: bool = False) -> int:
    """Shared memory of the warp-specialized kernel's Q tiles (16-bit) and K / V rings (`kv_bits`); an
    8-bit cache adds each Q tile's e4m3 terms (`q_terms` of q's `dtype`) and the ring of `v_widen` V tiles its
    converter warps fill from the V stages: fp16, or with `fp8_compute` e4m3, transposed, plus P's e4m3 tile."""
    if kv_bits == 16:
        return (q_tiles * WS_BLOCK_M * 2 + 2 * num_stages * block_N * 2) * head_dim
    q = q_tiles * WS_BLOCK_M * (2 + q_terms(dtype, fp8_compute))
    kv = 2 * num_stages * block_N + v_widen * block_N * (1 if fp8_compute else 2)
    return (q + kv) * head_dim + (WS_BLOCK_M * block_N if fp8_compute else 0)


def ws_smem_fits(q_tiles: int, block_N: int, num_stages: int, head_dim: int, kv_bits: int = 16,
                 v_widen: int = 1, dtype: str = "bfloat16", fp8_compute: bool = False) -> bool:
    """Whether they fit the shared memory a CTA may use (barriers and alignment aside: under 1 KB)."""
    return ws_smem_bytes(q_tiles, block_N, num_stages, head_dim, kv_bits, v_widen, dtype, fp8_compute) <= SMEM_BUDGET


def head_pack(num_heads: int, num_kv_heads: int, block_M: int) -> int:
    """How many query heads of one kv head share a CTA (rows of its M tile): the largest divisor
    of the group size that still leaves >= 16 tokens per tile."""
    groups = num_heads // num_kv_heads
    return max(d for d in range(1, groups + 1) if groups % d == 0 and d <= max(1, block_M // 16))


def tile_tokens(num_heads: int, num_kv_heads: int, block_M: int) -> int:
    """New tokens per query tile (its block_M rows hold them times head_pack query heads)."""
    return block_M // head_pack(num_heads, num_kv_heads, block_M)


def warp_specialized(dtype: str, page_size: int) -> bool:
    """Which kernel family serves a specialization: the warp-specialized persistent kernel for fp16/bf16
    pages of >= 16 rows, the gather kernel otherwise (fp32, small pages)."""
    return dtype != "float32" and page_size >= WS_PAGES_FROM


# An 8-bit cache's ring depths (8-bit stages, widened V), by preference (H200, bench (b), page 16 / 64: 2 and 2
# 2.04 / 2.02 ms, 2 and 1 2.14 / 2.14, 3 and 2 2.20 / 2.09, 2 and 3 2.23 / 2.05).
_WIDEN_DEPTHS = ((2, 2), (2, 1), (1, 1))


def default_config(head_dim: int, dtype: str, page_size: int, kv_bits: int = 16, fp8_compute: bool = False) -> dict:
    """Tiles that fit shared memory (Q, plus K and V per pipeline stage) and registers, CTA pairs from
    `MULTICAST_PAGES_FROM`-row pages. An 8-bit cache on the warp-specialized kernel adds the depth of its widened
    (or transposed) V ring (`v_widen`)."""
    if warp_specialized(dtype, page_size):  # Q + 2 stages of K and V: 160 KB, 192 KB at head_dim 256
        block_N = 64 if head_dim == 256 else 128
        cluster = 2 if page_size >= MULTICAST_PAGES_FROM else 1
        if kv_bits == 8:  # the deepest rings that fit beside one Q tile (192 KB at head_dim 128)
            stages, v = next(c for c in _WIDEN_DEPTHS
                             if ws_smem_fits(1, block_N, c[0], head_dim, 8, c[1], dtype, fp8_compute))
            return {"block_N": block_N, "num_stages": stages, "cluster": cluster, "v_widen": v}
        return {"block_N": block_N, "num_stages": 2, "cluster": cluster}
    # Whole-page (TMA) loads run two stages; the row gathers of smaller pages do not lower with two.
    stages = 2 if page_size >= PAGE_LOADS_FROM else 1
    if dtype == "float32":
        return {"block_M": 64, "block_N": 32 if head_dim == 256 else 64, "num_stages": stages, "threads": 128}
    if head_dim == 256:
        return {"block_M": 64, "block_N": 64, "num_stages": stages, "threads": 128}
    return {"block_M": 128, "block_N": 128, "num_stages": stages, "threads": 256}


def config_space(head_dim: int, dtype: str, page_size: int, kv_bits: int = 16, fp8_compute: bool = False) -> list[dict]:
    """The configs the autotuner may try for a specialization."""
    if warp_specialized(dtype, page_size):
        if kv_bits == 8:  # the default's tile; the 8-bit and the widened rings' depths within shared memory
            n = default_config(head_dim, dtype, page_size, kv_bits)["block_N"]
            return [{"block_N": n, "num_stages": s, "cluster": c, "v_widen": v}
                    for s in (1, 2, 3) for v in (1, 2, 3) for c in (1, 2)
                    if ws_smem_fits(1, n, s, head_dim, 8, v, dtype, fp8_compute)]
        # Q plus num_stages x (K and V tiles) within shared memory.
        return [{"block_N": n, "num_stages": s, "cluster": c} for n in (64, 128) for s in (2, 3) for c in (1, 2)
                if ws_smem_fits(1, n, s, head_dim)]
    # Two software-pipeline stages do not lower with the row-gather loads (small pages).
    stages = (1, 2) if page_size >= PAGE_LOADS_FROM else (0, 1)
    big = head_dim == 256 or dtype == "float32"
    tiles = ([(64, 64, 128), (64, 32, 128)] if big else
             [(128, 128, 256), (128, 64, 256), (64, 128, 128), (64, 64, 128)])
    return [{"block_M": m, "block_N": n, "num_stages": s, "threads": t} for m, n, t in tiles for s in stages]
