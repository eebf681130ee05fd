"""Host-side tiling and split schedule of the paged decode kernels (plain arithmetic, no TileLang): how the
query heads x tokens of a kv head pack into the rows of a CTA's tile, the KV tile size, and how many KV
tiles a split takes for a batch."""

from __future__ import annotations

from ..common.hw import SMEM_LIMIT, SMEM_PER_SM

HEAD_DIMS = (64, 128, 256)
MAX_Q_TOKENS = 8
ROWS_MAX = 32  # rows of a CTA's query tile (two 16-row mma tiles): the products stay tiny next to the K/V bytes
THREADS = 128
# Pages from this size are copied whole (or as block_N-row slices); smaller ones are gathered row by row.
PAGE_COPIES_FROM = 16


def head_pack(num_heads: int, num_kv_heads: int, num_q_tokens: int) -> int:
    """Query heads of one kv head per CTA: the largest divisor of the group whose heads x tokens fit
    ROWS_MAX rows (all of the group for plain decode up to G = 32: K/V read once per kv head)."""
    groups = num_heads // num_kv_heads
    return max(d for d in range(1, groups + 1) if groups % d == 0 and d * num_q_tokens <= ROWS_MAX)


def block_m(rows: int) -> int:
    """Tile rows: one or two 16-row mma tiles."""
    return 16 if rows <= 16 else 32


# the register budget: 3 CTAs of 256 threads (78-79 registers, no spills), or of the warp-split kernel's 128
# (159-168 registers at head_dim 128)
MAX_CTAS_PER_SM = 3


def smem_bytes(rows: int, block_N: int, num_stages: int, head_dim: int, fp8: bool) -> int:
    """Shared memory of a CTA's Q and P tiles and its K / V pipeline: 16-bit stages, or 8-bit stages plus the
    one 16-bit K and V tile they are widened into."""
    tile = 2 * block_N * head_dim  # K and V elements of one stage
    kv = num_stages * tile + 2 * tile if fp8 else 2 * num_stages * tile
    return 2 * block_m(rows) * (head_dim + block_N) + kv


def smem_fits(rows: int, block_N: int, num_stages: int, head_dim: int, fp8: bool) -> bool:
    return smem_bytes(rows, block_N, num_stages, head_dim, fp8) <= SMEM_LIMIT


def ctas_for_smem(smem: int) -> int:
    """CTAs per SM to budget registers for, for CTAs of `smem` bytes of shared memory: as many as an SM holds (plus
    the 1 KiB it reserves per CTA), at most MAX_CTAS_PER_SM. More resident CTAs keep more K / V bytes in flight."""
    return max(1, min(MAX_CTAS_PER_SM, SMEM_PER_SM // (smem + 1024)))


def min_blocks(rows: int, block_N: int, num_stages: int, head_dim: int, fp8: bool) -> int:
    """`ctas_for_smem` of the split kernel's shared memory."""
    return ctas_for_smem(smem_bytes(rows, block_N, num_stages, head_dim, fp8))


# The kernel whose warps split the keys (kernels/split_kv_warps.py), 16-bit and FP8 caches: a 16-row query tile
# whose q and output fragments stay in registers, so head_dim up to 128.
WARP_HEAD_DIMS = (64, 128)
WARP_ROWS = 16
WARP_STAGES = (2, 3, 4, 6)
# Its tiles arrive by TMA (a box per page and 128-byte band, issued by one thread) when a tile spans at most this
# many pages, else row by row (cp.async, every thread): FP8 at 16-row pages (8 boxes of 2 KB a 128-key tile) measured
# 10% slower by TMA than by rows, 16-bit ones (4 a 64-key tile) 3-5% faster than the split_kv kernel.
TMA_PAGES_PER_TILE = 4


def loads_by_tma(page_size: int, block_N: int) -> bool:
    """Whether the warp-split kernel loads its tiles by TMA (else by cp.async row gathers)."""
    return block_N <= TMA_PAGES_PER_TILE * page_size


def splits_keys_over_warps(rows: int, head_dim: int) -> bool:
    """Whether the decode runs the kernel whose warps split the keys (one 16-row tile, head_dim <= 128); other
    specializations run ``split_kv`` (FP8 widened in shared memory there)."""
    return rows <= WARP_ROWS and head_dim in WARP_HEAD_DIMS


def warp_smem_bytes(block_N: int, num_stages: int, head_dim: int, fp8: bool) -> int:
    """Shared memory of the warp-split kernel: its ring of K and V tiles as stored (8- or 16-bit), which the warps'
    merge at the end reuses (four warps x 32 lanes x (head_dim / 2 + 4) fp32 outputs, and the rows' max and sum)."""
    merge = 4 * 32 * (head_dim // 2 + 4) * 4 + 4 * 16 * 2 * 4
    return max(num_stages * 2 * block_N * head_dim * (1 if fp8 else 2), merge)


def pipeline_stages(page_size: int) -> tuple[int, ...]:
    """Software-pipeline depths that lower: whole-page copies (TMA, warp-specialized by TileLang) take 2
    or 3; the row gathers of small pages (cp.async) only 1 (2 fails in TileLang's codegen)."""
    return (2, 3) if page_size >= PAGE_COPIES_FROM else (1,)


def default_config(head_dim: int, page_size: int, rows: int = ROWS_MAX, fp8: bool = True) -> dict:
    """For the warp-split kernel (``splits_keys_over_warps``): 64 KiB rings of 2 at head_dim 128 (three CTAs per SM,
    each with a tile in flight while it computes one): 128-token tiles (32 keys a warp) for FP8 (measured 2-7%
    faster than 64-token tiles in rings of 2-4), 64-token ones for 16-bit caches (128 would fit one CTA per SM).
    Otherwise: block_N: KV tokens per pipeline stage (16 KiB of K per stage at 16-bit, head_dim 128; FP8 keeps the
    rows and halves the bytes); num_stages: K/V tiles in flight. Both: min_blocks: CTAs per SM the registers are
    budgeted for (rows and fp8 size the shared memory); ctas_per_sm: the split rule's target of CTAs per SM over the
    whole grid (several waves, so a GPU shared with another stream only adds waves); min_split_tiles: the shortest
    split worth its partial write and combine."""
    if splits_keys_over_warps(rows, head_dim):
        block_N = 128 if fp8 else 64
        return {"block_N": block_N, "num_stages": 2,
                "min_blocks": ctas_for_smem(warp_smem_bytes(block_N, 2, head_dim, fp8)),
                "ctas_per_sm": 8, "min_split_tiles": 4}
    block_N, stages = 32 if head_dim == 256 else 64, pipeline_stages(page_size)[0]
    return {"block_N": block_N, "num_stages": stages, "min_blocks": min_blocks(rows, block_N, stages, head_dim, fp8),
            "ctas_per_sm": 8, "min_split_tiles": 4}


def warp_config_space(head_dim: int, fp8: bool) -> list[dict]:
    """The warp-split kernel's tile sizes (16 or 32 keys a warp) x ring depths within shared memory."""
    return [{"block_N": n, "num_stages": s} for n in (64, 128) for s in WARP_STAGES
            if warp_smem_bytes(n, s, head_dim, fp8) <= SMEM_LIMIT]


def config_space(head_dim: int, page_size: int) -> list[dict]:
    """Tile size x stages within shared memory for the autotuner (the split rule stays at its default)."""
    return [{"block_N": n, "num_stages": s} for n in (32, 64, 128) for s in pipeline_stages(page_size)
            if smem_fits(ROWS_MAX, n, s, head_dim, True)]


def kv_tiles_bound(max_len: int, block_N: int, window_left: int, num_q_tokens: int) -> int:
    """Most KV tiles a sequence of at most max_len tokens visits: all of them, or with a window the tiles
    touching [len - nq - window_left, len)."""
    tiles = -(-max_len // block_N)
    if window_left >= 0:
        tiles = min(tiles, -(-(window_left + num_q_tokens) // block_N) + 1)
    return max(tiles, 1)


def split_tiles(rows: int, max_tiles: int, target_ctas: int, min_split_tiles: int) -> tuple[int, int]:
    """(tiles per split, splits): a fixed split length in KV tiles so that ``rows`` (sequence, head group)
    pairs of up to ``max_tiles`` tiles make about ``target_ctas`` CTAs (never fewer tiles than
    min_split_tiles a split), evened out over the longest sequence's splits. A sequence of n tiles takes
    ceil(n / tiles_per_split) splits, one (no partials, no combine) when n <= tiles_per_split."""
    per = max(min_split_tiles, -(-rows * max_tiles // max(target_ctas, 1)))
    splits = -(-max_tiles // per)
    return -(-max_tiles // splits), splits
