"""Split-K over the CTAs of a token tile, for the mix kernels (`mhc_pre_mix`, `mhc_post_mix`): each of a tile's
`splits` CTAs sums its share of the columns, writes its partials, and the last CTA of the tile to arrive (a count
per tile) adds every split's in split order and runs the epilogue. No CTA waits for another (a GPU shared with
another stream just runs more waves), and the sums are bitwise reproducible."""

import tilelang.language as T

SPLIT_SRC = r"""
// 1 in the last of a token tile's `splits` CTAs to get here (every thread fenced its partials before the CTA's
// barrier; this release orders them before the count, the acquire after it orders the other splits' before the
// reads that follow). The last one zeroes the count for the next launch on the same buffers (a timing loop).
__device__ __forceinline__ int mhc_last_split(const int* count, int tile, int splits) {
  int* c = const_cast<int*>(count) + tile;
  __threadfence();
  int last = atomicAdd(c, 1) == splits - 1;
  __threadfence();
  if (last) *c = 0;
  return last;
}
__device__ __forceinline__ void mhc_fence() { __threadfence(); }
// Another CTA's partials: from L2, never from a stale L1 line.
__device__ __forceinline__ float mhc_ld_cg(const float* p, int i) { return __ldcg(p + i); }
"""


def sum_splits(splits: int, block_t: int, width: int):
    """The macro ``(Part, Count, sums, sumsq, last, bx, sp)``: CTA sp of tile bx writes its partial ``sums``
    [block_t, width] and ``sumsq`` [block_t] (shared) to Part (flat [tiles, splits, block_t, width + 1]), counts
    itself in Count[bx], and ``last[0]`` (shared) says whether it came last; the last CTA's ``sums`` and ``sumsq``
    then hold the totals (in split order). Ends with a block barrier."""

    @T.macro
    def body(Part, Count, sums, sumsq, last, bx, sp):
        for t, r in T.Parallel(block_t, width + 1):
            Part[((bx * splits + sp) * block_t + t) * (width + 1) + r] = T.if_then_else(
                r < width, sums[t, T.min(r, width - 1)], sumsq[t])
        T.call_extern("handle", "mhc_fence")
        T.sync_threads()
        if T.get_thread_binding() == 0:
            last[0] = T.call_extern("int32", "mhc_last_split", Count.data, bx, splits)
        T.sync_threads()
        if last[0] == 1:
            for t, r in T.Parallel(block_t, width + 1):
                part = [T.call_extern("float32", "mhc_ld_cg", Part.data,
                                      ((bx * splits + s) * block_t + t) * (width + 1) + r) for s in range(splits)]
                total = sum(part[1:], part[0])  # in split order
                if r < width:
                    sums[t, r] = total
                else:
                    sumsq[t] = total
        T.sync_threads()

    return body
