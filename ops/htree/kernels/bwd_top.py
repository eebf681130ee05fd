"""The top layer's backward (for L > 1 the top layer, for L = 1 the whole causal attention): every query's
top-layer candidates are the nodes 0 .. t >> top_shift at buffer positions equal to their index (rotated once,
``htree_rope_kernel``), so both sides are GEMMs over blocks, as in the forward's top kernels.

``htree_bwd_top_dq_kernel``: one CTA per block of queries (rows = queries x G heads) streams the top layer in chunks
and accumulates dq_rot = sum dS k_rot, rotated back at the query's position t >> top_shift into a per-slab fp32
partial DQ (the lower layers add theirs in ``htree_bwd_rows_kernel``).
``htree_bwd_top_dkv_kernel``: one CTA per block of top nodes loops over the slab's query blocks that see it and adds
dK (rotated back at the node's position) and dV into the fp32 accumulators: each node's rows belong to one CTA per
launch, and the query blocks go in a fixed order, so the sums are deterministic.

Scores are recomputed in the log2 domain (q scaled by scale * log2(e)); P = exp2(s - lse * log2(e)) for the
merged candidates (on the causal side, not winners: the winner flags of the slab, ``has_sel``), zero otherwise;
dS = P (dO . v - D) with D = rowsum(dO * O)."""

from ...common.hw import LOG2E
from .bwd_common import LN2, rotate, tiles, unrotate

import tilelang.language as T  # noqa: E402


def _rows(G: int, block_m: int):
    """Queries per block of rows (row m: query m // G, head m % G; rows past bt * G unused)."""
    return block_m // G


def _query_rows(G: int, block_m: int, head_dim: int, v_head_dim: int, q_scale: float, put):
    """The macro loading a block of query rows from query t0 on (row m: query t0 + m // G, head h * G + m % G; rows
    past the block's bt queries or past t_end are zeros): q scaled by q_scale and rotated at t >> top_shift, dO,
    and the rows' lse (log2 domain) and D."""
    bt, half = _rows(G, block_m), head_dim // 2

    @T.macro
    def load(Q, dO, Lse, Dl, Cos, Sin, b, h, t0, t_end, top_shift, q_s, q_lo, do_s, do_lo, lse2, dl):
        for m, i in T.Parallel(block_m, half):
            tq = T.min(t0 + m // G, t_end - 1)
            ok = T.And(m < bt * G, t0 + m // G < t_end)
            x = T.if_then_else(ok, T.cast(Q[b, tq, h * G + m % G, i], "float32"), 0.0)
            y = T.if_then_else(ok, T.cast(Q[b, tq, h * G + m % G, i + half], "float32"), 0.0)
            lo, hi = rotate(x, y, Cos[tq >> top_shift, i], Sin[tq >> top_shift, i])
            put(q_scale * lo, q_s, q_lo, m, i)
            put(q_scale * hi, q_s, q_lo, m, i + half)
        for m, d in T.Parallel(block_m, v_head_dim):
            tq = T.min(t0 + m // G, t_end - 1)
            ok = T.And(m < bt * G, t0 + m // G < t_end)
            put(T.if_then_else(ok, T.cast(dO[b, tq, h * G + m % G, d], "float32"), 0.0), do_s, do_lo, m, d)
        for m in T.Parallel(block_m):
            tq = T.min(t0 + m // G, t_end - 1)
            lse2[m] = Lse[b, tq, h * G + m % G] * LOG2E
            dl[m] = Dl[b, tq, h * G + m % G]

    return load


def htree_bwd_top_dq_kernel(num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int, scale: float,
                            dtype: str, block_m: int = 64, block_n: int = 64, threads: int = 128):
    """DQ[b, t - t_start, h] (fp32): the top layer's part of dq for the slab's queries, rotated back and scaled."""
    H, Hkv, K, V = num_heads, num_kv_heads, head_dim, v_head_dim
    G = H // Hkv
    bt = _rows(G, block_m)
    half = K // 2
    q_scale = scale * LOG2E
    alloc, put, product, product_nn = tiles(dtype)
    load_rows = _query_rows(G, block_m, K, V, q_scale, put)
    B, Tn, NT, NV, NC = T.dynamic("B"), T.dynamic("T"), T.dynamic("NT"), T.dynamic("NV"), T.dynamic("NC")
    TS, FB, FT, FN = T.dynamic("TS"), T.dynamic("FB"), T.dynamic("FT"), T.dynamic("FN")

    @T.prim_func
    def htree_bwd_top_dq(Q: T.Tensor((B, Tn, H, K), dtype), dO: T.Tensor((B, Tn, H, V), dtype),
                         TopK: T.Tensor((B, Hkv, NT, K), dtype), TopV: T.Tensor((B, NV, Hkv, V), dtype),
                         Cos: T.Tensor((NC, half), "float32"), Sin: T.Tensor((NC, half), "float32"),
                         Lse: T.Tensor((B, Tn, H), "float32"), Dl: T.Tensor((B, Tn, H), "float32"),
                         Flags: T.Tensor((FB, FT, Hkv, FN), "int8"), DQ: T.Tensor((B, TS, H, K), "float32"),
                         top_shift: T.int32, top_off: T.int32, t_start: T.int32, has_sel: T.int32):
        with T.Kernel(T.ceildiv(TS, bt), Hkv, B, threads=threads) as (bx, h, b):
            q_s, q_lo = alloc((block_m, K))
            do_s, do_lo = alloc((block_m, V))
            k_s, k_lo = alloc((block_n, K))
            v_s, v_lo = alloc((block_n, V))
            ds_s, ds_lo = alloc((block_m, block_n))
            dq_sh = T.alloc_shared((block_m, K), "float32")
            acc_s = T.alloc_fragment((block_m, block_n), "float32")
            acc_dp = T.alloc_fragment((block_m, block_n), "float32")
            acc_dq = T.alloc_fragment((block_m, K), "float32")
            lse2 = T.alloc_fragment((block_m,), "float32")
            dl = T.alloc_fragment((block_m,), "float32")
            t0 = t_start + bx * bt
            t_end = t_start + TS

            load_rows(Q, dO, Lse, Dl, Cos, Sin, b, h, t0, t_end, top_shift, q_s, q_lo, do_s, do_lo, lse2, dl)
            T.clear(acc_dq)
            n_max = ((T.min(t0 + bt, t_end) - 1) >> top_shift) + 1  # the block's last query sees the most nodes
            for c in T.serial(T.ceildiv(n_max, block_n)):
                for j, d in T.Parallel(block_n, K):
                    put(T.cast(TopK[b, h, T.min(c * block_n + j, NT - 1), d], "float32"), k_s, k_lo, j, d)
                for j, d in T.Parallel(block_n, V):
                    put(T.cast(TopV[b, top_off + T.min(c * block_n + j, NT - 1), h, d], "float32"), v_s, v_lo, j, d)
                T.clear(acc_s)
                T.clear(acc_dp)
                product(q_s, q_lo, k_s, k_lo, acc_s)
                product(do_s, do_lo, v_s, v_lo, acc_dp)
                for m, j in T.Parallel(block_m, block_n):
                    node = c * block_n + j
                    tq = T.min(t0 + m // G, t_end - 1)
                    win = T.if_then_else(has_sel != 0, T.cast(
                        Flags[T.min(b, FB - 1), T.min(tq - t_start, FT - 1), h, T.min(node, FN - 1)], "int32"), 0)
                    keep = T.And(T.And(m < bt * G, t0 + m // G < t_end), T.And(node <= (tq >> top_shift), win == 0))
                    p = T.if_then_else(keep, T.exp2(acc_s[m, j] - lse2[m]), 0.0)
                    put(p * (acc_dp[m, j] - dl[m]), ds_s, ds_lo, m, j)
                product_nn(ds_s, ds_lo, k_s, k_lo, acc_dq)
            T.copy(acc_dq, dq_sh)
            for m, i in T.Parallel(block_m, half):
                tq = T.min(t0 + m // G, t_end - 1)
                if T.And(m < bt * G, t0 + m // G < t_end):
                    lo, hi = unrotate(dq_sh[m, i], dq_sh[m, i + half], Cos[tq >> top_shift, i], Sin[tq >> top_shift, i])
                    DQ[b, tq - t_start, h * G + m % G, i] = scale * lo
                    DQ[b, tq - t_start, h * G + m % G, i + half] = scale * hi

    return htree_bwd_top_dq


def htree_bwd_top_dkv_kernel(num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int, scale: float,
                             dtype: str, block_m: int = 64, block_n: int = 32, threads: int = 128):
    """AccK / AccV rows acc_off + node (fp32) += the top layer's dK (rotated back at the node's position) and dV
    from the slab's queries [t_start, t_start + ts_len)."""
    H, Hkv, K, V = num_heads, num_kv_heads, head_dim, v_head_dim
    G = H // Hkv
    bt = _rows(G, block_m)
    half = K // 2
    q_scale = scale * LOG2E
    alloc, put, product, product_nn = tiles(dtype, T.GemmWarpPolicy.FullCol)
    load_rows = _query_rows(G, block_m, K, V, q_scale, put)
    B, Tn, NT, NV, NC, NA = (T.dynamic("B"), T.dynamic("T"), T.dynamic("NT"), T.dynamic("NV"), T.dynamic("NC"),
                             T.dynamic("NA"))
    FB, FT, FN = T.dynamic("FB"), T.dynamic("FT"), T.dynamic("FN")

    @T.prim_func
    def htree_bwd_top_dkv(Q: T.Tensor((B, Tn, H, K), dtype), dO: T.Tensor((B, Tn, H, V), dtype),
                          TopK: T.Tensor((B, Hkv, NT, K), dtype), TopV: T.Tensor((B, NV, Hkv, V), dtype),
                          Cos: T.Tensor((NC, half), "float32"), Sin: T.Tensor((NC, half), "float32"),
                          Lse: T.Tensor((B, Tn, H), "float32"), Dl: T.Tensor((B, Tn, H), "float32"),
                          Flags: T.Tensor((FB, FT, Hkv, FN), "int8"), AccK: T.Tensor((B, NA, Hkv, K), "float32"),
                          AccV: T.Tensor((B, NA, Hkv, V), "float32"), top_shift: T.int32, top_off: T.int32,
                          acc_off: T.int32, t_start: T.int32, ts_len: T.int32, has_sel: T.int32):
        with T.Kernel(T.ceildiv(NT, block_n), Hkv, B, threads=threads) as (bx, h, b):
            k_s, k_lo = alloc((block_n, K))
            v_s, v_lo = alloc((block_n, V))
            q_s, q_lo = alloc((block_m, K))
            do_s, do_lo = alloc((block_m, V))
            p_s, p_lo = alloc((block_n, block_m))
            ds_s, ds_lo = alloc((block_n, block_m))
            lse_s = T.alloc_shared((block_m,), "float32")
            dl_s = T.alloc_shared((block_m,), "float32")
            dk_sh = T.alloc_shared((block_n, K), "float32")
            acc_s = T.alloc_fragment((block_n, block_m), "float32")  # scores, transposed (node, row)
            acc_dp = T.alloc_fragment((block_n, block_m), "float32")
            acc_dk = T.alloc_fragment((block_n, K), "float32")
            acc_dv = T.alloc_fragment((block_n, V), "float32")
            j0 = bx * block_n
            t_end = t_start + ts_len
            first = T.max(t_start, j0 << top_shift)  # the first query that sees node j0

            for j, d in T.Parallel(block_n, K):
                put(T.if_then_else(j0 + j < NT, T.cast(TopK[b, h, T.min(j0 + j, NT - 1), d], "float32"), 0.0),
                    k_s, k_lo, j, d)
            for j, d in T.Parallel(block_n, V):
                put(T.if_then_else(j0 + j < NT, T.cast(TopV[b, top_off + T.min(j0 + j, NT - 1), h, d], "float32"),
                                   0.0), v_s, v_lo, j, d)
            T.clear(acc_dk)
            T.clear(acc_dv)
            for qb in T.serial(T.ceildiv(T.max(t_end - first, 0), bt)):
                tq0 = first + qb * bt
                load_rows(Q, dO, Lse, Dl, Cos, Sin, b, h, tq0, t_end, top_shift, q_s, q_lo, do_s, do_lo, lse_s, dl_s)
                T.clear(acc_s)
                T.clear(acc_dp)
                product(k_s, k_lo, q_s, q_lo, acc_s)
                product(v_s, v_lo, do_s, do_lo, acc_dp)
                for j, m in T.Parallel(block_n, block_m):
                    node = j0 + j
                    tq = T.min(tq0 + m // G, t_end - 1)
                    win = T.if_then_else(has_sel != 0, T.cast(
                        Flags[T.min(b, FB - 1), T.min(tq - t_start, FT - 1), h, T.min(node, FN - 1)], "int32"), 0)
                    keep = T.And(T.And(m < bt * G, tq0 + m // G < t_end),
                                 T.And(T.And(node < NT, node <= (tq >> top_shift)), win == 0))
                    p = T.if_then_else(keep, T.exp2(acc_s[j, m] - lse_s[m]), 0.0)
                    put(p, p_s, p_lo, j, m)
                    put(p * (acc_dp[j, m] - dl_s[m]), ds_s, ds_lo, j, m)
                product_nn(p_s, p_lo, do_s, do_lo, acc_dv)
                product_nn(ds_s, ds_lo, q_s, q_lo, acc_dk)
            # q carried scale * log2(e): dK = ln(2) * acc_dk, rotated back at the node's position
            T.copy(acc_dk, dk_sh)
            for j, i in T.Parallel(block_n, half):
                node = j0 + j
                if node < NT:
                    lo, hi = unrotate(dk_sh[j, i], dk_sh[j, i + half], Cos[node, i], Sin[node, i])
                    AccK[b, acc_off + node, h, i] += lo * LN2
                    AccK[b, acc_off + node, h, i + half] += hi * LN2
            for j, d in T.Parallel(block_n, V):
                if j0 + j < NT:
                    AccV[b, acc_off + j0 + j, h, d] += acc_dv[j, d]

    return htree_bwd_top_dkv
