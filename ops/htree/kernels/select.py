"""The per-row top-k of the walk and the middle layers: a radix select of the top_k-th largest packed key in
shared memory, and the order-preserving compaction of the winners into the next layer's parents."""

from ...common.tl.radix import RADIX_BINS, pick_digit
from .fragments import child

import tilelang.language as T  # noqa: E402


@T.macro
def select_top_k(keys, n, top_k: int, hist, pick, tmp, tx, threads: int):
    """pick[0] = the top_k-th largest of keys[0:n] (distinct and non-negative), 0 when n <= top_k: radix select,
    8 bits per pass from bit 30 down, on a shared histogram (RADIX_BINS) of the keys that match pick[0] above the
    digit, with pick[1] the wanted key's rank among those (tmp: four int32 per thread; see pick_digit)."""
    if tx == 0:
        pick[0] = 0
        pick[1] = top_k
    T.sync_threads()
    if n > top_k:
        for d in T.serial(4):
            hi = 31 - 8 * d
            lo = T.max(hi - 8, 0)
            for i in T.Parallel(RADIX_BINS):
                hist[i] = 0
            tmp[3] = T.shift_right(pick[0], hi)  # the threshold's bits found so far
            T.sync_threads()
            for i in T.serial(T.ceildiv(n, threads)):
                p = i * threads + tx
                if p < n:
                    if T.shift_right(keys[p], hi) == tmp[3]:
                        # (atomicAdd itself: T.atomic_add makes ThreadSync put a barrier in every iteration; the
                        # increments commute)
                        T.call_extern("int32", "atomicAdd", T.address_of(
                            hist[T.bitwise_and(T.shift_right(keys[p], lo), 255)]), 1)
            T.sync_threads()
            pick_digit(hist, pick[1], tmp, tx, pick[0], lo)
            T.sync_threads()


@T.macro
def compact_winners(keys, n, thr, parents, n_par, chosen, counts, tx, threads: int, r: int, top_k: int,
                    chosen_pos=None):
    """chosen = the winners (keys[p] >= thr, p < n) in candidate order, -1 padded to top_k, as nodes: candidate p is
    node p of the top layer (n_par == 0), else child p % r of parent p / r; with ``chosen_pos`` also their candidate
    buffer positions p there (-1 padded)."""
    seg = -(-int(keys.shape[0]) // threads)  # keys per thread
    pos = T.alloc_var("int32")  # (a var, not a buffer element: ThreadSync would fence every store at it)
    pos = 0
    for i in T.serial(seg):
        p = tx * seg + i
        if p < n:
            if keys[p] >= thr:
                pos += 1
    counts[tx] = pos
    T.sync_threads()
    pos = 0
    for i in T.serial(threads):
        if i < tx:
            pos += counts[i]
    for i in T.serial(seg):
        p = tx * seg + i
        if p < n:
            if keys[p] >= thr:
                chosen[pos] = T.if_then_else(n_par == 0, p, child(parents, p, r, top_k))
                if chosen_pos is not None:
                    chosen_pos[pos] = p
                pos += 1
    T.sync_threads()
    for i in T.Parallel(top_k):
        if i >= T.min(n, top_k):
            chosen[i] = -1
            if chosen_pos is not None:
                chosen_pos[i] = -1
