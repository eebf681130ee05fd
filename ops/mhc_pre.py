"""mHC pre forward (`MHCForwardPreTileLang`): two kernels, no cross-CTA synchronization.

1. `mhc_pre_mix`: per tile of `block_t` tokens, the full n*D reduction h_mix = x @ phi^T on bf16 tensor
   cores (phi split into bf16 hi + lo parts: ~16 mantissa bits, more than TF32), pipelined over K, with
   the sum of squares taken from the same shared-memory tiles; its epilogue writes h_pre, h_post, h_res
   and inv_rms. phi is re-read from L2 once per token tile, so tiles are tall.
2. `mhc_pre_apply`: h_in = sum_i h_pre[i] * x[i, :], a bandwidth-bound pass.

x is read twice (once per kernel): the floor is 2 reads of x + 1 write of h_in. A single-pass design
(x kept on chip while the tile's CTAs exchange partial sums) was tried; its per-tile synchronization
left it latency-bound (docs/perf.md).
"""



import torch

from ._runtime import check_choice, check_int, check_tensor, compile_kernel, resolve_config

import tilelang.language as T  # noqa: E402  (after _runtime set the cache dir)

_D_PAD = 256  # phi's split copy pads D to a multiple of this, so every K-chunk reads in bounds


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def phi_split_rows(n: int) -> int:
    """Rows NG of phi's split copy: n*n+2n padded to a multiple of 16, the widest tensor-core N that
    TileLang issues as one wgmma (24 rows ran as three n8 instructions: 1.5x slower mix kernel)."""
    return _round_up(n * n + 2 * n, 16)


def _thread_choices(block_t: int) -> list[int]:
    """Threads of the mix kernel for a token tile: at most one warpgroup per 64 tokens (a wgmma's M)."""
    return [t for t in (128, 256) if t <= 2 * block_t]


def mhc_phi_split_kernel(n: int, D: int, block_d: int = _D_PAD, threads: int = 128):
    """phi fp32 [N, n*D] -> bf16 hi and lo parts [NG, n, Dp], NG = phi_split_rows(n) and Dp = D rounded
    up to _D_PAD: rows N..NG-1 and columns D..Dp-1 are zero."""
    N, NG = n * n + 2 * n, phi_split_rows(n)
    Dp = _round_up(D, _D_PAD)

    @T.prim_func
    def mhc_phi_split(Phi: T.Tensor((N, n * D), "float32"), PhiHi: T.Tensor((NG, n, Dp), "bfloat16"),
                      PhiLo: T.Tensor((NG, n, Dp), "bfloat16")):
        with T.Kernel(Dp // block_d, n, NG, threads=threads) as (bd, i, r):
            for d in T.Parallel(block_d):
                col = bd * block_d + d
                v = T.if_then_else(r < N and col < D, Phi[T.min(r, N - 1), i * D + T.min(col, D - 1)],
                                   T.float32(0))
                hi = T.cast(v, "bfloat16")
                PhiHi[r, i, col] = hi
                PhiLo[r, i, col] = T.cast(v - T.cast(hi, "float32"), "bfloat16")

    return mhc_phi_split


def mhc_pre_mix_kernel(n: int, D: int, rms_eps: float, hc_eps: float,
                       block_t: int = 128, block_k: int = 128, num_stages: int = 2, threads: int = 256):
    N, NG = n * n + 2 * n, phi_split_rows(n)
    d_chunks = _round_up(D, _D_PAD) // block_k  # phi's copy is padded with zeros past D
    num_tokens = T.dynamic("num_tokens")

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
    ):
        with T.Kernel(T.ceildiv(num_tokens, block_t), threads=threads) as bx:
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
            T.clear(sumsq)
            for kc in T.Pipelined(n * d_chunks, num_stages=num_stages):
                i, d0 = kc // d_chunks, (kc % d_chunks) * block_k
                T.copy(X[t0:t0 + block_t, i, d0:d0 + block_k], xs)
                T.copy(PhiHi[:, i, d0:d0 + block_k], hi_s)
                T.copy(PhiLo[:, i, d0:d0 + block_k], lo_s)
                # The sum of squares first: TileLang releases xs to the TMA producer after its last
                # reader, and the shared loads here must have returned by then (the reduction consumes
                # them before the products; read last, ptxas may release with loads in flight and the
                # next tile's TMA write can overtake them, see docs/perf.md, mHC backward).
                for t, k in T.Parallel(block_t, block_k):
                    sq[t, k] = T.cast(xs[t, k], "float32") * T.cast(xs[t, k], "float32")
                T.reduce_sum(sq, sumsq, dim=1, clear=False)
                # Warps split the tokens only, so each wgmma spans all NG columns.
                T.gemm(xs, hi_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.gemm(xs, lo_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)

            # Through shared memory: the epilogue pairs each h_mix entry with its token's sum of squares.
            T.copy(acc, mix_s)
            for t in T.Parallel(block_t):
                sumsq_s[t] = sumsq[t]
            T.sync_threads()
            for t, r in T.Parallel(block_t, NG):
                if t0 + t < num_tokens and r < N:
                    inv_rms = T.rsqrt(sumsq_s[t] / (n * D) + rms_eps)
                    if r == 0:
                        InvRms[t0 + t] = inv_rms
                    if r < n:
                        HPre[t0 + t, r] = T.sigmoid(Alpha[0] * inv_rms * mix_s[t, r] + Bias[r]) + hc_eps
                    elif r < 2 * n:
                        HPost[t0 + t, r - n] = 2 * T.sigmoid(Alpha[1] * inv_rms * mix_s[t, r] + Bias[r])
                    else:
                        HRes[t0 + t, r - 2 * n] = Alpha[2] * inv_rms * mix_s[t, r] + Bias[r]

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

            for i in T.unroll(n):  # every stream's loads in flight before the first use
                T.copy(X[t0:t0 + block_t, i, d0:d0 + block_d], x_f[i, :, :])
            T.copy(HPre[t0:t0 + block_t, :], hpre_s)
            T.clear(out_f)
            for i in T.unroll(n):
                for t, d in T.Parallel(block_t, block_d):
                    out_f[t, d] += hpre_s[t, i] * T.cast(x_f[i, t, d], "float32")
            T.copy(out_f, out)
            T.copy(out, HIn[t0:t0 + block_t, d0:d0 + block_d])

    return mhc_pre_apply


class MHCForwardPreTileLang:
    """mHC pre forward: ``op(x, phi, alpha, bias) -> (h_in, h_post, h_res)``; see golden/mhc_pre.py.

    x [B, S, n, D] bf16, phi [n*n+2n, n*D] fp32, alpha [3] fp32, bias [n*n+2n] fp32 (CUDA, contiguous).
    B and S are free at call time (one compiled kernel serves any number of tokens); n and D are fixed
    at construction. ``return_aux=True`` also returns inv_rms [B, S] and h_pre [B, S, n] (fp32), which
    the backward needs. The matmul runs on bf16 tensor cores with phi split into hi + lo bf16 parts.
    """

    op_name = "mhc_pre"
    tunable_kernel = staticmethod(mhc_pre_mix_kernel)
    DEFAULT_CONFIG = {"block_t": 128, "block_k": 128, "num_stages": 2, "threads": 256}

    @staticmethod
    def config_space(n: int, D: int, **_) -> list[dict]:
        return [dict(block_t=bt, block_k=bk, num_stages=st, threads=th)
                for bt in (64, 128) for bk in (64, 128) for st in (2, 3, 4) for th in _thread_choices(bt)]

    def __init__(self, B: int, S: int, n: int, D: int, rms_eps: float = 1e-6, hc_eps: float = 1e-6,
                 config: dict | None = None):
        check_int("B", B, lo=1)
        check_int("S", S, lo=1)
        check_int("n", n, lo=1, hi=8)
        check_int("D", D, lo=8, hi=16384, multiple_of=8)
        for name, eps in (("rms_eps", rms_eps), ("hc_eps", hc_eps)):
            if not isinstance(eps, (int, float)) or eps < 0:
                raise ValueError(f"{name}: expected a float >= 0, got {eps!r}")
        self.n, self.D = n, D
        self.spec = {"n": n, "D": D, "rms_eps": float(rms_eps), "hc_eps": float(hc_eps)}
        self.config = resolve_config(self.op_name, self.spec, config, self.DEFAULT_CONFIG)
        check_int("config['block_t']", self.config["block_t"], lo=64, hi=128, multiple_of=64)
        check_int("config['block_k']", self.config["block_k"], lo=64, hi=_D_PAD, multiple_of=64)
        check_int("config['num_stages']", self.config["num_stages"], lo=1, hi=4)
        check_choice("config['threads']", self.config["threads"], _thread_choices(self.config["block_t"]))
        self._split = compile_kernel(mhc_phi_split_kernel(n, D))
        self._mix = compile_kernel(mhc_pre_mix_kernel(**self.spec, **self.config))
        self._apply = compile_kernel(mhc_pre_apply_kernel(n, D))
        self._phi_parts = {}

    def check_inputs(self, x, phi, alpha, bias) -> None:
        n, D = self.n, self.D
        N = n * n + 2 * n
        check_tensor("x", x, torch.bfloat16, (None, None, n, D))
        check_tensor("phi", phi, torch.float32, (N, n * D), device=x.device)
        check_tensor("alpha", alpha, torch.float32, (3,), device=x.device)
        check_tensor("bias", bias, torch.float32, (N,), device=x.device)

    def _split_phi(self, phi):
        """phi's bf16 hi + lo parts, in buffers reused across calls on the same device."""
        if phi.device not in self._phi_parts:
            shape = (phi_split_rows(self.n), self.n, _round_up(self.D, _D_PAD))
            self._phi_parts[phi.device] = tuple(torch.empty(shape, device=phi.device, dtype=torch.bfloat16)
                                                for _ in range(2))
        hi, lo = self._phi_parts[phi.device]
        self._split(phi, hi, lo)
        return hi, lo

    def _mix_args(self, x, phi, alpha, bias):
        B, S, n, D = x.shape
        f32 = dict(device=x.device, dtype=torch.float32)
        outs = (torch.empty(B * S, n, **f32), torch.empty(B * S, n * n, **f32), torch.empty(B * S, **f32),
                torch.empty(B * S, n, **f32))
        return (x.view(B * S, n, D), *self._split_phi(phi), alpha, bias, *outs)

    def tune_args(self, x, phi, alpha, bias):
        """Arguments of the tunable kernel (``mhc_pre_mix``) for these inputs."""
        self.check_inputs(x, phi, alpha, bias)
        return self._mix_args(x, phi, alpha, bias)

    def __call__(self, x, phi, alpha, bias, return_aux: bool = False):
        self.check_inputs(x, phi, alpha, bias)
        B, S, n, D = x.shape
        args = self._mix_args(x, phi, alpha, bias)
        h_post, h_res, inv_rms, h_pre = args[5:]
        h_in = torch.empty(B * S, D, device=x.device, dtype=torch.bfloat16)
        if B * S:
            self._mix(*args)
            self._apply(args[0], h_pre, h_in)
        outs = (h_in.view(B, S, D), h_post.view(B, S, n), h_res.view(B, S, n, n))
        return outs + (inv_rms.view(B, S), h_pre.view(B, S, n)) if return_aux else outs
