"""The schedule kernel: a batch's query tiles ordered by decreasing KV work, built on the device from
``seq_lens`` and ``cum_seq_lens_q`` so that a call needs no host synchronization."""

import tilelang.language as T


def paged_prefill_schedule_kernel(tokens: int, threads: int = 256):
    """The query tiles of a batch (`tokens` new tokens per tile) ordered by decreasing KV work, as
    TileSeq[rank] (sequence, or -1 for the spare tiles at the end) and TileQ0[rank] (first query row).
    One thread per tile: a tile's work key is its first row's KV position (history + q0), strictly
    increasing along a sequence, so its rank counts per sequence in O(1) (ties go to the lower
    sequence): O(num_seqs) per tile, one launch instead of a dozen small torch ops per call."""
    num_seqs, num_tiles = T.dynamic("num_seqs, num_tiles")

    def tiles_of(CumSeqLensQ, s):
        return T.ceildiv(CumSeqLensQ[s + 1] - CumSeqLensQ[s], tokens)

    def history(SeqLens, CumSeqLensQ, s):
        return SeqLens[s] - (CumSeqLensQ[s + 1] - CumSeqLensQ[s])

    @T.prim_func
    def paged_prefill_schedule(SeqLens: T.Tensor((num_seqs,), "int32"),
                               CumSeqLensQ: T.Tensor((num_seqs + 1,), "int32"),
                               TileSeq: T.Tensor((num_tiles,), "int32"), TileQ0: T.Tensor((num_tiles,), "int32")):
        with T.Kernel(T.ceildiv(num_tiles, threads), threads=threads) as bx:
            tile = bx * threads + T.get_thread_binding()
            seq = T.alloc_var("int32", init=-1)
            first = T.alloc_var("int32", init=0)  # tiles of the sequences before `seq`
            total = T.alloc_var("int32", init=0)
            rank = T.alloc_var("int32", init=0)
            for s in T.serial(num_seqs):
                if T.And(seq < 0, tile < total + tiles_of(CumSeqLensQ, s)):
                    seq = s
                    first = total
                total = total + tiles_of(CumSeqLensQ, s)
            if tile < num_tiles:
                if seq >= 0:
                    key = history(SeqLens, CumSeqLensQ, seq) + (tile - first) * tokens
                    for s in T.serial(num_seqs):
                        # sequence s's tiles j with j * tokens > d rank first (and j * tokens == d, for s < seq)
                        d = key - history(SeqLens, CumSeqLensQ, s)
                        n = tiles_of(CumSeqLensQ, s)
                        rank = rank + T.if_then_else(d < 0, n, T.max(0, n - d // tokens - 1))
                        rank = rank + T.if_then_else(T.And(T.And(s < seq, d >= 0), T.And(d % tokens == 0,
                                                                                          d // tokens < n)), 1, 0)
                    TileSeq[rank] = seq
                    TileQ0[rank] = (tile - first) * tokens
                else:  # spare tiles: past every real one (whose ranks are 0 .. total - 1)
                    TileSeq[tile] = -1
                    TileQ0[tile] = 0

    return paged_prefill_schedule
