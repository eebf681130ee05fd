"""The Sinkhorn-Knopp projection of the comb logits (h_res), forward and backward: one thread per token holds
its n x n matrix in registers, fp32 (the math is golden/mhc_pre.py's ``sinkhorn`` and golden/mhc_pre_bwd.py's
``sinkhorn_backward``; the design and its cost: docs/design/mhc.md).

Normalization k (k = 0 .. 2 * iters - 2) divides the columns (k even) or the rows (k odd) by their sums plus
hc_eps; k = 0 follows the softmax of the rows plus hc_eps.

`mhc_pre_sinkhorn` turns the logits the pre kernels wrote into comb, in place. `mhc_pre_sinkhorn_bwd`
recomputes the logits from the forward's saved h_mix and inv_rms, and carries d loss / d comb back to them
(d loss / d h_res of the pre backward). Reverse mode needs every normalization's output and denominators; it
keeps the denominators of a segment of normalizations (all of them up to a shared-memory budget,
`sinkhorn_segment`) in shared memory, a column per thread, reconstructs the outputs backwards through the
segment (x = x' * d), and recomputes the forward from the softmax for each earlier segment. Nothing is stored
in global memory per iteration."""

import operator

from ...common import runtime  # noqa: F401  (the kernel cache dir before TileLang is imported)
from ..tiling import _SINKHORN_THREADS, sinkhorn_segment
from . import weights

import tilelang.language as T  # noqa: E402


def _at(n: int, a, b, cols: bool):
    """Flat index of element b of line a: column a (row b) when `cols`, else row a (column b)."""
    return b * n + a if cols else a * n + b


def _reduce(op, terms):
    """op(...op(op(t0, t1), t2)..., t_last): a fixed left-to-right order."""
    terms = list(terms)
    total = terms[0]
    for t in terms[1:]:
        total = op(total, t)
    return total


def _den(d0, a, tx):
    """Index of denominator a of a normalization whose denominators start at d0: in a local array (tx None),
    or in a shared one with a column per thread."""
    return d0 + a if tx is None else (d0 + a, tx)


def _macros(n: int, hc_eps: float):
    """The per-thread phases on a matrix p [n*n] in registers (row-major); q, r: local arrays of n; d: the
    denominators, from offset d0 (a local array of n, or with `tx` a shared one, a column per thread)."""

    @T.macro
    def softmax_rows(p, q, r):
        """p = softmax(p, over each row) (exact exp; r: the rows' maxima, q: their reciprocal sums)."""
        for a in T.unroll(n):
            r[a] = _reduce(T.max, (p[a * n + b] for b in range(n)))
        for a in T.unroll(n):
            for b in T.unroll(n):
                p[a * n + b] = T.exp(p[a * n + b] - r[a])
        for a in T.unroll(n):
            q[a] = T.float32(1) / _reduce(operator.add, (p[a * n + b] for b in range(n)))
            for b in T.unroll(n):
                p[a * n + b] = p[a * n + b] * q[a]

    @T.macro
    def softmax_logits(HMix, InvRms, Alpha, Bias, p, q, r, t):
        """p = softmax of token t's logits, recomputed as the forward's epilogue computes them."""
        for e in T.unroll(n * n):
            p[e] = Alpha[2] * InvRms[t] * HMix[t, 2 * n + e] + Bias[2 * n + e]
        softmax_rows(p, q, r)

    @T.macro
    def normalize(p, d, d0, q, cols: bool, tx=None):
        """Columns (or rows) of p divided by their sums + hc_eps, kept in d (the backward's denominators);
        q: their reciprocals."""
        for a in T.unroll(n):
            d[_den(d0, a, tx)] = _reduce(operator.add, (p[_at(n, a, b, cols)] for b in range(n))) + T.float32(hc_eps)
        for a in T.unroll(n):
            q[a] = T.float32(1) / d[_den(d0, a, tx)]
            for b in T.unroll(n):
                p[_at(n, a, b, cols)] = p[_at(n, a, b, cols)] * q[a]

    @T.macro
    def normalize_bwd(p, g, d, d0, q, r, v, cols: bool, tx):
        """Reverse of one `normalize` with output p and denominators d: g (d loss / d output) becomes
        d loss / d input, g = (g - sum_b g * p) / d along each line, and p the input again, p * d
        (r: the dots, v: the denominators, q: their reciprocals)."""
        for a in T.unroll(n):
            v[a] = d[_den(d0, a, tx)]
            q[a] = T.float32(1) / v[a]
            r[a] = _reduce(operator.add, (g[_at(n, a, b, cols)] * p[_at(n, a, b, cols)] for b in range(n)))
        for a in T.unroll(n):
            for b in T.unroll(n):
                g[_at(n, a, b, cols)] = (g[_at(n, a, b, cols)] - r[a]) * q[a]
                p[_at(n, a, b, cols)] = p[_at(n, a, b, cols)] * v[a]

    return softmax_rows, softmax_logits, normalize, normalize_bwd


def sinkhorn_project(n: int, sinkhorn_iters: int, hc_eps: float):
    """A per-thread macro ``project(p, q, d)``: p [n*n] (local) from one token's comb logits to comb, their
    Sinkhorn projection (q, d: local arrays of n). Used by `mhc_pre_sinkhorn` and `sinkhorn_epilogue`."""
    softmax_rows, _, normalize, _ = _macros(n, hc_eps)

    @T.macro
    def project(p, q, d):
        softmax_rows(p, q, d)
        for e in T.unroll(n * n):
            p[e] = p[e] + T.float32(hc_eps)
        normalize(p, d, 0, q, True)
        for _ in T.serial(sinkhorn_iters - 1):
            normalize(p, d, 0, q, False)
            normalize(p, d, 0, q, True)

    return project


def sinkhorn_epilogue(n: int, D: int, rms_eps: float, sinkhorn_iters: int, hc_eps: float):
    """The mix kernels' epilogue with `sinkhorn_iters` >= 1 (`mhc_pre_mix`, `mhc_post_mix`), a macro
    ``epilogue(HRes, Alpha, Bias, sumsq_s, mix, t0, num_tokens, block_t, threads, ready)``: a token of the tile
    per thread, its comb logits from its h_mix entries (``mix(t, r)``: token t's entry r) and sum of squares
    (``sumsq_s[t]``), projected, into HRes[t0 + t]; ``ready``: whether this CTA finishes the tile."""
    project = sinkhorn_project(n, sinkhorn_iters, hc_eps)

    @T.macro
    def epilogue(HRes, Alpha, Bias, sumsq_s, mix, t0, num_tokens, block_t, threads, ready):
        p = T.alloc_local((n * n,), "float32")
        q = T.alloc_local((n,), "float32")
        d = T.alloc_local((n,), "float32")
        for k in T.serial(T.ceildiv(block_t, threads)):
            t = k * threads + T.get_thread_binding()
            if ready and t < block_t and t0 + t < num_tokens:
                rms = weights.inv_rms(sumsq_s[t], n, D, rms_eps)
                for e in T.unroll(n * n):
                    p[e] = weights.h_res_logit(Alpha, rms, mix(t, 2 * n + e), Bias[2 * n + e])
                project(p, q, d)
                for e in T.unroll(n * n):
                    HRes[t0 + t, e] = p[e]

    return epilogue


def mhc_pre_sinkhorn_kernel(n: int, sinkhorn_iters: int, hc_eps: float, threads: int = _SINKHORN_THREADS):
    """HRes [tokens, n*n]: the comb logits in, comb = their Sinkhorn projection (`sinkhorn_iters` >= 1) out."""
    NN = n * n
    project = sinkhorn_project(n, sinkhorn_iters, hc_eps)
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_pre_sinkhorn(HRes: T.Tensor((num_tokens, NN), "float32")):
        with T.Kernel(T.ceildiv(num_tokens, threads), threads=threads) as bx:
            p = T.alloc_local((NN,), "float32")
            d = T.alloc_local((n,), "float32")
            q = T.alloc_local((n,), "float32")
            t = bx * threads + T.get_thread_binding()
            if t < num_tokens:
                for e in T.unroll(NN):
                    p[e] = HRes[t, e]
                project(p, q, d)
                for e in T.unroll(NN):
                    HRes[t, e] = p[e]

    return mhc_pre_sinkhorn


def mhc_pre_sinkhorn_bwd_kernel(n: int, sinkhorn_iters: int, hc_eps: float, threads: int = _SINKHORN_THREADS):
    """GLogits [tokens, n*n] = d loss / d logits from GComb = d loss / d comb, the logits recomputed as the
    forward's epilogue computes them (alpha[2] * inv_rms * h_mix[2n:] + bias[2n:])."""
    M, NN = n * n + 2 * n, n * n
    J = 2 * sinkhorn_iters - 1  # normalizations
    seg = sinkhorn_segment(n, sinkhorn_iters)  # normalizations per segment, even: a segment starts with columns
    segs = -(-J // seg)
    _, softmax_logits, normalize, normalize_bwd = _macros(n, hc_eps)
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_pre_sinkhorn_bwd(
        HMix: T.Tensor((num_tokens, M), "float32"),
        InvRms: T.Tensor((num_tokens,), "float32"),
        Alpha: T.Tensor((3,), "float32"),
        Bias: T.Tensor((M,), "float32"),
        GComb: T.Tensor((num_tokens, NN), "float32"),
        GLogits: T.Tensor((num_tokens, NN), "float32"),
    ):
        with T.Kernel(T.ceildiv(num_tokens, threads), threads=threads) as bx:
            p = T.alloc_local((NN,), "float32")
            g = T.alloc_local((NN,), "float32")
            dens = T.alloc_shared((seg * n, threads), "float32")  # a segment's denominators, a column per thread
            q = T.alloc_local((n,), "float32")
            r = T.alloc_local((n,), "float32")
            v = T.alloc_local((n,), "float32")
            tx = T.get_thread_binding()
            # The last CTA's idle threads redo the last token (every thread takes the same path to the warp sync;
            # the op never launches this for zero tokens).
            t = T.min(bx * threads + tx, num_tokens - 1)
            for e in T.unroll(NN):
                g[e] = GComb[t, e]
            for sr in T.serial(segs):
                s = segs - 1 - sr
                # Every segment starts from the softmax, recomputed from the logits (L1 hits).
                softmax_logits(HMix, InvRms, Alpha, Bias, p, q, r, t)
                for e in T.unroll(NN):
                    p[e] = p[e] + T.float32(hc_eps)
                for _ in T.serial(s):  # the earlier segments, recomputed
                    for _k in T.unroll(seg // 2):
                        normalize(p, q, 0, r, True)
                        normalize(p, q, 0, r, False)
                for k in T.unroll(seg // 2):  # this segment, its denominators kept
                    if s * seg + 2 * k < J:
                        normalize(p, dens, 2 * k * n, q, True, tx)
                    if s * seg + 2 * k + 1 < J:
                        normalize(p, dens, (2 * k + 1) * n, q, False, tx)
                # Without this the compiler may keep the stored denominators in registers until their reads
                # below (no other thread writes them), up to 2 * iters * n live values: spills.
                T.sync_warp()
                for kr in T.unroll(seg // 2):  # and back through it
                    if s * seg + seg - 1 - 2 * kr < J:
                        normalize_bwd(p, g, dens, (seg - 1 - 2 * kr) * n, q, r, v, False, tx)
                    if s * seg + seg - 2 - 2 * kr < J:
                        normalize_bwd(p, g, dens, (seg - 2 - 2 * kr) * n, q, r, v, True, tx)
            # Through the softmax sm: g = sm * (g - sum_b g * sm) along each row.
            softmax_logits(HMix, InvRms, Alpha, Bias, p, q, r, t)
            for a in T.unroll(n):
                r[a] = _reduce(operator.add, (g[a * n + b] * p[a * n + b] for b in range(n)))
            if bx * threads + tx < num_tokens:
                for a in T.unroll(n):
                    for b in T.unroll(n):
                        GLogits[t, a * n + b] = p[a * n + b] * (g[a * n + b] - r[a])

    return mhc_pre_sinkhorn_bwd
