"""The forward's two-kernel path (x read twice): `mhc_pre_mix` (per tile of tokens the full n*D
reduction h_mix = x @ phi^T on bf16 tensor cores, pipelined over K, with the sum of squares from the same
tiles; its epilogue writes h_pre, h_post, h_res and inv_rms) and `mhc_pre_apply` (h_in = sum_i h_pre[i] *
x[i, :], bandwidth-bound). The mix kernel with `apply` also writes h_in: the single pass's side kernel.

With `splits` > 1 the mix kernel's K (the n*D columns) is split over that many CTAs per token tile (`splits.py`):
more, shorter CTAs, so that a GPU shared with another stream (or a small token count) still gets a grid of several
waves."""

from ...common import runtime  # noqa: F401  (the kernel cache dir before TileLang is imported)
from ..tiling import _D_PAD, _SIDE_D, _round_up, phi_split_rows
from .sinkhorn import sinkhorn_epilogue
from .splits import SPLIT_SRC, sum_splits
from . import weights

import tilelang.language as T  # noqa: E402


def mhc_pre_mix_kernel(n: int, D: int, rms_eps: float, hc_eps: float,
                       block_t: int = 128, block_k: int = 128, num_stages: int = 2, threads: int = 256,
                       splits: int = 1, apply: bool = False, sinkhorn_iters: int = 0):
    """Per tile of `block_t` tokens: h_pre, h_post, h_res and inv_rms; with `apply` also h_in, from x read
    a second time (the side kernel of the single pass, see ops/mhc/pre.py); with `sinkhorn_iters` >= 1 h_res is
    comb, the logits' Sinkhorn projection, one thread per token of the tile (no kernel of its own). `splits` (a divisor of the
    n * Dp / block_k column chunks; 1 with `apply`) CTAs per tile, each over its share of the chunks, the
    partials in Part (flat, [tiles, splits, block_t, NG + 1] in that order, any longer length) and the arrivals
    counted in Count [tiles or more] (zero at the first launch; each tile's last CTA zeroes its count again): one
    buffer pair large enough for every config serves them all (the autotuner's). With one split both are unused."""
    N, NG = n * n + 2 * n, phi_split_rows(n)
    d_chunks = _round_up(D, _D_PAD) // block_k  # phi's copy is padded with zeros past D
    per_split = n * d_chunks // splits
    assert per_split * splits == n * d_chunks and not (apply and splits > 1)
    num_tokens = T.dynamic("num_tokens")
    part_len, count_tiles = T.dynamic("part_len"), T.dynamic("count_tiles")
    epilogue = sinkhorn_epilogue(n, D, rms_eps, sinkhorn_iters, hc_eps) if sinkhorn_iters else None
    sum_split_parts = sum_splits(splits, block_t, NG)

    @T.prim_func
    def mhc_pre_mix(
        X: T.Tensor((num_tokens, n, D), "bfloat16"),
        PhiHi: T.Tensor((NG, n, _round_up(D, _D_PAD)), "bfloat16"),
        PhiLo: T.Tensor((NG, n, _round_up(D, _D_PAD)), "bfloat16"),
        Alpha: T.Tensor((3,), "float32"),
        Bias: T.Tensor((N,), "float32"),
        HPost: T.Tensor((num_tokens, n), "float32"),
        HRes: T.Tensor((num_tokens, n * n), "float32"),
        InvRms: T.Tensor((num_tokens,), "float32"),
        HPre: T.Tensor((num_tokens, n), "float32"),
        HMix: T.Tensor((num_tokens, N), "float32"),
        HIn: T.Tensor((num_tokens, D), "bfloat16"),  # written only with `apply`
        Part: T.Tensor((part_len,), "float32"),  # used only with splits > 1
        Count: T.Tensor((count_tiles,), "int32"),
    ):
        with T.Kernel(T.ceildiv(num_tokens, block_t), splits, threads=threads, prelude=SPLIT_SRC) as (bx, sp):
            xs = T.alloc_shared((block_t, block_k), "bfloat16")
            hi_s = T.alloc_shared((NG, block_k), "bfloat16")
            lo_s = T.alloc_shared((NG, block_k), "bfloat16")
            acc = T.alloc_fragment((block_t, NG), "float32")
            sq = T.alloc_fragment((block_t, block_k), "float32")
            sumsq = T.alloc_fragment((block_t,), "float32")
            mix_s = T.alloc_shared((block_t, NG), "float32")
            sumsq_s = T.alloc_shared((block_t,), "float32")
            t0 = bx * block_t

            T.clear(acc)
            T.clear(sq)
            for kp in T.Pipelined(per_split, num_stages=num_stages):
                kc = sp * per_split + kp
                i, d0 = kc // d_chunks, (kc % d_chunks) * block_k
                T.copy(X[t0:t0 + block_t, i, d0:d0 + block_k], xs)
                T.copy(PhiHi[:, i, d0:d0 + block_k], hi_s)
                T.copy(PhiLo[:, i, d0:d0 + block_k], lo_s)
                # The squares first, then a proxy fence: TileLang releases xs to the TMA producer after its
                # last reader (the products), and ptxas may issue that release with these shared loads
                # still in flight; the fence orders them before the next tile's TMA write (the same hazard
                # as in the backward, see bwd_two_pass). Summed per element, reduced over the row once
                # after the loop (a reduction per chunk made the kernel issue-bound).
                for t, k in T.Parallel(block_t, block_k):
                    sq[t, k] += T.cast(xs[t, k], "float32") * T.cast(xs[t, k], "float32")
                T.fence_proxy_async()
                # Warps split the tokens only, so each wgmma spans all NG columns.
                T.gemm(xs, hi_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.gemm(xs, lo_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            T.reduce_sum(sq, sumsq, dim=1)

            # Through shared memory: the epilogue pairs each h_mix entry with its token's sum of squares.
            T.copy(acc, mix_s)
            for t in T.Parallel(block_t):
                sumsq_s[t] = sumsq[t]
            hpre_s = T.alloc_shared((block_t, n), "float32") if apply else None  # h_pre kept for h_in
            T.sync_threads()
            last = T.alloc_shared((1,), "int32")
            if splits > 1:  # the tile's last CTA adds every split's partials, in split order
                sum_split_parts(Part, Count, mix_s, sumsq_s, last, bx, sp)
            for t, r in T.Parallel(block_t, NG):
                if (splits == 1 or last[0] == 1) and t0 + t < num_tokens and r < N:
                    rms = weights.inv_rms(sumsq_s[t], n, D, rms_eps)
                    HMix[t0 + t, r] = mix_s[t, r]
                    if r == 0:
                        InvRms[t0 + t] = rms
                    if r < n:
                        h_pre = weights.h_pre(Alpha, rms, mix_s[t, r], Bias[r], hc_eps)
                        HPre[t0 + t, r] = h_pre
                        if apply:
                            hpre_s[t, r] = h_pre
                    elif r < 2 * n:
                        HPost[t0 + t, r - n] = weights.h_post(Alpha, rms, mix_s[t, r], Bias[r])
                    elif not sinkhorn_iters:
                        HRes[t0 + t, r - 2 * n] = weights.h_res_logit(Alpha, rms, mix_s[t, r], Bias[r])
            if sinkhorn_iters:  # comb from the logits, a token per thread (mix_s and sumsq_s are only read)
                epilogue(HRes, Alpha, Bias, sumsq_s, lambda t, r: mix_s[t, r], t0, num_tokens, block_t, threads,
                         splits == 1 or last[0] == 1)
            if apply:
                x_f = T.alloc_fragment((n, block_t, _SIDE_D), "bfloat16")
                out_f = T.alloc_fragment((block_t, _SIDE_D), "float32")
                out = T.alloc_fragment((block_t, _SIDE_D), "bfloat16")
                T.sync_threads()  # hpre_s is complete
                for c in T.serial(T.ceildiv(D, _SIDE_D)):
                    _apply_tile(X, hpre_s, x_f, out_f, out, HIn, t0, c * _SIDE_D, n, block_t, _SIDE_D)
                # Launched right behind the single pass, whose CTAs let it start early (T.pdl_trigger);
                # this wait (for the single pass to finish, with nothing left to do) is what makes TileLang
                # launch it that way.
                T.pdl_sync()

    return mhc_pre_mix


def mhc_pre_apply_kernel(n: int, D: int, block_t: int = 16, block_d: int = 256, threads: int = 128):
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_pre_apply(
        X: T.Tensor((num_tokens, n, D), "bfloat16"),
        HPre: T.Tensor((num_tokens, n), "float32"),
        HIn: T.Tensor((num_tokens, D), "bfloat16"),
    ):
        with T.Kernel(T.ceildiv(D, block_d), T.ceildiv(num_tokens, block_t), threads=threads) as (bd, bt):
            hpre_s = T.alloc_shared((block_t, n), "float32")
            x_f = T.alloc_fragment((n, block_t, block_d), "bfloat16")
            out_f = T.alloc_fragment((block_t, block_d), "float32")
            out = T.alloc_fragment((block_t, block_d), "bfloat16")
            t0, d0 = bt * block_t, bd * block_d

            T.copy(HPre[t0:t0 + block_t, :], hpre_s)
            _apply_tile(X, hpre_s, x_f, out_f, out, HIn, t0, d0, n, block_t, block_d)

    return mhc_pre_apply


@T.macro
def _apply_tile(X, hpre_s, x_f, out_f, out, HIn, t0, d0, n, block_t, block_d):
    """h_in[t0:t0 + block_t, d0:d0 + block_d] = sum_i h_pre[:, i] * x[:, i, d0:d0 + block_d]."""
    for i in T.unroll(n):  # every stream's loads in flight before the first use
        T.copy(X[t0:t0 + block_t, i, d0:d0 + block_d], x_f[i, :, :])
    T.clear(out_f)
    for i in T.unroll(n):
        for t, d in T.Parallel(block_t, block_d):
            out_f[t, d] += hpre_s[t, i] * T.cast(x_f[i, t, d], "float32")
    T.copy(out_f, out)
    T.copy(out, HIn[t0:t0 + block_t, d0:d0 + block_d])
