"""The backward's two kernels (n = 6, 8, and D too wide for the one pass's resident grid; x is read twice).

1. `mhc_pre_bwd_stats` (one CTA per tile of tokens, streaming over D): recomputes h_mix = x @ phi^T with
   the tensor cores (phi as bf16 hi + lo parts, x exact in bf16, as the forward), the dots p = g_in . x_i,
   and from them per token g_mix = d loss / d h_mix [NP], the coefficients [c, h_pre] of x and g_in in
   grad_x (c = -g_s * inv_rms^3 / (n*D)), g_z = d loss / d pre-activation (grad_bias terms) and the three
   grad_alpha terms.
2. `mhc_pre_bwd_grad` (one CTA per D-slice and token group, streaming over tokens): grad_x = g_mix @ phi
   + c * x + h_pre (x) g_in from one read of the x and g_in tiles, and grad_phi^T += x^T @ g_mix on the
   same tiles (a GEMM whose K is the token dimension). phi's slice stays in shared memory for the whole
   token stream; each CTA keeps its grad_phi slice in registers and writes it once.

Every tile of the pipelined loops is one whole shared buffer loaded by one bulk (TMA) copy from a 2D
view (x as [tokens, n*D]), so TileLang's warp-specialized producer prefetches it, guarded by that
buffer's own full / empty barriers. A copy that cannot be TMA (a row not a multiple of 16 bytes, such
as h_pre's [block_t, n] for n = 1, 2, 3, 6) must stay out of these loops: TileLang 0.1.15 issues it
under the first TMA buffer's empty barrier, which the consumers release when done with that buffer,
not after their last read of the copy's destination, so the next tile's copy overwrites it while it
is still read. Hence the grad kernel's per-token coefficients [c, h_pre] come as one fp32 tensor with
16-byte rows, written by the stats kernel.

TileLang releases a TMA tile to its producer right after the tile's last reader, and ptxas may issue
that release while shared loads of the tile are still in flight if their values are only used later
(the next tile's TMA write then overtakes them: wrong values, timing-dependent). So the stats kernel's
register-only readers of its tiles (the dots) end in a proxy fence (`fence.proxy.async`: generic-proxy
accesses ordered before later async-proxy ones, such as the next tile's TMA write) placed before every
release; the grad kernel's epilogue ends in stores.

g_mix and phi are split into bf16 hi + lo parts for the tensor cores: hi*hi + hi*lo + lo*hi keeps
~16 mantissa bits, more than TF32."""

from ...common import runtime  # noqa: F401  (the kernel cache dir before TileLang is imported)
from ..tiling import _coef_cols, _dims, _round_up
from .bwd_terms import _alpha_group, _grad_z, _x_coef

import tilelang.language as T  # noqa: E402


def mhc_pre_bwd_stats_kernel(n: int, D: int, has_g_in: bool = True, has_g_post: bool = True,
                             has_g_res: bool = True, block_t: int = 64, block_d: int = 64,
                             num_stages: int = 2, threads: int = 256):
    """Per-token backward scalars (module docstring, step 1). An absent output gradient is a [1, ...]
    placeholder that is never read."""
    M, NG, NP, Dp, Dc = _dims(n, D, block_d)
    num_tokens = T.dynamic("num_tokens")
    rows_in, rows_post, rows_res = (num_tokens if has else 1 for has in (has_g_in, has_g_post, has_g_res))
    CW = _coef_cols(n)
    streams = tuple(range(n))  # a Python tuple: the loops over it unroll while tracing
    coef_cols = tuple(range(1, CW))

    @T.prim_func
    def mhc_pre_bwd_stats(
        X: T.Tensor((num_tokens, n * D), "bfloat16"),
        PhiHL: T.Tensor((2 * NG, n * Dp), "bfloat16"),
        Alpha: T.Tensor((3,), "float32"),
        Bias: T.Tensor((M,), "float32"),
        InvRms: T.Tensor((num_tokens,), "float32"),
        HPre: T.Tensor((num_tokens, n), "float32"),
        GIn: T.Tensor((rows_in, D), "bfloat16"),
        GPost: T.Tensor((rows_post, n), "float32"),
        GRes: T.Tensor((rows_res, n * n), "float32"),
        GMix: T.Tensor((num_tokens, NP), "float32"),
        Coef: T.Tensor((num_tokens, CW), "float32"),
        Terms: T.Tensor((num_tokens, M + 3), "float32"),
    ):
        with T.Kernel(T.ceildiv(num_tokens, block_t), threads=threads) as bx:
            t0 = bx * block_t
            # One tile per stream, each a whole buffer, so that every load is one bulk (TMA) copy.
            xs = [T.alloc_shared((block_t, block_d), "bfloat16") for _ in streams]
            phs = [T.alloc_shared((2 * NG, block_d), "bfloat16") for _ in streams]  # [hi; lo] rows
            gs = T.alloc_shared((block_t, block_d), "bfloat16")
            mix2 = T.alloc_fragment((block_t, 2 * NG), "float32")  # h_mix = sum of the two halves
            mix2_s = T.alloc_shared((block_t, 2 * NG), "float32")
            # g_z * h_mix by alpha group (n*n columns each), padded so that its clear spans whole
            # rounds of the threads (64 x 27 for n = 3 does not lower).
            q_s = T.alloc_shared((block_t, _round_up(3 * n * n, 4)), "float32")
            qsum_s = T.alloc_shared((block_t, 3), "float32")

            T.clear(mix2)
            if has_g_in:  # p = g_in . x_i, accumulated per element, reduced over D at the end
                dots = [T.alloc_fragment((block_t, block_d), "float32") for _ in streams]
                p = T.alloc_fragment((block_t,), "float32")
                p_s = T.alloc_shared((n, block_t), "float32")
                for i in streams:
                    T.clear(dots[i])
            for kd in T.Pipelined(Dc // block_d, num_stages=num_stages):
                d0 = kd * block_d
                # Past D a stream's tile reads the next stream's x: phi's padded columns and g_in's
                # zero fill (out of bounds) cancel it.
                for i in streams:
                    T.copy(X[t0:t0 + block_t, i * D + d0:i * D + d0 + block_d], xs[i])
                    T.copy(PhiHL[:, i * Dp + d0:i * Dp + d0 + block_d], phs[i])
                if has_g_in:
                    T.copy(GIn[t0:t0 + block_t, d0:d0 + block_d], gs)
                    # The dots and then a proxy fence, before any tile's release (module docstring). The
                    # loop of one makes them one statement: TileLang releases gs right after its last
                    # reader, which would otherwise put the release between the dots and the fence.
                    for _ in T.serial(1):
                        for i in streams:
                            for t, d in T.Parallel(block_t, block_d):
                                dots[i][t, d] += T.cast(xs[i][t, d], "float32") * T.cast(gs[t, d], "float32")
                        T.fence_proxy_async()
                for i in streams:
                    T.gemm(xs[i], phs[i], mix2, transpose_B=True)

            if has_g_in:
                for i in streams:
                    T.reduce_sum(dots[i], p, dim=1)
                    for t in T.Parallel(block_t):
                        p_s[i, t] = p[t]
            T.copy(mix2, mix2_s)
            T.clear(q_s)
            # d loss / d pre-activation per (token, row of phi), and d loss / d h_mix.
            for t, r in T.Parallel(block_t, NP):
                tok = t0 + t
                ok = tok < num_tokens
                s = T.if_then_else(ok, InvRms[T.min(tok, num_tokens - 1)], T.float32(0))
                grp = _alpha_group(r, n)
                a = Alpha[grp]
                m = T.if_then_else(r < M, mix2_s[t, T.min(r, NG - 1)] + mix2_s[t, NG + T.min(r, NG - 1)], T.float32(0))
                sig = T.sigmoid(a * s * m + Bias[T.min(r, M - 1)])
                p = p_s[T.min(r, n - 1), t] if has_g_in else T.float32(0)
                gp = GPost[T.min(tok, rows_post - 1), T.clamp(r - n, 0, n - 1)] if has_g_post else T.float32(0)
                gr = GRes[T.min(tok, rows_res - 1), T.clamp(r - 2 * n, 0, n * n - 1)] if has_g_res else T.float32(0)
                gz = T.if_then_else(ok, _grad_z(r, n, M, sig, p, gp, gr), T.float32(0))
                if ok:
                    GMix[tok, r] = s * a * gz
                    if r < M:
                        Terms[tok, r] = gz
                        q_s[t, grp * n * n + T.if_then_else(grp == 2, r - 2 * n, r - grp * n)] = gz * m
            for t, g in T.Parallel(block_t, 3):
                qsum_s[t, g] = sum(q_s[t, g * n * n + r] for r in range(n * n))
            for t in T.Parallel(block_t):
                tok = t0 + t
                if tok < num_tokens:
                    s = InvRms[tok]
                    g_s = Alpha[0] * qsum_s[t, 0] + Alpha[1] * qsum_s[t, 1] + Alpha[2] * qsum_s[t, 2]
                    Coef[tok, 0] = _x_coef(g_s, s, n, D)
                    for j in coef_cols:
                        Coef[tok, j] = HPre[tok, j - 1] if j <= n else T.float32(0)
                    for g in T.unroll(3):
                        Terms[tok, M + g] = s * qsum_s[t, g]

    return mhc_pre_bwd_stats


def mhc_pre_bwd_grad_kernel(n: int, D: int, has_g_in: bool = True, token_groups: int = 4,
                            block_t: int = 64, block_d: int = 64, num_stages: int = 1, threads: int = 256):
    """grad_x and per-token-group grad_phi^T partials (module docstring, step 2)."""
    M, NG, NP, Dp, Dc = _dims(n, D, block_d)
    bk = n * block_d
    num_tokens = T.dynamic("num_tokens")
    rows_in = num_tokens if has_g_in else 1
    CW = _coef_cols(n)
    streams = tuple(range(n))  # a Python tuple: the loops over it unroll while tracing

    @T.prim_func
    def mhc_pre_bwd_grad(
        X: T.Tensor((num_tokens, n * D), "bfloat16"),
        PhiHi: T.Tensor((NG, n, Dp), "bfloat16"),
        PhiLo: T.Tensor((NG, n, Dp), "bfloat16"),
        GIn: T.Tensor((rows_in, D), "bfloat16"),
        GMix: T.Tensor((num_tokens, NP), "float32"),
        Coef: T.Tensor((num_tokens, CW), "float32"),
        GradX: T.Tensor((num_tokens, n, D), "bfloat16"),
        PartPhiT: T.Tensor((token_groups, n, Dc, NP), "float32"),
    ):
        with T.Kernel(Dc // block_d, token_groups, threads=threads) as (bx, by):
            d0 = bx * block_d
            # Per-stream tiles land by bulk (TMA) copies; x^T @ g_mix wants them side by side in xs.
            xs_i = [T.alloc_shared((block_t, block_d), "bfloat16") for _ in streams]
            xs = T.alloc_shared((block_t, bk), "bfloat16")
            gs = T.alloc_shared((block_t, block_d), "bfloat16")
            gm_s = T.alloc_shared((block_t, NP), "float32")
            coef_s = T.alloc_shared((block_t, CW), "float32")  # [c, h_pre] per token
            # g_mix as [hi | lo | hi] against phi as [hi; hi; lo]: one K = 3*NP product.
            gm3_s = T.alloc_shared((block_t, 3 * NP), "bfloat16")
            phi3_s = T.alloc_shared((3 * NP, bk), "bfloat16")
            gmhi_s = T.alloc_shared((block_t, NP), "bfloat16")
            gmlo_s = T.alloc_shared((block_t, NP), "bfloat16")
            gx = T.alloc_fragment((block_t, bk), "float32")
            gphi_hi = T.alloc_fragment((bk, NP), "float32")
            gphi_lo = T.alloc_fragment((bk, NP), "float32")

            for r, k in T.Parallel(NP, bk):
                ok = r < NG
                hi = T.if_then_else(ok, PhiHi[T.min(r, NG - 1), k // block_d, d0 + k % block_d], T.bfloat16(0))
                lo = T.if_then_else(ok, PhiLo[T.min(r, NG - 1), k // block_d, d0 + k % block_d], T.bfloat16(0))
                phi3_s[r, k] = hi
                phi3_s[NP + r, k] = hi
                phi3_s[2 * NP + r, k] = lo
            T.clear(gphi_hi)
            T.clear(gphi_lo)
            tiles = T.ceildiv(T.ceildiv(num_tokens, block_t), token_groups)
            for it in T.Pipelined(tiles, num_stages=num_stages):
                t0 = (by * tiles + it) * block_t
                # In the order the consumers free the tiles (x after its copy into xs, g_mix after its
                # split, g_in and the coefficients after the epilogue): the producer waits for each
                # free slot in program order, so a tile freed late must not hold back the others.
                for i in streams:  # past D a tile reads the next stream: those columns are dropped
                    T.copy(X[t0:t0 + block_t, i * D + d0:i * D + d0 + block_d], xs_i[i])
                T.copy(GMix[t0:t0 + block_t, :], gm_s)
                if has_g_in:
                    T.copy(GIn[t0:t0 + block_t, d0:d0 + block_d], gs)
                T.copy(Coef[t0:t0 + block_t, :], coef_s)
                for i in streams:
                    T.copy(xs_i[i], xs[:, i * block_d:(i + 1) * block_d])
                for t, r in T.Parallel(block_t, NP):
                    hi = T.cast(gm_s[t, r], "bfloat16")
                    lo = T.cast(gm_s[t, r] - T.cast(hi, "float32"), "bfloat16")
                    gm3_s[t, r] = hi
                    gm3_s[t, NP + r] = lo
                    gm3_s[t, 2 * NP + r] = hi
                    gmhi_s[t, r] = hi
                    gmlo_s[t, r] = lo
                T.gemm(gm3_s, phi3_s, gx, clear_accum=True)
                T.gemm(xs, gmhi_s, gphi_hi, transpose_A=True)
                T.gemm(xs, gmlo_s, gphi_lo, transpose_A=True)
                for t, k in T.Parallel(block_t, bk):
                    tok = t0 + t
                    i = k // block_d
                    d = d0 + k % block_d
                    h_in_term = coef_s[t, 1 + i] * T.cast(gs[t, k % block_d], "float32") if has_g_in else T.float32(0)
                    val = gx[t, k] + coef_s[t, 0] * T.cast(xs[t, k], "float32") + h_in_term
                    if tok < num_tokens and d < D:
                        GradX[tok, i, d] = T.cast(val, "bfloat16")
            for k, r in T.Parallel(bk, NP):
                PartPhiT[by, k // block_d, d0 + k % block_d, r] = gphi_hi[k, r] + gphi_lo[k, r]

    return mhc_pre_bwd_grad
