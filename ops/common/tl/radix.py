"""Radix-select building blocks, shared by the top-k selections of htree's walk and layer kernels
(``ops/htree/kernels/select.py``: keys in shared memory) and of HSA's top-k (``ops/hsa/kernels/radix_select.py``:
composite keys streamed from global memory).

A radix select settles the k-th largest key 8 bits at a time from the top: each pass counts the keys that match
the digits settled so far by their next digit, in a shared histogram of ``RADIX_BINS`` bins, and ``pick_digit``
finds the bin that holds the wanted key. ``suffix_sum`` is the block-wide scan the HSA top-k uses to find the
histogram bin of its k-th key among 16 bins per thread.
"""

import tilelang.language as T

RADIX_BINS = 256  # one 8-bit digit


@T.macro
def pick_digit(hist, need: T.Ref, tmp, tx, digit: T.Ref, shift):
    """In ``hist`` (RADIX_BINS counts of the keys matching the settled prefix, by their next digit), find the bin
    of the ``need``-th largest key (1-based; hist must hold at least that many): the lane of warp 0 that holds it
    ORs ``bin << shift`` into ``digit`` and sets ``need`` to the key's rank inside its bin. Lane tx scans bins
    8 tx .. 8 tx + 7 after a warp-wide suffix sum of the lanes' counts (one warp, no block barrier); ``tmp`` is
    four int32 of the thread's local memory. The caller syncs the block before (hist complete) and after."""
    if tx < 32:
        tmp[2] = need
        tmp[0] = 0
        for i in T.unroll(8):
            tmp[0] += hist[8 * tx + i]
        tmp[1] = tmp[0]  # -> keys in the bins of lanes >= tx
        for o in T.unroll(5):
            nxt = T.shfl_down(tmp[1], T.shift_left(1, o))
            tmp[1] = tmp[1] + T.if_then_else(tx + T.shift_left(1, o) < 32, nxt, 0)
        if tmp[1] >= tmp[2] and tmp[1] - tmp[0] < tmp[2]:
            tmp[1] = tmp[1] - tmp[0]
            for i in T.serial(8):
                if tmp[1] < tmp[2]:
                    tmp[1] = tmp[1] + hist[8 * tx + 7 - i]
                    if tmp[1] >= tmp[2]:
                        need = tmp[2] - tmp[1] + hist[8 * tx + 7 - i]
                        digit = T.bitwise_or(digit, T.shift_left(8 * tx + 7 - i, shift))


@T.macro
def suffix_sum(value, suffix, warp_sum, threads: int):
    """suffix[t] = sum of the threads' values over t..threads-1, suffix[threads] = 0: a shuffle scan inside
    each warp, then the warps' totals (two barriers, where a block-wide Hillis-Steele scan takes two per
    step). warp_sum holds threads / 32 ints."""
    NW = threads // 32
    tx = T.get_thread_binding()
    acc = T.alloc_var("int32")
    acc = value
    for k in T.unroll(5):
        down = T.shfl_down(acc, 1 << k)
        acc += T.if_then_else(tx % 32 + (1 << k) < 32, down, 0)
    if tx % 32 == 0:
        warp_sum[tx // 32] = acc
    T.sync_threads()
    for w in T.unroll(1, NW):
        acc += T.if_then_else(tx // 32 + w < NW, warp_sum[T.min(tx // 32 + w, NW - 1)], 0)
    suffix[tx] = acc
    if tx == 0:
        suffix[threads] = 0
    T.sync_threads()
