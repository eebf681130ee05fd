"""dq of the layers below the top for 16-bit inputs with r >= 16 (``htree_bwd_rows16_kernel``): the rows kernel of
``bwd_rows`` (the same launch arguments and result) with the operands gathered straight into m16n8k16 mma.sync register
fragments, as the forward's ``htree_layer16_kernel`` does, instead of staged through shared memory.

One CTA per (b, t, kv head) row; each of its four warps takes every fourth tile of 16 candidates of a layer (one
parent's children, r >= 16) and keeps its own dq in registers over all the lower layers; the warps' dq are added in a
fixed order at the end (deterministic). Per tile:
  - S = Q K^T as in ``htree_layer16_kernel`` (bitwise the forward's scores): K pre-rotated at its child index c
    (KRot0: the tokens, KRotN: the nodes of the middle layers, ``htree_rope_kernel`` with period r), the query
    rotated at the tile's relative position n - 1 - r pi (pi: the parent's slot), since <R(q, n - 1),
    R(k, r pi + c)> = <R(q, n - 1 - r pi), R(k, c)>; lane (gr, tg) holds candidates gr, gr + 8 and the RoPE pairs
    kdim(tg, i) of every head row;
  - dP = dO V^T the same way (V's dims permuted like K's: dot products do not care about the order of the dims);
  - dS = P (dP - D) for the merged candidates (past n, or won at a layer above layer 0: zero); the score
    accumulators are dS's A fragments as they are (heads x candidates);
  - dq_pre = dS K_pre: K's B fragments are the scores' K fragments transposed per 8 x 8 block by movmatrix (no
    second gather, no shared memory); the result's lane holds the same RoPE pairs kdim(tg, i), so it is rotated back
    at n - 1 - r pi with the angle rows the query used, dq += R^T dq_pre, in registers.
The query and dO rows are read per tile from shared memory, V gathered after the scores and the angle rows read again
for dq, so that 3 CTAs per SM fit without spills (168 registers) at G <= 8."""

from ...common.hw import LOG2E
from ...common.tl.mma import mma
from ..tree import MAX_LAYERS
from .bwd_common import lower_layer_tiles, unrotate
from .fragments import child, rope_pair

import tilelang.language as T  # noqa: E402

# movmatrix: an 8 x 8 matrix of 16-bit values in the mma fragment layout (lane 4 g + t: row g, columns 2 t, 2 t + 1)
# transposed across the warp
_MOVT_SRC = r"""
template <typename T>
__device__ __forceinline__ void htree_movt(const T* src, T* dst) {
  unsigned y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n"
               : "=r"(y) : "r"(*reinterpret_cast<const unsigned*>(src)));
  *reinterpret_cast<unsigned*>(dst) = y;
}
"""


def uses_rows16(dtype: str, compression_rate: int) -> bool:
    """Whether the rows kernel is ``htree_bwd_rows16_kernel``: 16-bit inputs and r >= 16 (a 16-candidate tile never
    spans two parents); else ``htree_bwd_rows_kernel``."""
    return dtype != "float32" and compression_rate >= 16


def htree_bwd_rows16_kernel(num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int, compression_rate: int,
                            top_k_per_layer: int, scale: float, dtype: str, min_blocks: int | None = None):
    """dQ[b, t_start + ts] = scale * (the lower layers' dq) + DQ[b, ts] (the top layer's), in q's dtype.
    min_blocks: CTAs per SM the registers are capped for; by default 3 (168 registers, no spills), 2 with 16 heads
    at K = 128 (their dq and query pairs take twice the registers: ~226)."""
    H, Hkv, K, V, r = num_heads, num_kv_heads, head_dim, v_head_dim, compression_rate
    top_k = top_k_per_layer
    G = H // Hkv
    NH = 1 if G <= 8 else 2  # head rows gr (and gr + 8)
    if min_blocks is None:
        min_blocks = 2 if NH == 2 and K > 64 else 3
    half, vhalf = K // 2, V // 2
    KP, VP = K // 8, V // 8  # per lane and candidate: RoPE pairs of K, dims of each half of V
    KC, VC = min(8, KP), min(8, VP)  # of them per 16-byte load
    KS, VS = K // 16, V // 16  # k-steps of S = Q K^T and of dP = dO V^T

    def kdim(tg, i):  # lane tg's i-th pair (i, i + K/2): the four tg lanes' 16-byte loads lie side by side
        return KC * tg + 4 * KC * (i // KC) + i % KC
    q_scale = scale * LOG2E
    B, Tn, NN, NR, NC, TS = (T.dynamic(x) for x in ("B", "T", "NN", "NR", "NC", "TS"))
    LS, PB, PT, FN = T.dynamic("LS"), T.dynamic("PB"), T.dynamic("PT"), T.dynamic("FN")

    @T.macro
    def gather(Src, row0, rows, dst_x, dst_y, P: int, C: int, src_half: int, b, h, gr, tg, rotated: bool):
        """Candidates gr and gr + 8 of the tile (rows row0 + ... of Src, clamped: candidates past n are masked):
        lane tg's P pairs (i, i + src_half) of each, C per 16-byte load (K: KRot [B, Hkv, rows, K]; V: [B, rows,
        Hkv, V])."""
        for j in T.unroll(2):
            row = T.max(T.min(row0 + gr + 8 * j, rows - 1), 0)
            for c in T.unroll(P // C):
                for e in T.vectorized(C):
                    if rotated:
                        dst_x[j * P + c * C + e] = Src[b, h, row, C * tg + 4 * C * c + e]
                    else:
                        dst_x[j * P + c * C + e] = Src[b, row, h, C * tg + 4 * C * c + e]
                for e in T.vectorized(C):
                    if rotated:
                        dst_y[j * P + c * C + e] = Src[b, h, row, src_half + C * tg + 4 * C * c + e]
                    else:
                        dst_y[j * P + c * C + e] = Src[b, row, h, src_half + C * tg + 4 * C * c + e]

    @T.macro
    def rows(src, dst_x, dst_y, P: int, C: int, src_half: int, gr, tg):
        """Head rows gr (gr + 8) of the query or dO from shared memory: lane tg's P pairs (i, i + src_half); lanes
        past G read nothing (fewer wavefronts)."""
        for rr in T.unroll(NH):
            g = gr + 8 * rr
            for c in T.unroll(P // C):
                for e in T.vectorized(C):
                    dst_x[rr * P + c * C + e] = T.if_then_else(g < G, src[g, C * tg + 4 * C * c + e],
                                                               T.cast(0.0, dtype))
                for e in T.vectorized(C):
                    dst_y[rr * P + c * C + e] = T.if_then_else(g < G, src[g, src_half + C * tg + 4 * C * c + e],
                                                               T.cast(0.0, dtype))

    @T.macro
    def angles(Cos, Sin, pos, fc, fs, tg):
        """The angle rows at pos of lane tg's pairs kdim(tg, i)."""
        for c in T.unroll(KP // KC):
            for e in T.vectorized(KC):
                fc[c * KC + e] = Cos[pos, KC * tg + 4 * KC * c + e]
            for e in T.vectorized(KC):
                fs[c * KC + e] = Sin[pos, KC * tg + 4 * KC * c + e]

    @T.macro
    def tile(KRot, Vs, row_off, nk, nv, tables, smem, regs, b, ts, h, l, n, p0, gr, tg, flagged):
        """One tile of 16 candidates p0 .. p0 + 15 (child c of the parent in slot pi = p0 / r): dq += R^T dS K_pre
        (lane (gr, tg): head rows gr (gr + 8), pairs kdim(tg, i)). V is gathered after the scores and the angle
        rows again for dq (L1 hits): fewer registers live at once. KRot, Vs: the layer's K (pre-rotated) and V, row_off
        their first row, nk, nv their row counts (buffers passed as arguments, not in a tuple: TileLang then keeps each
        call's buffer and shapes apart); tables = (Cos, Sin, Flags), smem = (parents, the query's and dO's rows)."""
        Cos, Sin, Flags = tables
        parents, q_sh, do_sh = smem
        (qx, qy, dx, dy, doa, lse2, dl, fc, fs, fk_x, fk_y, fv_x, fv_y, qa, kb, sc, dp, dsa, kt, cx, cy, win, dq_x,
         dq_y) = regs
        pos = n - 1 - p0 // r * r
        node0 = child(parents, p0, r, top_k)
        gather(KRot, row_off + node0, nk, fk_x, fk_y, KP, KC, half, b, h, gr, tg, True)
        angles(Cos, Sin, pos, fc, fs, tg)
        for j in T.unroll(2):
            for e in T.unroll(2):
                p = p0 + 8 * j + 2 * tg + e
                if flagged:  # the layer's winners were expanded (merged one layer down), not merged here
                    win[2 * j + e] = T.if_then_else(p < n, T.cast(Flags[l - 1, b, ts, h, T.min(p, FN - 1)], "int32"),
                                                    1)
                else:
                    win[2 * j + e] = T.if_then_else(p < n, 0, 1)
        rows(q_sh, qx, qy, KP, KC, half, gr, tg)
        # S = Q K^T with the query at the tile's relative position n - 1 - r pi, rotated k-step by k-step; then
        # dP = dO V^T: [4 j + 2 rr + e] is head 8 rr + gr, candidate p0 + 8 j + 2 tg + e
        for e in T.unroll(8):
            sc[e] = 0.0
        for ks in T.unroll(KS):
            for rr in T.unroll(NH):
                for e in T.unroll(2):
                    lo_v, hi_v = rope_pair(T.cast(qx[rr * KP + 2 * ks + e], "float32"),
                                           T.cast(qy[rr * KP + 2 * ks + e], "float32"), fc[2 * ks + e], fs[2 * ks + e])
                    qa[ks * 8 + 2 * rr + e] = T.cast(lo_v, dtype)
                    qa[ks * 8 + 4 + 2 * rr + e] = T.cast(hi_v, dtype)
            for j in T.unroll(2):
                for e in T.unroll(2):
                    kb[e] = fk_x[j * KP + 2 * ks + e]
                    kb[2 + e] = fk_y[j * KP + 2 * ks + e]
                mma(qa, ks * 8, kb, 0, sc, j * 4, dtype)
        gather(Vs, row_off + node0, nv, fv_x, fv_y, VP, VC, vhalf, b, h, gr, tg, False)
        rows(do_sh, dx, dy, VP, VC, vhalf, gr, tg)
        for e in T.unroll(8):
            dp[e] = 0.0
        for ks in T.unroll(VS):
            for rr in range(2):
                for e in T.unroll(2):
                    if rr < NH:
                        doa[2 * rr + e] = dx[rr * VP + 2 * ks + e]
                        doa[4 + 2 * rr + e] = dy[rr * VP + 2 * ks + e]
                    else:  # rows gr + 8 zero with G <= 8
                        doa[2 * rr + e] = T.cast(0.0, dtype)
                        doa[4 + 2 * rr + e] = T.cast(0.0, dtype)
            for j in T.unroll(2):
                for e in T.unroll(2):
                    kb[e] = fv_x[j * VP + 2 * ks + e]
                    kb[2 + e] = fv_y[j * VP + 2 * ks + e]
                mma(doa, 0, kb, 0, dp, j * 4, dtype)
        # dS = P (dP - D) of the merged candidates: as dtype, the A fragment of dS K (heads x 16 candidates)
        for j in T.unroll(2):
            for rr in range(2):
                for e in T.unroll(2):
                    i = 4 * j + 2 * rr + e
                    if rr < NH:
                        pr = T.if_then_else(win[2 * j + e] == 0, T.exp2(sc[i] * q_scale - lse2[rr]), 0.0)
                        dsa[i] = T.cast(pr * (dp[i] - dl[rr]), dtype)
                    else:
                        dsa[i] = T.cast(0.0, dtype)
        # dq_pre = dS K_pre per k-step's x and y dims (K's 8 x 8 blocks transposed: rows = candidates), rotated back
        angles(Cos, Sin, pos, fc, fs, tg)
        for ks in T.unroll(KS):
            for j in T.unroll(2):
                T.call_extern("handle", "htree_movt", T.address_of(fk_x[j * KP + 2 * ks]), T.address_of(kt[2 * j]))
            for e in T.unroll(4):
                cx[e] = 0.0
            mma(dsa, 0, kt, 0, cx, 0, dtype)
            for j in T.unroll(2):
                T.call_extern("handle", "htree_movt", T.address_of(fk_y[j * KP + 2 * ks]), T.address_of(kt[2 * j]))
            for e in T.unroll(4):
                cy[e] = 0.0
            mma(dsa, 0, kt, 0, cy, 0, dtype)
            for rr in T.unroll(NH):
                for e in T.unroll(2):
                    lo, hi = unrotate(cx[2 * rr + e], cy[2 * rr + e], fc[2 * ks + e], fs[2 * ks + e])
                    dq_x[(ks * NH + rr) * 2 + e] += lo
                    dq_y[(ks * NH + rr) * 2 + e] += hi

    walk = lower_layer_tiles(tile)

    @T.prim_func
    def htree_bwd_rows16(Q: T.Tensor((B, Tn, H, K), dtype), dO: T.Tensor((B, Tn, H, V), dtype),
                         KRot0: T.Tensor((B, Hkv, Tn, K), dtype), Vt: T.Tensor((B, Tn, Hkv, V), dtype),
                         KRotN: T.Tensor((B, Hkv, NR, K), dtype), NodesV: T.Tensor((B, NN, Hkv, V), dtype),
                         Cos: T.Tensor((NC, half), "float32"), Sin: T.Tensor((NC, half), "float32"),
                         Lse: T.Tensor((B, Tn, H), "float32"), Dl: T.Tensor((B, Tn, H), "float32"),
                         Par: T.Tensor((LS, PB, PT, Hkv, top_k), "int32"), NCand: T.Tensor((LS, PB, PT, Hkv), "int32"),
                         Flags: T.Tensor((LS, PB, PT, Hkv, FN), "int8"), LayerOff: T.Tensor((MAX_LAYERS,), "int32"),
                         DQ: T.Tensor((B, TS, H, K), "float32"), dQ: T.Tensor((B, Tn, H, K), dtype),
                         num_lower: T.int32, t_start: T.int32):
        with T.Kernel(TS, Hkv, B, threads=128, prelude=_MOVT_SRC) as (ts, h, b):
            T.annotate_min_blocks_per_sm(min_blocks)
            parents = T.alloc_shared((top_k,), "int32")
            dq_sh = T.alloc_shared((16, K), "float32")
            # the query and dO rows (zero past G), read per tile in the fragments' order (rows padded by 64 bytes:
            # the 16-byte reads of lanes gr and gr + 1 fall in different banks)
            q_sh = T.alloc_shared((16, K + 32), dtype)
            do_sh = T.alloc_shared((16, V + 32), dtype)
            qx = T.alloc_local((NH * KP,), dtype)  # a tile's raw query pairs (i, i + K/2) of head rows gr (gr + 8)
            qy = T.alloc_local((NH * KP,), dtype)
            dx = T.alloc_local((NH * VP,), dtype)  # its dO pairs (i, i + V/2)
            dy = T.alloc_local((NH * VP,), dtype)
            doa = T.alloc_local((8,), dtype)  # the A fragment of dO of one k-step
            lse2 = T.alloc_local((2,), "float32")  # head rows gr, gr + 8: lse (log2 domain), D
            dl = T.alloc_local((2,), "float32")
            fc = T.alloc_local((KP,), "float32")  # a tile's angle rows, K pairs and V dims of candidates gr, gr + 8
            fs = T.alloc_local((KP,), "float32")
            fk_x = T.alloc_local((2 * KP,), dtype)
            fk_y = T.alloc_local((2 * KP,), dtype)
            fv_x = T.alloc_local((2 * VP,), dtype)
            fv_y = T.alloc_local((2 * VP,), dtype)
            qa = T.alloc_local((KS * 8,), dtype)  # A fragments of the rotated query, per k-step
            kb = T.alloc_local((4,), dtype)
            sc = T.alloc_local((8,), "float32")
            dp = T.alloc_local((8,), "float32")
            dsa = T.alloc_local((8,), dtype)
            kt = T.alloc_local((4,), dtype)
            cx = T.alloc_local((4,), "float32")
            cy = T.alloc_local((4,), "float32")
            win = T.alloc_local((4,), "int32")
            dq_x = T.alloc_local((KS * NH * 2,), "float32")  # this warp's dq: head rows gr (gr + 8), pairs kdim
            dq_y = T.alloc_local((KS * NH * 2,), "float32")

            tx = T.get_thread_binding()
            lane = tx % 32
            w = tx // 32
            gr = lane // 4
            tg = lane % 4
            t = t_start + ts
            for g, d in T.Parallel(16, K):
                q_sh[g, d] = T.if_then_else(g < G, Q[b, t, h * G + T.min(g, G - 1), d], T.cast(0.0, dtype))
            for g, d in T.Parallel(16, V):
                do_sh[g, d] = T.if_then_else(g < G, dO[b, t, h * G + T.min(g, G - 1), d], T.cast(0.0, dtype))
            for i in T.unroll(KS * 8):  # rows gr + 8 stay zero with G <= 8
                qa[i] = T.cast(0.0, dtype)
            for rr in T.unroll(2):
                g = gr + 8 * rr
                lse2[rr] = T.if_then_else(g < G, Lse[b, t, h * G + T.min(g, G - 1)] * LOG2E, 0.0)
                dl[rr] = T.if_then_else(g < G, Dl[b, t, h * G + T.min(g, G - 1)], 0.0)
            for i in T.unroll(KS * NH * 2):
                dq_x[i] = 0.0
                dq_y[i] = 0.0
            for g, d in T.Parallel(16, K):
                dq_sh[g, d] = 0.0
            regs = (qx, qy, dx, dy, doa, lse2, dl, fc, fs, fk_x, fk_y, fv_x, fv_y, qa, kb, sc, dp, dsa, kt, cx, cy, win,
                    dq_x, dq_y)
            tables, smem = (Cos, Sin, Flags), (parents, q_sh, do_sh)
            walk(KRot0, Vt, KRotN, NodesV, Tn, NR, NN, Par, NCand, LayerOff, tables, smem, regs, b, ts, h, w, gr, tg,
                 num_lower)
            # the warps' dq added in a fixed order (after dq_sh's zeros, also without lower layers)
            T.sync_threads()
            for ww in T.serial(4):
                if w == ww:
                    for ks in T.unroll(KS):
                        for rr in T.unroll(NH):
                            for e in T.unroll(2):
                                dq_sh[gr + 8 * rr, kdim(tg, 2 * ks + e)] += dq_x[(ks * NH + rr) * 2 + e]
                                dq_sh[gr + 8 * rr, half + kdim(tg, 2 * ks + e)] += dq_y[(ks * NH + rr) * 2 + e]
                T.sync_threads()
            for g, d in T.Parallel(G, K):
                dQ[b, t, h * G + g, d] = T.cast(scale * dq_sh[g, d] + DQ[b, ts, h * G + g, d], dtype)

    return htree_bwd_rows16
