"""mHC pre backward (`MHCBackwardPreTileLang`); its kernels are in ops/mhc/kernels, the design in
docs/design/mhc.md.

The math (golden/mhc_pre_bwd.py): per token, the gradient of x first needs reductions over the whole
token, p = g_in . x_i (n dots over D) and g_s = u . h_mix (u from p and the other output gradients),
so x has to be seen twice. Two ways:

One pass (`mhc_pre_bwd_one_pass`, n <= 4 where a CTA per (D-slice, token group) fits the SM budget,
`one_pass`): a grad role streams token tiles of its D-slice and writes grad_x and grad_phi^T partials; in
the same CTA a row role claims whole token rows from a counter, reads them from memory a few tiles ahead,
reduces their dots, turns them into the coefficients of grad_x (from the forward's saved h_mix, so no GEMM)
and publishes them per tile; the grad roles of every slice wait for that count and re-read x and g_in from
L2, so memory sees them once. Rows go to whichever CTAs run, so no CTA waits for one that found no SM (another
stream's kernel holding them): the op slows down but never waits for that kernel.

Two kernels (n = 6, 8, and D too wide for the one pass's resident grid): `mhc_pre_bwd_stats` (per token
tile, streaming over D: h_mix recomputed on the tensor cores, the dots, the coefficients and the
grad_bias / grad_alpha terms), then `mhc_pre_bwd_grad` (per D-slice and token group, streaming over
tokens: grad_x and grad_phi^T partials from one read of the x and g_in tiles).

Token reductions (grad_phi over token groups, grad_bias, grad_alpha over tokens) are sums of per-CTA
(grad_phi) or per-token partials in a fixed order: bitwise reproducible, no float atomics. grad_phi's
partials are summed and transposed by one small kernel (`mhc_pre_bwd_phi_sum`).

With `sinkhorn_iters` >= 1 (h_res was the Sinkhorn projection comb), a small kernel first carries the gradient
of comb back to the logits (`mhc_pre_sinkhorn_bwd`, one thread per token, the iterations recomputed from the
saved h_mix and inv_rms); the kernels above take that as the gradient of h_res.
"""

import torch

from ..common.protocol import Op
from ..common.runtime import compile_kernel, resolve_config
from ..common.validate import check_float, check_int, check_tensor
from .kernels.bwd_one_pass import mhc_pre_bwd_one_pass_kernel
from .kernels.bwd_two_pass import mhc_pre_bwd_grad_kernel, mhc_pre_bwd_stats_kernel
from .kernels.phi_split import mhc_phi_split_kernel
from .kernels.phi_sum import mhc_pre_bwd_phi_sum_kernel
from .kernels.sinkhorn import mhc_pre_sinkhorn_bwd_kernel
from .pre import check_sinkhorn_iters, check_x
from .tiling import (_OP_BLOCK, _OP_MIN_STAGES, _coef_cols, _dims, _slices, _smem_bytes, _smem_limit, _stats_stages,
                     backward_config_space, backward_default_config, check_num_sms, one_pass, one_pass_groups)


def grad_kernel(n: int, D: int, has_g_in: bool = True, has_g_post: bool = True, has_g_res: bool = True,
                block_t: int = 64, block_d: int = 64, token_groups: int = 4, num_stages: int = 1,
                num_sms: int | None = None):
    """The kernel that writes grad_x for (n, D): the one pass where `one_pass(n, D, num_sms)`, else the
    pipelined grad kernel (after the stats kernel; it reads no g_post / g_res)."""
    if one_pass(n, D, num_sms):
        return mhc_pre_bwd_one_pass_kernel(n, D, has_g_in, has_g_post, has_g_res, token_groups, num_stages)
    return mhc_pre_bwd_grad_kernel(n, D, has_g_in, token_groups, block_t, block_d, num_stages)


class MHCBackwardPreTileLang(Op):
    """mHC pre backward: ``op(x, phi, alpha, bias, inv_rms, h_pre, h_mix, grad_h_in, grad_h_post,
    grad_h_res) -> (grad_x, grad_phi, grad_alpha, grad_bias)``; see golden/mhc_pre_bwd.py.

    x [..., n, D] bf16, phi [n*n+2n, n*D], alpha [3], bias [n*n+2n], and the forward's inv_rms [...],
    h_pre [..., n] and h_mix [..., n*n+2n] (fp32, ``return_aux``; the one pass reads h_mix, the two
    kernels recompute it); output gradients grad_h_in [..., D] bf16, grad_h_post [..., n] fp32,
    grad_h_res [..., n, n] fp32, each may be None (zero, never read). Returns grad_x [..., n, D] bf16,
    grad_phi [n*n+2n, n*D], grad_alpha [3], grad_bias [n*n+2n] fp32. The leading dimensions are free at
    call time. With ``sinkhorn_iters`` >= 1 (and its ``hc_eps``), as the forward's, grad_h_res is the gradient
    of comb. Kernels for the all-gradients case are built at construction, those for a pattern of absent
    gradients on its first call. n = 5 and 7 are not supported (no tiling fits shared memory). ``num_sms``
    (default None: the whole GPU) bounds the one pass's persistent grid (a CTA per 64-column slice and token
    group), for callers that keep SMs for communication; where not even one token group fits it, the two kernels
    run (no persistent grid).
    """

    op_name = "mhc_pre_bwd"
    # The bench shapes, without and with DeepSeek-V4's 20 Sinkhorn iterations.
    warm_specs = tuple(dict(B=1, S=16384, n=4, D=D, sinkhorn_iters=k) for D in (4096, 7168) for k in (0, 20))

    @classmethod
    def default_config(cls, spec: dict) -> dict:
        return backward_default_config(spec["n"], spec["D"])

    @classmethod
    def config_space(cls, spec: dict) -> list[dict]:
        return backward_config_space(spec["n"], spec["D"])

    @classmethod
    def tunable_kernel(cls, spec: dict):
        """The kernel that writes grad_x (`grad_kernel`): the one pass, or the two kernels' grad kernel."""
        return grad_kernel

    def __init__(self, B: int, S: int, n: int, D: int, config: dict | None = None, *, hc_eps: float = 1e-6,
                 sinkhorn_iters: int = 0, num_sms: int | None = None):
        check_int("B", B, lo=1)
        check_int("S", S, lo=1)
        check_int("n", n, lo=1, hi=8)
        if n in (5, 7):
            raise ValueError(f"n: expected one of 1, 2, 3, 4, 6, 8 (no tiling of the backward fits shared "
                             f"memory for n=5 or 7), got {n}")
        check_int("D", D, lo=8, hi=16384, multiple_of=8)
        hc_eps = check_float("hc_eps", hc_eps, lo=0)
        check_sinkhorn_iters(sinkhorn_iters)
        self.num_sms = budget = check_num_sms(num_sms)
        self.n, self.D, self.hc_eps, self.sinkhorn_iters = n, D, hc_eps, sinkhorn_iters
        self._one = one = one_pass(n, D, budget)
        # Neither hc_eps nor sinkhorn_iters is part of the spec: they change neither the tunable kernel nor its
        # config.
        self.spec = {"n": n, "D": D}
        self.config = resolve_config(self.op_name, self.spec, config, backward_default_config(n, D, budget))
        if one and config is None:  # a stored config (tuned on the whole GPU) within the budget
            self.config["token_groups"] = min(self.config["token_groups"], one_pass_groups(D, budget))
        cfg = self.config
        check_int("config['block_t']", cfg["block_t"], lo=64, hi=128, multiple_of=64)
        check_int("config['block_d']", cfg["block_d"], lo=16, hi=128, power_of_two=True)
        if n * cfg["block_d"] % 64:
            raise ValueError(f"config: n*block_d must be a multiple of 64, got n={n}, block_d={cfg['block_d']}")
        check_int("config['token_groups']", cfg["token_groups"], lo=1, hi=64)
        check_int("config['num_stages']", cfg["num_stages"], lo=1, hi=4)
        if one:
            if (cfg["block_t"], cfg["block_d"]) != (_OP_BLOCK, _OP_BLOCK):
                raise ValueError(f"config: block_t and block_d must be {_OP_BLOCK} for n={n} (the one-pass kernel), "
                                 f"got {cfg['block_t']} and {cfg['block_d']}")
            if cfg["num_stages"] < _OP_MIN_STAGES:
                raise ValueError(f"config['num_stages']: expected >= {_OP_MIN_STAGES} for n={n} (the one-pass "
                                 f"kernel hands a stage back one tile late), got {cfg['num_stages']}")
            if _slices(D) * cfg["token_groups"] > budget:
                raise ValueError(f"config['token_groups']: expected <= {one_pass_groups(D, budget)} for D={D} (the one "
                                 f"pass's persistent grid within {budget} SMs), got {cfg['token_groups']}")
        need = _smem_bytes(n, D, cfg["block_t"], cfg["block_d"], cfg["num_stages"], budget)
        if need > _smem_limit(n, D, budget):
            raise ValueError(f"config: {cfg} needs about {need} bytes of shared memory for n={n}, "
                             f"over {_smem_limit(n, D, budget)}")
        self._split = compile_kernel(mhc_phi_split_kernel(n, D))
        self._phi_sum = compile_kernel(mhc_pre_bwd_phi_sum_kernel(n, D, cfg["token_groups"], cfg["block_d"]))
        self._stats, self._grad = {}, {}
        self._kernels(True, True, True)
        self._placeholders = {}
        self._sinkhorn_bwd = (compile_kernel(mhc_pre_sinkhorn_bwd_kernel(n, sinkhorn_iters, hc_eps))
                              if sinkhorn_iters else None)

    def _kernels(self, has_g_in: bool, has_g_post: bool, has_g_res: bool):
        """The kernels of a pattern of present gradients: the one pass (built alone), or stats and grad."""
        cfg, n, D = self.config, self.n, self.D
        tiles = {k: cfg[k] for k in ("block_t", "block_d")}
        key = (has_g_in, has_g_post, has_g_res)
        if self._one:
            if key not in self._grad:
                self._grad[key] = compile_kernel(grad_kernel(n, D, *key, **cfg, num_sms=self.num_sms))
            return None, self._grad[key]
        if key not in self._stats:
            stages = _stats_stages(n, cfg["block_t"], cfg["block_d"])
            self._stats[key] = compile_kernel(mhc_pre_bwd_stats_kernel(n, D, *key, num_stages=stages, **tiles))
        if has_g_in not in self._grad:
            self._grad[has_g_in] = compile_kernel(grad_kernel(
                n, D, has_g_in, token_groups=cfg["token_groups"], num_stages=cfg["num_stages"], num_sms=self.num_sms,
                **tiles))
        return self._stats[key], self._grad[has_g_in]

    def check_inputs(self, x, phi, alpha, bias, inv_rms, h_pre, h_mix, grad_h_in=None, grad_h_post=None,
                     grad_h_res=None) -> None:
        n, D, M = self.n, self.D, self.n * self.n + 2 * self.n
        check_x(x, n, D)
        lead = tuple(x.shape[:-2])
        dev = x.device
        check_tensor("phi", phi, torch.float32, (M, n * D), device=dev)
        check_tensor("alpha", alpha, torch.float32, (3,), device=dev)
        check_tensor("bias", bias, torch.float32, (M,), device=dev)
        check_tensor("inv_rms", inv_rms, torch.float32, lead, device=dev)
        check_tensor("h_pre", h_pre, torch.float32, (*lead, n), device=dev)
        check_tensor("h_mix", h_mix, torch.float32, (*lead, M), device=dev)
        for name, g, dtype, shape in (("grad_h_in", grad_h_in, torch.bfloat16, (*lead, D)),
                                      ("grad_h_post", grad_h_post, torch.float32, (*lead, n)),
                                      ("grad_h_res", grad_h_res, torch.float32, (*lead, n, n))):
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
        tokens, dev = x.numel() // (n * D), x.device
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
        if self._one:
            g_mix = torch.empty(tokens, 2, NP, device=dev, dtype=torch.bfloat16)  # bf16 hi, lo
            # Per-tile counts, then a row counter per token group and the count of finished CTAs (zeroed again by
            # the kernel's last CTA).
            tiles = -(-tokens // _OP_BLOCK)
            counters = torch.zeros(tiles + cfg["token_groups"] + 1, device=dev, dtype=torch.int32)
            # A row of terms per token: g_z of each row of phi, then the three alpha terms.
            terms = torch.empty(tokens, M + 3, **f32)
            return None, (x.view(tokens, n, D), phi_hi, phi_lo, alpha, bias, inv_rms.view(tokens),
                          h_pre.view(tokens, n), h_mix.view(tokens, M), g_in, g_post, g_res, g_mix, coef,
                          counters[:tiles], counters[tiles:], terms, grad_x, part_phi_t)
        x2, g_mix = x.view(tokens, n * D), torch.empty(tokens, NP, **f32)
        # Each kernel's outputs come last: terms (per token) and (grad_x, part_phi_t).
        stats_args = (x2, phi_hl.view(2 * NG, n * Dp), alpha, bias, inv_rms.view(tokens), h_pre.view(tokens, n),
                      g_in, g_post, g_res, g_mix, coef, torch.empty(tokens, M + 3, **f32))
        return stats_args, (x2, phi_hi, phi_lo, g_in, g_mix, coef, grad_x, part_phi_t)

    def tune_args(self, x, phi, alpha, bias, inv_rms, h_pre, h_mix, grad_h_in=None, grad_h_post=None,
                  grad_h_res=None):
        """Arguments of the grad kernel (the tunable one) for these call inputs; runs the stats kernel
        so that they hold real values. The one pass's counters are zeroed here and again by each run's last CTA,
        so every timed run does the whole work."""
        call = (x, phi, alpha, bias, inv_rms, h_pre, h_mix, grad_h_in, grad_h_post, grad_h_res)
        self.check_inputs(*call)
        call = call[:9] + (self._logit_grad(alpha, bias, inv_rms, h_mix, grad_h_res),)
        stats_args, grad_args = self._launch_args(*call)
        stats = self._kernels(*(g is not None for g in call[7:]))[0]
        if stats is not None:
            stats(*stats_args)
        return grad_args

    def _logit_grad(self, alpha, bias, inv_rms, h_mix, grad_h_res):
        """The gradient of the h_res logits: grad_h_res itself, or with Sinkhorn carried back from comb's."""
        if self._sinkhorn_bwd is None or grad_h_res is None or grad_h_res.numel() == 0:
            return grad_h_res
        n = self.n
        tokens = grad_h_res.numel() // (n * n)
        g_logits = torch.empty(tokens, n * n, device=grad_h_res.device, dtype=torch.float32)
        self._sinkhorn_bwd(h_mix.view(tokens, -1), inv_rms.view(tokens), alpha, bias,
                           grad_h_res.view(tokens, n * n), g_logits)
        return g_logits.view(grad_h_res.shape)

    def __call__(self, x, phi, alpha, bias, inv_rms, h_pre, h_mix, grad_h_in=None, grad_h_post=None,
                 grad_h_res=None):
        call = (x, phi, alpha, bias, inv_rms, h_pre, h_mix, grad_h_in, grad_h_post, grad_h_res)
        self.check_inputs(*call)
        n, D = self.n, self.D
        M = n * n + 2 * n
        present = tuple(g is not None for g in call[7:])
        if x.numel() == 0 or not any(present):
            return (torch.zeros_like(x), torch.zeros_like(phi), torch.zeros_like(alpha), torch.zeros_like(bias))
        call = call[:9] + (self._logit_grad(alpha, bias, inv_rms, h_mix, grad_h_res),)
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
        return grad_x.view(x.shape), grad_phi, sums[M:], sums[:M]
