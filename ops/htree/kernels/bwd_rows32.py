"""dq of the layers below the top for fp32 with r >= 16 (``htree_bwd_rows32_kernel``; where:
``bwd_common.uses_fp32_fragments``): the rows kernel of
``bwd_rows`` (the same launch arguments and result as ``bwd_rows16``) with its three products as mma.sync m16n8k8
TF32 tiles whose operands go from the loads straight into the PTX register fragments.

One CTA per (b, t, kv head) row; each of its four warps takes every fourth tile of 16 candidates of a layer (one
parent's children, r >= 16) and keeps its own dq in registers over all the lower layers; the warps' dq are added in a
fixed order at the end (deterministic). The G query heads are the products' rows (gr, gr + 8; padded to 16). The
lower layers' K comes rotated at its child index c (KRot0 / KRotN, ``htree_rope_kernel`` with period r, as for
``bwd_rows16``), so the query is rotated per tile at its relative position n - 1 - r pi (pi: the parent's slot):
<R(q, n - 1), R(k, r pi + c)> = <R(q, n - 1 - r pi), R(k, c)>. Per tile, lane (gr, tg):
  - S = Q K^T: B's column gr is candidate gr (+ 8); lane tg's k-steps cover the RoPE pairs (KE tg + ks,
    half + KE tg + ks), so the query's pairs are rotated in the lane that holds them;
  - dP = dO V^T: lane tg's k-step ks covers V dims VQ tg + 2 ks, + 1 (dO's A fragments are loaded once per row);
  - dS = P (dP - D) for the merged candidates; the accumulators' columns (2 tg, 2 tg + 1) are taken as A's columns
    (tg, tg + 4) of dq_pre = dS K (candidates 2 tg, 2 tg + 1 of each k-step);
  - dq_pre's column gr of tile kt is dim KH gr + kt of K's first half (kt < KH) or of its second (tile kt + KH),
    so each lane holds whole RoPE pairs of dq_pre and rotates them back at n - 1 - r pi into the warp's dq.
Each warp copies its next tile's K and V rows and angle row by cp.async into its own stage of shared memory while
it computes the current tile (``bwd_common.lower_layer_tiles`` with a prefetch), so the gathers' latency overlaps
the products. fp32_precision "highest": every operand split into TF32 halves, three products; "high": rounded, one
product. Each tile's products start from zero and are added in fp32 (the mma accumulators add in truncation)."""

from ...common.hw import LOG2E
from ..tree import MAX_LAYERS
from .bwd_common import lower_layer_tiles, unrotate
from .fragments import child, rope_pair, tf32_tiles

import tilelang.language as T  # noqa: E402


def htree_bwd_rows32_kernel(num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int, compression_rate: int,
                            top_k_per_layer: int, scale: float, fp32_precision: str = "highest",
                            min_blocks: int = 2):
    """dQ[b, t_start + ts] = scale * (the lower layers' dq) + DQ[b, ts] (the top layer's), in fp32 (see the module's
    docstring). min_blocks: CTAs per SM the registers are capped for."""
    H, Hkv, K, V, r = num_heads, num_kv_heads, head_dim, v_head_dim, compression_rate
    top_k = top_k_per_layer
    G = H // Hkv
    half = K // 2
    KE = K // 8  # per lane: RoPE pairs of S's k-steps (KE k-steps)
    VQ, VS = V // 4, V // 8  # per lane: V dims of dP's k-steps (VS k-steps, two dims each)
    KT = K // 8  # dq_pre's column tiles
    KH = KT // 2  # ... of K's first half (then as many of its second)
    KP, VP = K + 4, V + 4  # the staged rows' strides (padded: the fragments' column loads spread over the banks)
    operand, product = tf32_tiles(fp32_precision)
    q_scale = scale * LOG2E
    dtype = "float32"
    B, Tn, NN, NR, NC, TS = (T.dynamic(x) for x in ("B", "T", "NN", "NR", "NC", "TS"))
    LS, PB, PT, FN = T.dynamic("LS"), T.dynamic("PB"), T.dynamic("PT"), T.dynamic("FN")

    @T.macro
    def prefetch(KRot, Vs, row_off, nk, nv, tables, smem, b, h, n, p0, w, gr, tg, st):
        """Tile p0's 16 K rows, 16 V rows and its angle row (cos, sin at its relative position) into the warp's
        stage st by cp.async, 16 bytes a lane and copy, then one commit."""
        Cos, Sin = tables[0], tables[1]
        parents, k_st, v_st, a_st = smem
        lane = gr * 4 + tg
        pos = n - 1 - p0 // r * r
        node0 = child(parents, p0, r, top_k)
        for c in T.unroll(K // 8):
            j, col = (lane + 32 * c) // (K // 4), (lane + 32 * c) % (K // 4) * 4
            row = T.max(T.min(row_off + node0 + j, nk - 1), 0)
            T.ptx_cp_async(T.access_ptr(k_st[w, st, j * KP + col], "w", 4), T.access_ptr(KRot[b, h, row, col], "r", 4),
                           4)
        for c in T.unroll(V // 8):
            j, col = (lane + 32 * c) // (V // 4), (lane + 32 * c) % (V // 4) * 4
            row_v = T.max(T.min(row_off + node0 + j, nv - 1), 0)
            T.ptx_cp_async(T.access_ptr(v_st[w, st, j * VP + col], "w", 4), T.access_ptr(Vs[b, row_v, h, col], "r", 4),
                           4)
        if lane < half // 4:
            T.ptx_cp_async(T.access_ptr(a_st[w, st, 4 * lane], "w", 4), T.access_ptr(Cos[pos, 4 * lane], "r", 4), 4)
        if lane >= 16 and lane < 16 + half // 4:
            T.ptx_cp_async(T.access_ptr(a_st[w, st, half + 4 * (lane - 16)], "w", 4),
                           T.access_ptr(Sin[pos, 4 * (lane - 16)], "r", 4), 4)
        T.ptx_commit_group()

    @T.macro
    def tile(KRot, Vs, row_off, nk, nv, tables, smem, regs, b, ts, h, l, n, p0, gr, tg, flagged, w, st):
        """One tile of 16 candidates p0 .. p0 + 15 (children of the parent in slot p0 / r): dq += R^T dS K_c, its
        K and V rows and angle row read from the warp's stage st (``prefetch``); KRot, Vs: the layer's K (rotated
        at the child index) and V (unused here: the prefetch copied them); tables = (Cos, Sin, Flags), smem =
        (parents, the warps' K, V and angle stages)."""
        Flags = tables[2]
        k_st, v_st, a_st = smem[1:]
        (qx, qy, da_h, da_l, lse2, dl, fc, fs, fx, fy, fv, a_h, a_l, b_h, b_l, sc, dp, sa_h, sa_l, kx, ky, cx, cy,
         win, dq) = regs
        for jn in T.unroll(2):
            for e in T.unroll(2):
                p = p0 + 8 * jn + 2 * tg + e
                if flagged:  # the layer's winners were expanded (merged one layer down), not merged here
                    win[2 * jn + e] = T.if_then_else(p < n, T.cast(Flags[l - 1, b, ts, h, T.min(p, FN - 1)], "int32"),
                                                     1)
                else:
                    win[2 * jn + e] = T.if_then_else(p < n, 0, 1)
        # the query's pairs rotated at the tile's relative position, scaled into the log2 domain, as S's A fragments
        for e in T.vectorized(KE):
            fc[e] = a_st[w, st, KE * tg + e]
        for e in T.vectorized(KE):
            fs[e] = a_st[w, st, half + KE * tg + e]
        for ks in T.unroll(KE):
            for rr in T.unroll(2):
                lo_v, hi_v = rope_pair(qx[rr * KE + ks], qy[rr * KE + ks], fc[ks], fs[ks])
                operand(q_scale * lo_v, a_h, a_l, ks * 4 + rr)
                operand(q_scale * hi_v, a_h, a_l, ks * 4 + 2 + rr)
        # S = Q K^T and dP = dO V^T: [4 jn + e] is head gr + 8 (e // 2), candidate p0 + 8 jn + 2 tg + e % 2
        for jn in T.unroll(2):
            row = (8 * jn + gr) * KP
            for e in T.vectorized(KE):
                fx[e] = k_st[w, st, row + KE * tg + e]
            for e in T.vectorized(KE):
                fy[e] = k_st[w, st, row + half + KE * tg + e]
            for e in T.vectorized(VQ):
                fv[e] = v_st[w, st, (8 * jn + gr) * VP + VQ * tg + e]
            for e in T.unroll(4):
                sc[jn * 4 + e] = 0.0
                dp[jn * 4 + e] = 0.0
            for ks in T.unroll(KE):
                operand(fx[ks], b_h, b_l, 0)
                operand(fy[ks], b_h, b_l, 1)
                product(a_h, a_l, ks * 4, b_h, b_l, 0, sc, jn * 4)
            for ks in T.unroll(VS):
                operand(fv[2 * ks], b_h, b_l, 0)
                operand(fv[2 * ks + 1], b_h, b_l, 1)
                product(da_h, da_l, ks * 4, b_h, b_l, 0, dp, jn * 4)
        # dS = P (dP - D) of the merged candidates, as dq_pre's A fragments (order 0, 2, 1, 3 per k-step)
        for jn in T.unroll(2):
            for e in T.unroll(4):
                pr = T.if_then_else(win[2 * jn + e % 2] == 0, T.exp2(sc[jn * 4 + e] - lse2[e // 2]), 0.0)
                operand(pr * (dp[jn * 4 + e] - dl[e // 2]), sa_h, sa_l, jn * 4 + (e % 2) * 2 + e // 2)
        # dq_pre = dS K_c: B's rows are candidates 8 jn + 2 tg (+ 1), its column gr dim KH gr + kt (+ half)
        for jn in T.unroll(2):
            for e in T.unroll(2):
                row = (8 * jn + 2 * tg + e) * KP
                for i in T.vectorized(KH):
                    kx[(jn * 2 + e) * KH + i] = k_st[w, st, row + KH * gr + i]
                for i in T.vectorized(KH):
                    ky[(jn * 2 + e) * KH + i] = k_st[w, st, row + half + KH * gr + i]
        for e in T.vectorized(2 * KH):
            fc[e] = a_st[w, st, 2 * KH * tg + e]
        for e in T.vectorized(2 * KH):
            fs[e] = a_st[w, st, half + 2 * KH * tg + e]
        for kt in T.unroll(KH):
            for e in T.unroll(4):
                cx[e] = 0.0
                cy[e] = 0.0
            for jn in T.unroll(2):
                for e in T.unroll(2):
                    operand(kx[(jn * 2 + e) * KH + kt], b_h, b_l, e)
                product(sa_h, sa_l, jn * 4, b_h, b_l, 0, cx, 0)
                for e in T.unroll(2):
                    operand(ky[(jn * 2 + e) * KH + kt], b_h, b_l, e)
                product(sa_h, sa_l, jn * 4, b_h, b_l, 0, cy, 0)
            # c[e]: head gr + 8 (e // 2), pair KH (2 tg + e % 2) + kt: rotated back at the relative position
            for e in T.unroll(4):
                i = KH * (e % 2) + kt
                lo, hi = unrotate(cx[e], cy[e], fc[i], fs[i])
                dq[kt * 4 + e] += lo
                dq[(kt + KH) * 4 + e] += hi

    walk = lower_layer_tiles(tile, prefetch)

    @T.prim_func
    def htree_bwd_rows32(Q: T.Tensor((B, Tn, H, K), dtype), dO: T.Tensor((B, Tn, H, V), dtype),
                         KRot0: T.Tensor((B, Hkv, Tn, K), dtype), Vt: T.Tensor((B, Tn, Hkv, V), dtype),
                         KRotN: T.Tensor((B, Hkv, NR, K), dtype), NodesV: T.Tensor((B, NN, Hkv, V), dtype),
                         Cos: T.Tensor((NC, half), "float32"), Sin: T.Tensor((NC, half), "float32"),
                         Lse: T.Tensor((B, Tn, H), "float32"), Dl: T.Tensor((B, Tn, H), "float32"),
                         Par: T.Tensor((LS, PB, PT, Hkv, top_k), "int32"), NCand: T.Tensor((LS, PB, PT, Hkv), "int32"),
                         Flags: T.Tensor((LS, PB, PT, Hkv, FN), "int8"), LayerOff: T.Tensor((MAX_LAYERS,), "int32"),
                         DQ: T.Tensor((B, TS, H, K), "float32"), dQ: T.Tensor((B, Tn, H, K), dtype),
                         num_lower: T.int32, t_start: T.int32):
        with T.Kernel(TS, Hkv, B, threads=128) as (ts, h, b):
            T.annotate_min_blocks_per_sm(min_blocks)
            parents = T.alloc_shared((top_k,), "int32")
            dq_sh = T.alloc_shared((4, 16, K), "float32")  # the warps' dq, added in warp order
            k_st = T.alloc_shared((4, 2, 16 * KP), dtype)  # each warp's two stages of a tile's rows
            v_st = T.alloc_shared((4, 2, 16 * VP), dtype)
            a_st = T.alloc_shared((4, 2, K), dtype)
            qx = T.alloc_local((2 * KE,), dtype)  # the query's pairs (i, i + K/2) of head rows gr, gr + 8
            qy = T.alloc_local((2 * KE,), dtype)
            da_h = T.alloc_local((VS * 4,), dtype)  # dO's A fragments, per k-step
            da_l = T.alloc_local((VS * 4,), dtype)
            lse2 = T.alloc_local((2,), "float32")  # head rows gr, gr + 8: lse (log2 domain), D
            dl = T.alloc_local((2,), "float32")
            fc = T.alloc_local((KE,), dtype)  # a tile's angle rows
            fs = T.alloc_local((KE,), dtype)
            fx = T.alloc_local((KE,), dtype)  # a candidate's K pairs and V dims as loaded
            fy = T.alloc_local((KE,), dtype)
            fv = T.alloc_local((VQ,), dtype)
            a_h = T.alloc_local((KE * 4,), dtype)  # the rotated query's A fragments
            a_l = T.alloc_local((KE * 4,), dtype)
            b_h = T.alloc_local((2,), dtype)  # one B fragment
            b_l = T.alloc_local((2,), dtype)
            sc = T.alloc_local((8,), "float32")
            dp = T.alloc_local((8,), "float32")
            sa_h = T.alloc_local((8,), dtype)  # dS as dq_pre's A fragments
            sa_l = T.alloc_local((8,), dtype)
            kx = T.alloc_local((4 * KH,), dtype)  # K of candidates 8 jn + 2 tg (+ 1) at dq_pre's columns
            ky = T.alloc_local((4 * KH,), dtype)
            cx = T.alloc_local((4,), "float32")
            cy = T.alloc_local((4,), "float32")
            win = T.alloc_local((4,), "int32")
            dq = T.alloc_local((KT * 4,), "float32")  # the warp's dq: tile kt, [e] head gr + 8 (e // 2)

            tx = T.get_thread_binding()
            lane = tx % 32
            w = tx // 32
            gr = lane // 4
            tg = lane % 4
            t = t_start + ts
            for rr in T.unroll(2):
                g = gr + 8 * rr
                hq = h * G + T.min(g, G - 1)
                for e in T.vectorized(KE):
                    fx[e] = Q[b, t, hq, KE * tg + e]
                for e in T.vectorized(KE):
                    fy[e] = Q[b, t, hq, half + KE * tg + e]
                for e in T.unroll(KE):
                    qx[rr * KE + e] = T.if_then_else(g < G, fx[e], 0.0)
                    qy[rr * KE + e] = T.if_then_else(g < G, fy[e], 0.0)
                for e in T.vectorized(VQ):
                    fv[e] = dO[b, t, hq, VQ * tg + e]
                for ks in T.unroll(VS):
                    operand(T.if_then_else(g < G, fv[2 * ks], 0.0), da_h, da_l, ks * 4 + rr)
                    operand(T.if_then_else(g < G, fv[2 * ks + 1], 0.0), da_h, da_l, ks * 4 + 2 + rr)
                lse2[rr] = T.if_then_else(g < G, Lse[b, t, hq] * LOG2E, 0.0)
                dl[rr] = T.if_then_else(g < G, Dl[b, t, hq], 0.0)
            for i in T.unroll(KT * 4):
                dq[i] = 0.0
            regs = (qx, qy, da_h, da_l, lse2, dl, fc, fs, fx, fy, fv, a_h, a_l, b_h, b_l, sc, dp, sa_h, sa_l, kx, ky,
                    cx, cy, win, dq)
            walk(KRot0, Vt, KRotN, NodesV, Tn, NR, NN, Par, NCand, LayerOff, (Cos, Sin, Flags),
                 (parents, k_st, v_st, a_st), regs, b, ts, h, w, gr, tg, num_lower)
            # the warps' dq added in a fixed order
            for kt in T.unroll(KT):
                for e in T.unroll(4):
                    col = T.if_then_else(kt < KH, 0, half) + KH * (2 * tg + e % 2) + kt % KH
                    dq_sh[w, gr + 8 * (e // 2), col] = dq[kt * 4 + e]
            T.sync_threads()
            for g, d in T.Parallel(G, K):
                lower = (dq_sh[0, g, d] + dq_sh[1, g, d]) + (dq_sh[2, g, d] + dq_sh[3, g, d])
                dQ[b, t, h * G + g, d] = scale * lower + DQ[b, ts, h * G + g, d]

    return htree_bwd_rows32
