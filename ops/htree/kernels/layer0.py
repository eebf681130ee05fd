"""fp32 layer 0 below the walk (``htree_layer0_kernel``, K and V in {32, 64}, G <= 16): split-TF32 mma.sync
products whose operands go from the gathers straight into the PTX register fragments."""

from ...common.hw import LOG2E
from ...common.tl.mma import mma
from ...common.tl.softmax import NEG
from ..tree import pack_bits
from .fragments import child, rope_pair, split_halves, warp_scales, warp_state_in, warp_state_out

import tilelang.language as T  # noqa: E402


def htree_layer0_kernel(num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int, compression_rate: int,
                        top_k_per_layer: int, max_top_nodes: int, scale: float, tiles0: int = 2, min_blocks: int = 4):
    """fp32 layer 0 (merge everything, running maximum) of the rows of one slab (K, V in {32, 64}, G <= 16),
    after the walk left each row's layer-0 parents in Par, its candidate count in N0 and the state of the
    layers above in PartO / PartML (updated in place). One CTA per row, as split-TF32 mma.sync products whose
    operands go from the gathers straight into the PTX register fragments: no shared memory between a
    candidate's load and the tensor cores (the walk is bound by the L1 data pipe, and staging operands through
    shared memory cost ~20 of its ~28 wavefronts per candidate).
    Each warp takes every fourth chunk of CH candidates with its own online-softmax state; the warps' states
    are combined once, in a fixed order. Per 8-candidate tile, lane (gr, tg) = (lane / 4, lane % 4):
      - scores S = Q K^T: B's column gr is candidate gr; dot products do not care about the order of the head
        dimension, so lane tg's k-steps cover the RoPE pairs (KE tg + ks, half + KE tg + ks): two contiguous
        loads per row and table, and each pair is rotated in the lane that loads it;
      - O += P V: the accumulator's columns (2 tg, 2 tg + 1) are taken as A's columns (tg, tg + 4), i.e.
        candidates 2 tg and 2 tg + 1, so P stays in the lane; B's column gr of V tile vt is V dim VE gr + vt:
        one contiguous load per candidate.
    The mma accumulators add in truncation, so each chunk's P V starts from zero and is added in fp32;
    independent accumulators (hi*hi apart from the two corrections) keep the mma chains short."""
    H, Hkv, K, V, r = num_heads, num_kv_heads, head_dim, v_head_dim, compression_rate
    top_k = top_k_per_layer
    G = H // Hkv
    GP = 16
    half = K // 2
    nbuf = 1 << pack_bits(r, top_k, max_top_nodes)
    KE, VE = K // 8, V // 8  # per lane: head dims of each half, V tiles
    NT0 = tiles0 if K + V <= 64 else max(1, tiles0 // 2)  # 8-candidate tiles per chunk
    CH = 8 * NT0
    q_scale = scale * LOG2E
    dtype = "float32"
    B, Tn, TS = T.dynamic("B"), T.dynamic("T"), T.dynamic("TS")

    @T.macro
    def load_row(Q, Cos, Sin, Par, q_raw, parents, o_sh, qh, ql, b, t, ts, h, n, gr, tg):
        """The row's parents and its query heads gr, gr + 8 as A fragments, scaled and rotated at n - 1."""
        for g, d in T.Parallel(G, K):
            q_raw[g, d] = Q[b, t, h * G + g, d]
        for i in T.Parallel(top_k):
            parents[i] = Par[b, ts, h, i]
        T.clear(o_sh)
        T.sync_threads()
        for ks in T.unroll(KE):
            for rr in T.unroll(2):
                g = gr + 8 * rr
                i = KE * tg + ks
                x = T.if_then_else(g < G, q_raw[T.min(g, G - 1), i], 0.0)
                y = T.if_then_else(g < G, q_raw[T.min(g, G - 1), i + half], 0.0)
                lo_v, hi_v = rope_pair(x, y, Cos[n - 1, i], Sin[n - 1, i])
                split_halves(q_scale * lo_v, qh, ql, ks * 4 + rr)
                split_halves(q_scale * hi_v, qh, ql, ks * 4 + 2 + rr)

    @T.macro
    def load_state(PartO, PartML, o_acc, m_w, l_w, b, ts, h, w, gr, tg):
        """The layers above: warp 0 carries their state, the others start empty (same reference)."""
        for vt in T.unroll(VE):
            for e in T.unroll(4):
                g = gr + 8 * (e // 2)
                o_acc[vt * 4 + e] = T.if_then_else(
                    w == 0, T.if_then_else(g < G, PartO[b, ts, h * G + T.min(g, G - 1), VE * (2 * tg + e % 2) + vt],
                                           0.0), 0.0)
        warp_state_in(PartML, m_w, l_w, b, ts, h, w, gr, tg, G)

    @T.macro
    def gather_chunk(Kt, Vt, Cos, Sin, parents, fk_x, fk_y, fk_c, fk_s, fv, b, h, c0, gr, tg):
        """All of the chunk's gathers in flight at once (candidates past n, masked later, read clamped rows).
        With r >= 8 a tile's 8 candidates are 8 consecutive children of one parent."""
        for nt in T.unroll(NT0):
            p0 = c0 + 8 * nt
            if r >= 8:
                row0 = child(parents, p0, r, top_k)
                row_k = T.max(T.min(row0 + gr, Tn - 1), 0)
            else:
                row_k = T.max(T.min(child(parents, p0 + gr, r, top_k), Tn - 1), 0)
            slot = T.min(p0 + gr, nbuf - 1)
            for e in T.vectorized(KE):
                fk_x[nt * KE + e] = Kt[b, row_k, h, KE * tg + e]
            for e in T.vectorized(KE):
                fk_y[nt * KE + e] = Kt[b, row_k, h, half + KE * tg + e]
            for e in T.vectorized(KE):
                fk_c[nt * KE + e] = Cos[slot, KE * tg + e]
            for e in T.vectorized(KE):
                fk_s[nt * KE + e] = Sin[slot, KE * tg + e]
            for j2 in T.unroll(2):
                if r >= 8:
                    row_v = T.max(T.min(row0 + 2 * tg + j2, Tn - 1), 0)
                else:
                    row_v = T.max(T.min(child(parents, p0 + 2 * tg + j2, r, top_k), Tn - 1), 0)
                for e in T.vectorized(VE):
                    fv[(nt * 2 + j2) * VE + e] = Vt[b, row_v, h, VE * gr + e]

    @T.macro
    def chunk_scores(qh, ql, fk_x, fk_y, fk_c, fk_s, kb_h, kb_l, sc, sc2):
        """The chunk's K rotated into split B fragments; sc = hi*hi scores, sc2 = their corrections."""
        for nt in T.unroll(NT0):
            for ks in T.unroll(KE):
                lo_v, hi_v = rope_pair(fk_x[nt * KE + ks], fk_y[nt * KE + ks], fk_c[nt * KE + ks],
                                       fk_s[nt * KE + ks])
                split_halves(lo_v, kb_h, kb_l, (nt * KE + ks) * 2)
                split_halves(hi_v, kb_h, kb_l, (nt * KE + ks) * 2 + 1)
            for e in T.unroll(4):
                sc[nt * 4 + e] = 0.0
                sc2[nt * 4 + e] = 0.0
            for ks in T.unroll(KE):
                mma(qh, ks * 4, kb_h, (nt * KE + ks) * 2, sc, nt * 4)
                mma(qh, ks * 4, kb_l, (nt * KE + ks) * 2, sc2, nt * 4)
                mma(ql, ks * 4, kb_h, (nt * KE + ks) * 2, sc2, nt * 4)

    @T.macro
    def chunk_softmax(sc, sc2, pa_h, pa_l, m_w, l_w, mx, al, c0, n, tg):
        """Fold the chunk's scores into the warp's running maximum m_w and sum l_w (al: the old state's rescale);
        their probabilities as split A fragments of P V."""
        for rr in T.unroll(2):
            mx[rr] = NEG
        for nt in T.unroll(NT0):
            for e in T.unroll(4):
                sc[nt * 4 + e] = T.if_then_else(c0 + 8 * nt + 2 * tg + e % 2 < n,
                                                sc[nt * 4 + e] + sc2[nt * 4 + e], NEG)
                mx[e // 2] = T.max(mx[e // 2], sc[nt * 4 + e])
        for rr in T.unroll(2):  # the row's maximum over its four lanes
            mx[rr] = T.max(mx[rr], T.shfl_xor(mx[rr], 1))
            mx[rr] = T.max(mx[rr], T.shfl_xor(mx[rr], 2))
            mx[rr] = T.max(mx[rr], m_w[rr])
            al[rr] = T.exp2(m_w[rr] - mx[rr])
            m_w[rr] = mx[rr]
            l_w[rr] *= al[rr]
        for nt in T.unroll(NT0):
            for e in T.unroll(4):
                sc[nt * 4 + e] = T.if_then_else(sc[nt * 4 + e] <= NEG, 0.0,
                                                T.exp2(sc[nt * 4 + e] - m_w[e // 2]))
                l_w[e // 2] += sc[nt * 4 + e]
            for e in T.unroll(4):  # A's (row, column) e <- accumulator element (e % 2) * 2 + e // 2
                split_halves(sc[nt * 4 + (e % 2) * 2 + e // 2], pa_h, pa_l, nt * 4 + e)

    @T.macro
    def chunk_pv(fv, vb_h, vb_l, pa_h, pa_l, o_tmp, o_acc, al):
        """o_acc = o_acc * al + the chunk's P V (from zero, added in fp32)."""
        for e in T.unroll(VE * 4):
            o_tmp[e] = 0.0
        for nt in T.unroll(NT0):
            for vt in T.unroll(VE):
                for j2 in T.unroll(2):
                    split_halves(fv[(nt * 2 + j2) * VE + vt], vb_h, vb_l, vt * 2 + j2)
            for vt in T.unroll(VE):
                mma(pa_h, nt * 4, vb_h, vt * 2, o_tmp, vt * 4)
            for vt in T.unroll(VE):
                mma(pa_h, nt * 4, vb_l, vt * 2, o_tmp, vt * 4)
            for vt in T.unroll(VE):
                mma(pa_l, nt * 4, vb_h, vt * 2, o_tmp, vt * 4)
        for e in T.unroll(VE * 4):
            o_acc[e] = o_acc[e] * al[e // 2 % 2] + o_tmp[e]

    @T.macro
    def combine(PartO, PartML, o_acc, o_sh, red, m_w, l_w, mx, al, b, ts, h, w, gr, tg):
        """The warps' states, combined in a fixed order, back to PartO / PartML."""
        warp_scales(m_w, l_w, mx, al, red, w, gr, tg)
        for ww in T.serial(4):
            if w == ww:
                for vt in T.unroll(VE):
                    for e in T.unroll(4):
                        row = gr + 8 * (e // 2)
                        col = VE * (2 * tg + e % 2) + vt
                        o_sh[row, col] += o_acc[vt * 4 + e] * al[e // 2]
            T.sync_threads()
        warp_state_out(o_sh, red, PartO, PartML, b, ts, h, G)

    @T.prim_func
    def htree_layer0(
        Q: T.Tensor((B, Tn, H, K), dtype),
        Kt: T.Tensor((B, Tn, Hkv, K), dtype),
        Vt: T.Tensor((B, Tn, Hkv, V), dtype),
        Cos: T.Tensor((nbuf, half), "float32"),
        Sin: T.Tensor((nbuf, half), "float32"),
        Par: T.Tensor((B, TS, Hkv, top_k), "int32"),
        N0: T.Tensor((B, TS, Hkv), "int32"),
        PartO: T.Tensor((B, TS, H, V), "float32"),
        PartML: T.Tensor((B, TS, H, 2), "float32"),
        t_start: T.int32,
    ):
        with T.Kernel(TS, Hkv, B, threads=128) as (ts, h, b):
            T.annotate_min_blocks_per_sm(min_blocks)
            q_raw = T.alloc_shared((G, K), dtype)
            parents = T.alloc_shared((top_k,), "int32")
            o_sh = T.alloc_shared((GP, V), "float32")
            red = T.alloc_shared((5, GP), "float32")
            qh = T.alloc_local((KE * 4,), "float32")  # A fragments of the rotated, scaled query, per k-step
            ql = T.alloc_local((KE * 4,), "float32")
            fk_x = T.alloc_local((NT0 * KE,), dtype)  # a chunk's gathers: K pairs, their table entries, V
            fk_y = T.alloc_local((NT0 * KE,), dtype)
            fk_c = T.alloc_local((NT0 * KE,), "float32")
            fk_s = T.alloc_local((NT0 * KE,), "float32")
            fv = T.alloc_local((NT0 * 2 * VE,), dtype)
            kb_h = T.alloc_local((NT0 * KE * 2,), "float32")  # B fragments of the rotated K, per tile and k-step
            kb_l = T.alloc_local((NT0 * KE * 2,), "float32")
            sc = T.alloc_local((NT0 * 4,), "float32")  # scores (hi*hi), then probabilities
            sc2 = T.alloc_local((NT0 * 4,), "float32")  # the scores' corrections (hi*lo + lo*hi)
            pa_h = T.alloc_local((NT0 * 4,), "float32")
            pa_l = T.alloc_local((NT0 * 4,), "float32")
            vb_h = T.alloc_local((VE * 2,), "float32")
            vb_l = T.alloc_local((VE * 2,), "float32")
            o_acc = T.alloc_local((VE * 4,), "float32")
            o_tmp = T.alloc_local((VE * 4,), "float32")
            m_w = T.alloc_local((2,), "float32")  # rows gr and gr + 8: running maximum, partial sum
            l_w = T.alloc_local((2,), "float32")
            mx = T.alloc_local((2,), "float32")
            al = T.alloc_local((2,), "float32")

            tx = T.get_thread_binding()
            lane = tx % 32
            w = tx // 32
            gr = lane // 4
            tg = lane % 4
            t = t_start + ts
            n = N0[b, ts, h]

            load_row(Q, Cos, Sin, Par, q_raw, parents, o_sh, qh, ql, b, t, ts, h, n, gr, tg)
            load_state(PartO, PartML, o_acc, m_w, l_w, b, ts, h, w, gr, tg)
            for it in T.serial(T.ceildiv(T.max(T.ceildiv(n, CH) - w, 0), 4)):
                c0 = (w + 4 * it) * CH
                gather_chunk(Kt, Vt, Cos, Sin, parents, fk_x, fk_y, fk_c, fk_s, fv, b, h, c0, gr, tg)
                chunk_scores(qh, ql, fk_x, fk_y, fk_c, fk_s, kb_h, kb_l, sc, sc2)
                chunk_softmax(sc, sc2, pa_h, pa_l, m_w, l_w, mx, al, c0, n, tg)
                chunk_pv(fv, vb_h, vb_l, pa_h, pa_l, o_tmp, o_acc, al)
            combine(PartO, PartML, o_acc, o_sh, red, m_w, l_w, mx, al, b, ts, h, w, gr, tg)

    return htree_layer0
