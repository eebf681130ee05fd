"""mHC pre forward (`MHCForwardPreTileLang`): one pass over x, split over D across cooperating CTAs.

Why this shape: every token needs the full n*D reduction (h_mix, inv_rms) before h_in can be formed,
and phi (~48 tokens' worth of bytes) must be reused across many tokens to stay cheap. So a *tile* of
`block_t` tokens is shared by C = D / block_d CTAs; each CTA keeps x[tile, :, its D-slice] in shared
memory, computes partial h_mix / sum-of-squares with the tensor cores, and the C partials are summed in
a fixed order (deterministic) through a small L2-resident workspace. Then each CTA writes its slice of
h_in straight from shared memory: x is read from DRAM exactly once.

CTAs of a tile wait for each other, so they take work through an atomic ticket in launch order: all
earlier tiles are then resident or finished and cannot block a later one (no deadlock as long as one
tile's C CTAs fit on the GPU at once, which the op checks). Workspace slots are reused round-robin;
a slot is refilled only after its previous tile has finished.

phi is fp32; the matmul splits it into bf16 hi + lo parts (x is bf16, exact), two bf16 tensor-core
products whose sum carries ~16 mantissa bits of phi, more than TF32.
"""


import torch

from ._runtime import check_int, check_tensor, compile_kernel, resolve_config

import tilelang.language as T  # noqa: E402  (after _runtime set the cache dir)

_SLOT_COUNTERS = 3  # per slot: partials arrived, activations written, tile finished
_HEAD_COUNTERS = 2  # work ticket, CTAs exited
_D_PAD = 256  # phi's split copy pads D to this (the largest block_d), so any config can read it


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def mhc_phi_split_kernel(n: int, D: int, block_d: int = _D_PAD, threads: int = 128):
    """phi fp32 [N, n*D] -> bf16 hi and lo parts [NG, n, Dp], Dp = D rounded up to _D_PAD: rows
    N..NG-1 and columns D..Dp-1 are zero (NG, a multiple of 8, is the tensor-core product's N)."""
    N, NG = n * n + 2 * n, _round_up(n * n + 2 * n, 8)
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


def mhc_pre_fwd_kernel(n: int, D: int, rms_eps: float, hc_eps: float,
                       block_t: int = 64, block_d: int = 64, phi_group: int = 4, threads: int = 128):
    N, NG = n * n + 2 * n, _round_up(n * n + 2 * n, 8)
    C = (D + block_d - 1) // block_d  # CTAs per token tile
    num_slots = _num_slots(C)
    Dp = _round_up(D, _D_PAD)
    sq_chunk = 64  # columns squared per reduction step (bounds the fragment's registers)
    tok_per_cta = (block_t + C - 1) // C  # tokens whose activations one CTA finalizes
    num_counters = _HEAD_COUNTERS + _SLOT_COUNTERS * num_slots
    num_tokens = T.dynamic("num_tokens")
    # Workspaces are flat so their argument shapes do not depend on the config (autotuning reuses them).
    mix_elems, sq_elems, counter_elems = T.dynamic("mix_elems"), T.dynamic("sq_elems"), T.dynamic("counter_elems")

    @T.prim_func
    def mhc_pre_fwd(
        X: T.Tensor((num_tokens, n, D), "bfloat16"),
        PhiHi: T.Tensor((NG, n, Dp), "bfloat16"),
        PhiLo: T.Tensor((NG, n, Dp), "bfloat16"),
        Alpha: T.Tensor((3,), "float32"),
        Bias: T.Tensor((N,), "float32"),
        HIn: T.Tensor((num_tokens, D), "bfloat16"),
        HPost: T.Tensor((num_tokens, n), "float32"),
        HRes: T.Tensor((num_tokens, n * n), "float32"),
        InvRms: T.Tensor((num_tokens,), "float32"),
        HPre: T.Tensor((num_tokens, n), "float32"),
        PartMixFlat: T.Tensor((mix_elems,), "float32"),
        PartSqFlat: T.Tensor((sq_elems,), "float32"),
        Counters: T.Tensor((counter_elems,), "int32"),
    ):
        with T.Kernel(T.ceildiv(num_tokens, block_t) * C, threads=threads):
            xs = T.alloc_shared((n, block_t, block_d), "bfloat16")
            hi_s = T.alloc_shared((phi_group, NG, block_d), "bfloat16")
            lo_s = T.alloc_shared((phi_group, NG, block_d), "bfloat16")
            ticket = T.alloc_shared((1,), "int32")
            hpre_s = T.alloc_shared((block_t, n), "float32")
            acc = T.alloc_fragment((block_t, NG), "float32")
            sq = T.alloc_fragment((block_t, sq_chunk), "float32")
            sumsq = T.alloc_fragment((block_t,), "float32")
            fin_mix = T.alloc_shared((tok_per_cta, NG), "float32")
            fin_sq = T.alloc_shared((tok_per_cta,), "float32")
            out_f = T.alloc_fragment((block_t, block_d), "float32")
            out = T.alloc_fragment((block_t, block_d), "bfloat16")
            tid = T.get_thread_binding()

            if tid == 0:
                ticket[0] = T.atomic_add(Counters[0], 1, return_prev=True)
            T.sync_threads()
            tile = ticket[0] // C
            c = ticket[0] % C
            slot = tile % num_slots
            gen = tile // num_slots
            t0 = tile * block_t
            d0 = c * block_d
            arrived = Counters[_HEAD_COUNTERS + slot * _SLOT_COUNTERS]
            finalized = Counters[_HEAD_COUNTERS + 1 + slot * _SLOT_COUNTERS]
            finished = Counters[_HEAD_COUNTERS + 2 + slot * _SLOT_COUNTERS]

            # x is put in flight at once and stays resident until h_in is written; phi (from L2) comes
            # in groups of phi_group streams (all n at once where shared memory allows).
            for i in T.unroll(n):
                T.async_copy(X[t0:t0 + block_t, i, d0:d0 + block_d], xs[i, :, :])

            # Partial h_mix and sum of squares over this CTA's D-slice of every stream.
            T.clear(acc)
            T.clear(sumsq)
            for g in T.serial(n // phi_group):
                for gi in T.unroll(phi_group):
                    T.async_copy(PhiHi[:, g * phi_group + gi, d0:d0 + block_d], hi_s[gi, :, :])
                    T.async_copy(PhiLo[:, g * phi_group + gi, d0:d0 + block_d], lo_s[gi, :, :])
                T.ptx_wait_group(0)
                T.sync_threads()
                for gi in T.unroll(phi_group):
                    i = g * phi_group + gi
                    T.gemm(xs[i, :, :], hi_s[gi, :, :], acc, transpose_B=True)
                    T.gemm(xs[i, :, :], lo_s[gi, :, :], acc, transpose_B=True)
                    for kk in T.unroll(block_d // sq_chunk):
                        for t, k in T.Parallel(block_t, sq_chunk):
                            sq[t, k] = T.cast(xs[i, t, kk * sq_chunk + k], "float32") * T.cast(
                                xs[i, t, kk * sq_chunk + k], "float32")
                        T.reduce_sum(sq, sumsq, dim=1, clear=False)
                T.sync_threads()

            # A slot is refilled only once the tile that used it last has finished.
            if tid == 0:
                _spin_until(finished, gen * C)
            T.sync_threads()
            for t, r in T.Parallel(block_t, NG):
                PartMixFlat[((slot * C + c) * block_t + t) * NG + r] = acc[t, r]
            for t in T.Parallel(block_t):
                PartSqFlat[(slot * C + c) * block_t + t] = sumsq[t]
            _arrive_and_wait(tid, arrived, (gen + 1) * C)

            # This CTA finalizes tokens [c*tok_per_cta, (c+1)*tok_per_cta) of the tile: each output is
            # one thread's sum of the C partials in a fixed order (bitwise reproducible).
            for j, r in T.Parallel(tok_per_cta, NG):
                if c * tok_per_cta + j < block_t:
                    fin_mix[j, r] = _fixed_order_sum(
                        PartMixFlat[((slot * C + p) * block_t + c * tok_per_cta + j) * NG + r] for p in range(C))
            for j in T.Parallel(tok_per_cta):
                if c * tok_per_cta + j < block_t:
                    fin_sq[j] = _fixed_order_sum(
                        PartSqFlat[(slot * C + p) * block_t + c * tok_per_cta + j] for p in range(C))
            T.sync_threads()
            for j, r in T.Parallel(tok_per_cta, NG):
                t = t0 + c * tok_per_cta + j
                if c * tok_per_cta + j < block_t and t < num_tokens:
                    inv_rms = T.rsqrt(fin_sq[j] / (n * D) + rms_eps)
                    if r == 0:
                        InvRms[t] = inv_rms
                    if r < n:
                        HPre[t, r] = T.sigmoid(Alpha[0] * inv_rms * fin_mix[j, r] + Bias[r]) + hc_eps
                    elif r < 2 * n:
                        HPost[t, r - n] = 2 * T.sigmoid(Alpha[1] * inv_rms * fin_mix[j, r] + Bias[r])
                    elif r < N:
                        HRes[t, r - 2 * n] = Alpha[2] * inv_rms * fin_mix[j, r] + Bias[r]
            _arrive_and_wait(tid, finalized, (gen + 1) * C)

            # h_in for this CTA's D-slice, from the x tile still in shared memory.
            for t, i in T.Parallel(block_t, n):
                if t0 + t < num_tokens:
                    hpre_s[t, i] = _coherent_load(HPre[t0 + t, i])
                else:
                    hpre_s[t, i] = T.float32(0)
            T.clear(out_f)
            for i in T.unroll(n):
                for t, d in T.Parallel(block_t, block_d):
                    out_f[t, d] += hpre_s[t, i] * T.cast(xs[i, t, d], "float32")
            T.copy(out_f, out)
            T.copy(out, HIn[t0:t0 + block_t, d0:d0 + block_d])
            T.sync_threads()
            if tid == 0:
                T.atomic_add(finished, 1, memory_order="release")
                # The last CTA out zeroes the counters, so the next launch needs no memset.
                if T.atomic_add(Counters[1], 1, memory_order="acq_rel", return_prev=True) == \
                        T.ceildiv(num_tokens, block_t) * C - 1:
                    for k in T.serial(num_counters):
                        Counters[k] = 0

    return mhc_pre_fwd


def _fixed_order_sum(elements):
    """Left-to-right sum of coherent loads (independent loads, so all are in flight at once)."""
    total = None
    for e in elements:
        total = _coherent_load(e) if total is None else total + _coherent_load(e)
    return total


def _coherent_load(element):
    """Load another CTA's global write at L2 (an L1-cached line could be stale: the same workspace
    rows are rewritten for later tiles by other SMs)."""
    return T.atomic_load(element, memory_order="relaxed")


@T.macro
def _spin_until(counter, target):
    # Back off between polls: all CTAs of a tile poll one L2 line, and tight polling starves it.
    while T.atomic_load(counter, memory_order="acquire") < target:
        T.call_extern("handle", "__nanosleep", 200)


@T.macro
def _arrive_and_wait(tid, counter, target):
    """Publish this CTA's global writes to the tile and wait until all its CTAs have done so. Every
    writing thread fences its own stores (not only the arriving thread's release)."""
    T.call_extern("handle", "__threadfence")
    T.sync_threads()
    if tid == 0:
        T.atomic_add(counter, 1, memory_order="release")
        _spin_until(counter, target)
    T.sync_threads()


def _sm_count() -> int:
    # Without a GPU, build for an H100/H200 (132 SMs) so the cached kernel matches the device.
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132


def _num_slots(ctas_per_tile: int) -> int:
    # More slots than tiles that can be in flight at once (up to 3 CTAs per SM), so slot reuse rarely waits.
    return -(-3 * _sm_count() // ctas_per_tile) + 2


def _smem_bytes(n: int, block_t: int, block_d: int, phi_group: int, **_) -> int:
    NG = _round_up(n * n + 2 * n, 8)
    return n * block_t * block_d * 2 + 2 * phi_group * NG * block_d * 2 + 2048


def _config_ok(n: int, D: int, cfg: dict, smem_limit: int = 220 * 1024) -> bool:
    # The CTAs of one token tile wait for each other, so they must all fit on the GPU at once.
    return (n % cfg["phi_group"] == 0 and -(-D // cfg["block_d"]) <= _sm_count()
            and _smem_bytes(n, **cfg) <= smem_limit)


class MHCForwardPreTileLang:
    """mHC pre forward: ``op(x, phi, alpha, bias) -> (h_in, h_post, h_res)``; see golden/mhc_pre.py.

    x [B, S, n, D] bf16, phi [n*n+2n, n*D] fp32, alpha [3] fp32, bias [n*n+2n] fp32 (CUDA, contiguous).
    B and S are free at call time (one compiled kernel serves any number of tokens); n and D are fixed
    at construction. ``return_aux=True`` also returns inv_rms [B, S] and h_pre [B, S, n] (fp32), which
    the backward needs. The matmul runs on bf16 tensor cores with phi split into hi + lo bf16 parts.
    """

    op_name = "mhc_pre"
    tunable_kernel = staticmethod(mhc_pre_fwd_kernel)

    @staticmethod
    def config_space(n: int, D: int, **_) -> list[dict]:
        groups = [g for g in (8, 4, 2, 1) if n % g == 0]
        return [dict(block_t=bt, block_d=bd, phi_group=g, threads=128)
                for bt in (64, 128) for bd in (64, 128, 256) for g in groups
                if _config_ok(n, D, dict(block_t=bt, block_d=bd, phi_group=g), smem_limit=160 * 1024)]

    @staticmethod
    def default_config(n: int, D: int) -> dict:
        """Narrow D-slices (more CTAs per SM to hide latency) with all of phi's streams prefetched,
        widened only where one tile's CTAs would not fit on the GPU or shared memory would overflow."""
        for smem_limit in (112 * 1024, 220 * 1024):  # two CTAs per SM if possible, else one
            for bd in (64, 128, 256):
                for g in (n, *[g for g in (4, 2, 1) if g < n and n % g == 0]):
                    cfg = dict(block_t=64, block_d=bd, phi_group=g, threads=128)
                    if _config_ok(n, D, cfg, smem_limit):
                        return cfg
        raise AssertionError(f"no mhc_pre config fits n={n}, D={D}")  # unreachable for n <= 8, D <= 16384

    def __init__(self, B: int, S: int, n: int, D: int, rms_eps: float = 1e-6, hc_eps: float = 1e-6,
                 config: dict | None = None):
        check_int("B", B, lo=1)
        check_int("S", S, lo=1)
        check_int("n", n, lo=1, hi=8)
        check_int("D", D, lo=8, hi=16384, multiple_of=8)
        for name, eps in (("rms_eps", rms_eps), ("hc_eps", hc_eps)):
            if not isinstance(eps, (int, float)) or eps < 0:
                raise ValueError(f"{name}: expected a float >= 0, got {eps!r}")
        self.B, self.S, self.n, self.D = B, S, n, D
        self.spec = {"n": n, "D": D, "rms_eps": float(rms_eps), "hc_eps": float(hc_eps)}
        self.config = resolve_config(self.op_name, self.spec, config, self.default_config(n, D))
        cfg = self.config
        check_int("config['block_t']", cfg["block_t"], lo=64, hi=128, multiple_of=64)
        check_int("config['block_d']", cfg["block_d"], lo=64, hi=256, multiple_of=64)
        check_int("config['phi_group']", cfg["phi_group"], lo=1, hi=n)
        if not _config_ok(n, D, cfg):
            raise ValueError(f"config: {cfg} does not fit n={n}, D={D}: phi_group must divide n, the "
                             f"{-(-D // cfg['block_d'])} CTAs of a token tile must fit on the GPU's {_sm_count()} SMs "
                             f"at once, and shared memory ({_smem_bytes(n, **cfg)} bytes) must stay under 220 KiB")
        self.ctas_per_tile = -(-D // cfg["block_d"])
        self._split = compile_kernel(mhc_phi_split_kernel(n, D))
        self._fwd = compile_kernel(mhc_pre_fwd_kernel(**self.spec, **self.config))
        self._workspace = {}

    def _workspace_for(self, device: torch.device, configs=None):
        """phi hi/lo buffers and the forward kernel's flat workspaces, sized for ``configs``
        (default: this op's config). The counters start at zero and the kernel leaves them so."""
        key = (device, configs is None)
        if key not in self._workspace:
            n, D = self.n, self.D
            NG = _round_up(n * n + 2 * n, 8)
            sizes = [self._work_sizes(cfg) for cfg in (configs or [self.config])]
            mix, sq, counters = (max(v) for v in zip(*sizes))
            Dp = _round_up(D, _D_PAD)
            self._workspace[key] = (
                torch.empty(NG, n, Dp, device=device, dtype=torch.bfloat16),
                torch.empty(NG, n, Dp, device=device, dtype=torch.bfloat16),
                torch.empty(mix, device=device, dtype=torch.float32),
                torch.empty(sq, device=device, dtype=torch.float32),
                torch.zeros(counters, device=device, dtype=torch.int32),
            )
        return self._workspace[key]

    def _work_sizes(self, config):
        C = -(-self.D // config["block_d"])
        slots = _num_slots(C)
        NG = _round_up(self.n * self.n + 2 * self.n, 8)
        return (slots * C * config["block_t"] * NG, slots * C * config["block_t"],
                _HEAD_COUNTERS + _SLOT_COUNTERS * slots)

    def check_inputs(self, x, phi, alpha, bias) -> None:
        n, D = self.n, self.D
        N = n * n + 2 * n
        check_tensor("x", x, torch.bfloat16, (None, None, n, D))
        check_tensor("phi", phi, torch.float32, (N, n * D), device=x.device)
        check_tensor("alpha", alpha, torch.float32, (3,), device=x.device)
        check_tensor("bias", bias, torch.float32, (N,), device=x.device)

    def tune_args(self, x, phi, alpha, bias):
        """Arguments of the forward kernel for these inputs, valid for every config of ``config_space``."""
        self.check_inputs(x, phi, alpha, bias)
        return self._launch_args(x, phi, alpha, bias, self.config_space(self.n, self.D))

    def _launch_args(self, x, phi, alpha, bias, configs=None):
        B, S, n, D = x.shape
        tokens = B * S
        phi_hi, phi_lo, part_mix, part_sq, counters = self._workspace_for(x.device, configs)
        self._split(phi, phi_hi, phi_lo)
        f32 = dict(device=x.device, dtype=torch.float32)
        outs = (torch.empty(tokens, D, device=x.device, dtype=torch.bfloat16), torch.empty(tokens, n, **f32),
                torch.empty(tokens, n * n, **f32), torch.empty(tokens, **f32), torch.empty(tokens, n, **f32))
        return (x.view(tokens, n, D), phi_hi, phi_lo, alpha, bias, *outs, part_mix, part_sq, counters)

    def __call__(self, x, phi, alpha, bias, return_aux: bool = False):
        self.check_inputs(x, phi, alpha, bias)
        B, S, n, D = x.shape
        args = self._launch_args(x, phi, alpha, bias)
        if B * S:
            self._fwd(*args)
        h_in, h_post, h_res, inv_rms, h_pre = args[5:10]
        outs = (h_in.view(B, S, D), h_post.view(B, S, n), h_res.view(B, S, n, n))
        return outs + (inv_rms.view(B, S), h_pre.view(B, S, n)) if return_aux else outs
