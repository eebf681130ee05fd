"""What the split-KV decode kernels and the combine share: a sequence's KV tile range, split count and the tiles
of one split."""

import tilelang.language as T


def kv_tile_range(L, num_q_tokens: int, block_N: int, window_left: int):
    """(first tile, tile count) of a sequence of L tokens: the tiles touching [lo, L), lo the first key a
    query row sees (L - nq - window_left with a window)."""
    lo = T.max(L - num_q_tokens - window_left, 0) if window_left >= 0 else 0
    first = lo // block_N
    return first, T.ceildiv(L, block_N) - first


def split_count(n_tiles, tiles_per_split, num_splits):
    """Splits of a sequence of n_tiles: ceil(n_tiles / tiles_per_split), at most num_splits (the grid's;
    the last split then takes the rest, so lengths grown past the plan's stay correct) and at least 1."""
    return T.max(T.min(T.ceildiv(n_tiles, tiles_per_split), num_splits), 1)


def split_steps(sp, n_split, n_tiles, tiles_per_split):
    """KV tiles of split sp of a sequence of n_tiles in n_split splits: tiles_per_split each, the rest in the last
    one, none past the last."""
    return T.if_then_else(sp < n_split, T.if_then_else(sp == n_split - 1, n_tiles - sp * tiles_per_split,
                                                       tiles_per_split), 0)
