"""The combine of the split-KV decode: merges a sequence's split partials in split order (deterministic)."""

import tilelang.language as T

from .common import kv_tile_range, split_count


def paged_decode_combine_kernel(num_heads: int, head_dim: int, dtype: str, num_q_tokens: int, block_N: int,
                                window_left: int):
    """Per (head, query row) of a sequence of more than one split: out = sum_s exp(lse_s) o_s / sum_s
    exp(lse_s), lse = log sum_s exp(lse_s), folded in split order 0, 1, ... (no atomics: bitwise the same
    result every run). Rows of one-split sequences were written by the split kernel and are left alone."""
    nq = num_q_tokens
    total_q, batch, ws_rows, num_splits = T.dynamic("total_q, batch, ws_rows, num_splits")
    f32 = "float32"

    @T.prim_func
    def paged_decode_combine(
        SeqLens: T.Tensor((batch,), "int32"),
        Sched: T.Tensor((1,), "int32"),
        OPart: T.Tensor((ws_rows, num_splits, nq, num_heads, head_dim), f32),
        LsePart: T.Tensor((ws_rows, num_splits, nq, num_heads), f32),
        Out: T.Tensor((total_q, num_heads, head_dim), dtype),
        Lse: T.Tensor((total_q, num_heads), f32),
    ):
        with T.Kernel(num_heads, total_q, threads=head_dim) as (h, row):
            acc = T.alloc_fragment((head_dim,), f32)
            m = T.alloc_var(f32)
            total = T.alloc_var(f32)
            w = T.alloc_var(f32)
            b = row // nq
            i = row % nq
            _, n_tiles = kv_tile_range(SeqLens[b], nq, block_N, window_left)
            n_split = T.alloc_var("int32", init=split_count(n_tiles, Sched[0], num_splits))
            if n_split > 1:
                m = -T.infinity(f32)
                for s in T.serial(n_split):
                    m = T.max(m, LsePart[b, s, i, h])
                total = 0
                T.clear(acc)
                if m > -T.infinity(f32):
                    for s in T.serial(n_split):
                        w = T.exp(LsePart[b, s, i, h] - m)
                        total += w
                        for d in T.Parallel(head_dim):
                            acc[d] += w * OPart[b, s, i, h, d]
                for d in T.Parallel(head_dim):
                    Out[row, h, d] = T.cast(T.if_then_else(total > 0, acc[d] / total, 0), dtype)
                    if d == 0:
                        Lse[row, h] = T.if_then_else(total > 0, m + T.log(total), -T.infinity(f32))

    return paged_decode_combine
