"""One sublayer's mHC post fused with the next sublayer's pre (inference): `mhc_post_mix`.

Per tile of `block_t` tokens, streaming over D in chunks of `block_k` columns (TileLang's TMA pipeline): the n
residual streams' and the layer output's chunks land in shared memory with phi's [hi; lo] chunk of every stream;
the consumer threads form the new residual x'[k] = post[k] * layer_out + sum_j comb[j, k] * residual[j] (fp32,
rounded once to bf16, as `mhc_post`), write it to memory, accumulate its squares and feed it to the tensor
cores: h_mix = x' @ phi^T (phi as bf16 hi + lo parts, as the pre). Each thread owns 8 columns of the same tokens in
every chunk: it loads each input vector once (16 bytes) for all n outputs, and its tokens' post and comb weights
stay in registers for the whole tile (that elementwise work, not the memory, bounds this kernel). The epilogue
writes h_pre, h_post and the comb logits h_res as the pre's mix kernel does, or with `sinkhorn_iters` their
Sinkhorn projection comb. So the residual is read once and the new residual written once; only
h_in = sum_i h_pre[i] * x'[i] (the pre's `mhc_pre_apply`, after this kernel) reads the new residual again, since
h_pre needs the whole token's reduction first. With `splits` > 1 a tile's D chunks are shared by that many CTAs
(`splits.py`: the last to finish adds the partials in split order and writes the weights), so that a token count of
about one wave of tiles still makes a grid of several waves on a GPU shared with another stream. Nothing is
persistent and no CTA waits for another. The design and what was weighed against it: docs/design/mhc_post.md."""

from ...common import runtime  # noqa: F401  (the kernel cache dir before TileLang is imported)
from ..tiling import _D_PAD, _round_up, phi_split_rows
from . import weights
from .sinkhorn import sinkhorn_epilogue
from .splits import SPLIT_SRC, sum_splits

import tilelang.language as T  # noqa: E402

VEC = 8  # bf16 columns per 16-byte access


def mhc_post_mix_kernel(n: int, D: int, rms_eps: float, hc_eps: float, block_t: int = 64, block_k: int = 64,
                        num_stages: int = 2, threads: int = 128, splits: int = 1, sinkhorn_iters: int = 0):
    """The new residual, h_pre, h_post and the comb logits of the next pre, from the post's inputs (module
    docstring). `block_k` divides _D_PAD (phi's split copy is zero past D; the TMA loads zero-fill past D).
    `threads` / 128 warpgroups share the tile's elementwise work and split the product's 64-row wgmma tiles: by
    rows where block_t = 64 per warpgroup, by h_mix's columns at block_t = 64, else both. `splits` (a divisor of
    the D chunks) CTAs per tile, the partials in Part (flat, [tiles, splits, block_t, 2 NG + 1], any longer length)
    and the arrivals counted in Count [tiles or more] (zero at the first launch); unused with one split."""
    wg = threads // 128
    policy = (T.GemmWarpPolicy.FullRow if block_t == 64 * wg else
              T.GemmWarpPolicy.FullCol if block_t == 64 else T.GemmWarpPolicy.Square)
    N, NG = n * n + 2 * n, phi_split_rows(n)
    Dp = _round_up(D, _D_PAD)
    d_chunks = -(-D // block_k)
    per_split = d_chunks // splits
    assert per_split * splits == d_chunks
    sum_split_parts = sum_splits(splits, block_t, 2 * NG)
    epilogue = sinkhorn_epilogue(n, D, rms_eps, sinkhorn_iters, hc_eps) if sinkhorn_iters else None
    streams = tuple(range(n))  # Python tuples: the loops over them unroll while tracing
    lanes = block_k // VEC  # threads per token row of a chunk
    rows = threads // lanes  # token rows per pass of the threads over a chunk
    passes = -(-block_t // rows)
    num_tokens = T.dynamic("num_tokens")
    part_len, count_tiles = T.dynamic("part_len"), T.dynamic("count_tiles")

    @T.prim_func
    def mhc_post_mix(
        Residual: T.Tensor((num_tokens, n, D), "bfloat16"),
        LayerOut: T.Tensor((num_tokens, D), "bfloat16"),
        Post: T.Tensor((num_tokens, n), "float32"),
        Comb: T.Tensor((num_tokens, n, n), "float32"),
        PhiHL: T.Tensor((2 * NG, n, Dp), "bfloat16"),  # phi's hi rows, then its lo rows
        Alpha: T.Tensor((3,), "float32"),
        Bias: T.Tensor((N,), "float32"),
        NewResidual: T.Tensor((num_tokens, n, D), "bfloat16"),
        HPost: T.Tensor((num_tokens, n), "float32"),
        HRes: T.Tensor((num_tokens, n * n), "float32"),
        HPre: T.Tensor((num_tokens, n), "float32"),
        Part: T.Tensor((part_len,), "float32"),  # used only with splits > 1
        Count: T.Tensor((count_tiles,), "int32"),
    ):
        with T.Kernel(T.ceildiv(num_tokens, block_t), splits, threads=threads, prelude=SPLIT_SRC) as (bx, sp):
            # One buffer per stream, each filled by one bulk (TMA) copy.
            rs = [T.alloc_shared((block_t, block_k), "bfloat16") for _ in streams]
            ls = T.alloc_shared((block_t, block_k), "bfloat16")
            phs = [T.alloc_shared((2 * NG, block_k), "bfloat16") for _ in streams]
            xs = [T.alloc_shared((block_t, block_k), "bfloat16") for _ in streams]  # the new residual's chunk
            mix2 = T.alloc_fragment((block_t, 2 * NG), "float32")  # h_mix = the sum of its two halves
            sq_s = T.alloc_shared((block_t, lanes), "float32")  # the threads' sums of squares
            mix2_s = T.alloc_shared((block_t, 2 * NG), "float32")
            sumsq_s = T.alloc_shared((block_t,), "float32")
            # A thread owns VEC columns of `passes` tokens of every chunk: their post weights stay in registers.
            pw = T.alloc_local((passes, n), "float32")
            cw = T.alloc_local((passes, n, n), "float32")
            ssq = T.alloc_local((passes,), "float32")
            y = T.alloc_local((VEC,), "bfloat16")
            r = T.alloc_local((n, VEC), "bfloat16")
            xv = T.alloc_local((VEC,), "bfloat16")
            tx = T.get_thread_binding()
            row, c = tx // lanes, tx % lanes * VEC
            t0 = bx * block_t

            for u in T.unroll(passes):  # zero past the last token (those rows are never stored)
                t = T.min(t0 + row + rows * u, num_tokens - 1)
                live = t0 + row + rows * u < num_tokens
                ssq[u] = 0.0
                for i in streams:
                    pw[u, i] = T.if_then_else(live, Post[t, i], 0.0)
                    for j in streams:
                        cw[u, j, i] = T.if_then_else(live, Comb[t, j, i], 0.0)
            T.clear(mix2)
            for kp in T.Pipelined(per_split, num_stages=num_stages):
                d0 = (sp * per_split + kp) * block_k
                for j in streams:
                    T.copy(Residual[t0:t0 + block_t, j, d0:d0 + block_k], rs[j])
                T.copy(LayerOut[t0:t0 + block_t, d0:d0 + block_k], ls)
                for i in streams:
                    T.copy(PhiHL[:, i, d0:d0 + block_k], phs[i])
                # The new residual from the landed tiles, then a proxy fence: TileLang hands the tiles back to the
                # TMA producer after their last reader, and ptxas may issue that release with these shared loads
                # still in flight (see bwd_two_pass). The loop of one keeps the fence inside the same statement.
                for _ in T.serial(1):
                    for u in T.unroll(passes):
                        tl = row + rows * u
                        if tl < block_t:
                            # each input vector loaded once (16 bytes), used by every output stream
                            for e in T.vectorized(VEC):
                                y[e] = ls[tl, c + e]
                            for j in streams:
                                for e in T.vectorized(VEC):
                                    r[j, e] = rs[j][tl, c + e]
                            for i in streams:
                                for e in T.unroll(VEC):
                                    xv[e] = T.cast(pw[u, i] * T.cast(y[e], "float32")
                                                   + sum(cw[u, j, i] * T.cast(r[j, e], "float32") for j in streams),
                                                   "bfloat16")
                                    ssq[u] += T.cast(xv[e], "float32") * T.cast(xv[e], "float32")
                                for e in T.vectorized(VEC):
                                    xs[i][tl, c + e] = xv[e]
                                if t0 + tl < num_tokens and d0 + c < D:
                                    for e in T.vectorized(VEC):
                                        NewResidual[t0 + tl, i, d0 + c + e] = xv[e]
                    T.fence_proxy_async()
                # Every stream's product in flight at once, one wait; in a loop of one so that TileLang hands phi's
                # tiles back after the wait, not after the (asynchronous) issue.
                for _ in T.serial(1):
                    for i in streams:
                        T.wgmma_gemm(xs[i], phs[i], mix2, transpose_B=True, policy=policy)
                    T.wait_wgmma(0)
            for u in T.unroll(passes):
                if row + rows * u < block_t:
                    sq_s[row + rows * u, tx % lanes] = ssq[u]
            T.copy(mix2, mix2_s)
            for t in T.Parallel(block_t):  # each token's partial sums, in lane order
                sumsq_s[t] = 0.0
                for lane in T.serial(lanes):
                    sumsq_s[t] += sq_s[t, lane]
            last = T.alloc_shared((1,), "int32")
            if splits > 1:  # the tile's last CTA adds every split's partials, in split order
                T.sync_threads()
                sum_split_parts(Part, Count, mix2_s, sumsq_s, last, bx, sp)
            for t, r in T.Parallel(block_t, NG):
                if (splits == 1 or last[0] == 1) and t0 + t < num_tokens and r < N:
                    inv_rms = weights.inv_rms(sumsq_s[t], n, D, rms_eps)
                    mix = mix2_s[t, r] + mix2_s[t, NG + r]
                    if r < n:
                        HPre[t0 + t, r] = weights.h_pre(Alpha, inv_rms, mix, Bias[r], hc_eps)
                    elif r < 2 * n:
                        HPost[t0 + t, r - n] = weights.h_post(Alpha, inv_rms, mix, Bias[r])
                    elif not sinkhorn_iters:
                        HRes[t0 + t, r - 2 * n] = weights.h_res_logit(Alpha, inv_rms, mix, Bias[r])
            if sinkhorn_iters:  # comb from the logits, a token per thread (as the pre's mix kernel)
                epilogue(HRes, Alpha, Bias, sumsq_s, lambda t, r: mix2_s[t, r] + mix2_s[t, NG + r], t0, num_tokens,
                         block_t, threads, splits == 1 or last[0] == 1)

    return mhc_post_mix
