"""The gather kernel: one CTA per (query tile, head group) and one software pipeline over its KV tiles,
for the specializations the warp-specialized kernel does not take (fp32 as TF32, whose P goes through
shared memory; pages under 16 rows, gathered row by row with cp.async). TileLang warp-specializes its
whole-page loads (pages of >= 32 rows) on its own."""

import tilelang.language as T

from ..tiling import PAGE_LOADS_FROM
from .tile_plan import TilePlan


def paged_prefill_gather_kernel(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                                dtype: str, use_alibi: bool, kv_layout: str, scale: float,
                                block_M: int = 128, block_N: int = 128, num_stages: int = 1, threads: int = 256):
    """Causal paged attention with one software pipeline (module docstring): fp32 and small pages."""
    plan = TilePlan(num_heads, num_kv_heads, head_dim, page_size, dtype, use_alibi, kv_layout, scale,
                    block_M, block_N)
    total_q, num_seqs, num_blocks, max_blocks, num_tiles = plan.dims
    accum = "float32"
    paged = page_size >= PAGE_LOADS_FROM  # whole-page (TMA) loads; smaller pages are gathered row by row

    @T.macro
    def gather_rows(cache, dst, tables, seq, kv_head, kv_len, kt):
        for j, d in T.Parallel(block_N, head_dim):
            pos = T.min(kt * block_N + j, kv_len - 1)  # clamped: never reads past the sequence
            block = tables[seq, pos // page_size]
            if kv_layout == "HND":
                dst[j, d] = cache[block, kv_head, pos % page_size, d]
            else:
                dst[j, d] = cache[block, pos % page_size, kv_head, d]

    @T.prim_func
    def paged_prefill(
        Q: T.Tensor(plan.q_shape, dtype),
        KCache: T.Tensor(plan.kv_shape, dtype),
        VCache: T.Tensor(plan.kv_shape, dtype),
        BlockTables: T.Tensor((num_seqs, max_blocks), "int32"),
        SeqLens: T.Tensor((num_seqs,), "int32"),
        CumSeqLensQ: T.Tensor((num_seqs + 1,), "int32"),
        AlibiSlopes: T.Tensor((num_heads,), "float32"),
        TileSeq: T.Tensor((num_tiles,), "int32"),
        TileQ0: T.Tensor((num_tiles,), "int32"),
        Out: T.Tensor(plan.q_shape, dtype),
    ):
        with T.Kernel(num_heads // plan.pack, num_tiles, threads=threads) as (head_group, tile):
            q_s = T.alloc_shared((block_M, head_dim), dtype)
            k_s = T.alloc_shared((block_N, head_dim), dtype)
            v_s = T.alloc_shared((block_N, head_dim), dtype)
            acc_s = T.alloc_fragment((block_M, block_N), accum)
            if dtype == "float32":  # TF32 products take P from shared memory (no register layout)
                acc_p = T.alloc_shared((block_M, block_N), dtype)
            else:
                acc_p = T.alloc_fragment((block_M, block_N), dtype)
            acc_o = T.alloc_fragment((block_M, head_dim), accum)
            m_prev = T.alloc_fragment((block_M,), accum)
            m_cur = T.alloc_fragment((block_M,), accum)
            rescale = T.alloc_fragment((block_M,), accum)
            row_sum = T.alloc_fragment((block_M,), accum)
            denom = T.alloc_fragment((block_M,), accum)
            slope = T.alloc_fragment((block_M,), accum)

            # No branch on idle tiles around the KV loop (it would keep the loads from being pipelined).
            _, seq, kv_head, head0, q_begin, q_len, q0, kv_len, pos0, rows, steps = plan.tile(
                TileSeq, TileQ0, CumSeqLensQ, SeqLens, tile, head_group)
            plan.load_q(Q, q_s, q_begin, q0, q_len, head0)
            if use_alibi:
                plan.load_slopes(AlibiSlopes, slope, head0)
            T.fill(acc_o, 0)
            T.fill(denom, 0)
            T.fill(m_cur, -T.infinity(accum))

            for kt in T.Pipelined(steps, num_stages=num_stages):
                if paged:
                    # The page ids are the loop body's leading bindings: the warp-specialization
                    # pass keeps those in the producer branch (read once for K and V, ahead of
                    # the copies).
                    blocks = plan.page_ids(BlockTables, seq, kv_len, kt)
                    plan.load_pages(KCache, k_s, blocks, kv_head, kt)
                    plan.load_pages(VCache, v_s, blocks, kv_head, kt)
                else:
                    gather_rows(KCache, k_s, BlockTables, seq, kv_head, kv_len, kt)
                T.clear(acc_s)
                T.gemm(q_s, k_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                plan.mask_scores(acc_s, slope, kt, pos0)
                plan.softmax_step(acc_s, m_cur, m_prev, rescale, row_sum, denom)
                T.copy(acc_s, acc_p)
                for i, d in T.Parallel(block_M, head_dim):
                    acc_o[i, d] *= rescale[i]
                if paged:
                    if (kt + 1) * block_N > kv_len:
                        plan.zero_v_tail(v_s, kt, kv_len)
                else:
                    gather_rows(VCache, v_s, BlockTables, seq, kv_head, kv_len, kt)
                T.gemm(acc_p, v_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

            plan.store_out(Out, acc_o, denom, q_begin, q0, head0, rows)

    return paged_prefill
