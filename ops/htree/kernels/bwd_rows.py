"""dq of the layers below the top (``htree_bwd_rows_kernel``): one CTA per (b, t, kv head) row of a slab walks its
lower layers l = L-2 .. 0 from the selections (the parents of layer l: the winners one layer up, Par[l], as nodes;
its candidate count NCand[l]; its winners, merged one layer down instead, Flags[l - 1]), recomputes the scores of
its merged candidates in chunks, and accumulates dq_rot = sum dS k_rot per layer, rotated back at the layer's query
position n - 1. The top layer's part (``htree_bwd_top_dq_kernel``, DQ) is added at the end and dq written once, in
q's dtype: one CTA per row, a fixed order, no atomics.

A chunk's K rows are gathered and rotated at their candidate positions p (RoPE table rows) into one tile that serves
both the scores (Q K^T) and dq (dS K), V into another; the G query heads are the rows of the products (padded
to 16). This kernel serves fp32 and r < 16; 16-bit inputs with r >= 16 run ``bwd_rows16`` (register fragments)."""

import math

from ...common.hw import LOG2E
from ..tree import MAX_LAYERS, pack_bits
from .bwd_common import rotate, tiles, unrotate

import tilelang.language as T  # noqa: E402


def htree_bwd_rows_kernel(num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int, compression_rate: int,
                          top_k_per_layer: int, max_top_nodes: int, scale: float, dtype: str, block_n: int = 64,
                          threads: int = 128, fp32_precision: str = "highest"):
    """dQ[b, t_start + ts] = scale * (the lower layers' dq) + DQ[b, ts] (the top layer's), in q's dtype."""
    H, Hkv, K, V, r = num_heads, num_kv_heads, head_dim, v_head_dim, compression_rate
    top_k = top_k_per_layer
    G = H // Hkv
    GP = 16  # G <= 16 heads as the products' rows
    half = K // 2
    log_r = int(math.log2(r))
    nbuf = 1 << pack_bits(r, top_k, max_top_nodes)
    q_scale = scale * LOG2E
    alloc, put, product, product_nn = tiles(dtype, T.GemmWarpPolicy.FullCol, fp32_precision)
    B, Tn, NN, NC, TS = T.dynamic("B"), T.dynamic("T"), T.dynamic("NN"), T.dynamic("NC"), T.dynamic("TS")
    LS, PB, PT, FN = T.dynamic("LS"), T.dynamic("PB"), T.dynamic("PT"), T.dynamic("FN")

    @T.macro
    def gather(Src, SrcV, rows, row_off, parents, Cos, Sin, k_s, k_lo, v_s, v_lo, b, h, c0, n):
        """The chunk's candidates c0 .. c0 + block_n: K rotated at the position into k_s, V into v_s; zero past the
        candidates."""
        for j, i in T.Parallel(block_n, half):
            p = T.min(c0 + j, nbuf - 1)
            ok = c0 + j < n
            node = parents[T.min(p >> log_r, top_k - 1)] * r + T.bitwise_and(p, r - 1)
            row = T.max(T.min(row_off + node, rows - 1), 0)
            x = T.if_then_else(ok, T.cast(Src[b, row, h, i], "float32"), 0.0)
            y = T.if_then_else(ok, T.cast(Src[b, row, h, i + half], "float32"), 0.0)
            lo, hi = rotate(x, y, Cos[p, i], Sin[p, i])
            put(lo, k_s, k_lo, j, i)
            put(hi, k_s, k_lo, j, i + half)
        for j, d in T.Parallel(block_n, V):
            p = T.min(c0 + j, nbuf - 1)
            node = parents[T.min(p >> log_r, top_k - 1)] * r + T.bitwise_and(p, r - 1)
            row = T.max(T.min(row_off + node, rows - 1), 0)
            put(T.if_then_else(c0 + j < n, T.cast(SrcV[b, row, h, d], "float32"), 0.0), v_s, v_lo, j, d)

    @T.prim_func
    def htree_bwd_rows(Q: T.Tensor((B, Tn, H, K), dtype), dO: T.Tensor((B, Tn, H, V), dtype),
                       Kt: T.Tensor((B, Tn, Hkv, K), dtype), Vt: T.Tensor((B, Tn, Hkv, V), dtype),
                       NodesK: T.Tensor((B, NN, Hkv, K), dtype), NodesV: T.Tensor((B, NN, Hkv, V), dtype),
                       Cos: T.Tensor((NC, half), "float32"), Sin: T.Tensor((NC, half), "float32"),
                       Lse: T.Tensor((B, Tn, H), "float32"), Dl: T.Tensor((B, Tn, H), "float32"),
                       Par: T.Tensor((LS, PB, PT, Hkv, top_k), "int32"), NCand: T.Tensor((LS, PB, PT, Hkv), "int32"),
                       Flags: T.Tensor((LS, PB, PT, Hkv, FN), "int8"), LayerOff: T.Tensor((MAX_LAYERS,), "int32"),
                       DQ: T.Tensor((B, TS, H, K), "float32"), dQ: T.Tensor((B, Tn, H, K), dtype),
                       num_lower: T.int32, t_start: T.int32):
        with T.Kernel(TS, Hkv, B, threads=threads) as (ts, h, b):
            q_raw = T.alloc_shared((G, K), dtype)
            q_s, q_lo = alloc((GP, K))
            do_s, do_lo = alloc((GP, V))
            k_s, k_lo = alloc((block_n, K))
            v_s, v_lo = alloc((block_n, V))
            ds_s, ds_lo = alloc((GP, block_n))
            parents = T.alloc_shared((top_k,), "int32")
            dq_sh = T.alloc_shared((GP, K), "float32")  # the lower layers' dq so far, rotated back
            dqr_sh = T.alloc_shared((GP, K), "float32")  # one layer's, in its rotated frame
            acc_s = T.alloc_fragment((GP, block_n), "float32")
            acc_dp = T.alloc_fragment((GP, block_n), "float32")
            acc_dq = T.alloc_fragment((GP, K), "float32")
            lse2 = T.alloc_fragment((GP,), "float32")
            dl = T.alloc_fragment((GP,), "float32")
            n = T.alloc_var("int32")
            t = t_start + ts

            for g, d in T.Parallel(G, K):
                q_raw[g, d] = Q[b, t, h * G + g, d]
            for g, d in T.Parallel(GP, V):
                put(T.if_then_else(g < G, T.cast(dO[b, t, h * G + T.min(g, G - 1), d], "float32"), 0.0),
                    do_s, do_lo, g, d)
            for g in T.Parallel(GP):
                lse2[g] = T.if_then_else(g < G, Lse[b, t, h * G + T.min(g, G - 1)] * LOG2E, 0.0)
                dl[g] = T.if_then_else(g < G, Dl[b, t, h * G + T.min(g, G - 1)], 0.0)
            for g, d in T.Parallel(GP, K):
                dq_sh[g, d] = 0.0
            for li in T.serial(num_lower):
                l = num_lower - 1 - li
                n = NCand[l, b, ts, h]
                for i in T.Parallel(top_k):
                    parents[i] = Par[l, b, ts, h, i]
                # the query at the layer's position n - 1, scaled into the log2 domain
                for g, i in T.Parallel(GP, half):
                    x = T.if_then_else(g < G, T.cast(q_raw[T.min(g, G - 1), i], "float32"), 0.0)
                    y = T.if_then_else(g < G, T.cast(q_raw[T.min(g, G - 1), i + half], "float32"), 0.0)
                    lo, hi = rotate(x, y, Cos[n - 1, i], Sin[n - 1, i])
                    put(q_scale * lo, q_s, q_lo, g, i)
                    put(q_scale * hi, q_s, q_lo, g, i + half)
                T.clear(acc_dq)
                for c in T.serial(T.ceildiv(n, block_n)):
                    if l == 0:
                        gather(Kt, Vt, Tn, 0, parents, Cos, Sin, k_s, k_lo, v_s, v_lo, b, h, c * block_n, n)
                    else:
                        gather(NodesK, NodesV, NN, LayerOff[l], parents, Cos, Sin, k_s, k_lo, v_s, v_lo, b, h,
                               c * block_n, n)
                    T.clear(acc_s)
                    T.clear(acc_dp)
                    product(q_s, q_lo, k_s, k_lo, acc_s)
                    product(do_s, do_lo, v_s, v_lo, acc_dp)
                    for g, j in T.Parallel(GP, block_n):
                        p = c * block_n + j
                        # the layer's winners were expanded (merged one layer down), not merged here
                        win = T.if_then_else(l > 0, T.cast(Flags[T.max(l - 1, 0), b, ts, h, T.min(p, FN - 1)], "int32"),
                                             0)
                        keep = T.And(T.And(g < G, p < n), win == 0)
                        pr = T.if_then_else(keep, T.exp2(acc_s[g, j] - lse2[g]), 0.0)
                        put(pr * (acc_dp[g, j] - dl[g]), ds_s, ds_lo, g, j)
                    product_nn(ds_s, ds_lo, k_s, k_lo, acc_dq)
                T.copy(acc_dq, dqr_sh)
                for g, i in T.Parallel(GP, half):
                    lo, hi = unrotate(dqr_sh[g, i], dqr_sh[g, i + half], Cos[n - 1, i], Sin[n - 1, i])
                    dq_sh[g, i] += lo
                    dq_sh[g, i + half] += hi
            for g, d in T.Parallel(G, K):
                dQ[b, t, h * G + g, d] = T.cast(scale * dq_sh[g, d] + DQ[b, ts, h * G + g, d], dtype)

    return htree_bwd_rows
