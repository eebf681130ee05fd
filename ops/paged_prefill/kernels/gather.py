"""The gather kernel: one CTA per (query tile, head group) and one software pipeline over its KV tiles,
for the specializations the warp-specialized kernel does not take (fp32 as TF32, whose P goes through
shared memory; pages under 16 rows, gathered row by row with cp.async). TileLang warp-specializes its
whole-page loads (pages of >= 32 rows) on its own."""

import tilelang.language as T

from ..tiling import PAGE_LOADS_FROM
from .tile_plan import TilePlan


def paged_prefill_gather_kernel(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                                dtype: str, use_alibi: bool, kv_layout: str, scale: float, window_left: int = -1,
                                soft_cap: float = 0.0, kv_dtype: str | None = None, block_M: int = 128,
                                block_N: int = 128, num_stages: int = 1, threads: int = 256):
    """Causal paged attention with one software pipeline (module docstring): fp32 and small pages. Writes
    the output and the log-sum-exp (fp32, natural log) of every query row and head."""
    plan = TilePlan(num_heads, num_kv_heads, head_dim, page_size, dtype, use_alibi, kv_layout, scale,
                    block_M, block_N, window_left, soft_cap, kv_dtype)
    kv_dtype = plan.kv_dtype
    total_q, num_seqs, num_blocks, max_blocks, num_tiles = plan.dims
    accum = "float32"
    paged = page_size >= PAGE_LOADS_FROM  # whole-page (TMA) loads; smaller pages are gathered row by row
    # An 8-bit cache (16-bit q, so pages under 16 rows here) is dequantized as its rows are gathered.
    assert kv_dtype == dtype or not paged, "8-bit caches take the row gathers"

    @T.macro
    def gather_rows(cache, dst, tables, seq, kv_head, kv_len, kt, lo):
        for j, d in T.Parallel(block_N, head_dim):
            pos = T.min(plan.clamp_lo(kt * block_N + j, lo), kv_len - 1)  # only the sequence's needed rows
            block = tables[seq, pos // page_size]
            if kv_layout == "HND":
                x = cache[block, kv_head, pos % page_size, d]
            else:
                x = cache[block, pos % page_size, kv_head, d]
            if kv_dtype == dtype:
                dst[j, d] = x
            else:  # exact (e4m3 values fit fp16 / bf16): the scales go to the scores and the output
                dst[j, d] = T.cast(T.cast(x, accum), dtype)

    @T.prim_func
    def paged_prefill(
        Q: T.StridedTensor(plan.q_shape, plan.q_strides, dtype),
        KCache: T.Tensor(plan.kv_shape, kv_dtype),
        VCache: T.Tensor(plan.kv_shape, kv_dtype),
        BlockTables: T.Tensor((num_seqs, max_blocks), "int32"),
        SeqLens: T.Tensor((num_seqs,), "int32"),
        CumSeqLensQ: T.Tensor((num_seqs + 1,), "int32"),
        AlibiSlopes: T.Tensor((num_heads,), "float32"),
        KVScales: T.Tensor((2,), "float32"),
        TileSeq: T.Tensor((num_tiles,), "int32"),
        TileQ0: T.Tensor((num_tiles,), "int32"),
        Out: T.StridedTensor(plan.q_shape, plan.out_strides, dtype),
        Lse: T.Tensor(plan.q_shape[:2], accum),
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
            kv_mult = T.alloc_local((2,), accum)  # [k_scale, v_scale] of an 8-bit cache
            if plan.fp8:
                for k in T.serial(2):
                    kv_mult[k] = KVScales[k]

            # No branch on idle tiles around the KV loop (it would keep the loads from being pipelined).
            _, seq, kv_head, head0, q_begin, q_len, q0, kv_len, pos0, rows, lo, kt0, steps = plan.tile(
                TileSeq, TileQ0, CumSeqLensQ, SeqLens, tile, head_group)
            plan.load_q(Q, q_s, q_begin, q0, q_len, head0)
            if use_alibi:
                plan.load_slopes(AlibiSlopes, slope, head0)
            T.fill(acc_o, 0)
            T.fill(denom, 0)
            T.fill(m_cur, -T.infinity(accum))

            for kt in T.Pipelined(kt0, steps, num_stages=num_stages):
                if paged:
                    # The page ids are the loop body's leading bindings: the warp-specialization
                    # pass keeps those in the producer branch (read once for K and V, ahead of
                    # the copies).
                    blocks = plan.page_ids(BlockTables, seq, kv_len, kt, lo)
                    plan.load_pages(KCache, k_s, blocks, kv_head, kt)
                    plan.load_pages(VCache, v_s, blocks, kv_head, kt)
                else:
                    gather_rows(KCache, k_s, BlockTables, seq, kv_head, kv_len, kt, lo)
                T.clear(acc_s)
                T.gemm(q_s, k_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                plan.mask_scores(acc_s, slope, kt, pos0, kv_mult[0])
                plan.softmax_step(acc_s, m_cur, m_prev, rescale, row_sum, denom)
                T.copy(acc_s, acc_p)
                for i, d in T.Parallel(block_M, head_dim):
                    acc_o[i, d] *= rescale[i]
                if paged:
                    if (kt + 1) * block_N > kv_len:
                        plan.zero_v_tail(v_s, kt, kv_len)
                else:
                    gather_rows(VCache, v_s, BlockTables, seq, kv_head, kv_len, kt, lo)
                T.gemm(acc_p, v_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

            # The valid rows as one variable: the stores' conditions stay small for TileLang's vectorizer.
            valid = T.alloc_var("int32", init=rows)
            plan.store_out(Out, acc_o, denom, q_begin, q0, head0, valid, kv_mult[1])
            plan.store_lse(Lse, m_cur, denom, q_begin, q0, head0, valid)

    return paged_prefill
