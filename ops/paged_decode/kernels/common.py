"""What the split-KV decode kernel and the combine share: a sequence's KV tile range and split count."""

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
