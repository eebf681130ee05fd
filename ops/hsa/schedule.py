"""Host-side constants and schedules of the HSA kernels: tile sizes, the selection key's layout, the score kernel's
thread layout, the extend's tiles, the decode's shared-memory model and its split count (see docs/design/hsa.md)."""

from __future__ import annotations

import functools

from ..common.hw import SMEM_LIMIT, SMEM_PER_SM

RADIX = 256  # histogram bins of one radix-select digit (= threads of the decode's top-k kernel)
IDX_BITS = 24  # logical page index bits of the selection key (max_pages < 2**24)
RANK_MAX = 2 * RADIX  # up to this many top-k candidates are ranked by counting, without radix passes
HIST_BITS = 12  # the top-k counts a row's keys by their top bits: 1/8 of an octave of scores a bin
# HSA extend's top-k: many short rows (a new token's ~1000 candidates at 64K of history), each CTA's time mostly
# latency: half the threads and bins fit 9 CTAs per SM instead of 5 (registers): 1.4x faster on ~1000-key rows, as
# fast on ~8000 (H200: docs/design/hsa.md).
EXTEND_TOPK_THREADS = 128
EXTEND_HIST_BITS = 11
RANK_UNROLL = 8
VEC = 8  # 16-bit elements of one 16-byte load
QROWS_DECODE = 16  # query rows of the decode products (one mma M tile; G <= 16)
ZCOLS = 32  # reprs of a split's selected pages: the N of the z product (>= items per split)
DECODE_CTAS_PER_SM = 4  # register bound of a decode CTA (115 registers x 128 threads at the bench shape)


def extend_tile_tokens(num_heads: int, num_kv_heads: int) -> int:
    """New tokens per query tile of HSA extend's attention: 64 rows (one wgmma M tile) of tokens x G query heads,
    at least one token."""
    return max(1, 64 // (num_heads // num_kv_heads))


# HSA extend's reprs in page-table order (B x max_pages x Hkv x head_dim 16-bit values) are gathered for this many
# bytes of requests at a time: batches of many requests on a long page table score in several launches instead of
# one workspace of their whole table.
EXTEND_REPRS_BYTES = 256 << 20
# HSA extend's selection keys by score tile ([Hkv, tile, page block, tile row, page]): a tile's step is one box of
# its tokens x KEY_PAGES pages, stored whole from the accumulator (8-byte stores). Stored key by key (4-byte stores,
# rows [rows, Hkv, max_pages] or blocks of 128 rows) the score kernel took 1.6-1.7x as long at the bench's rows
# (H200: docs/design/hsa.md).
KEY_PAGES = 64


def key_tiles_shape(num_tiles: int, num_kv_heads: int, max_pages: int, tokens: int) -> tuple[int, ...]:
    """Shape of the selection keys of `num_tiles` score tiles of `tokens` rows, `max_pages` candidates each."""
    return num_kv_heads, num_tiles, -(-max_pages // KEY_PAGES), tokens, KEY_PAGES


# Shared memory the score tile's queries may take (tokens x G x head_dim 16-bit values), beside two stages of reprs.
SCORE_Q_BYTES = 128 * 1024


def score_tile_tokens(group: int, head_dim: int) -> int:
    """New tokens per score tile: as many as SCORE_Q_BYTES holds, up to 128 (two warpgroups of 64 GEMM rows), at
    least 16 (a G x head_dim of up to 16 x 256)."""
    tokens = 128
    while tokens > 16 and tokens * group * head_dim * 2 > SCORE_Q_BYTES:
        tokens //= 2
    return tokens


def score_block_pages(selection_strategy: str, group: int, head_dim: int, tokens: int, num_stages: int = 2,
                      threads: int = 256) -> int:
    """Candidate pages per step: 64 (128 measured 20-28% slower at the bench shapes, not analysed), fewer where shared
    memory (the queries and `num_stages` steps of reprs) or the head strategy's G accumulators (one per query head,
    maxed; at most 128 fp32 registers a thread) would not fit."""
    accumulators = group if selection_strategy == "head" else 1
    block = 64
    while block > 16 and (tokens * group * head_dim * 2 + num_stages * block * head_dim * 2 > SMEM_LIMIT
                          or accumulators * tokens * block > 128 * threads):
        block //= 2
    return block


def local_pages_max(page_size: int, window_size: int) -> int:
    """Most logical pages the local tokens [lo, L) can touch: at most max(window, page_size - 1) tokens,
    starting anywhere in a page."""
    return (max(window_size, page_size - 1) + page_size - 1) // page_size + 1


def decode_smem(page_size: int, head_dim: int) -> int:
    """Bytes of shared memory of a decode CTA (16-bit K, V, q and repr tiles)."""
    return (2 * page_size + QROWS_DECODE + ZCOLS) * head_dim * 2


def decode_ctas_per_sm(page_size: int, head_dim: int) -> int:
    """Decode CTAs resident per SM: the register bound, or fewer where shared memory (plus the 1 KiB the
    SM reserves per CTA) runs out first."""
    return max(1, min(DECODE_CTAS_PER_SM, SMEM_PER_SM // (decode_smem(page_size, head_dim) + 1024)))


# Fractions of the GPU another stream may hold while a decode runs (NCCL / DeepEP kernels take 16-40 of 132 SMs
# during overlapped communication): the split count must suit each, not only the whole GPU.
SHARED_FRACTIONS = (0.0, 16 / 132, 40 / 132)


@functools.lru_cache(maxsize=None)
def num_splits(rows: int, n_items: int, slots: int, overhead: int) -> int:
    """Decode split count for ``rows`` (request, kv head) pairs of at most ``n_items`` items each, when ``slots``
    CTAs fit the whole GPU. A split count's cost with ``m`` slots free is (waves of CTAs) x (items per split +
    ``overhead``), the overhead pricing a split's fixed work (query, selected ids, reprs and z before its first
    page) in items. The count chosen is the one closest to the best on average over the GPU's shares in
    SHARED_FRACTIONS (ties to fewer splits): a grid of exactly one wave of the whole GPU would take two when a few
    SMs are held. A split holds at most ZCOLS items (its reprs fill the z tile)."""
    counts = range(-(-n_items // ZCOLS), n_items + 1)
    frees = [max(1, round(slots * (1 - held))) for held in SHARED_FRACTIONS]

    def cost(s, free):
        return -(-rows * s // free) * (-(-n_items // s) + overhead)

    best = [min(cost(s, free) for s in counts) for free in frees]
    return min(counts, key=lambda s: (sum(cost(s, free) / b for free, b in zip(frees, best)), s))


def score_layout(num_kv_heads: int, head_dim: int, max_threads: int = 256) -> tuple[int, int]:
    """(heads per CTA, pages per step) of the score kernel. A CTA reads whole rows: the reprs of its
    heads of one page, head_dim / 8 lanes of 16 bytes per head (all kv heads = one contiguous 2 KB row at
    the bench shape); most heads first, then as many rows per step as fit in max_threads whole warps."""
    lph = head_dim // VEC
    for hc in range(num_kv_heads, 0, -1):
        vr = hc * lph
        if num_kv_heads % hc == 0 and vr <= max_threads:
            rows = [r for r in range(1, max_threads // vr + 1) if r * vr % 32 == 0]
            if rows:
                return hc, rows[-1]
    raise AssertionError("unreachable: one head (8..32 lanes) always fits")
