"""The backward in one launch (`mhc_pre_bwd_one_pass`, n <= 4 where every (D-slice, token group) CTA fits
the GPU, or the op's SM budget, at once).

Per token, the gradient of x needs reductions over the whole token first (p = g_in . x_i, then g_s), so x
has to be seen twice. Here each CTA has a grad role (the two-kernel path's grad kernel, warp-specialized: a
producer warp streams whole token tiles by TMA, grad_x is formed in place of the x tile and stored from
there by TMA) and a row role that reads whole token rows from memory a few tiles ahead, reduces their dots,
turns them into the coefficients (from the forward's saved h_mix, so no GEMM) and publishes them per tile;
the grad roles of every slice wait for that count and re-read x and g_in from L2, so memory sees them once.

No CTA waits for a CTA that has not started: the row roles claim the rows of their token group one at a time
from a counter, so the rows go to the CTAs that run, and a grad role waits only for tiles whose rows are all
claimed by running CTAs (a row role never waits, after its claim, for anything but its own warps). While
another stream holds SMs the CTAs that find none start later and find their rows taken: they only stream
their grad tiles. What a token contributes (g_mix, coefficients, its g_z / grad_alpha terms) is written per
token, whichever CTA computes it, and grad_phi^T is summed per CTA over its fixed tiles: bitwise reproducible.
The dot warps' register-only reads of the row ring end in a proxy fence before the slot goes back to TMA (see
bwd_two_pass); the grad role hands a stage back only after a barrier and its TMA stores' reads. The phases are
macros, each the code of one warp role."""

from ...common import runtime  # noqa: F401  (the kernel cache dir before TileLang is imported)
from ..tiling import _COEF_WARPS, _DOT_WARPS, _OP_BLOCK, _OP_THREADS, _ROW_COLS, _ROW_SLOTS, _coef_cols, _dims, _lag
from .bwd_terms import _alpha_group, _grad_z, _x_coef

import tilelang.language as T  # noqa: E402

_SYNC_SRC = r"""
// The row roles publish a count per token tile (release), the grad producers poll it (acquire); the proxy
// fence orders the TMA loads that follow behind the acquire.
__device__ __forceinline__ void mhc_wait_count(const int* p, int target) {
  int v;
  for (;;) {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    if (v >= target) break;
    __nanosleep(64);
  }
  asm volatile("fence.proxy.async.global;" ::: "memory");
}
__device__ __forceinline__ void mhc_publish(int* p) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" :: "l"(p) : "memory");
}
__device__ __forceinline__ void mhc_fence_acq_rel() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
// A warp claims the next row of its token group (every lane gets it).
__device__ __forceinline__ int mhc_claim(int* p) {
  int v = 0;
  if ((threadIdx.x & 31) == 0) v = atomicAdd(p, 1);
  return __shfl_sync(0xffffffffu, v, 0);
}
// Waits while token tile `tile` (that of the last row claimed; the next claim lies there or later) is `lag` or more
// tiles past this CTA's grad role (`done` tiles finished), so that the rows this CTA reads stay in L2 until the grad
// roles re-read them. It holds no claimed row meanwhile, so no other CTA waits on this one.
__device__ __forceinline__ void mhc_throttle(const int* done, int tile, int lag) {
  if ((threadIdx.x & 31) == 0) {
    while (tile >= *(const volatile int*)done + lag) __nanosleep(256);
  }
  __syncwarp();
}
__device__ __forceinline__ void mhc_set_volatile(int* p, int v) { *(volatile int*)p = v; }
// 1 in the grid's last CTA to get here: every other CTA is past its last use of the counters, which that CTA zeroes
// for the next launch on the same buffers (a timing loop's reruns).
__device__ __forceinline__ int mhc_arrive_exit(int* p, int total) {
  __threadfence();
  return atomicAdd(p, 1) == total - 1;
}
"""


def mhc_pre_bwd_one_pass_kernel(n: int, D: int, has_g_in: bool = True, has_g_post: bool = True,
                                has_g_res: bool = True, token_groups: int = 2, num_stages: int = 3):
    """The whole backward in one launch for n <= 4 (this module's docstring): grad_x, per-token-group grad_phi^T
    partials and the g_z / grad_alpha terms per token (M + 3 <= 27 lanes). One CTA per (D-slice, token group);
    none waits for one that has not started (module docstring). Its grad role streams token tiles of its slice
    (x, g_in, g_mix, coefficients) by TMA into a ring of `num_stages` for two consumer warpgroups; its row role
    claims whole token rows of its group, reads them from memory up to `_lag` tiles ahead of its grad role,
    reduces their dots, turns them into the coefficients and publishes them per tile, so the grad roles of
    every slice re-read x and g_in from L2. `Claim` holds a row counter per token group and, last, the count of
    CTAs done; the last CTA zeroes it and `Ready` again."""
    block_t = block_d = _OP_BLOCK
    M, NG, NP, Dp, Dc = _dims(n, D, block_d)
    bk = n * block_d
    slices = Dc // block_d
    chunks = -(-D // _ROW_COLS)
    # The throttle (`mhc_throttle`) must let the row role claim past every tile the grad producer may wait for
    # (up to num_stages ahead of the finished tiles), or all CTAs could wait on rows none may claim.
    C, W, lag, row_slots = _COEF_WARPS, _DOT_WARPS, max(_lag(n, D, token_groups), num_stages + 1), _ROW_SLOTS
    QR = 2 * C  # rows announced to the dot and coefficient warps ahead (>= C: one end mark per coefficient warp)
    num_tokens = T.dynamic("num_tokens")
    rows_in, rows_post, rows_res = (num_tokens if has else 1 for has in (has_g_in, has_g_post, has_g_res))
    CW = _coef_cols(n)
    streams = tuple(range(n))  # a Python tuple: the loops over it unroll while tracing

    def stage(it):
        return it % num_stages

    def phase(it):
        return (it // num_stages) % 2

    @T.macro
    def grad_loads(X, GIn, GMix, Coef, Ready, x_ring, g_ring, gmh_ring, gml_ring, coef_ring, full, free, first,
                   tiles, d0):
        """Warp 8, the grad role's loads: token tile `it` of this D-slice into ring stage it % num_stages, once
        its rows' coefficients are all published (so x and g_in come from L2, where the row roles left them):
        x and g_in, g_mix and the coefficients, by TMA."""
        for it in T.serial(tiles):
            st = stage(it)
            t0 = (first + it) * block_t
            # The tile's coefficients come from the row roles that claimed its rows (a count per tile).
            T.call_extern("handle", "mhc_wait_count", T.address_of(Ready[first + it]),
                          T.min(block_t, num_tokens - t0))
            T.barrier_wait(free[st], phase(it) ^ 1)
            for i in streams:
                T.tma_copy(X[t0:t0 + block_t, i, d0:d0 + block_d],
                           x_ring[st, :, i * block_d:(i + 1) * block_d], barrier=full[st],
                           leader_scope_threads=32, eviction_policy="evict_first")
            if has_g_in:
                T.tma_copy(GIn[t0:t0 + block_t, d0:d0 + block_d], g_ring[st, :, :], barrier=full[st],
                           leader_scope_threads=32, eviction_policy="evict_first")
            T.tma_copy(GMix[t0:t0 + block_t, 0, :], gmh_ring[st, :, :], barrier=full[st],
                       leader_scope_threads=32)
            T.tma_copy(GMix[t0:t0 + block_t, 1, :], gml_ring[st, :, :], barrier=full[st],
                       leader_scope_threads=32)
            T.tma_copy(Coef[t0:t0 + block_t, :], coef_ring[st, :, :], barrier=full[st],
                       leader_scope_threads=32)
            T.barrier_arrive(full[st])

    @T.macro
    def row_loads(X, GIn, Claim, rx, rg, rfull, rfree, rowq, qfull, qfree, last, cur, tx, g_lo, g_len, by):
        """Warp 9, the row role's loads: rows of this token group claimed one at a time (`mhc_claim`), each announced
        in `rowq` (its token, -1 after the last: one end mark per coefficient warp) and read whole (x and g_in,
        `_ROW_COLS` columns a chunk) into the row ring; a claim first waits while the last row's tile lies `lag`
        tiles past this CTA's grad role (`mhc_throttle`)."""
        lane = tx % 32
        last[0] = 0
        for k in T.serial(g_len + 1):  # at most every row of the group, then the end marks
            T.call_extern("handle", "mhc_throttle", T.address_of(rowq[QR]), last[0], lag)
            cur[0] = T.call_extern("int32", "mhc_claim", T.address_of(Claim[by]))
            T.barrier_wait(qfree[k % QR], ((k // QR) % 2) ^ 1)
            if lane == 0:
                rowq[k % QR] = T.if_then_else(cur[0] < g_len, g_lo + cur[0], -1)
            T.barrier_arrive(qfull[k % QR])
            if cur[0] >= g_len:
                for e in T.serial(C - 1):  # the other coefficient warps' end marks
                    q = k + 1 + e
                    T.barrier_wait(qfree[q % QR], ((q // QR) % 2) ^ 1)
                    if lane == 0:
                        rowq[q % QR] = -1
                    T.barrier_arrive(qfull[q % QR])
                T.loop_break()
            if has_g_in:
                tok = g_lo + cur[0]
                for q in T.serial(chunks):
                    u = k * chunks + q
                    sl = u % row_slots
                    T.barrier_wait(rfree[sl], ((u // row_slots) % 2) ^ 1)
                    for bb in T.unroll(_ROW_COLS // 256):
                        c0 = q * _ROW_COLS + bb * 256
                        T.tma_copy(X[tok, :, c0:c0 + 256], rx[sl, :, bb * 256:(bb + 1) * 256],
                                   barrier=rfull[sl], leader_scope_threads=32, eviction_policy="evict_last")
                        T.tma_copy(GIn[tok, c0:c0 + 256], rg[sl, bb * 256:(bb + 1) * 256],
                                   barrier=rfull[sl], leader_scope_threads=32, eviction_policy="evict_last")
                    T.barrier_arrive(rfull[sl])
            last[0] = cur[0] // block_t

    @T.macro
    def row_dots(rx, rg, p_ring, pfull, pfree, rfull, rfree, rowq, qfull, qfree, acc, gv, xv, tv, tx, g_len):
        """Warps 10.., the row role's dots p_i = g_in . x_i of each row this CTA claimed (until the end mark), chunk
        u by warp u % W, handed to the coefficient warps through `p_ring`."""
        lane = tx % 32
        w = (tx - 320) // 32
        for k in T.serial(g_len + 1):
            T.barrier_wait(qfull[k % QR], (k // QR) % 2)
            tv[0] = rowq[k % QR]
            T.barrier_arrive(qfree[k % QR])
            if tv[0] < 0:
                T.loop_break()
            T.barrier_wait(pfree[k % C], ((k // C) % 2) ^ 1)
            for i in T.unroll(n):
                acc[i] = T.float32(0)
            if has_g_in:
                for q in T.serial(chunks):
                    u = k * chunks + q
                    if u % W == w:
                        sl = u % row_slots
                        T.barrier_wait(rfull[sl], (u // row_slots) % 2)
                        for v in T.unroll(_ROW_COLS // 256):
                            c = (v * 32 + lane) * 8
                            for e in T.vectorized(8):
                                gv[e] = rg[sl, c + e]
                            for i in T.unroll(n):
                                for e in T.vectorized(8):
                                    xv[e] = rx[sl, i, c + e]
                                for e in T.unroll(8):
                                    acc[i] += T.cast(xv[e], "float32") * T.cast(gv[e], "float32")
                        # ptxas may place the arrive before the FMAs that consume these shared
                        # loads: without the fence the next TMA write can overtake them.
                        T.fence_proxy_async()
                        T.barrier_arrive(rfree[sl])
                for i in T.unroll(n):
                    for o in T.unroll(5):
                        acc[i] += T.shfl_xor(acc[i], 16 >> o)
            if lane < n:
                for i in T.unroll(n):
                    if lane == i:
                        p_ring[k % C, w, i] = acc[i]
            T.barrier_arrive(pfull[k % C])

    @T.macro
    def row_coefficients(Alpha, Bias, InvRms, HPre, HMix, GPost, GRes, GMix, Coef, Ready, Terms, p_ring, pfull, pfree,
                         rowq, qfull, qfree, qv, tv, tx, g_len):
        """The row role's coefficient warps, this CTA's rows dealt round robin: from a row's dots and the forward's
        h_mix, its g_mix (bf16 hi + lo), coefficients [c, h_pre] and g_z / grad_alpha terms (written per token, so
        their sum does not depend on which CTA took the token); the coefficients are published per token tile
        (`Ready`)."""
        lane = tx % 32
        c = (tx - 320 - 32 * W) // 32
        r = lane  # NP = 32 for n <= 4: lane r owns row r of phi
        grp = _alpha_group(r, n)
        a = Alpha[grp]
        b = Bias[T.min(r, M - 1)]
        for kk in T.serial(T.ceildiv(g_len, C) + 1):  # this warp's rows, then its end mark
            k = c + kk * C
            T.barrier_wait(qfull[k % QR], (k // QR) % 2)
            tv[0] = rowq[k % QR]
            T.barrier_arrive(qfree[k % QR])
            if tv[0] < 0:
                T.loop_break()
            tok = tv[0]
            # The token's small inputs, loaded before the wait for its dots.
            s = InvRms[tok]
            m = T.if_then_else(r < M, HMix[tok, T.min(r, M - 1)], T.float32(0))
            gp = GPost[T.min(tok, rows_post - 1), T.clamp(r - n, 0, n - 1)] if has_g_post else T.float32(0)
            gr = GRes[T.min(tok, rows_res - 1), T.clamp(r - 2 * n, 0, n * n - 1)] if has_g_res else T.float32(0)
            hp = HPre[tok, T.clamp(lane - 1, 0, n - 1)]
            T.barrier_wait(pfull[c], kk % 2)
            pr = sum(p_ring[c, w, T.min(r, n - 1)] for w in range(1, W)) + p_ring[c, 0, T.min(r, n - 1)]
            T.barrier_arrive(pfree[c])
            gz = _grad_z(r, n, M, T.sigmoid(a * s * m + b), pr, gp, gr)
            gmix = s * a * gz
            hi = T.cast(gmix, "bfloat16")
            GMix[tok, 0, r] = hi
            GMix[tok, 1, r] = T.cast(gmix - T.cast(hi, "float32"), "bfloat16")
            for g in T.unroll(3):
                qv[g] = T.if_then_else(grp == g, gz * m, T.float32(0))
                for o in T.unroll(5):
                    qv[g] += T.shfl_xor(qv[g], 16 >> o)
            if lane < M:
                Terms[tok, lane] = gz
            elif lane < M + 3:
                Terms[tok, lane] = s * T.if_then_else(lane == M, qv[0], T.if_then_else(lane == M + 1, qv[1], qv[2]))
            if lane == 0:
                Coef[tok, 0] = _x_coef(Alpha[0] * qv[0] + Alpha[1] * qv[1] + Alpha[2] * qv[2], s, n, D)
            elif lane < CW:
                Coef[tok, lane] = T.if_then_else(lane <= n, hp, T.float32(0))
            T.call_extern("handle", "mhc_fence_acq_rel")  # each writing lane: its stores first
            T.sync_warp()
            if lane == 0:
                T.call_extern("handle", "mhc_publish", T.address_of(Ready[tok // block_t]))

    @T.macro
    def grad_role(PhiHi, PhiLo, GradX, PartPhiT, x_ring, g_ring, gmh_ring, gml_ring, coef_ring, phi_hi, phi_lo, full,
                  free, rowq, gx, gphi, tx, first, tiles, d0, by):
        """The consumer warpgroups, the grad role: per token tile grad_x = g_mix @ phi + c * x + h_pre (x) g_in on
        the tensor cores, formed in place of the x tile and stored from there by TMA; grad_phi^T += x^T @
        g_mix in registers, written once at the end."""
        for r, k in T.Parallel(NP, bk):
            ok = r < NG
            col = d0 + k % block_d
            phi_hi[r, k] = T.if_then_else(ok, PhiHi[T.min(r, NG - 1), k // block_d, col], T.bfloat16(0))
            phi_lo[r, k] = T.if_then_else(ok, PhiLo[T.min(r, NG - 1), k // block_d, col], T.bfloat16(0))
        T.clear(gphi)
        for it in T.serial(tiles):
            st = stage(it)
            t0 = (first + it) * block_t
            T.barrier_wait(full[st], phase(it))
            T.wgmma_gemm(gmh_ring[st, :, :], phi_hi, gx, clear_accum=True)
            T.wgmma_gemm(gml_ring[st, :, :], phi_hi, gx)
            T.wgmma_gemm(gmh_ring[st, :, :], phi_lo, gx)
            T.wgmma_gemm(x_ring[st, :, :], gmh_ring[st, :, :], gphi, transpose_A=True, policy=T.GemmWarpPolicy.FullRow)
            T.wgmma_gemm(x_ring[st, :, :], gml_ring[st, :, :], gphi, transpose_A=True, policy=T.GemmWarpPolicy.FullRow)
            T.wait_wgmma(0)
            for t, k in T.Parallel(block_t, bk):
                h_in_term = (coef_ring[st, t, 1 + k // block_d] * T.cast(g_ring[st, t, k % block_d], "float32")
                             if has_g_in else T.float32(0))
                gx[t, k] += coef_ring[st, t, 0] * T.cast(x_ring[st, t, k], "float32") + h_in_term
            T.sync_threads(1, 256)
            if tx == 0:  # the tiles done, for this CTA's row role (`mhc_throttle`)
                T.call_extern("handle", "mhc_set_volatile", T.address_of(rowq[QR]), it + 1)
            T.copy(gx, x_ring[st, :, :])
            T.fence_proxy_async()
            T.sync_threads(1, 256)
            for i in streams:
                if tx // 32 == i:
                    T.tma_copy(x_ring[st, :, i * block_d:(i + 1) * block_d],
                               GradX[t0:t0 + block_t, i, d0:d0 + block_d], leader_scope_threads=32,
                               eviction_policy="evict_first")
            T.tma_store_wait(1)
            if it > 0:
                T.barrier_arrive(free[stage(it - 1)])
        T.tma_store_wait(0)
        if tiles > 0:
            T.barrier_arrive(free[stage(tiles - 1)])
        for k, r in T.Parallel(bk, NP):
            PartPhiT[by, k // block_d, d0 + k % block_d, r] = gphi[k, r]

    @T.prim_func
    def mhc_pre_bwd_one_pass(
        X: T.Tensor((num_tokens, n, D), "bfloat16"),
        PhiHi: T.Tensor((NG, n, Dp), "bfloat16"),
        PhiLo: T.Tensor((NG, n, Dp), "bfloat16"),
        Alpha: T.Tensor((3,), "float32"),
        Bias: T.Tensor((M,), "float32"),
        InvRms: T.Tensor((num_tokens,), "float32"),
        HPre: T.Tensor((num_tokens, n), "float32"),
        HMix: T.Tensor((num_tokens, M), "float32"),
        GIn: T.Tensor((rows_in, D), "bfloat16"),
        GPost: T.Tensor((rows_post, n), "float32"),
        GRes: T.Tensor((rows_res, n * n), "float32"),
        GMix: T.Tensor((num_tokens, 2, NP), "bfloat16"),
        Coef: T.Tensor((num_tokens, CW), "float32"),
        Ready: T.Tensor((T.ceildiv(num_tokens, block_t),), "int32"),
        Claim: T.Tensor((token_groups + 1,), "int32"),
        Terms: T.Tensor((num_tokens, M + 3), "float32"),
        GradX: T.Tensor((num_tokens, n, D), "bfloat16"),
        PartPhiT: T.Tensor((token_groups, n, Dc, NP), "float32"),
    ):
        with T.Kernel(slices, token_groups, threads=_OP_THREADS, prelude=_SYNC_SRC) as (bx, by):
            d0 = bx * block_d
            x_ring = T.alloc_shared((num_stages, block_t, bk), "bfloat16")
            g_ring = T.alloc_shared((num_stages, block_t, block_d), "bfloat16")
            gmh_ring = T.alloc_shared((num_stages, block_t, NP), "bfloat16")  # g_mix's bf16 hi and lo parts
            gml_ring = T.alloc_shared((num_stages, block_t, NP), "bfloat16")
            coef_ring = T.alloc_shared((num_stages, block_t, CW), "float32")
            phi_hi = T.alloc_shared((NP, bk), "bfloat16")
            phi_lo = T.alloc_shared((NP, bk), "bfloat16")
            rx = T.alloc_shared((row_slots, n, _ROW_COLS), "bfloat16")
            rg = T.alloc_shared((row_slots, _ROW_COLS), "bfloat16")
            p_ring = T.alloc_shared((C, W, 4), "float32")  # a token's partial dots, per dot warp
            # The claimed rows' tokens (-1: end mark), then the grad role's count of finished tiles.
            rowq = T.alloc_shared((QR + 1,), "int32")
            pfull = T.alloc_barrier([32 * W] * C)
            pfree = T.alloc_barrier([32] * C)
            full = T.alloc_barrier([32] * num_stages)
            free = T.alloc_barrier([256] * num_stages)
            rfull = T.alloc_barrier([32] * row_slots)
            rfree = T.alloc_barrier([32] * row_slots)
            qfull = T.alloc_barrier([32] * QR)  # the load warp announced a row
            qfree = T.alloc_barrier([32 * (W + 1)] * QR)  # the dot warps and the row's coefficient warp read it
            gx = T.alloc_fragment((block_t, bk), "float32")
            gphi = T.alloc_fragment((bk, NP), "float32")
            acc = T.alloc_local((n,), "float32")
            qv = T.alloc_local((3,), "float32")
            gv = T.alloc_local((8,), "bfloat16")
            xv = T.alloc_local((8,), "bfloat16")
            tv = T.alloc_local((1,), "int32")
            last = T.alloc_local((1,), "int32")
            cur = T.alloc_local((1,), "int32")
            tx = T.get_thread_binding()
            all_tiles = T.ceildiv(num_tokens, block_t)
            per_group = T.ceildiv(all_tiles, token_groups)
            first = by * per_group
            tiles = T.max(T.min(per_group, all_tiles - first), 0)
            g_lo = first * block_t
            g_len = T.max(T.min(tiles * block_t, num_tokens - g_lo), 0)
            if tx == 0:
                rowq[QR] = 0
            T.sync_threads()

            if tx >= 256:
                T.set_max_nreg(56, 0)
                if tx < 288:  # warp 8: the grad role's loads
                    grad_loads(X, GIn, GMix, Coef, Ready, x_ring, g_ring, gmh_ring, gml_ring, coef_ring, full, free,
                               first, tiles, d0)
                elif tx < 320:  # warp 9: the row role's claims and loads, at most ~`lag` tiles ahead of the grad role
                    row_loads(X, GIn, Claim, rx, rg, rfull, rfree, rowq, qfull, qfree, last, cur, tx, g_lo, g_len, by)
                elif tx < 320 + 32 * W:  # warps 10..: the row role's dots, chunk u by warp u % W
                    row_dots(rx, rg, p_ring, pfull, pfree, rfull, rfree, rowq, qfull, qfree, acc, gv, xv, tv, tx, g_len)
                elif tx < 320 + 32 * (W + C):  # the row role's coefficients, rows dealt round robin, published
                    row_coefficients(Alpha, Bias, InvRms, HPre, HMix, GPost, GRes, GMix, Coef, Ready, Terms, p_ring,
                                     pfull, pfree, rowq, qfull, qfree, qv, tv, tx, g_len)
            else:  # consumer warpgroups: the grad role
                T.set_max_nreg(200, 1)
                grad_role(PhiHi, PhiLo, GradX, PartPhiT, x_ring, g_ring, gmh_ring, gml_ring, coef_ring, phi_hi, phi_lo,
                          full, free, rowq, gx, gphi, tx, first, tiles, d0, by)

            # The grid's last CTA zeroes the counters: the next launch on these buffers starts afresh.
            T.sync_threads()
            if tx == 0:
                rowq[0] = T.call_extern("int32", "mhc_arrive_exit", T.address_of(Claim[token_groups]),
                                        slices * token_groups)
            T.sync_threads()
            if rowq[0] == 1:
                for i in T.serial(T.ceildiv(all_tiles, _OP_THREADS)):
                    if i * _OP_THREADS + tx < all_tiles:
                        Ready[i * _OP_THREADS + tx] = 0
                if tx <= token_groups:
                    Claim[tx] = 0

    return mhc_pre_bwd_one_pass
