"""The top layer (for L > 1), by GEMMs over blocks of queries: every query scores the same rotated top-layer
rows, only its own RoPE position differs. ``htree_top_lse_kernel`` computes every query head's log-sum-exp over
it, ``htree_top_keys_kernel`` every query's packed importance keys, and, after the walk,
``htree_top_merge_kernel`` merges the top layer's non-winners and writes O. Each streams the top layer in chunks
staged by cp.async one chunk ahead, so a chunk's loads overlap the previous chunk's products; fp32 K and V come
split into TF32 halves once per call (``split_tf32``), so the chunks land as the products' operand tiles, which
the 64-row tiles multiply as warpgroup (wgmma) products."""

from ...common.hw import LOG2E

LN2 = 1.0 / LOG2E
from ..tree import pack_bits
from ...common.tl.softmax import NEG, lse_finish, lse_update
from .fragments import FLT_MIN, operand_stores, packed_key, split_product

import tilelang.language as T  # noqa: E402


def _top_operand(B, Hkv, NT, K, dtype: str):
    """Shape and dtype of the top-layer kernels' K operand: the rotated rows [B, Hkv, NT, K], or for fp32 their
    TF32 halves [2, B, Hkv, NT, K] (``split_tf32``), loaded straight into the products' operand tiles."""
    return ((2, B, Hkv, NT, K), T.tfloat32) if dtype == "float32" else ((B, Hkv, NT, K), dtype)


def _top_layer_macros(num_heads: int, num_kv_heads: int, head_dim: int, scale: float, dtype: str,
                      block_m: int, block_n: int):
    """What the top-layer kernels share. Every query's top-layer candidates are the same nodes at the
    same buffer positions (nodes 0 .. t >> top_shift, rotated once by ``htree_rope_kernel``); only the
    query's own RoPE position n - 1 differs. So a CTA takes block_m // G queries of one kv head (rows
    (t, g)) and scores each chunk of block_n nodes for all of them with one GEMM."""
    G = num_heads // num_kv_heads
    bt = block_m // G  # queries per CTA
    half = head_dim // 2
    split = dtype == "float32"
    put, put_rotated = operand_stores(dtype, half)

    @T.macro
    def load_queries(Q, Cos, Sin, q_s, q_lo, b, h, t0, t_end, top_shift):
        """Row m: query t0 + m // G, head m % G, scaled and rotated at its position n - 1 (zero past t_end)."""
        for m, i in T.Parallel(block_m, half):
            tq = T.min(t0 + m // G, t_end - 1)
            ok = T.And(m < bt * G, t0 + m // G < t_end)
            x = T.if_then_else(ok, T.cast(Q[b, tq, h * G + m % G, i], "float32"), 0.0)
            y = T.if_then_else(ok, T.cast(Q[b, tq, h * G + m % G, i + half], "float32"), 0.0)
            put_rotated(x, y, Cos[tq >> top_shift, i], Sin[tq >> top_shift, i], scale * LOG2E, True, q_s, q_lo,
                        m, i)

    @T.macro
    def load_slab_rows(Q, Cos, Sin, Lse, q_s, q_lo, lse, b, h, bx, t_start, TS, top_shift):
        """The CTA's rows of the slab [t_start, t_start + TS) (load_queries) and their lse; returns
        (first query t0, t_end, n_max: the top nodes its last query sees)."""
        t0 = t_start + bx * bt
        t_end = t_start + TS
        load_queries(Q, Cos, Sin, q_s, q_lo, b, h, t0, t_end, top_shift)
        for m in T.Parallel(block_m):
            lse[m] = Lse[b, T.min(t0 + m // G, t_end - 1), h * G + m % G]
        return t0, t_end, (T.min(t0 + bt, t_end) - 1 >> top_shift) + 1

    @T.macro
    def load_chunk(TopK, kt_s, b, h, c, TopV=None, vt_s=None, top_off=None):
        """Chunk c's rotated top-layer K (and V) into stage c % 2 by cp.async, rows past the buffers as
        zeros (the callers mask candidates past a query's n by position). fp32: both TF32 halves of K
        ([2, B, Hkv, NT, K]) and of V transposed ([2, B, Hkv, V, chunks * block_n]), split once per call
        (``split_tf32``); 16-bit: K rows, and V rows of the tree's top layer (from row top_off)."""
        nodes = slice(c * block_n, (c + 1) * block_n)
        if split:
            for part in range(2):
                T.async_copy(TopK[part, b, h, nodes, :], kt_s[c % 2, part, :, :])
                if TopV is not None:
                    T.async_copy(TopV[part, b, h, :, nodes], vt_s[c % 2, part, :, :])
        else:
            T.async_copy(TopK[b, h, nodes, :], kt_s[c % 2, :, :])
            if TopV is not None:
                T.async_copy(TopV[b, top_off + c * block_n:top_off + (c + 1) * block_n, h, :], vt_s[c % 2, :, :])

    @T.macro
    def await_chunk(TopK, kt_s, b, h, c, nc, TopV=None, vt_s=None, top_off=None):
        """Chunk c's copies landed (for all threads), chunk c + 1's issued: its loads overlap chunk c's math."""
        if c + 1 < nc:
            load_chunk(TopK, kt_s, b, h, c + 1, TopV, vt_s, top_off)
            T.ptx_wait_group((1 if TopV is None else 2) * (2 if split else 1))
        else:
            T.ptx_wait_group(0)
        T.sync_threads()

    @T.macro
    def chunk_scores(kt_s, q_s, q_lo, acc_s, c):
        """acc_s[m, j] = log2-domain score of row m against top node c * block_n + j (its K in kt_s[c % 2])."""
        T.clear(acc_s)
        if split:
            split_product(q_s, q_lo, kt_s[c % 2, 0, :, :], kt_s[c % 2, 1, :, :], acc_s)
        else:
            T.gemm(q_s, kt_s[c % 2, :, :], acc_s, transpose_B=True)

    @T.macro
    def alloc_operand(shape):
        """An mma operand's shared tile and the tile of its split-TF32 low halves (fp32; else a stub). fp32
        halves are typed TF32, which TileLang multiplies with wgmma (warpgroup products reading shared
        memory once per warpgroup; fp32 tiles get mma.sync, whose warps each load the whole B tile)."""
        cdt = T.tfloat32 if split else dtype
        return T.alloc_shared(shape, cdt), T.alloc_shared(shape if split else (1, 1), cdt)

    @T.macro
    def alloc_stages(shape):
        """Two cp.async stages of a chunk's operand tile (fp32: its TF32 halves side by side)."""
        return T.alloc_shared((2, 2) + shape, T.tfloat32) if split else T.alloc_shared((2,) + shape, dtype)

    @T.macro
    def alloc_scores():
        """chunk_scores' buffers (q_s, q_lo, kt_s, acc_s): the products read the staged K (fp32: its halves)."""
        q_s, q_lo = alloc_operand((block_m, head_dim))
        acc_s = T.alloc_fragment((block_m, block_n), "float32")
        return q_s, q_lo, alloc_stages((block_n, head_dim)), acc_s

    return (G, bt, put, alloc_operand, alloc_scores, alloc_stages, load_queries, load_slab_rows, load_chunk,
            await_chunk, chunk_scores)


def htree_top_lse_kernel(num_heads: int, num_kv_heads: int, head_dim: int, scale: float, dtype: str,
                         block_m: int = 64, block_n: int = 64, threads: int = 128):
    """Lse[b, t, h]: log2-domain log-sum-exp of query head h's scores over the top layer (for L > 1),
    the softmax reference of the top layer's importance and merge."""
    H, Hkv, K = num_heads, num_kv_heads, head_dim
    G, bt, _, _, alloc_scores, _, load_queries, _, load_chunk, await_chunk, chunk_scores = _top_layer_macros(
        H, Hkv, K, scale, dtype, block_m, block_n)
    B, Tn, NT, NC = T.dynamic("B"), T.dynamic("T"), T.dynamic("NT"), T.dynamic("NC")
    top_k_shape, top_dtype = _top_operand(B, Hkv, NT, K, dtype)

    @T.prim_func
    def htree_top_lse(Q: T.Tensor((B, Tn, H, K), dtype), TopK: T.Tensor(top_k_shape, top_dtype),
                      Cos: T.Tensor((NC, K // 2), "float32"), Sin: T.Tensor((NC, K // 2), "float32"),
                      Lse: T.Tensor((B, Tn, H), "float32"), top_shift: T.int32):
        with T.Kernel(T.ceildiv(Tn, bt), Hkv, B, threads=threads) as (bx, h, b):
            q_s, q_lo, kt_s, acc_s = alloc_scores()
            m_part = T.alloc_fragment((block_m, block_n), "float32")
            l_part = T.alloc_fragment((block_m, block_n), "float32")
            m_row = T.alloc_fragment((block_m,), "float32")
            lse = T.alloc_fragment((block_m,), "float32")
            t0 = bx * bt
            n_max = (T.min(t0 + bt, Tn) - 1 >> top_shift) + 1  # the CTA's last query sees the most nodes

            nc = T.ceildiv(n_max, block_n)
            load_chunk(TopK, kt_s, b, h, 0)
            load_queries(Q, Cos, Sin, q_s, q_lo, b, h, t0, Tn, top_shift)
            T.fill(m_part, NEG)
            T.fill(l_part, 0.0)
            for c in T.serial(nc):
                await_chunk(TopK, kt_s, b, h, c, nc)
                chunk_scores(kt_s, q_s, q_lo, acc_s, c)
                for m, j in T.Parallel(block_m, block_n):
                    lse_update(m_part, l_part, m, j,
                                T.if_then_else(c * block_n + j <= (T.min(t0 + m // G, Tn - 1) >> top_shift),
                                               acc_s[m, j], NEG))
            lse_finish(m_part, l_part, m_row, lse)
            for m in T.Parallel(block_m):
                if T.And(m < bt * G, t0 + m // G < Tn):
                    Lse[b, t0 + m // G, h * G + m % G] = lse[m]

    return htree_top_lse


def htree_top_keys_kernel(num_heads: int, num_kv_heads: int, head_dim: int, compression_rate: int,
                          top_k_per_layer: int, max_top_nodes: int, scale: float, dtype: str, block_m: int = 64,
                          block_n: int = 64, threads: int = 128):
    """Keys[b, t - t_start, h, p]: the packed importance key of top node p (p < n) for query t of the slab
    [t_start, t_start + TS): fp32 importance sum_g exp2(s_gp - lse_g) (subnormal terms flushed, heads summed
    in order, the rightmost node's 1e3) with its low LOG_N bits replaced by ~p."""
    H, Hkv, K = num_heads, num_kv_heads, head_dim
    G, bt, _, _, alloc_scores, _, _, load_slab_rows, load_chunk, await_chunk, chunk_scores = _top_layer_macros(
        H, Hkv, K, scale, dtype, block_m, block_n)
    pos_mask = (1 << pack_bits(compression_rate, top_k_per_layer, max_top_nodes)) - 1
    B, Tn, NT, NC = T.dynamic("B"), T.dynamic("T"), T.dynamic("NT"), T.dynamic("NC")
    TS, NK = T.dynamic("TS"), T.dynamic("NK")
    top_k_shape, top_dtype = _top_operand(B, Hkv, NT, K, dtype)

    @T.prim_func
    def htree_top_keys(Q: T.Tensor((B, Tn, H, K), dtype), TopK: T.Tensor(top_k_shape, top_dtype),
                       Cos: T.Tensor((NC, K // 2), "float32"), Sin: T.Tensor((NC, K // 2), "float32"),
                       Lse: T.Tensor((B, Tn, H), "float32"), Keys: T.Tensor((B, TS, Hkv, NK), "int32"),
                       top_shift: T.int32, t_start: T.int32):
        with T.Kernel(T.ceildiv(TS, bt), Hkv, B, threads=threads) as (bx, h, b):
            q_s, q_lo, kt_s, acc_s = alloc_scores()
            prob_s = T.alloc_shared((block_m, block_n), "float32")
            lse = T.alloc_fragment((block_m,), "float32")
            t0, t_end, n_max = load_slab_rows(Q, Cos, Sin, Lse, q_s, q_lo, lse, b, h, bx, t_start, TS, top_shift)
            nc = T.ceildiv(n_max, block_n)
            load_chunk(TopK, kt_s, b, h, 0)
            for c in T.serial(nc):
                await_chunk(TopK, kt_s, b, h, c, nc)
                chunk_scores(kt_s, q_s, q_lo, acc_s, c)
                for m, j in T.Parallel(block_m, block_n):
                    pr = T.exp2(acc_s[m, j] - lse[m])
                    prob_s[m, j] = T.if_then_else(pr < FLT_MIN, 0.0, pr)
                for i, j in T.Parallel(bt, block_n):
                    p = c * block_n + j
                    n = ((t0 + i) >> top_shift) + 1
                    if T.And(t0 + i < t_end, p < n):
                        Keys[b, t0 + i - t_start, h, p] = packed_key(prob_s, G, i * G, j, p, n, pos_mask)

    return htree_top_keys


def htree_top_merge_kernel(num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int, scale: float,
                           dtype: str, block_m: int = 64, block_n: int = 64, threads: int = 128,
                           for_backward: bool = False):
    """O for the slab's queries: the top layer's non-winners (keys below the row's winning threshold Thr)
    merged against the lse reference, combined with the walk's state of the layers below (PartO
    unnormalized against PartML's maximum, PartML's sum). ``for_backward``: each row's final log-sum-exp
    (natural log) then replaces its top-layer lse in Lse (every CTA reads only its own rows, at its start)."""
    H, Hkv, K, V = num_heads, num_kv_heads, head_dim, v_head_dim
    G, bt, put, alloc_operand, alloc_scores, alloc_stages, _, load_slab_rows, load_chunk, await_chunk, \
        chunk_scores = _top_layer_macros(H, Hkv, K, scale, dtype, block_m, block_n)
    split = dtype == "float32"
    B, Tn, NT, NC, NN = T.dynamic("B"), T.dynamic("T"), T.dynamic("NT"), T.dynamic("NC"), T.dynamic("NN")
    TS, NK, NTC = T.dynamic("TS"), T.dynamic("NK"), T.dynamic("NTC")
    top_k_shape, top_dtype = _top_operand(B, Hkv, NT, K, dtype)
    # fp32: the top layer's V transposed in TF32 halves, padded to whole chunks; 16-bit: the tree's V rows
    top_v_shape = (2, B, Hkv, V, NTC * block_n) if split else (B, NN, Hkv, V)

    @T.prim_func
    def htree_top_merge(Q: T.Tensor((B, Tn, H, K), dtype), TopK: T.Tensor(top_k_shape, top_dtype),
                        TopV: T.Tensor(top_v_shape, top_dtype),
                        Cos: T.Tensor((NC, K // 2), "float32"), Sin: T.Tensor((NC, K // 2), "float32"),
                        Lse: T.Tensor((B, Tn, H), "float32"), Keys: T.Tensor((B, TS, Hkv, NK), "int32"),
                        Thr: T.Tensor((B, TS, Hkv), "int32"), PartO: T.Tensor((B, TS, H, V), "float32"),
                        PartML: T.Tensor((B, TS, H, 2), "float32"), O: T.Tensor((B, Tn, H, V), dtype),
                        top_shift: T.int32, t_start: T.int32, top_off: T.int32):
        with T.Kernel(T.ceildiv(TS, bt), Hkv, B, threads=threads) as (bx, h, b):
            q_s, q_lo, kt_s, acc_s = alloc_scores()
            p_s, p_lo = alloc_operand((block_m, block_n))
            vt_s = alloc_stages((V, block_n) if split else (block_n, V))  # a TF32 wgmma takes B K-major only
            s_part = T.alloc_fragment((block_m, block_n), "float32")
            acc_o = T.alloc_fragment((block_m, V), "float32")
            lse = T.alloc_fragment((block_m,), "float32")
            thr = T.alloc_fragment((block_m,), "int32")
            s_top = T.alloc_fragment((block_m,), "float32")
            t0, t_end, n_max = load_slab_rows(Q, Cos, Sin, Lse, q_s, q_lo, lse, b, h, bx, t_start, TS, top_shift)
            load_chunk(TopK, kt_s, b, h, 0, TopV, vt_s, top_off)
            for m in T.Parallel(block_m):
                thr[m] = Thr[b, T.min(t0 + m // G, t_end - 1) - t_start, h]
            T.fill(s_part, 0.0)
            T.fill(acc_o, 0.0)
            nc = T.ceildiv(n_max, block_n)
            for c in T.serial(nc):
                await_chunk(TopK, kt_s, b, h, c, nc, TopV, vt_s, top_off)
                chunk_scores(kt_s, q_s, q_lo, acc_s, c)
                for m, j in T.Parallel(block_m, block_n):
                    # a non-winner of its query (the candidates past n have no key: masked by position)
                    tq = T.min(t0 + m // G, t_end - 1)
                    keep = T.And(c * block_n + j <= (tq >> top_shift),
                                 Keys[b, tq - t_start, h, T.min(c * block_n + j, NK - 1)] < thr[m])
                    pr = T.if_then_else(keep, T.exp2(acc_s[m, j] - lse[m]), 0.0)
                    s_part[m, j] += pr
                    put(pr, p_s, p_lo, m, j)
                if split:
                    split_product(p_s, p_lo, vt_s[c % 2, 0, :, :], vt_s[c % 2, 1, :, :], acc_o)
                else:
                    T.gemm(p_s, vt_s[c % 2, :, :], acc_o)
            T.reduce_sum(s_part, s_top, dim=1, clear=True)
            # both parts against their common maximum
            for m, d in T.Parallel(block_m, V):
                if T.And(m < bt * G, t0 + m // G < t_end):
                    tl = t0 + m // G - t_start
                    hq = h * G + m % G
                    mx = T.max(lse[m], PartML[b, tl, hq, 0])
                    w_top = T.exp2(lse[m] - mx)
                    w_low = T.exp2(PartML[b, tl, hq, 0] - mx)
                    O[b, t0 + m // G, hq, d] = T.cast(
                        (acc_o[m, d] * w_top + PartO[b, tl, hq, d] * w_low)
                        / (s_top[m] * w_top + PartML[b, tl, hq, 1] * w_low), dtype)
            if for_backward:
                T.sync_threads()  # every thread is past its reads of Lse (load_slab_rows)
                for m in T.Parallel(block_m):
                    if T.And(m < bt * G, t0 + m // G < t_end):
                        tl = t0 + m // G - t_start
                        hq = h * G + m % G
                        mx = T.max(lse[m], PartML[b, tl, hq, 0])
                        total = s_top[m] * T.exp2(lse[m] - mx) + PartML[b, tl, hq, 1] * T.exp2(
                            PartML[b, tl, hq, 0] - mx)
                        Lse[b, t0 + m // G, hq] = (mx + T.log2(total)) * LN2

    return htree_top_merge
