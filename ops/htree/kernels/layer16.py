"""16-bit layers below the walk (``htree_layer16_kernel``, r >= 16): layer 0 and the middle layers, with the
operands gathered straight into m16n8k16 mma.sync register fragments and K pre-rotated at its child index."""

import math

from ...common.hw import LOG2E
from ...common.tl.mma import mma
from ...common.tl.softmax import NEG
from ..tree import pack_bits
from .fragments import (FLT_MIN, child, packed_key, rope_pair, warp_scales, warp_state_in,
                        warp_state_out)
from .select import compact_winners, select_top_k

import tilelang.language as T  # noqa: E402


def htree_layer16_kernel(num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int, compression_rate: int,
                         top_k_per_layer: int, max_top_nodes: int, scale: float, dtype: str,
                         middle: bool = False, min_blocks: int = 3, for_backward: bool = False):
    """16-bit layers below the walk, for r >= 16: layer 0 (``middle=False``: merge everything) or a middle layer
    0 < l < L - 1 (``middle=True``) of the rows of one slab. The walk (or the middle layer above) left each row's
    parents of the layer in Par, its candidate count in N0, and the state of the layers above in PartO / PartML
    (updated in place). One CTA per row; each warp takes every fourth tile of 16 candidates (one parent's children,
    r >= 16) with its own online softmax, combined once in a fixed order.
    A middle layer (1) scores every candidate into a per-slab scratch Scr and takes each head's log-sum-exp,
    (2) packs the importance keys from the scratch into shared memory, selects the top_k (radix select, as the walk)
    and hands the winners' children to the layer below through Par / N0 (in place), (3) merges the non-winners from
    the scratch scores with V: each candidate's K and V are gathered once.
    No RoPE table rows per candidate: candidate p = r pi + c (child c of parent slot pi) is rotated at p, and
    <R(q, n - 1), R(k, r pi + c)> = <R(q, n - 1 - r pi), R(k, c)>, so the nodes come pre-rotated at their
    child index (KRot, ``htree_rope_kernel`` with period r) and the query is rotated once per tile.
    The operands go from the gathers straight into m16n8k16 mma.sync fragments (lane (gr, tg) = (lane / 4,
    lane % 4)); dot products do not care about the order of the dimensions they sum, which is permuted so that
    every lane loads whole 16-byte pieces, side by side with its neighbours' (the kernel is bound by the L1
    wavefronts of its gathers, one per 128-byte line that an instruction touches):
      - scores S = Q K^T (M = 16 heads, two 8-candidate tiles): k-step ks's columns (2 tg, 2 tg + 1) are lane
        tg's pairs kdim(tg, 2 ks), kdim(tg, 2 ks + 1) and columns (2 tg + 8, + 9) the same dims + K/2, so a lane
        holds whole RoPE pairs of the query and K/8 dims of each half of its candidates gr and gr + 8;
      - O^T += V^T P^T (M = 16 V dims, N = 8 heads, K = the 16 candidates): the score accumulators are P^T's
        B fragments as they are (no transpose); rows gr and gr + 8 of m-tile mt are lane gr's V dims
        vdim(gr, 2 mt), vdim(gr, 2 mt + 1), so a lane loads V/8 dims of each of its candidates 2 tg, 2 tg + 1,
        2 tg + 8, 2 tg + 9.
    ``for_backward`` (a middle layer): Sel takes the winners' candidate-buffer positions as int16, the differentiable
    forward's saved selections."""
    H, Hkv, K, V, r = num_heads, num_kv_heads, head_dim, v_head_dim, compression_rate
    top_k = top_k_per_layer
    G = H // Hkv
    NH = 1 if G <= 8 else 2  # heads in tiles of 8: score rows gr (and gr + 8), O^T's N tiles
    half = K // 2
    log_r = int(math.log2(r))
    KP, VP = K // 8, V // 8  # per lane: RoPE pairs of the query, V dims of a candidate
    KC, VC = min(8, KP), min(8, VP)  # of them per 16-byte load

    def kdim(tg, i):  # lane tg's i-th pair (i, i + K/2): the four tg lanes' 16-byte loads lie side by side
        return KC * tg + 4 * KC * (i // KC) + i % KC

    def vdim(gr, i):  # lane gr's i-th V dim: the eight gr lanes' 16-byte loads cover 128 contiguous bytes
        return VC * gr + 8 * VC * (i // VC) + i % VC
    KS, VM = K // 16, V // 16  # the scores' k-steps, O^T's m-tiles
    nbuf = 1 << pack_bits(r, top_k, max_top_nodes)
    pos_mask = nbuf - 1
    q_scale = scale * LOG2E
    B, Tn, TS, NR, NV = T.dynamic("B"), T.dynamic("T"), T.dynamic("TS"), T.dynamic("NR"), T.dynamic("NV")
    SL, SB, ST = T.dynamic("SL"), T.dynamic("SB"), T.dynamic("ST")
    XB, XT, XH, XG, XN = T.dynamic("XB"), T.dynamic("XT"), T.dynamic("XH"), T.dynamic("XG"), T.dynamic("XN")

    @T.macro
    def tile_scores(KRot, Cos, Sin, parents, qx, qy, fc, fs, fk_x, fk_y, qa, kb, sc, b, h, n, p0, gr, tg):
        """sc = the tile's log2-domain scores (NEG past the candidates): sc[4 j + 2 rr + e] is head 8 rr + gr,
        candidate p0 + 8 j + 2 tg + e."""
        pi = p0 // r
        row0 = child(parents, p0, r, top_k)
        # K and the angle's table rows in flight at once (candidates past n, masked below, read clamped rows)
        for j in T.unroll(2):
            row = T.max(T.min(row0 + gr + 8 * j, NR - 1), 0)
            for c in T.unroll(KP // KC):
                for e in T.vectorized(KC):
                    fk_x[j * KP + c * KC + e] = KRot[b, h, row, KC * tg + 4 * KC * c + e]
                for e in T.vectorized(KC):
                    fk_y[j * KP + c * KC + e] = KRot[b, h, row, half + KC * tg + 4 * KC * c + e]
        for c in T.unroll(KP // KC):
            for e in T.vectorized(KC):
                fc[c * KC + e] = Cos[n - 1 - pi * r, KC * tg + 4 * KC * c + e]
            for e in T.vectorized(KC):
                fs[c * KC + e] = Sin[n - 1 - pi * r, KC * tg + 4 * KC * c + e]
        # the query at the tile's relative position n - 1 - r pi
        for rr in T.unroll(NH):
            for e in T.unroll(KP):
                lo_v, hi_v = rope_pair(T.cast(qx[rr * KP + e], "float32"), T.cast(qy[rr * KP + e], "float32"),
                                        fc[e], fs[e])
                qa[e // 2 * 8 + 2 * rr + e % 2] = T.cast(lo_v, dtype)
                qa[e // 2 * 8 + 4 + 2 * rr + e % 2] = T.cast(hi_v, dtype)
        for j in T.unroll(2):
            for e in T.unroll(4):
                sc[j * 4 + e] = 0.0
            for ks in T.unroll(KS):
                for e in T.unroll(2):
                    kb[e] = fk_x[j * KP + 2 * ks + e]
                    kb[2 + e] = fk_y[j * KP + 2 * ks + e]
                mma(qa, ks * 8, kb, 0, sc, j * 4, dtype)
        for j in T.unroll(2):
            for e in T.unroll(4):
                sc[j * 4 + e] = T.if_then_else(p0 + 8 * j + 2 * tg + e % 2 < n, sc[j * 4 + e] * q_scale, NEG)

    @T.macro
    def softmax_update(sc, m_w, l_w, mx, al):
        """Fold the tile's scores into the warp's running maximum m_w and sum l_w (al: the old state's rescale);
        sc becomes the probabilities against m_w."""
        for rr in T.unroll(NH):
            mx[rr] = m_w[rr]
            for j in T.unroll(2):
                for e in T.unroll(2):
                    mx[rr] = T.max(mx[rr], sc[j * 4 + 2 * rr + e])
            mx[rr] = T.max(mx[rr], T.shfl_xor(mx[rr], 1))
            mx[rr] = T.max(mx[rr], T.shfl_xor(mx[rr], 2))
            al[rr] = T.exp2(m_w[rr] - mx[rr])
            m_w[rr] = mx[rr]
            l_w[rr] *= al[rr]
            for j in T.unroll(2):
                for e in T.unroll(2):
                    i = j * 4 + 2 * rr + e
                    sc[i] = T.if_then_else(sc[i] <= NEG, 0.0, T.exp2(sc[i] - m_w[rr]))
                    l_w[rr] += sc[i]

    @T.macro
    def tile_merge(Vt, parents, fv, va, pb, sc, o_acc, m_w, l_w, mx, al, b, h, p0, v_off, gr, tg):
        """Merge the tile (scores sc) into the warp's online softmax (m_w, l_w, o_acc) with the candidates' V."""
        row0 = v_off + child(parents, p0, r, top_k)
        # V after the scores: fewer registers, so 3 CTAs per SM without spills
        for c in T.unroll(4):
            row = T.max(T.min(row0 + 2 * tg + c % 2 + 8 * (c // 2), NV - 1), 0)
            for vc in T.unroll(VP // VC):
                for e in T.vectorized(VC):
                    fv[c * VP + vc * VC + e] = Vt[b, row, h, VC * gr + 8 * VC * vc + e]
        softmax_update(sc, m_w, l_w, mx, al)
        for rr in T.unroll(NH):
            for j in T.unroll(2):
                for e in T.unroll(2):
                    pb[rr * 4 + 2 * j + e] = T.cast(sc[j * 4 + 2 * rr + e], dtype)
        # O^T's column 2 tg + e of head tile nh is head 8 nh + 2 tg + e, whose rescale lane 4 (2 tg + e) holds
        for nh in T.unroll(NH):
            for e in T.unroll(2):
                mx[0] = T.shfl_sync(al[nh], 4 * (2 * tg + e))
                for mt in T.unroll(VM):
                    for hi in T.unroll(2):
                        o_acc[(mt * NH + nh) * 4 + 2 * hi + e] *= mx[0]
        for mt in T.unroll(VM):
            for c2 in T.unroll(2):
                for hi in T.unroll(2):
                    for e in T.unroll(2):
                        va[4 * c2 + 2 * hi + e] = fv[(2 * c2 + e) * VP + 2 * mt + hi]
            for nh in T.unroll(NH):
                mma(va, 0, pb, nh * 4, o_acc, (mt * NH + nh) * 4, dtype)


    # ------------------------------------------------------------------------- the kernel's phases
    @T.macro
    def load_row(Q, Par, parents, o_sh, qx, qy, qa, b, t, ts, h, gr, tg):
        """The row's parents and the raw query pairs of its head rows gr (gr + 8); qa zero (rows gr + 8 stay zero
        with G <= 8)."""
        for i in T.Parallel(top_k):
            parents[i] = Par[b, ts, h, i]
        T.clear(o_sh)
        for rr in T.unroll(NH):
            g = gr + 8 * rr
            for e in T.unroll(KP):
                qx[rr * KP + e] = T.if_then_else(g < G, Q[b, t, h * G + T.min(g, G - 1), kdim(tg, e)],
                                                 T.cast(0.0, dtype))
                qy[rr * KP + e] = T.if_then_else(g < G, Q[b, t, h * G + T.min(g, G - 1), half + kdim(tg, e)],
                                                 T.cast(0.0, dtype))
        for i in T.unroll(KS * 8):  # rows gr + 8 stay zero with G <= 8
            qa[i] = T.cast(0.0, dtype)
        T.sync_threads()

    @T.macro
    def middle_lse(KRot, Cos, Sin, Scr, parents, tile_regs, softmax, red, lse, b, ts, h, n, w, gr, tg):
        """(1) every candidate's scores into the scratch, each head's log-sum-exp into lse. tile_regs = (qx, qy,
        fc, fs, fk_x, fk_y, qa, kb, sc): tile_scores' registers; softmax = (m_w, l_w, mx, al)."""
        qx, qy, fc, fs, fk_x, fk_y, qa, kb, sc = tile_regs
        m_w, l_w, mx, al = softmax
        for rr in T.unroll(2):
            m_w[rr] = NEG
            l_w[rr] = 0.0
        for it in T.serial(T.ceildiv(T.max(T.ceildiv(n, 16) - w, 0), 4)):
            p0 = (w + 4 * it) * 16
            tile_scores(KRot, Cos, Sin, parents, qx, qy, fc, fs, fk_x, fk_y, qa, kb, sc, b, h, n, p0, gr, tg)
            for rr in T.unroll(NH):
                for j in T.unroll(2):
                    for e in T.unroll(2):
                        p = p0 + 8 * j + 2 * tg + e
                        if gr + 8 * rr < G and p < n:
                            Scr[b, ts, h, T.min(gr + 8 * rr, G - 1), p] = sc[j * 4 + 2 * rr + e]
            softmax_update(sc, m_w, l_w, mx, al)
        warp_scales(m_w, l_w, mx, al, red, w, gr, tg)
        for g in T.Parallel(16):
            lse[g] = red[4, g] + T.log2((red[0, g] + red[1, g]) + (red[2, g] + red[3, g]))
        T.sync_threads()

    @T.macro
    def middle_select(Scr, Par, N0, Sel, parents, selection, prob, lse, b, t, ts, h, n, tx, layer, write_sel,
                      thr: T.Ref):
        """(2) the packed importance keys, the top-k threshold thr and the winners' children for the layer below
        (Par / N0, in place; Sel on request). selection = (keys, chosen, chosen_pos, counts, hist, pick, tmp)."""
        keys, chosen, chosen_pos, counts, hist, pick, tmp = selection
        for i in T.serial(T.ceildiv(n, 128)):
            p = i * 128 + tx
            if p < n:
                for g in T.unroll(G):
                    pr = T.exp2(Scr[b, ts, h, g, p] - lse[g])
                    prob[g, 0] = T.if_then_else(pr < FLT_MIN, 0.0, pr)
                keys[p] = packed_key(prob, G, 0, 0, p, n, pos_mask)
        T.sync_threads()
        select_top_k(keys, n, top_k, hist, pick, tmp, tx, 128)
        thr = pick[0]
        compact_winners(keys, n, thr, parents, 1, chosen, counts, tx, 128, r, top_k, chosen_pos)
        if write_sel != 0:
            for i in T.Parallel(top_k):
                if for_backward:  # the positions, int16
                    Sel[layer - 1, b, t, h, i] = T.cast(chosen_pos[i], "int16")
                else:
                    Sel[layer - 1, b, t, h, i] = chosen[i]
        for i in T.Parallel(top_k):
            Par[b, ts, h, i] = chosen[i]
        if tx == 0:
            N0[b, ts, h] = (T.min(n, top_k) - 1) * r + T.bitwise_and(t >> ((layer - 1) * log_r), r - 1) + 1

    @T.macro
    def load_state(PartO, PartML, o_acc, m_w, l_w, b, ts, h, w, gr, tg):
        """The layers above: warp 0 carries their state, the others start empty (same reference)."""
        for mt in T.unroll(VM):
            for nh in T.unroll(NH):
                for e in T.unroll(4):
                    g = 8 * nh + 2 * tg + e % 2
                    o_acc[(mt * NH + nh) * 4 + e] = T.if_then_else(
                        w == 0 and g < G, PartO[b, ts, h * G + T.min(g, G - 1), vdim(gr, 2 * mt + e // 2)], 0.0)
        warp_state_in(PartML, m_w, l_w, b, ts, h, w, gr, tg, G)

    @T.macro
    def scratch_scores(Scr, keys, sc, b, ts, h, n, p0, gr, tg, thr: T.Ref):
        """sc = a middle layer tile's scores from the scratch, NEG for the winners and past the candidates."""
        for rr in T.unroll(NH):
            for j in T.unroll(2):
                for e in T.unroll(2):
                    p = p0 + 8 * j + 2 * tg + e
                    sc[j * 4 + 2 * rr + e] = T.if_then_else(
                        p < n and keys[T.min(p, nbuf - 1)] < thr,
                        Scr[b, ts, h, T.min(gr + 8 * rr, G - 1), T.min(p, nbuf - 1)], NEG)

    @T.macro
    def combine(PartO, PartML, o_acc, o_sh, red, m_w, l_w, mx, al, b, ts, h, w, gr, tg):
        """The warps' states, combined in a fixed order, back to PartO / PartML."""
        warp_scales(m_w, l_w, mx, al, red, w, gr, tg)
        for ww in T.serial(4):
            if w == ww:
                for nh in T.unroll(NH):
                    for e in T.unroll(2):
                        mx[0] = T.shfl_sync(al[nh], 4 * (2 * tg + e))
                        for mt in T.unroll(VM):
                            for hi in T.unroll(2):
                                o_sh[8 * nh + 2 * tg + e, vdim(gr, 2 * mt + hi)] += \
                                    o_acc[(mt * NH + nh) * 4 + 2 * hi + e] * mx[0]
            T.sync_threads()
        warp_state_out(o_sh, red, PartO, PartML, b, ts, h, G)

    @T.prim_func
    def htree_layer16(
        Q: T.Tensor((B, Tn, H, K), dtype),
        KRot: T.Tensor((B, Hkv, NR, K), dtype),
        Vt: T.Tensor((B, NV, Hkv, V), dtype),
        Cos: T.Tensor((nbuf, half), "float32"),
        Sin: T.Tensor((nbuf, half), "float32"),
        Par: T.Tensor((B, TS, Hkv, top_k), "int32"),
        N0: T.Tensor((B, TS, Hkv), "int32"),
        PartO: T.Tensor((B, TS, H, V), "float32"),
        PartML: T.Tensor((B, TS, H, 2), "float32"),
        Scr: T.Tensor((XB, XT, XH, XG, XN), "float32"),  # [B, TS, Hkv, G, nbuf] (a middle layer)
        Sel: T.Tensor((SL, SB, ST, Hkv, top_k), "int16" if for_backward else "int32"),
        t_start: T.int32,
        v_off: T.int32,
        layer: T.int32,
        write_sel: T.int32,
    ):
        with T.Kernel(TS, Hkv, B, threads=128) as (ts, h, b):
            T.annotate_min_blocks_per_sm(min_blocks)
            parents = T.alloc_shared((top_k,), "int32")
            o_sh = T.alloc_shared((16, V), "float32")
            red = T.alloc_shared((5, 16), "float32")
            # a middle layer's selection (placeholders at layer 0)
            keys = T.alloc_shared((nbuf,) if middle else (1,), "int32")
            chosen = T.alloc_shared((top_k,) if middle else (1,), "int32")
            chosen_pos = T.alloc_shared((top_k,), "int32") if for_backward and middle else None
            counts = T.alloc_shared((128,) if middle else (1,), "int32")
            hist = T.alloc_shared((256,) if middle else (1,), "int32")
            pick = T.alloc_shared((2,), "int32")
            lse = T.alloc_shared((16,), "float32")
            qx = T.alloc_local((NH * KP,), dtype)  # the raw query pairs (i, i + K/2) of head rows gr (gr + 8)
            qy = T.alloc_local((NH * KP,), dtype)
            fc = T.alloc_local((KP,), "float32")  # a tile's gathers: its RoPE angle, K rows gr and gr + 8, V rows
            fs = T.alloc_local((KP,), "float32")
            fk_x = T.alloc_local((2 * KP,), dtype)
            fk_y = T.alloc_local((2 * KP,), dtype)
            fv = T.alloc_local((4 * VP,), dtype)
            qa = T.alloc_local((KS * 8,), dtype)  # A fragments of the rotated query, per k-step
            kb = T.alloc_local((4,), dtype)
            va = T.alloc_local((8,), dtype)
            pb = T.alloc_local((NH * 4,), dtype)  # B fragments of P^T, per head tile
            sc = T.alloc_local((8,), "float32")
            o_acc = T.alloc_local((VM * NH * 4,), "float32")
            m_w = T.alloc_local((2,), "float32")  # head rows gr and gr + 8: running maximum, partial sum
            l_w = T.alloc_local((2,), "float32")
            mx = T.alloc_local((2,), "float32")
            al = T.alloc_local((2,), "float32")
            prob = T.alloc_local((G, 1), "float32")
            tmp = T.alloc_local((4,), "int32")
            thr = T.alloc_var("int32")  # smallest winning key (middle layers)

            tx = T.get_thread_binding()
            lane = tx % 32
            w = tx // 32
            gr = lane // 4
            tg = lane % 4
            t = t_start + ts
            n = N0[b, ts, h]

            load_row(Q, Par, parents, o_sh, qx, qy, qa, b, t, ts, h, gr, tg)
            thr = 0
            if middle:
                middle_lse(KRot, Cos, Sin, Scr, parents, (qx, qy, fc, fs, fk_x, fk_y, qa, kb, sc), (m_w, l_w, mx, al),
                           red, lse, b, ts, h, n, w, gr, tg)
                middle_select(Scr, Par, N0, Sel, parents, (keys, chosen, chosen_pos, counts, hist, pick, tmp), prob,
                              lse, b, t, ts, h, n, tx, layer, write_sel, thr)
            # (3) merge the non-winners (layer 0: everything) into the online softmax
            load_state(PartO, PartML, o_acc, m_w, l_w, b, ts, h, w, gr, tg)
            for it in T.serial(T.ceildiv(T.max(T.ceildiv(n, 16) - w, 0), 4)):
                p0 = (w + 4 * it) * 16
                if middle:
                    scratch_scores(Scr, keys, sc, b, ts, h, n, p0, gr, tg, thr)
                else:
                    tile_scores(KRot, Cos, Sin, parents, qx, qy, fc, fs, fk_x, fk_y, qa, kb, sc, b, h, n, p0, gr, tg)
                tile_merge(Vt, parents, fv, va, pb, sc, o_acc, m_w, l_w, mx, al, b, h, p0, v_off, gr, tg)
            combine(PartO, PartML, o_acc, o_sh, red, m_w, l_w, mx, al, b, ts, h, w, gr, tg)

    return htree_layer16
