"""dK and dV of a layer below the top for fp32 with r >= 16 (``htree_bwd_nodes32_kernel``; where:
``bwd_common.uses_fp32_fragments``): the nodes kernel of
``bwd_nodes`` (the same launch arguments and result) with its four products as mma.sync m16n8k8 TF32 tiles whose
operands are loaded straight into the PTX register fragments, as the forward's ``htree_layer0_kernel`` does: no
block-wide barrier between an entry's loads and the tensor cores.

One CTA per (parent j, tile of 16 children, kv head): its children, K rotated at the child index and V, are the A
fragments of S^T = K_c q^T and dP^T = V_c dO^T (rows: children gr, gr + 8), loaded once. Each of the four warps
takes every fourth entry (query, slot) of the parent's list, the indices of 32 entries loaded at once (a lane each)
and broadcast by shuffles, so that an entry's loads do not wait on a chain of index loads. A warp's next entry
(the query's G heads of q and dO, their lse and D, the angle row of its rotation) is copied by cp.async into the
warp's own stage of shared memory while it computes the current one, whose fragments it loads from the other
stage: the rows' latency (from L2 or DRAM: ~1 TB over the call at (a)) overlaps the products. The query's G heads
(padded to 8 or 16) are the products' columns, so one entry is one tile of the four products:
  - S^T: lane tg's k-steps cover the RoPE pairs (KE tg + ks, half + KE tg + ks), so each pair of the query is
    rotated (at n - 1 - slot r) in the lane that loads it;
  - dP^T: lane tg's k-step ks covers V dims VQ tg + 2 ks, + 1 (one contiguous load per head);
  - P^T, dS^T: the accumulators' columns (2 tg, 2 tg + 1) are taken as A's columns (tg, tg + 4), i.e. heads
    2 tg and 2 tg + 1, so P and dS stay in the lane (as in the forward's O += P V);
  - dV += P^T dO, dK += dS^T q_rot: B's column gr is dim 8 vt + gr of V, and of the rotated query the pair
    (8 kt + gr, half + 8 kt + gr) in tiles kt and kt + K / 16, rotated in the lane.
fp32_precision "highest": every operand split into TF32 halves, three products (hi hi + hi lo + lo hi); "high":
operands rounded to TF32, one product. An entry's dK, dV products start from zero (the mma accumulators add in
truncation) and are added in fp32 to the warp's sums; the warps' sums are added in a fixed order at the end, then
dK rotated back at the child index: deterministic, no atomics."""

import math

from ...common.hw import LOG2E
from ..tree import MAX_LAYERS
from .bwd_common import LN2, unrotate, warp_double_buffer
from .bwd_nodes import LIST_SLOT_BITS
from .fragments import rope_pair, tf32_tiles

import tilelang.language as T  # noqa: E402

CHILDREN = 16  # children per CTA: the products' rows


def htree_bwd_nodes32_kernel(num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int,
                             compression_rate: int, top_k_per_layer: int, scale: float,
                             fp32_precision: str = "highest", min_blocks: int | None = None):
    """AccK / AccV rows acc_off + node (fp32) += dK, dV of the layer's nodes from the slab's queries (see the
    module's docstring). min_blocks: CTAs per SM the registers are capped for; by default 2 at "highest" (255
    registers, no spills; at 3, 168 registers with 4 bytes of spills ran 17% slower at the bench's (a)) and 3 at
    "high" (168 registers, 16 bytes of spills, 3% faster than 2)."""
    H, Hkv, K, V, r = num_heads, num_kv_heads, head_dim, v_head_dim, compression_rate
    if min_blocks is None:
        min_blocks = 2 if fp32_precision == "highest" else 3
    G = H // Hkv
    NH = 1 if G <= 8 else 2  # 8-head column tiles
    half = K // 2
    log_r = int(math.log2(r))
    NCT = r // CHILDREN
    KE = K // 8  # per lane: RoPE pairs of S^T's k-steps (KS = KE k-steps)
    VQ = V // 4  # per lane: V dims of dP^T's k-steps (VS = V / 8 k-steps, two dims each)
    VS, VT, KT = V // 8, V // 8, K // 8  # dP^T k-steps; dV and dK column tiles
    KH = KT // 2  # dK's tiles of x dims (then as many of y dims)
    KP, VP = K + 4, V + 4  # the staged rows' strides
    AUX = 32  # the staged lse (words 0 .. G), D (16 .. 16 + G), then cos and sin (half each)
    operand, product = tf32_tiles(fp32_precision)
    q_scale = scale * LOG2E
    dtype = "float32"
    B, Tn, NN, NC, NA = T.dynamic("B"), T.dynamic("T"), T.dynamic("NN"), T.dynamic("NC"), T.dynamic("NA")
    LS, PB, PT, FN = T.dynamic("LS"), T.dynamic("PB"), T.dynamic("PT"), T.dynamic("FN")
    NP1, NE = T.dynamic("NP1"), T.dynamic("NE")

    @T.macro
    def load_children(Src, SrcV, rows, row_off, Cos, Sin, ka_h, ka_l, va_h, va_l, fx, fy, fv, b, h, j, c0, n_nodes,
                      gr, tg):
        """Children c0 + gr (+ 8) of parent j: K rotated at the child index as S^T's A fragments, V as dP^T's;
        zero past the layer."""
        for ri in T.unroll(2):
            c = c0 + gr + 8 * ri
            ok = j * r + c < n_nodes
            row = T.max(T.min(row_off + j * r + c, rows - 1), 0)
            for e in T.vectorized(KE):
                fx[e] = Src[b, row, h, KE * tg + e]
            for e in T.vectorized(KE):
                fy[e] = Src[b, row, h, half + KE * tg + e]
            for e in T.vectorized(VQ):
                fv[e] = SrcV[b, row, h, VQ * tg + e]
            for ks in T.unroll(KE):
                lo_v, hi_v = rope_pair(fx[ks], fy[ks], Cos[c, KE * tg + ks], Sin[c, KE * tg + ks])
                operand(T.if_then_else(ok, lo_v, 0.0), ka_h, ka_l, ks * 4 + ri)
                operand(T.if_then_else(ok, hi_v, 0.0), ka_h, ka_l, ks * 4 + 2 + ri)
            for ks in T.unroll(VS):
                operand(T.if_then_else(ok, fv[2 * ks], 0.0), va_h, va_l, ks * 4 + ri)
                operand(T.if_then_else(ok, fv[2 * ks + 1], 0.0), va_h, va_l, ks * 4 + 2 + ri)

    @T.macro
    def prefetch(Q, dO, Lse, Dl, Cos, Sin, qs, ds, ax, w, lane, st, b, h, t, rel):
        """Entry (t, rel)'s rows into the warp's stage st by cp.async, 16 bytes a lane and copy (lse and D by
        4), then one commit."""
        for c in T.unroll(-(-G * K // 128)):
            ch = lane + 32 * c
            if ch < G * K // 4:
                T.ptx_cp_async(T.access_ptr(qs[w, st, ch // (K // 4) * KP + ch % (K // 4) * 4], "w", 4),
                               T.access_ptr(Q[b, t, h * G + ch // (K // 4), ch % (K // 4) * 4], "r", 4), 4)
        for c in T.unroll(-(-G * V // 128)):
            ch = lane + 32 * c
            if ch < G * V // 4:
                T.ptx_cp_async(T.access_ptr(ds[w, st, ch // (V // 4) * VP + ch % (V // 4) * 4], "w", 4),
                               T.access_ptr(dO[b, t, h * G + ch // (V // 4), ch % (V // 4) * 4], "r", 4), 4)
        if lane < G:
            T.ptx_cp_async(T.access_ptr(ax[w, st, lane], "w", 1), T.access_ptr(Lse[b, t, h * G + lane], "r", 1), 1)
        if lane >= 16 and lane < 16 + G:
            T.ptx_cp_async(T.access_ptr(ax[w, st, lane], "w", 1), T.access_ptr(Dl[b, t, h * G + lane - 16], "r", 1),
                           1)
        if lane < half // 4:
            T.ptx_cp_async(T.access_ptr(ax[w, st, AUX + 4 * lane], "w", 4), T.access_ptr(Cos[rel, 4 * lane], "r", 4), 4)
        if lane >= 16 and lane < 16 + half // 4:
            T.ptx_cp_async(T.access_ptr(ax[w, st, AUX + half + 4 * (lane - 16)], "w", 4),
                           T.access_ptr(Sin[rel, 4 * (lane - 16)], "r", 4), 4)
        T.ptx_commit_group()

    @T.prim_func
    def htree_bwd_nodes32(Q: T.Tensor((B, Tn, H, K), dtype), dO: T.Tensor((B, Tn, H, V), dtype),
                          Kt: T.Tensor((B, Tn, Hkv, K), dtype), Vt: T.Tensor((B, Tn, Hkv, V), dtype),
                          NodesK: T.Tensor((B, NN, Hkv, K), dtype), NodesV: T.Tensor((B, NN, Hkv, V), dtype),
                          Cos: T.Tensor((NC, half), "float32"), Sin: T.Tensor((NC, half), "float32"),
                          Lse: T.Tensor((B, Tn, H), "float32"), Dl: T.Tensor((B, Tn, H), "float32"),
                          NCand: T.Tensor((LS, PB, PT, Hkv), "int32"), Flags: T.Tensor((LS, PB, PT, Hkv, FN), "int8"),
                          Start: T.Tensor((B, Hkv, NP1), "int32"), List: T.Tensor((NE,), "int32"),
                          LayerOff: T.Tensor((MAX_LAYERS,), "int32"), AccK: T.Tensor((B, NA, Hkv, K), "float32"),
                          AccV: T.Tensor((B, NA, Hkv, V), "float32"), n_nodes: T.int32, layer: T.int32,
                          acc_off: T.int32, t_start: T.int32):
        with T.Kernel((NP1 - 1) * NCT, Hkv, B, threads=128) as (bx, h, b):
            T.annotate_min_blocks_per_sm(min_blocks)
            red_k = T.alloc_shared((4, CHILDREN, K), "float32")  # the warps' sums, added in warp order
            red_v = T.alloc_shared((4, CHILDREN, V), "float32")
            # each warp's next entry in flight (cp.async) while it computes the current one: the query's G heads
            # of q and dO (rows padded by 4 words: the fragments' column loads hit distinct banks), its lse and D,
            # the angle row (cos, sin) of its rotation
            qs = T.alloc_shared((4, 2, G * KP), dtype)
            ds = T.alloc_shared((4, 2, G * VP), dtype)
            ax = T.alloc_shared((4, 2, AUX + K), dtype)
            ka_h = T.alloc_local((KE * 4,), dtype)  # the children's A fragments (K rotated, V), split halves
            ka_l = T.alloc_local((KE * 4,), dtype)
            va_h = T.alloc_local((VS * 4,), dtype)
            va_l = T.alloc_local((VS * 4,), dtype)
            fx = T.alloc_local((KE,), dtype)  # a row's raw pairs / V dims as loaded
            fy = T.alloc_local((KE,), dtype)
            fv = T.alloc_local((VQ,), dtype)
            fc = T.alloc_local((KE,), dtype)  # the entry's angle row (S^T's pairs)
            fs = T.alloc_local((KE,), dtype)
            qb_h = T.alloc_local((NH * KE * 2,), dtype)  # S^T's B fragments: the rotated, scaled query
            qb_l = T.alloc_local((NH * KE * 2,), dtype)
            db_h = T.alloc_local((NH * VS * 2,), dtype)  # dP^T's: dO
            db_l = T.alloc_local((NH * VS * 2,), dtype)
            sc = T.alloc_local((NH * 4,), "float32")  # S^T, then P^T / dS^T (children x heads)
            dp = T.alloc_local((NH * 4,), "float32")
            pa_h = T.alloc_local((NH * 4,), dtype)  # P^T and dS^T as A fragments
            pa_l = T.alloc_local((NH * 4,), dtype)
            da_h = T.alloc_local((NH * 4,), dtype)
            da_l = T.alloc_local((NH * 4,), dtype)
            bb_h = T.alloc_local((NH * 2,), dtype)  # a B fragment of dO or of the rotated query (one column tile)
            bb_l = T.alloc_local((NH * 2,), dtype)
            bx_ = T.alloc_local((NH * 2,), dtype)  # a dK pair's x and y for heads 2 tg, 2 tg + 1 of each tile
            by_ = T.alloc_local((NH * 2,), dtype)
            lse2 = T.alloc_local((NH * 2,), "float32")  # heads 8 nt + 2 tg + e: lse (log2 domain), D
            dl = T.alloc_local((NH * 2,), "float32")
            keep = T.alloc_local((2,), "int32")  # children gr, gr + 8: merged by the entry
            tmp = T.alloc_local((4,), "float32")  # one entry's dK or dV tile product
            tmp_y = T.alloc_local((4,), "float32")
            acc_k = T.alloc_local((KT * 4,), "float32")  # the warp's sums
            acc_v = T.alloc_local((VT * 4,), "float32")

            tx = T.get_thread_binding()
            lane = tx % 32
            w = tx // 32
            gr = lane // 4
            tg = lane % 4
            j = bx // NCT  # the parent, at layer + 1
            c0 = (bx % NCT) * CHILDREN
            e0 = Start[b, h, j]
            e1 = Start[b, h, j + 1]
            for i in T.unroll(KT * 4):
                acc_k[i] = 0.0
            for i in T.unroll(VT * 4):
                acc_v[i] = 0.0
            if e1 > e0:
                if layer == 0:
                    load_children(Kt, Vt, Tn, 0, Cos, Sin, ka_h, ka_l, va_h, va_l, fx, fy, fv, b, h, j, c0, n_nodes,
                                  gr, tg)
                else:
                    load_children(NodesK, NodesV, NN, LayerOff[layer], Cos, Sin, ka_h, ka_l, va_h, va_l, fx, fy, fv,
                                  b, h, j, c0, n_nodes, gr, tg)
                n_w = T.ceildiv(T.max(e1 - e0 - w, 0), 4)  # the warp's entries: e0 + w + 4 i
                for grp in T.serial(T.ceildiv(n_w, 32)):
                    # 32 entries' indices at once, lane k's of entry 32 grp + k (one load, not a dependent chain of
                    # two per entry), broadcast per entry below
                    idx = T.min(32 * grp + lane, n_w - 1)
                    code_k = List[e0 + w + 4 * idx]
                    ts_k = T.shift_right(code_k, LIST_SLOT_BITS)
                    slot_k = T.bitwise_and(code_k, (1 << LIST_SLOT_BITS) - 1)
                    rel_k = T.max(NCand[layer, b, ts_k, h] - 1 - slot_k * r, 0)  # the query's rotation
                    cnt = T.min(n_w - 32 * grp, 32)
                    T.sync_warp()  # the warp's last entry read stage 1; stage 0 is free
                    prefetch(Q, dO, Lse, Dl, Cos, Sin, qs, ds, ax, w, lane, 0, b, h, t_start + T.shfl_sync(ts_k, 0),
                             T.shfl_sync(rel_k, 0))
                    for k in T.serial(cnt):
                        st = k % 2
                        warp_double_buffer(k, cnt, lambda s: prefetch(
                            Q, dO, Lse, Dl, Cos, Sin, qs, ds, ax, w, lane, s, b, h, t_start + T.shfl_sync(ts_k, k + 1),
                            T.shfl_sync(rel_k, k + 1)))
                        ts = T.shfl_sync(ts_k, k)
                        slot = T.shfl_sync(slot_k, k)
                        t = t_start + ts
                        # the parent holding t keeps only its children up to t's (the rightmost candidate)
                        cut = T.if_then_else(T.shift_right(t, (layer + 1) * log_r) == j,
                                             T.bitwise_and(T.shift_right(t, layer * log_r), r - 1), r - 1)
                        for ri in T.unroll(2):
                            c = c0 + gr + 8 * ri
                            # above layer 0 the layer's winners were expanded (merged one layer down), not merged here
                            win = T.if_then_else(layer > 0, T.cast(
                                Flags[T.max(layer - 1, 0), b, ts, h, T.min(slot * r + c, FN - 1)], "int32"), 0)
                            keep[ri] = T.if_then_else(T.And(c <= cut, win == 0), 1, 0)
                        for nt in T.unroll(NH):
                            for e in T.unroll(2):
                                g = 8 * nt + 2 * tg + e
                                hg = h * G + T.min(g, G - 1)
                                lse2[nt * 2 + e] = T.if_then_else(g < G, ax[w, st, T.min(g, G - 1)] * LOG2E, 0.0)
                                dl[nt * 2 + e] = T.if_then_else(g < G, ax[w, st, 16 + T.min(g, G - 1)], 0.0)
                        # S^T = K_c q_rot^T (q scaled into the log2 domain, rotated at rel)
                        for e in T.vectorized(KE):
                            fc[e] = ax[w, st, AUX + KE * tg + e]
                        for e in T.vectorized(KE):
                            fs[e] = ax[w, st, AUX + half + KE * tg + e]
                        for nt in T.unroll(NH):
                            g = 8 * nt + gr
                            hq = T.min(g, G - 1) * KP
                            for e in T.vectorized(KE):
                                fx[e] = qs[w, st, hq + KE * tg + e]
                            for e in T.vectorized(KE):
                                fy[e] = qs[w, st, hq + half + KE * tg + e]
                            for ks in T.unroll(KE):
                                lo_v, hi_v = rope_pair(fx[ks], fy[ks], fc[ks], fs[ks])
                                operand(T.if_then_else(g < G, q_scale * lo_v, 0.0), qb_h, qb_l, (nt * KE + ks) * 2)
                                operand(T.if_then_else(g < G, q_scale * hi_v, 0.0), qb_h, qb_l, (nt * KE + ks) * 2 + 1)
                            for e in T.vectorized(VQ):
                                fv[e] = ds[w, st, T.min(g, G - 1) * VP + VQ * tg + e]
                            for ks in T.unroll(VS):
                                operand(T.if_then_else(g < G, fv[2 * ks], 0.0), db_h, db_l, (nt * VS + ks) * 2)
                                operand(T.if_then_else(g < G, fv[2 * ks + 1], 0.0), db_h, db_l, (nt * VS + ks) * 2 + 1)
                        for nt in T.unroll(NH):
                            for e in T.unroll(4):
                                sc[nt * 4 + e] = 0.0
                                dp[nt * 4 + e] = 0.0
                            for ks in T.unroll(KE):
                                product(ka_h, ka_l, ks * 4, qb_h, qb_l, (nt * KE + ks) * 2, sc, nt * 4)
                            for ks in T.unroll(VS):
                                product(va_h, va_l, ks * 4, db_h, db_l, (nt * VS + ks) * 2, dp, nt * 4)
                        # P^T, dS^T of the merged children and real heads, as A fragments: [nt * 4 + e] of the
                        # accumulator is child gr + 8 (e // 2), head 8 nt + 2 tg + e % 2 -> A's (row, column tg or
                        # tg + 4) order 0, 2, 1, 3
                        for nt in T.unroll(NH):
                            for e in T.unroll(4):
                                g = 8 * nt + 2 * tg + e % 2
                                pr = T.if_then_else(T.And(keep[e // 2] != 0, g < G),
                                                    T.exp2(sc[nt * 4 + e] - lse2[nt * 2 + e % 2]), 0.0)
                                ai = nt * 4 + (e % 2) * 2 + e // 2
                                operand(pr, pa_h, pa_l, ai)
                                operand(pr * (dp[nt * 4 + e] - dl[nt * 2 + e % 2]), da_h, da_l, ai)
                        # dV += P^T dO: B's column gr of tile vt is dim 8 vt + gr, its rows heads 8 nt + 2 tg (+ 1)
                        for vt in T.unroll(VT):
                            for nt in T.unroll(NH):
                                for e in T.unroll(2):
                                    g = 8 * nt + 2 * tg + e
                                    operand(T.if_then_else(g < G, ds[w, st, T.min(g, G - 1) * VP + 8 * vt + gr], 0.0),
                                            bb_h, bb_l, nt * 2 + e)
                            for e in T.unroll(4):
                                tmp[e] = 0.0
                            for nt in T.unroll(NH):
                                product(pa_h, pa_l, nt * 4, bb_h, bb_l, nt * 2, tmp, 0)
                            for e in T.unroll(4):
                                acc_v[vt * 4 + e] += tmp[e]
                        # dK += dS^T q_rot: tiles kt and kt + KH hold the rotated pair (8 kt + gr, half + 8 kt + gr)
                        for kt in T.unroll(KH):
                            i = 8 * kt + gr
                            for nt in T.unroll(NH):
                                for e in T.unroll(2):
                                    g = 8 * nt + 2 * tg + e
                                    hq = T.min(g, G - 1) * KP
                                    lo_v, hi_v = rope_pair(qs[w, st, hq + i], qs[w, st, hq + half + i],
                                                           ax[w, st, AUX + i], ax[w, st, AUX + half + i])
                                    bx_[nt * 2 + e] = T.if_then_else(g < G, q_scale * lo_v, 0.0)
                                    by_[nt * 2 + e] = T.if_then_else(g < G, q_scale * hi_v, 0.0)
                            for e in T.unroll(4):
                                tmp[e] = 0.0
                                tmp_y[e] = 0.0
                            for nt in T.unroll(NH):
                                for e in T.unroll(2):
                                    operand(bx_[nt * 2 + e], bb_h, bb_l, nt * 2 + e)
                            for nt in T.unroll(NH):
                                product(da_h, da_l, nt * 4, bb_h, bb_l, nt * 2, tmp, 0)
                            for nt in T.unroll(NH):
                                for e in T.unroll(2):
                                    operand(by_[nt * 2 + e], bb_h, bb_l, nt * 2 + e)
                            for nt in T.unroll(NH):
                                product(da_h, da_l, nt * 4, bb_h, bb_l, nt * 2, tmp_y, 0)
                            for e in T.unroll(4):
                                acc_k[kt * 4 + e] += tmp[e]
                                acc_k[(kt + KH) * 4 + e] += tmp_y[e]
            # the warps' sums in a fixed order; dK rotated back at the child index (q carried scale log2(e))
            for vt in T.unroll(VT):
                for e in T.unroll(4):
                    red_v[w, gr + 8 * (e // 2), 8 * vt + 2 * tg + e % 2] = acc_v[vt * 4 + e]
            for kt in T.unroll(KT):
                for e in T.unroll(4):
                    col = T.if_then_else(kt < KH, 8 * kt, half + 8 * (kt - KH)) + 2 * tg + e % 2
                    red_k[w, gr + 8 * (e // 2), col] = acc_k[kt * 4 + e]
            T.sync_threads()
            if e1 > e0:
                for i, d in T.Parallel(CHILDREN, half):
                    c = c0 + i
                    if j * r + c < n_nodes:
                        x = (red_k[0, i, d] + red_k[1, i, d]) + (red_k[2, i, d] + red_k[3, i, d])
                        y = (red_k[0, i, d + half] + red_k[1, i, d + half]) + (red_k[2, i, d + half]
                                                                             + red_k[3, i, d + half])
                        lo, hi = unrotate(x, y, Cos[c, d], Sin[c, d])
                        AccK[b, acc_off + j * r + c, h, d] += lo * LN2
                        AccK[b, acc_off + j * r + c, h, d + half] += hi * LN2
                for i, d in T.Parallel(CHILDREN, V):
                    c = c0 + i
                    if j * r + c < n_nodes:
                        AccV[b, acc_off + j * r + c, h, d] += ((red_v[0, i, d] + red_v[1, i, d])
                                                              + (red_v[2, i, d] + red_v[3, i, d]))

    return htree_bwd_nodes32
