"""mHC pre backward (`MHCBackwardPreTileLang`) and the differentiable `mhc_pre`.

The math (golden/mhc_pre_bwd.py): per token, the gradient of x first needs reductions over the whole
token, p = g_in . x_i (n dots over D) and g_s = u . h_mix (u from p and the other output gradients),
so x has to be seen twice. Two ways:

One pass (`mhc_pre_bwd_one_pass`, n <= 4 where every (D-slice, token group) CTA fits the GPU at once):
the grad role below, and in the same CTA a row role that owns whole token rows, reads them from memory a
few tiles ahead, reduces their dots, turns them into the coefficients below (from the forward's saved
h_mix, so no GEMM) and publishes them per tile; the grad roles of every slice wait for that count and
re-read x and g_in from L2, so memory sees them once (docs/perf.md, twenty-fifth session).

Two kernels (n = 6, 8, and D too wide for the one pass's resident grid):

1. `stats` (one CTA per tile of tokens, streaming over D): recomputes h_mix = x @ phi^T with the tensor
   cores (phi as bf16 hi + lo parts, x exact in bf16, as the forward), the dots p, and from them per
   token g_mix = d loss / d h_mix [NP], the coefficients [c, h_pre] of x and g_in in grad_x
   (c = -g_s * inv_rms^3 / (n*D)), g_z = d loss / d pre-activation (grad_bias terms) and the three
   grad_alpha terms.
2. `grad` (one CTA per D-slice and token group, streaming over tokens): grad_x = g_mix @ phi
   + c * x + h_pre (x) g_in from one read of the x and g_in tiles, and grad_phi^T += x^T @ g_mix on the
   same tiles (a GEMM whose K is the token dimension). phi's slice stays in shared memory for the whole
   token stream; each CTA keeps its grad_phi slice in registers and writes it once. The one pass's grad
   role is this kernel warp-specialized: a producer warp streams whole token tiles by TMA three deep, grad_x
   is formed in place of the x tile and stored from there by TMA (2.0-2.3x `mhc_pre_bwd_grad`, TileLang's
   own pipeline, which the two kernels use).

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
(the next tile's TMA write then overtakes them: wrong values, timing-dependent; see docs/perf.md). So
the stats kernel's register-only readers of its tiles (the dots) end in a proxy fence
(`fence.proxy.async`: generic-proxy accesses ordered before later async-proxy ones, such as the next
tile's TMA write) placed before every release, as do the one pass's dot warps; the pipelined grad kernel's
epilogue ends in stores (the one pass's grad role hands a stage back only after a barrier and its TMA
stores' reads).

Token reductions (grad_phi over token groups, grad_bias, grad_alpha over tokens) are sums of per-CTA,
per-coefficient-warp (one pass) or per-token (stats kernel) partials in a fixed order: bitwise reproducible, no
float atomics. grad_phi's partials are summed and transposed by one small kernel (`phi_sum`).
g_mix and phi are split into bf16 hi + lo parts for the tensor cores: hi*hi + hi*lo + lo*hi keeps
~16 mantissa bits, more than TF32.
"""

import torch

from ._runtime import check_int, check_tensor, compile_kernel, resolve_config, sm_count
from .mhc_pre import (_D_PAD, _SMEM_BUDGET, MHCForwardPreTileLang, _round_up, mhc_phi_split_kernel,
                      phi_split_rows)

import tilelang.language as T  # noqa: E402  (after _runtime set the cache dir)


def _dims(n: int, D: int, block_d: int):
    """M rows of phi; NG = phi_split_rows(n) and Dp = D padded to _D_PAD: the layout
    [NG, n, Dp] of the forward's phi split, reused here; NP = M padded to 32 for g_mix as a tensor-core
    operand (K multiple of 16, >= 64-byte rows as the MN-major operand of grad_phi); Dc = D padded to
    block_d (the D-chunks the kernels walk; block_d divides _D_PAD, so Dc <= Dp)."""
    M = n * n + 2 * n
    return M, phi_split_rows(n), _round_up(M, 32), _round_up(D, _D_PAD), _round_up(D, block_d)


def _coef_cols(n: int) -> int:
    """Columns of the per-token coefficients [c, h_pre[0..n-1], zeros]: rows of a multiple of 16 bytes
    (a TMA box row)."""
    return _round_up(n + 1, 4)


def _alpha_group(r, n: int):
    """The alpha that scales row r of phi: 0 (h_pre rows), 1 (h_post rows), 2 (h_res rows)."""
    return T.if_then_else(r < n, 0, T.if_then_else(r < 2 * n, 1, 2))


def _grad_z(r, n: int, M: int, sig, p, g_post, g_res):
    """d loss / d pre-activation z of row r (golden's g_z), sig = sigmoid(z); zero for the padding rows."""
    return T.if_then_else(r < n, p * sig * (1 - sig), T.if_then_else(
        r < 2 * n, 2 * g_post * sig * (1 - sig), T.if_then_else(r < M, g_res, T.float32(0))))


def _x_coef(g_s, s, n: int, D: int):
    """c, the coefficient of x in grad_x: d loss / d inv_rms times d inv_rms / d x = -s^3 x / (n*D)."""
    return -g_s * s * s * s / (n * D)


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


def mhc_pre_bwd_phi_sum_kernel(n: int, D: int, token_groups: int, block_d: int, cols: int = 64,
                               threads: int = 128):
    """grad_phi [M, n*D] from the grad kernels' per-token-group partials of its transpose, summed in group
    order (deterministic); through shared memory so that both the reads and the writes are whole rows."""
    M, _, NP, _, Dc = _dims(n, D, block_d)

    @T.prim_func
    def mhc_pre_bwd_phi_sum(
        PartPhiT: T.Tensor((token_groups, n, Dc, NP), "float32"),
        GradPhi: T.Tensor((M, n * D), "float32"),
    ):
        with T.Kernel(T.ceildiv(D, cols), n, threads=threads) as (bx, i):
            k0 = bx * cols
            tile = T.alloc_shared((cols, NP), "float32")
            for k, r in T.Parallel(cols, NP):
                kk = T.min(k0 + k, Dc - 1)
                tile[k, r] = sum((PartPhiT[g, i, kk, r] for g in range(1, token_groups)), PartPhiT[0, i, kk, r])
            for r, k in T.Parallel(M, cols):
                if k0 + k < D:
                    GradPhi[r, i * D + k0 + k] = tile[k, r]

    return mhc_pre_bwd_phi_sum


_OP_BLOCK = 64  # tokens per tile and bf16 columns per stream of a D-slice (one 128-byte swizzle band)
_OP_THREADS = 512  # two consumer warpgroups; warps 8 (grad loads), 9 (row loads), 10-11 (dots), 12-15 (coefficients)
_DOT_WARPS, _COEF_WARPS = 2, 4
_ROW_COLS = 512  # columns of every stream per row chunk (two 256-column TMA boxes)
_ROW_SLOTS = 8  # row chunks in flight per CTA (40 KB at n = 4; 12 or 16 were no faster, docs/perf.md)
# The row role runs at most `lag` token tiles ahead of the grad role, and the rows it read stay in L2 until their
# re-read: the largest lag <= 8 whose rows fit this budget. More lag hides the exchange, but held rows past ~35 MiB
# start to miss L2 (H200, twenty-sixth session: at D = 4096 lag 6-7 beat 8 by 3%, at D = 7168 lag 8 beat 7).
_ROW_L2_BUDGET = 36 << 20
# A stage is handed back one tile after its own (once its grad_x stores have read it): with one stage the
# producer would wait for a release that comes only after the next tile has landed.
_OP_MIN_STAGES = 2

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
"""


def _slices(D: int) -> int:
    """The one pass's D-slices: one CTA each per token group."""
    return -(-D // _OP_BLOCK)


def _lag(n: int, D: int, token_groups: int) -> int:
    """Token tiles the one pass's row role may run ahead of its grad role (_ROW_L2_BUDGET). A resident grid
    holds at most sm_count() * 64 columns, so one tile's rows stay near 5 MB on 132 SMs and the lag at 6 or more."""
    tile_rows = token_groups * _OP_BLOCK * (n + 1) * D * 2  # x and g_in of one token tile of every group
    return min(8, _ROW_L2_BUDGET // tile_rows)


def one_pass(n: int, D: int) -> bool:
    """Whether the backward runs as one pass (`mhc_pre_bwd_one_pass`): n <= 4 (its rings fit shared memory)
    and one CTA per D-slice fits the GPU at once (D <= 8448 on 132 SMs), since the CTAs wait on each other."""
    return n <= 4 and _slices(D) <= sm_count()


def mhc_pre_bwd_one_pass_kernel(n: int, D: int, has_g_in: bool = True, has_g_post: bool = True,
                                has_g_res: bool = True, token_groups: int = 2, num_stages: int = 3):
    """The whole backward in one launch for n <= 4 (module docstring): grad_x, per-token-group grad_phi^T
    partials and the g_z / grad_alpha terms summed per coefficient warp (M + 3 <= 27 lanes). One persistent
    CTA per (D-slice, token group), all resident. Its grad role streams token tiles of its slice (x, g_in,
    g_mix, coefficients) by TMA into a ring of `num_stages` for two consumer warpgroups; its row role owns
    whole token rows (group start + slice + k * slices), reads them from memory `_lag` tiles ahead, reduces
    their dots, turns them into the coefficients and publishes them per tile, so the grad roles of every
    slice re-read x and g_in from L2."""
    block_t = block_d = _OP_BLOCK
    M, NG, NP, Dp, Dc = _dims(n, D, block_d)
    bk = n * block_d
    slices = Dc // block_d
    chunks = -(-D // _ROW_COLS)
    C, W, lag, row_slots = _COEF_WARPS, _DOT_WARPS, _lag(n, D, token_groups), _ROW_SLOTS
    num_tokens = T.dynamic("num_tokens")
    rows_in, rows_post, rows_res = (num_tokens if has else 1 for has in (has_g_in, has_g_post, has_g_res))
    CW = _coef_cols(n)
    streams = tuple(range(n))  # a Python tuple: the loops over it unroll while tracing

    def stage(it):
        return it % num_stages

    def phase(it):
        return (it // num_stages) % 2

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
        Terms: T.Tensor((token_groups * slices * C, M + 3), "float32"),
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
            pfull = T.alloc_barrier([32 * W] * C)
            pfree = T.alloc_barrier([32] * C)
            full = T.alloc_barrier([32] * num_stages)
            free = T.alloc_barrier([256] * num_stages)
            rfull = T.alloc_barrier([32] * row_slots)
            rfree = T.alloc_barrier([32] * row_slots)
            cfull = T.alloc_barrier([32] * lag)
            cfree = T.alloc_barrier([256] * lag)
            gx = T.alloc_fragment((block_t, bk), "float32")
            gphi = T.alloc_fragment((bk, NP), "float32")
            acc = T.alloc_local((n,), "float32")
            qv = T.alloc_local((3,), "float32")
            zt = T.alloc_local((4,), "float32")  # a coefficient warp's sums: g_z of row `lane`, the alpha terms
            gv = T.alloc_local((8,), "bfloat16")
            xv = T.alloc_local((8,), "bfloat16")
            tx = T.get_thread_binding()
            all_tiles = T.ceildiv(num_tokens, block_t)
            per_group = T.ceildiv(all_tiles, token_groups)
            first = by * per_group
            tiles = T.max(T.min(per_group, all_tiles - first), 0)
            g_lo = first * block_t
            g_len = T.max(T.min(tiles * block_t, num_tokens - g_lo), 0)
            nrows = T.if_then_else(g_len > bx, T.ceildiv(g_len - bx, slices), 0)

            if tx >= 256:
                T.set_max_nreg(56, 0)
                if tx < 288:  # warp 8: the grad role's loads
                    for it in T.serial(tiles):
                        st = stage(it)
                        t0 = (first + it) * block_t
                        T.barrier_wait(cfull[it % lag], (it // lag) % 2)
                        T.barrier_wait(free[st], phase(it) ^ 1)
                        for i in streams:
                            T.tma_copy(X[t0:t0 + block_t, i, d0:d0 + block_d],
                                       x_ring[st, :, i * block_d:(i + 1) * block_d], barrier=full[st],
                                       leader_scope_threads=32, eviction_policy="evict_first")
                        if has_g_in:
                            T.tma_copy(GIn[t0:t0 + block_t, d0:d0 + block_d], g_ring[st, :, :], barrier=full[st],
                                       leader_scope_threads=32, eviction_policy="evict_first")
                        # The tile's coefficients come from every slice's row role (a count per tile).
                        T.call_extern("handle", "mhc_wait_count", T.address_of(Ready[first + it]),
                                      T.min(block_t, num_tokens - t0))
                        T.tma_copy(GMix[t0:t0 + block_t, 0, :], gmh_ring[st, :, :], barrier=full[st],
                                   leader_scope_threads=32)
                        T.tma_copy(GMix[t0:t0 + block_t, 1, :], gml_ring[st, :, :], barrier=full[st],
                                   leader_scope_threads=32)
                        T.tma_copy(Coef[t0:t0 + block_t, :], coef_ring[st, :, :], barrier=full[st],
                                   leader_scope_threads=32)
                        T.barrier_arrive(full[st])
                elif tx < 320:  # warp 9: the row role's loads, at most `lag` tiles ahead of the grad role
                    for j in T.serial(tiles):
                        T.barrier_wait(cfree[j % lag], ((j // lag) % 2) ^ 1)
                        if has_g_in:
                            k_lo = T.ceildiv(T.max(j * block_t - bx, 0), slices)
                            k_hi = T.min(T.ceildiv(T.max((j + 1) * block_t - bx, 0), slices), nrows)
                            for k in T.serial(k_hi - k_lo):
                                tok = g_lo + bx + (k_lo + k) * slices
                                for q in T.serial(chunks):
                                    u = (k_lo + k) * chunks + q
                                    sl = u % row_slots
                                    T.barrier_wait(rfree[sl], ((u // row_slots) % 2) ^ 1)
                                    for bb in T.unroll(_ROW_COLS // 256):
                                        c0 = q * _ROW_COLS + bb * 256
                                        T.tma_copy(X[tok, :, c0:c0 + 256], rx[sl, :, bb * 256:(bb + 1) * 256],
                                                   barrier=rfull[sl], leader_scope_threads=32, eviction_policy="evict_last")
                                        T.tma_copy(GIn[tok, c0:c0 + 256], rg[sl, bb * 256:(bb + 1) * 256],
                                                   barrier=rfull[sl], leader_scope_threads=32, eviction_policy="evict_last")
                                    T.barrier_arrive(rfull[sl])
                        T.barrier_arrive(cfull[j % lag])
                elif tx < 320 + 32 * W:  # warps 10..: the row role's dots, chunk u by warp u % W
                    lane = tx % 32
                    w = (tx - 320) // 32
                    for k in T.serial(nrows):
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
                elif tx < 320 + 32 * (W + C):  # the row role's coefficients, tokens dealt round robin, published
                    lane = tx % 32
                    c = (tx - 320 - 32 * W) // 32
                    r = lane  # NP = 32 for n <= 4: lane r owns row r of phi
                    grp = _alpha_group(r, n)
                    a = Alpha[grp]
                    b = Bias[T.min(r, M - 1)]
                    for i in T.unroll(4):
                        zt[i] = T.float32(0)
                    for kk in T.serial(T.ceildiv(T.max(nrows - c, 0), C)):
                        k = c + kk * C
                        tok = g_lo + bx + k * slices
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
                        zt[0] += gz
                        for g in T.unroll(3):
                            qv[g] = T.if_then_else(grp == g, gz * m, T.float32(0))
                            for o in T.unroll(5):
                                qv[g] += T.shfl_xor(qv[g], 16 >> o)
                            zt[1 + g] += s * qv[g]
                        if lane == 0:
                            Coef[tok, 0] = _x_coef(Alpha[0] * qv[0] + Alpha[1] * qv[1] + Alpha[2] * qv[2], s, n, D)
                        elif lane < CW:
                            Coef[tok, lane] = T.if_then_else(lane <= n, hp, T.float32(0))
                        T.call_extern("handle", "mhc_fence_acq_rel")  # each writing lane: its stores first
                        T.sync_warp()
                        if lane == 0:
                            T.call_extern("handle", "mhc_publish", T.address_of(Ready[tok // block_t]))
                    # Summed over this warp's tokens in their fixed order, so the op's sum over warps is
                    # deterministic; a warp without tokens writes zeros.
                    row = (by * slices + bx) * C + c
                    if lane < M:
                        Terms[row, lane] = zt[0]
                    elif lane < M + 3:
                        Terms[row, lane] = T.if_then_else(lane == M, zt[1],
                                                          T.if_then_else(lane == M + 1, zt[2], zt[3]))
            else:  # consumer warpgroups: the grad role
                T.set_max_nreg(200, 1)
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
                    T.barrier_arrive(cfree[it % lag])
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

    return mhc_pre_bwd_one_pass


def grad_kernel(n: int, D: int, has_g_in: bool = True, has_g_post: bool = True, has_g_res: bool = True,
                block_t: int = 64, block_d: int = 64, token_groups: int = 4, num_stages: int = 1):
    """The kernel that writes grad_x for (n, D): the one pass where `one_pass(n, D)`, else the pipelined
    grad kernel (after the stats kernel; it reads no g_post / g_res)."""
    if one_pass(n, D):
        return mhc_pre_bwd_one_pass_kernel(n, D, has_g_in, has_g_post, has_g_res, token_groups, num_stages)
    return mhc_pre_bwd_grad_kernel(n, D, has_g_in, token_groups, block_t, block_d, num_stages)


def _default_config(n: int, D: int) -> dict:
    if one_pass(n, D):  # as many token groups as keep every CTA resident (D = 4096: 2, D = 7168: 1)
        return {"block_t": _OP_BLOCK, "block_d": _OP_BLOCK,
                "token_groups": min(64, sm_count() // _slices(D)), "num_stages": 3}
    # block_d keeps n*block_d a multiple of 64 (the grad_phi product's M over 8 warps) and shared
    # memory in bounds (n = 5 and 7 fit with no block_d, see MHCBackwardPreTileLang). num_stages is the
    # grad kernel's (the tunable one; the stats kernel takes 2 when they fit, see _stats_stages): one
    # stage, as measured; its x tiles are copied out at once, which frees them for the next loads.
    return {"block_t": 64, "block_d": {6: 32, 8: 16}.get(n, 64), "token_groups": 4, "num_stages": 1}


class MHCBackwardPreTileLang:
    """mHC pre backward: ``op(x, phi, alpha, bias, inv_rms, h_pre, h_mix, grad_h_in, grad_h_post,
    grad_h_res) -> (grad_x, grad_phi, grad_alpha, grad_bias)``; see golden/mhc_pre_bwd.py.

    x [B, S, n, D] bf16, phi [n*n+2n, n*D], alpha [3], bias [n*n+2n], and the forward's inv_rms [B, S],
    h_pre [B, S, n] and h_mix [B, S, n*n+2n] (fp32, ``return_aux``; the one pass reads h_mix, the two
    kernels recompute it); output gradients grad_h_in [B, S, D] bf16, grad_h_post [B, S, n] fp32,
    grad_h_res [B, S, n, n] fp32, each may be None (zero, never read). Returns grad_x [B, S, n, D] bf16,
    grad_phi [n*n+2n, n*D], grad_alpha [3], grad_bias [n*n+2n] fp32. B and S are free at call time.
    Kernels for the all-gradients case are built at construction, those for a pattern of absent
    gradients on its first call. n = 5 and 7 are not supported (no tiling fits shared memory).
    """

    op_name = "mhc_pre_bwd"
    DEFAULT_CONFIG = _default_config(4, 4096)
    tunable_kernel = staticmethod(grad_kernel)

    @staticmethod
    def config_space(n: int, D: int, **_) -> list[dict]:
        # block_d and token_groups fix the workspace shapes of tune_args, so they stay at the default.
        base = _default_config(n, D)
        tiles, least = ((64,), _OP_MIN_STAGES) if one_pass(n, D) else ((64, 128), 1)
        return [{**base, "block_t": bt, "num_stages": s} for bt in tiles for s in range(least, 5)
                if _smem_bytes(n, D, bt, base["block_d"], s) <= _smem_limit(n, D)]

    def __init__(self, B: int, S: int, n: int, D: int, config: dict | None = None):
        check_int("B", B, lo=1)
        check_int("S", S, lo=1)
        check_int("n", n, lo=1, hi=8)
        if n in (5, 7):
            raise ValueError(f"n: expected one of 1, 2, 3, 4, 6, 8 (no tiling of the backward fits shared "
                             f"memory for n=5 or 7), got {n}")
        check_int("D", D, lo=8, hi=16384, multiple_of=8)
        self.n, self.D = n, D
        self.spec = {"n": n, "D": D}
        self.config = resolve_config(self.op_name, self.spec, config, _default_config(n, D))
        cfg = self.config
        check_int("config['block_t']", cfg["block_t"], lo=64, hi=128, multiple_of=64)
        check_int("config['block_d']", cfg["block_d"], lo=16, hi=128, power_of_two=True)
        if n * cfg["block_d"] % 64:
            raise ValueError(f"config: n*block_d must be a multiple of 64, got n={n}, block_d={cfg['block_d']}")
        check_int("config['token_groups']", cfg["token_groups"], lo=1, hi=64)
        check_int("config['num_stages']", cfg["num_stages"], lo=1, hi=4)
        if one_pass(n, D):
            if (cfg["block_t"], cfg["block_d"]) != (_OP_BLOCK, _OP_BLOCK):
                raise ValueError(f"config: block_t and block_d must be {_OP_BLOCK} for n={n} (the one-pass kernel), "
                                 f"got {cfg['block_t']} and {cfg['block_d']}")
            if cfg["num_stages"] < _OP_MIN_STAGES:
                raise ValueError(f"config['num_stages']: expected >= {_OP_MIN_STAGES} for n={n} (the one-pass "
                                 f"kernel hands a stage back one tile late), got {cfg['num_stages']}")
            if _slices(D) * cfg["token_groups"] > sm_count():
                raise ValueError(f"config['token_groups']: expected <= {sm_count() // _slices(D)} for "
                                 f"D={D} (the one pass needs every CTA resident), got {cfg['token_groups']}")
        need = _smem_bytes(n, D, cfg["block_t"], cfg["block_d"], cfg["num_stages"])
        if need > _smem_limit(n, D):
            raise ValueError(f"config: {cfg} needs about {need} bytes of shared memory for n={n}, "
                             f"over {_smem_limit(n, D)}")
        self._split = compile_kernel(mhc_phi_split_kernel(n, D))
        self._phi_sum = compile_kernel(mhc_pre_bwd_phi_sum_kernel(n, D, cfg["token_groups"], cfg["block_d"]))
        self._stats, self._grad = {}, {}
        self._kernels(True, True, True)
        self._placeholders = {}

    def _kernels(self, has_g_in: bool, has_g_post: bool, has_g_res: bool):
        """The kernels of a pattern of present gradients: the one pass (built alone), or stats and grad."""
        cfg, n, D = self.config, self.n, self.D
        tiles = {k: cfg[k] for k in ("block_t", "block_d")}
        key = (has_g_in, has_g_post, has_g_res)
        if one_pass(n, D):
            if key not in self._grad:
                self._grad[key] = compile_kernel(grad_kernel(n, D, *key, **cfg))
            return None, self._grad[key]
        if key not in self._stats:
            stages = _stats_stages(n, cfg["block_t"], cfg["block_d"])
            self._stats[key] = compile_kernel(mhc_pre_bwd_stats_kernel(n, D, *key, num_stages=stages, **tiles))
        if has_g_in not in self._grad:
            self._grad[has_g_in] = compile_kernel(grad_kernel(
                n, D, has_g_in, token_groups=cfg["token_groups"], num_stages=cfg["num_stages"], **tiles))
        return self._stats[key], self._grad[has_g_in]

    def check_inputs(self, x, phi, alpha, bias, inv_rms, h_pre, h_mix, grad_h_in=None, grad_h_post=None,
                     grad_h_res=None) -> None:
        n, D, M = self.n, self.D, self.n * self.n + 2 * self.n
        check_tensor("x", x, torch.bfloat16, (None, None, n, D))
        B, S = x.shape[:2]
        dev = x.device
        check_tensor("phi", phi, torch.float32, (M, n * D), device=dev)
        check_tensor("alpha", alpha, torch.float32, (3,), device=dev)
        check_tensor("bias", bias, torch.float32, (M,), device=dev)
        check_tensor("inv_rms", inv_rms, torch.float32, (B, S), device=dev)
        check_tensor("h_pre", h_pre, torch.float32, (B, S, n), device=dev)
        check_tensor("h_mix", h_mix, torch.float32, (B, S, M), device=dev)
        for name, g, dtype, shape in (("grad_h_in", grad_h_in, torch.bfloat16, (B, S, D)),
                                      ("grad_h_post", grad_h_post, torch.float32, (B, S, n)),
                                      ("grad_h_res", grad_h_res, torch.float32, (B, S, n, n))):
            if g is not None:
                check_tensor(name, g, dtype, shape, device=dev)

    def _placeholder(self, device, shape, dtype):
        """A tiny tensor standing in for an absent gradient (the kernel variant never reads it)."""
        key = (device, shape, dtype)
        if key not in self._placeholders:
            self._placeholders[key] = torch.zeros(shape, device=device, dtype=dtype)
        return self._placeholders[key]

    def _launch_args(self, x, phi, alpha, bias, inv_rms, h_pre, h_mix, grad_h_in, grad_h_post, grad_h_res):
        """(stats kernel args, grad kernel args); the one pass has no stats kernel (None)."""
        n, D, cfg = self.n, self.D, self.config
        M, NG, NP, Dp, Dc = _dims(n, D, cfg["block_d"])
        tokens, dev = x.shape[0] * x.shape[1], x.device
        f32 = dict(device=dev, dtype=torch.float32)
        phi_hl = torch.empty(2 * NG, n, Dp, device=dev, dtype=torch.bfloat16)  # [hi; lo]
        phi_hi, phi_lo = phi_hl[:NG], phi_hl[NG:]
        self._split(phi, phi_hi, phi_lo)
        g_in = (self._placeholder(dev, (1, D), torch.bfloat16) if grad_h_in is None
                else grad_h_in.view(tokens, D))
        g_post = self._placeholder(dev, (1, n), torch.float32) if grad_h_post is None else grad_h_post.view(tokens, n)
        g_res = (self._placeholder(dev, (1, n * n), torch.float32) if grad_h_res is None
                 else grad_h_res.view(tokens, n * n))
        coef = torch.empty(tokens, _coef_cols(n), **f32)
        grad_x = torch.empty(tokens, n, D, device=dev, dtype=torch.bfloat16)
        part_phi_t = torch.empty(cfg["token_groups"], n, Dc, NP, **f32)
        if one_pass(n, D):
            g_mix = torch.empty(tokens, 2, NP, device=dev, dtype=torch.bfloat16)  # bf16 hi, lo
            ready = torch.zeros(-(-tokens // _OP_BLOCK), device=dev, dtype=torch.int32)  # per-tile counts
            # One row of terms (g_z of each row of phi, then the three alpha terms) per coefficient warp.
            terms = torch.empty(cfg["token_groups"] * _slices(D) * _COEF_WARPS, M + 3, **f32)
            return None, (x.view(tokens, n, D), phi_hi, phi_lo, alpha, bias, inv_rms.view(tokens), h_pre.view(tokens, n),
                          h_mix.view(tokens, M), g_in, g_post, g_res, g_mix, coef, ready, terms, grad_x, part_phi_t)
        x2, g_mix = x.view(tokens, n * D), torch.empty(tokens, NP, **f32)
        # Each kernel's outputs come last: terms (per token) and (grad_x, part_phi_t).
        stats_args = (x2, phi_hl.view(2 * NG, n * Dp), alpha, bias, inv_rms.view(tokens), h_pre.view(tokens, n),
                      g_in, g_post, g_res, g_mix, coef, torch.empty(tokens, M + 3, **f32))
        return stats_args, (x2, phi_hi, phi_lo, g_in, g_mix, coef, grad_x, part_phi_t)

    def tune_args(self, x, phi, alpha, bias, inv_rms, h_pre, h_mix, grad_h_in=None, grad_h_post=None,
                  grad_h_res=None):
        """Arguments of the grad kernel (the tunable one) for these call inputs; runs the stats kernel
        so that they hold real values. The one pass's per-tile counts are zeroed once here, so only its
        first timed run waits on them."""
        call = (x, phi, alpha, bias, inv_rms, h_pre, h_mix, grad_h_in, grad_h_post, grad_h_res)
        self.check_inputs(*call)
        stats_args, grad_args = self._launch_args(*call)
        stats = self._kernels(*(g is not None for g in call[7:]))[0]
        if stats is not None:
            stats(*stats_args)
        return grad_args

    def __call__(self, x, phi, alpha, bias, inv_rms, h_pre, h_mix, grad_h_in=None, grad_h_post=None,
                 grad_h_res=None):
        call = (x, phi, alpha, bias, inv_rms, h_pre, h_mix, grad_h_in, grad_h_post, grad_h_res)
        self.check_inputs(*call)
        B, S, n, D = x.shape
        M = n * n + 2 * n
        present = tuple(g is not None for g in call[7:])
        if B * S == 0 or not any(present):
            return (torch.zeros_like(x), torch.zeros_like(phi), torch.zeros_like(alpha), torch.zeros_like(bias))
        stats, grad = self._kernels(*present)
        stats_args, grad_args = self._launch_args(*call)
        if stats is not None:
            stats(*stats_args)
        grad(*grad_args)
        terms = grad_args[-3] if stats is None else stats_args[-1]
        grad_x, part_phi_t = grad_args[-2:]
        # Fixed-order sums of the per-group and per-warp (or per-token) partials: deterministic.
        grad_phi = torch.empty(M, n * D, device=x.device, dtype=torch.float32)
        self._phi_sum(part_phi_t, grad_phi)
        sums = terms.sum(0)
        return grad_x.view(B, S, n, D), grad_phi, sums[M:], sums[:M]


_SMEM_LIMIT = 220 * 1024


def _stats_smem(n: int, block_t: int, block_d: int, num_stages: int) -> int:
    """Shared memory of the stats kernel: its TMA tiles once per stage, the epilogue's buffers."""
    _, NG, _, _, _ = _dims(n, block_d, block_d)
    bk = n * block_d
    tiles = block_t * bk * 2 + 2 * NG * bk * 2 + block_t * block_d * 2
    return num_stages * tiles + block_t * (2 * NG + _round_up(3 * n * n, 4) + 3 + n) * 4


def _grad_smem(n: int, block_t: int, block_d: int, num_stages: int) -> int:
    """Shared memory of the grad kernel: its TMA tiles once per stage, then phi's [hi; hi; lo] slice,
    the side-by-side x tile and g_mix's bf16 parts."""
    _, _, NP, _, _ = _dims(n, block_d, block_d)
    bk = n * block_d
    tiles = block_t * (bk * 2 + block_d * 2 + NP * 4 + _coef_cols(n) * 4)
    return num_stages * tiles + 3 * NP * bk * 2 + block_t * bk * 2 + block_t * 5 * NP * 2


def _one_pass_smem(n: int, block_t: int, num_stages: int) -> int:
    """Shared memory of the one pass: the grad role's ring (x, g_in, g_mix's hi and lo, coefficients), phi's
    [hi; lo] slice, the row ring and the dots handed to the coefficient warps."""
    _, _, NP, _, _ = _dims(n, _OP_BLOCK, _OP_BLOCK)
    bk = n * _OP_BLOCK
    stage = block_t * (bk * 2 + _OP_BLOCK * 2 + NP * 2 * 2 + _coef_cols(n) * 4)
    rows = _ROW_SLOTS * (n + 1) * _ROW_COLS * 2
    return num_stages * stage + 2 * NP * bk * 2 + rows + _COEF_WARPS * _DOT_WARPS * 4 * 4


def _stats_stages(n: int, block_t: int, block_d: int) -> int:
    """Two stages for the stats kernel where they fit, else one."""
    return 2 if _stats_smem(n, block_t, block_d, 2) + 2048 <= _SMEM_LIMIT else 1


def _smem_bytes(n: int, D: int, block_t: int, block_d: int, num_stages: int) -> int:
    """Shared memory of the one pass (exact), or of the larger of the two kernels plus slack."""
    if one_pass(n, D):
        return _one_pass_smem(n, block_t, num_stages)
    stats = _stats_smem(n, block_t, block_d, _stats_stages(n, block_t, block_d))
    return max(stats, _grad_smem(n, block_t, block_d, num_stages)) + 2048


def _smem_limit(n: int, D: int) -> int:
    """Hopper's opt-in shared memory per block less slack for the one pass (its model is exact), or the two
    kernels' margin."""
    return _SMEM_BUDGET if one_pass(n, D) else _SMEM_LIMIT


class _MHCPre(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, phi, alpha, bias, rms_eps, hc_eps):
        fwd, bwd = _ops_for(x, rms_eps, hc_eps)
        h_in, h_post, h_res, inv_rms, h_pre, h_mix = fwd(x, phi, alpha, bias, return_aux=True)
        ctx.save_for_backward(x, phi, alpha, bias, inv_rms, h_pre, h_mix)
        ctx.bwd = bwd
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: never read
        return h_in, h_post, h_res

    @staticmethod
    def backward(ctx, grad_h_in, grad_h_post, grad_h_res):
        grads = [None if g is None else g.contiguous() for g in (grad_h_in, grad_h_post, grad_h_res)]
        grad_x, grad_phi, grad_alpha, grad_bias = ctx.bwd(*ctx.saved_tensors, *grads)
        return grad_x, grad_phi, grad_alpha, grad_bias, None, None


_OPS: dict = {}


def _ops_for(x, rms_eps: float, hc_eps: float):
    """The compiled forward and backward for x's (n, D) and these epsilons, built once per process."""
    B, S, n, D = x.shape
    key = (n, D, float(rms_eps), float(hc_eps))
    if key not in _OPS:
        _OPS[key] = (MHCForwardPreTileLang(max(B, 1), max(S, 1), n, D, rms_eps, hc_eps),
                     MHCBackwardPreTileLang(max(B, 1), max(S, 1), n, D))
    return _OPS[key]


def mhc_pre(x, phi, alpha, bias, rms_eps: float = 1e-6, hc_eps: float = 1e-6):
    """Differentiable mHC pre: (h_in, h_post, h_res) of the compiled forward, with the compiled
    backward for x, phi, alpha and bias under ``loss.backward()``."""
    return _MHCPre.apply(x, phi, alpha, bias, rms_eps, hc_eps)
