"""The mHC post step, forward (`mhc_post`) and backward (`mhc_post_bwd`): bandwidth-bound passes over the residual
streams written per thread, 16 bytes (8 bf16 columns) at a time. The math is golden/mhc_post.py's.

Forward: a CTA owns `block_t` tokens x 256 columns; each warp row of 32 lanes covers the 256 columns of one token
(512 contiguous bytes per stream), and a thread takes `tokens_per_thread` tokens, issuing all their n + 1 loads
(n residual streams and the layer output) before the first use. The grid is one CTA per tile, nothing persistent.

Backward: one warp per token walks its D columns, 8 per lane per step, `unroll` steps of loads in flight (the
token's post and comb staged in shared memory, read as broadcasts); it writes grad_residual and grad_layer_out as
it goes and keeps the n + n*n dot products (grad_post, grad_comb) as per-lane fp32 partials, reduced across the
warp by shuffles at the end: a fixed order, so the result is bitwise reproducible, with no atomics.
"""

from ...common import runtime  # noqa: F401  (the kernel cache dir before TileLang is imported)

import tilelang.language as T  # noqa: E402

VEC = 8  # bf16 columns per 16-byte access
LANES = 32  # lanes of a warp, each VEC columns: 256 columns of one token per warp row


def mhc_post_kernel(n: int, D: int, threads: int = 128, tokens_per_thread: int = 4):
    """out[t, k, :] = post[t, k] * layer_out[t, :] + sum_j comb[t, j, k] * residual[t, j, :] (fp32, one rounding).
    D a multiple of 8 (VEC); any number of tokens."""
    rows, U = threads // LANES, tokens_per_thread
    block_t = rows * U
    V = D // VEC  # 16-byte vectors per stream row
    streams = tuple(range(n))  # Python tuples: loops over them unroll while tracing
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_post(
        Residual: T.Tensor((num_tokens, n, D), "bfloat16"),
        LayerOut: T.Tensor((num_tokens, D), "bfloat16"),
        Post: T.Tensor((num_tokens, n), "float32"),
        Comb: T.Tensor((num_tokens, n, n), "float32"),
        Out: T.Tensor((num_tokens, n, D), "bfloat16"),
    ):
        # Tokens on the grid's x (up to 2^31 - 1 CTAs; y stops at 65535).
        with T.Kernel(T.ceildiv(num_tokens, block_t), T.ceildiv(V, LANES), threads=threads) as (bt, bv):
            post_s = T.alloc_shared((block_t, n), "float32")
            comb_s = T.alloc_shared((block_t, n, n), "float32")
            res = T.alloc_local((U, n, VEC), "bfloat16")
            lo = T.alloc_local((U, VEC), "bfloat16")
            out = T.alloc_local((VEC,), "bfloat16")
            tx = T.get_thread_binding()
            row, v = tx // LANES, bv * LANES + tx % LANES
            t0 = bt * block_t

            # The tile's mixing weights (rows past the last token read as zero, never used).
            for t, k in T.Parallel(block_t, n):
                post_s[t, k] = T.if_then_else(t0 + t < num_tokens, Post[T.min(t0 + t, num_tokens - 1), k], 0.0)
            for t, j, k in T.Parallel(block_t, n, n):
                comb_s[t, j, k] = T.if_then_else(t0 + t < num_tokens, Comb[T.min(t0 + t, num_tokens - 1), j, k], 0.0)
            # Every load of the thread's tokens is issued before the first is used.
            for u in T.unroll(U):
                t = t0 + row + u * rows
                if t < num_tokens and v < V:
                    for j in streams:
                        for e in T.vectorized(VEC):
                            res[u, j, e] = Residual[t, j, v * VEC + e]
                    for e in T.vectorized(VEC):
                        lo[u, e] = LayerOut[t, v * VEC + e]
            T.sync_threads()  # post_s and comb_s are complete
            for u in T.unroll(U):
                t, tl = t0 + row + u * rows, row + u * rows
                if t < num_tokens and v < V:
                    for k in streams:
                        for e in T.unroll(VEC):
                            out[e] = T.cast(post_s[tl, k] * T.cast(lo[u, e], "float32")
                                            + sum(comb_s[tl, j, k] * T.cast(res[u, j, e], "float32") for j in streams),
                                            "bfloat16")
                        for e in T.vectorized(VEC):
                            Out[t, k, v * VEC + e] = out[e]

    return mhc_post


def mhc_post_bwd_kernel(n: int, D: int, threads: int = 128, unroll: int = 2):
    """From g = d loss / d out [t, n, D]: grad_residual[t, j] = sum_k comb[t, j, k] g[t, k], grad_layer_out[t] =
    sum_k post[t, k] g[t, k] (bf16), grad_post[t, k] = <g[t, k], layer_out[t]> and grad_comb[t, j, k] =
    <g[t, k], residual[t, j]> (fp32). One warp per token; D a multiple of 8 (VEC)."""
    warps = threads // LANES
    V = D // VEC
    rounds = -(-V // (LANES * unroll))  # each round: `unroll` steps of one vector per lane
    streams = tuple(range(n))
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_post_bwd(
        Residual: T.Tensor((num_tokens, n, D), "bfloat16"),
        LayerOut: T.Tensor((num_tokens, D), "bfloat16"),
        Post: T.Tensor((num_tokens, n), "float32"),
        Comb: T.Tensor((num_tokens, n, n), "float32"),
        GradOut: T.Tensor((num_tokens, n, D), "bfloat16"),
        GradResidual: T.Tensor((num_tokens, n, D), "bfloat16"),
        GradLayerOut: T.Tensor((num_tokens, D), "bfloat16"),
        GradPost: T.Tensor((num_tokens, n), "float32"),
        GradComb: T.Tensor((num_tokens, n, n), "float32"),
    ):
        with T.Kernel(T.ceildiv(num_tokens, warps), threads=threads) as bt:
            p = T.alloc_shared((warps, n), "float32")  # this warp's token's weights (broadcast reads)
            c = T.alloc_shared((warps, n, n), "float32")
            acc_p = T.alloc_local((n,), "float32")  # this lane's partial <g[k], y>
            acc_c = T.alloc_local((n, n), "float32")  # this lane's partial <x[j], g[k]>
            g = T.alloc_local((unroll, n, VEC), "bfloat16")
            x = T.alloc_local((unroll, n, VEC), "bfloat16")
            y = T.alloc_local((unroll, VEC), "bfloat16")
            gx = T.alloc_local((VEC,), "bfloat16")
            gy = T.alloc_local((VEC,), "bfloat16")
            tx = T.get_thread_binding()
            lane, w = tx % LANES, tx // LANES
            t = bt * warps + w

            if t < num_tokens:  # uniform over the warp: the shuffles below see every lane
                for k in streams:
                    acc_p[k] = 0.0
                    for j in streams:
                        acc_c[j, k] = 0.0
                if lane < n:  # the warp stages its token's weights
                    p[w, lane] = Post[t, lane]
                for q in T.unroll(-(-n * n // LANES)):
                    if q * LANES + lane < n * n:
                        c[w, (q * LANES + lane) // n, (q * LANES + lane) % n] = \
                            Comb[t, (q * LANES + lane) // n, (q * LANES + lane) % n]
                T.sync_warp()
                for r in T.serial(rounds):
                    for s in T.unroll(unroll):  # every load of the round first
                        v = (r * unroll + s) * LANES + lane
                        if v < V:
                            for k in streams:
                                for e in T.vectorized(VEC):
                                    g[s, k, e] = GradOut[t, k, v * VEC + e]
                            for j in streams:
                                for e in T.vectorized(VEC):
                                    x[s, j, e] = Residual[t, j, v * VEC + e]
                            for e in T.vectorized(VEC):
                                y[s, e] = LayerOut[t, v * VEC + e]
                    for s in T.unroll(unroll):
                        v = (r * unroll + s) * LANES + lane
                        if v < V:
                            for j in streams:
                                for e in T.unroll(VEC):
                                    gx[e] = T.cast(sum(c[w, j, k] * T.cast(g[s, k, e], "float32") for k in streams),
                                                   "bfloat16")
                                for e in T.vectorized(VEC):
                                    GradResidual[t, j, v * VEC + e] = gx[e]
                            for e in T.unroll(VEC):
                                gy[e] = T.cast(sum(p[w, k] * T.cast(g[s, k, e], "float32") for k in streams),
                                               "bfloat16")
                            for e in T.vectorized(VEC):
                                GradLayerOut[t, v * VEC + e] = gy[e]
                            for k in streams:
                                acc_p[k] += sum(T.cast(g[s, k, e], "float32") * T.cast(y[s, e], "float32")
                                                for e in range(VEC))
                                for j in streams:
                                    acc_c[j, k] += sum(T.cast(g[s, k, e], "float32") * T.cast(x[s, j, e], "float32")
                                                       for e in range(VEC))
                # Butterfly sums over the warp's lanes: the same order on every run.
                for k in streams:
                    acc_p[k] = T.warp_reduce_sum(acc_p[k])
                    for j in streams:
                        acc_c[j, k] = T.warp_reduce_sum(acc_c[j, k])
                if lane == 0:
                    for k in streams:
                        GradPost[t, k] = acc_p[k]
                        for j in streams:
                            GradComb[t, j, k] = acc_c[j, k]

    return mhc_post_bwd
