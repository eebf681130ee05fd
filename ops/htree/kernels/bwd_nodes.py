"""dK and dV of a layer below the top (``htree_bwd_nodes_kernel``), node-major: the nodes of layer l are the
children of the parents at layer l + 1, and a parent's children are candidates exactly of the queries that selected
the parent. So one CTA per (parent j, tile of its children, kv head) goes through the list of the slab's queries
that selected j (built on the host, ``bwd_index.parent_lists``: entries (query, slot) ordered by query) and adds the
children's dK, dV into the fp32 accumulators. Each child belongs to one CTA per launch and the list has a fixed
order: deterministic, no atomics.

Candidate-local RoPE: a query's candidate at position p = slot * r + c (child c of its slot-th parent) is rotated at p
and the query at n - 1; <R(q, n - 1), R(k, slot r + c)> = <R(q, n - 1 - slot r), R(k, c)>, so the children are
rotated once at their child index c and each entry's query at n - 1 - slot r. A child is merged by the query unless
it lies past the query's rightmost child (the parent holding t) or won at layer l (l > 0: expanded instead)."""

import math

from ...common.hw import LOG2E
from ..tree import MAX_LAYERS
from .bwd_common import LN2, rotate, tiles, unrotate

import tilelang.language as T  # noqa: E402

LIST_SLOT_BITS = 14  # a list entry packs (query in the slab) << 14 | slot (slot < top_k <= 8192)


def children_tile(compression_rate: int) -> int:
    """Children per CTA (the products' rows): r, at least 16 (rows past r are zero), at most 32."""
    return min(max(compression_rate, 16), 32)


def htree_bwd_nodes_kernel(num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int, compression_rate: int,
                           top_k_per_layer: int, scale: float, dtype: str, block_m: int = 64, threads: int = 128,
                           fp32_precision: str = "highest"):
    """AccK / AccV rows acc_off + node (fp32) += dK, dV of the layer's nodes from the slab's queries."""
    H, Hkv, K, V, r = num_heads, num_kv_heads, head_dim, v_head_dim, compression_rate
    G = H // Hkv
    eb = block_m // G  # list entries (queries) per block of rows: row m is entry m // G, head m % G
    half = K // 2
    log_r = int(math.log2(r))
    CT = children_tile(r)
    NCT = -(-r // CT)
    q_scale = scale * LOG2E
    alloc, put, product, product_nn = tiles(dtype, T.GemmWarpPolicy.FullCol, fp32_precision)
    B, Tn, NN, NC, NA = T.dynamic("B"), T.dynamic("T"), T.dynamic("NN"), T.dynamic("NC"), T.dynamic("NA")
    LS, PB, PT, FN = T.dynamic("LS"), T.dynamic("PB"), T.dynamic("PT"), T.dynamic("FN")
    NP1, NE = T.dynamic("NP1"), T.dynamic("NE")

    @T.macro
    def load_children(Src, SrcV, rows, row_off, Cos, Sin, kc_s, kc_lo, vc_s, vc_lo, b, h, j, c0, n_nodes):
        """The tile's children of parent j: K rotated at the child index, V; zero past the layer or the parent."""
        for i, d in T.Parallel(CT, half):
            c = c0 + i
            ok = T.And(c < r, j * r + c < n_nodes)
            row = T.max(T.min(row_off + j * r + c, rows - 1), 0)
            x = T.if_then_else(ok, T.cast(Src[b, row, h, d], "float32"), 0.0)
            y = T.if_then_else(ok, T.cast(Src[b, row, h, d + half], "float32"), 0.0)
            lo, hi = rotate(x, y, Cos[T.min(c, r - 1), d], Sin[T.min(c, r - 1), d])
            put(lo, kc_s, kc_lo, i, d)
            put(hi, kc_s, kc_lo, i, d + half)
        for i, d in T.Parallel(CT, V):
            c = c0 + i
            ok = T.And(c < r, j * r + c < n_nodes)
            row = T.max(T.min(row_off + j * r + c, rows - 1), 0)
            put(T.if_then_else(ok, T.cast(SrcV[b, row, h, d], "float32"), 0.0), vc_s, vc_lo, i, d)

    @T.prim_func
    def htree_bwd_nodes(Q: T.Tensor((B, Tn, H, K), dtype), dO: T.Tensor((B, Tn, H, V), dtype),
                        Kt: T.Tensor((B, Tn, Hkv, K), dtype), Vt: T.Tensor((B, Tn, Hkv, V), dtype),
                        NodesK: T.Tensor((B, NN, Hkv, K), dtype), NodesV: T.Tensor((B, NN, Hkv, V), dtype),
                        Cos: T.Tensor((NC, half), "float32"), Sin: T.Tensor((NC, half), "float32"),
                        Lse: T.Tensor((B, Tn, H), "float32"), Dl: T.Tensor((B, Tn, H), "float32"),
                        NCand: T.Tensor((LS, PB, PT, Hkv), "int32"), Flags: T.Tensor((LS, PB, PT, Hkv, FN), "int8"),
                        Start: T.Tensor((B, Hkv, NP1), "int32"), List: T.Tensor((NE,), "int32"),
                        LayerOff: T.Tensor((MAX_LAYERS,), "int32"), AccK: T.Tensor((B, NA, Hkv, K), "float32"),
                        AccV: T.Tensor((B, NA, Hkv, V), "float32"), n_nodes: T.int32, layer: T.int32,
                        acc_off: T.int32, t_start: T.int32):
        with T.Kernel((NP1 - 1) * NCT, Hkv, B, threads=threads) as (bx, h, b):
            kc_s, kc_lo = alloc((CT, K))
            vc_s, vc_lo = alloc((CT, V))
            q_s, q_lo = alloc((block_m, K))
            do_s, do_lo = alloc((block_m, V))
            # the block's gathered rows as stored (pure copies: the pipeline overlaps the next block's gathers with
            # this block's products)
            qr_s = T.alloc_shared((block_m, K), dtype)
            dor_s = T.alloc_shared((block_m, V), dtype)
            p_s, p_lo = alloc((CT, block_m))
            ds_s, ds_lo = alloc((CT, block_m))
            # the block's rows: entry valid, query in the slab, slot, rotation of its query, last child it sees
            r_ok = T.alloc_shared((block_m,), "int32")
            r_ts = T.alloc_shared((block_m,), "int32")
            r_slot = T.alloc_shared((block_m,), "int32")
            r_rel = T.alloc_shared((block_m,), "int32")
            r_cut = T.alloc_shared((block_m,), "int32")
            r_lse = T.alloc_shared((block_m,), "float32")
            r_dl = T.alloc_shared((block_m,), "float32")
            dk_sh = T.alloc_shared((CT, K), "float32")
            acc_s = T.alloc_fragment((CT, block_m), "float32")  # scores, transposed (child, row)
            acc_dp = T.alloc_fragment((CT, block_m), "float32")
            acc_dk = T.alloc_fragment((CT, K), "float32")
            acc_dv = T.alloc_fragment((CT, V), "float32")
            j = bx // NCT  # the parent, at layer + 1
            c0 = (bx % NCT) * CT
            e0 = Start[b, h, j]
            e1 = Start[b, h, j + 1]
            if e1 > e0:
                if layer == 0:
                    load_children(Kt, Vt, Tn, 0, Cos, Sin, kc_s, kc_lo, vc_s, vc_lo, b, h, j, c0, n_nodes)
                else:
                    load_children(NodesK, NodesV, NN, LayerOff[layer], Cos, Sin, kc_s, kc_lo, vc_s, vc_lo, b, h, j, c0,
                                  n_nodes)
                T.clear(acc_dk)
                T.clear(acc_dv)
                for it in T.Pipelined(T.ceildiv(e1 - e0, eb), num_stages=1):
                    # the block's rows, copied as stored (the next block's while this one computes); their indices
                    # are plain loads of the list (an index from an async copy would be read before it lands)
                    for m, d in T.Parallel(block_m, K):
                        qr_s[m, d] = Q[b, t_start + T.shift_right(List[T.min(e0 + it * eb + m // G, e1 - 1)],
                                                                  LIST_SLOT_BITS), h * G + m % G, d]
                    for m, d in T.Parallel(block_m, V):
                        dor_s[m, d] = dO[b, t_start + T.shift_right(List[T.min(e0 + it * eb + m // G, e1 - 1)],
                                                                    LIST_SLOT_BITS), h * G + m % G, d]
                    for m in T.Parallel(block_m):
                        e = e0 + it * eb + m // G
                        code = List[T.min(e, e1 - 1)]
                        tsr = T.shift_right(code, LIST_SLOT_BITS)
                        slot = T.bitwise_and(code, (1 << LIST_SLOT_BITS) - 1)
                        t = t_start + tsr
                        r_ok[m] = T.if_then_else(T.And(m < eb * G, e < e1), 1, 0)
                        r_ts[m] = tsr
                        r_slot[m] = slot
                        r_rel[m] = T.max(NCand[layer, b, tsr, h] - 1 - slot * r, 0)
                        # the parent holding t keeps only its children up to t's (the rightmost candidate)
                        r_cut[m] = T.if_then_else(T.shift_right(t, (layer + 1) * log_r) == j,
                                                  T.bitwise_and(T.shift_right(t, layer * log_r), r - 1), r - 1)
                        r_lse[m] = Lse[b, t, h * G + m % G] * LOG2E
                        r_dl[m] = Dl[b, t, h * G + m % G]
                    for m, i in T.Parallel(block_m, half):
                        x = T.if_then_else(r_ok[m] != 0, T.cast(qr_s[m, i], "float32"), 0.0)
                        y = T.if_then_else(r_ok[m] != 0, T.cast(qr_s[m, i + half], "float32"), 0.0)
                        lo, hi = rotate(x, y, Cos[r_rel[m], i], Sin[r_rel[m], i])
                        put(q_scale * lo, q_s, q_lo, m, i)
                        put(q_scale * hi, q_s, q_lo, m, i + half)
                    for m, d in T.Parallel(block_m, V):
                        put(T.if_then_else(r_ok[m] != 0, T.cast(dor_s[m, d], "float32"), 0.0), do_s, do_lo, m, d)
                    T.clear(acc_s)
                    T.clear(acc_dp)
                    product(kc_s, kc_lo, q_s, q_lo, acc_s)
                    product(vc_s, vc_lo, do_s, do_lo, acc_dp)
                    for i, m in T.Parallel(CT, block_m):
                        c = c0 + i
                        win = T.if_then_else(layer > 0, T.cast(
                            Flags[T.max(layer - 1, 0), b, r_ts[m], h, T.min(r_slot[m] * r + c, FN - 1)], "int32"), 0)
                        keep = T.And(T.And(r_ok[m] != 0, c <= r_cut[m]), win == 0)
                        p = T.if_then_else(keep, T.exp2(acc_s[i, m] - r_lse[m]), 0.0)
                        put(p, p_s, p_lo, i, m)
                        put(p * (acc_dp[i, m] - r_dl[m]), ds_s, ds_lo, i, m)
                    product_nn(p_s, p_lo, do_s, do_lo, acc_dv)
                    product_nn(ds_s, ds_lo, q_s, q_lo, acc_dk)
                # q carried scale * log2(e): dK = ln(2) * acc_dk, rotated back at the child index
                T.copy(acc_dk, dk_sh)
                for i, d in T.Parallel(CT, half):
                    c = c0 + i
                    if T.And(c < r, j * r + c < n_nodes):
                        lo, hi = unrotate(dk_sh[i, d], dk_sh[i, d + half], Cos[c, d], Sin[c, d])
                        AccK[b, acc_off + j * r + c, h, d] += lo * LN2
                        AccK[b, acc_off + j * r + c, h, d + half] += hi * LN2
                for i, d in T.Parallel(CT, V):
                    c = c0 + i
                    if T.And(c < r, j * r + c < n_nodes):
                        AccV[b, acc_off + j * r + c, h, d] += acc_dv[i, d]

    return htree_bwd_nodes
