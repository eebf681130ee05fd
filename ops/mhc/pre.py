"""mHC pre forward (`MHCForwardPreTileLang`); its kernels are in ops/mhc/kernels, the design in
docs/design/mhc.md.

Two kernels (the default; x is read twice), neither persistent nor waiting on another CTA, so the op runs on
whatever SMs another stream leaves it:
1. `mhc_pre_mix`: per tile of `block_t` tokens, the full n*D reduction, pipelined over K, with the sum
   of squares from the same tiles; its epilogue writes h_pre, h_post, h_res and inv_rms.
2. `mhc_pre_apply`: h_in = sum_i h_pre[i] * x[i, :], a bandwidth-bound pass.

Single pass (`mhc_pre_fused`, opt-in with ``single_pass=True``, shapes where `fused_fits`): x is read from
memory once. A cluster of 16 CTAs owns a tile of 64 tokens, each CTA D / 16 columns of every stream. A
producer warpgroup streams the CTA's x chunks by TMA into a ring that holds the whole share (plus slack for
the next tile) and phi's chunks (from L2) into a shallower ring; the consumer warpgroup accumulates its
partial h_mix = x @ phi^T on bf16 tensor cores (phi split into bf16 hi + lo parts: ~16 mantissa bits, more
than TF32) and the sum of squares, exchanges partials with the other 15 CTAs through distributed shared
memory (a reduce-scatter, then an all-gather of h_pre), and writes h_in = sum_i h_pre[i] * x[i, :] from the
chunks still in shared memory. Clusters are persistent, as many as the SM budget holds at once; the SMs no
cluster takes run the last tokens (`side_tokens`) in a side kernel (`mhc_pre_mix` with `apply`), launched
right behind (programmatic dependent launch: the single pass triggers at its start). It is not the default
because a 16-CTA cluster needs 16 free SMs in one GPC: while another stream's kernel holds SMs spread over
the GPCs (40 of 132 on an H200), no cluster can start and the op waits for that kernel to end.

With `sinkhorn_iters` >= 1 h_res is the logits' Sinkhorn projection comb: the mix kernel's epilogue computes it
(one thread per token of its tile); after the single pass a small kernel (`mhc_pre_sinkhorn`, one thread per
token) turns the logits it wrote into comb, in place.
"""

import torch

from ..common.hw import SMEM_BUDGET
from ..common.protocol import Op
from ..common.runtime import compile_kernel, compile_kernels, max_active_clusters, resolve_config, sm_count
from ..common.validate import check_bool, check_choice, check_float, check_int, check_tensor
from .kernels.fwd_fused import mhc_pre_fused_kernel
from .kernels.fwd_mix import mhc_pre_apply_kernel, mhc_pre_mix_kernel
from .kernels.phi_split import mhc_phi_split_kernel
from .kernels.sinkhorn import mhc_pre_sinkhorn_kernel
from .tiling import (_CLUSTER, _D_PAD, _SIDE_CONFIG, SINKHORN_MAX_ITERS, _round_up, _thread_choices, check_num_sms,
                     check_splits, forward_config_space, forward_default_config, forward_small_config, fused_chunks,
                     fused_fits, fused_smem_bytes, mix_chunks, mix_smem_bytes, phi_split_rows, side_tokens,
                     small_tokens_limit)


def check_x(x, n: int | None = None, D: int | None = None) -> None:
    """x [..., n, D] bf16, CUDA, contiguous (n, D None: any); any number of leading dimensions."""
    shape = None
    if isinstance(x, torch.Tensor):
        if x.dim() < 2:
            raise ValueError(f"x: expected shape [..., n, D], got {list(x.shape)}")
        shape = (None,) * (x.dim() - 2) + (n, D)
    check_tensor("x", x, torch.bfloat16, shape)


def check_sinkhorn_iters(sinkhorn_iters) -> None:
    """An int in [0, SINKHORN_MAX_ITERS]. A symbolic int (a custom op's fake under torch.compile's dynamic
    shapes) passes here: the op checks the concrete value when it is built."""
    if not isinstance(sinkhorn_iters, torch.SymInt):
        check_int("sinkhorn_iters", sinkhorn_iters, lo=0, hi=SINKHORN_MAX_ITERS)


_NO_SPLITS: dict = {}  # per device: the one-element workspace stand-ins of kernels that do not split


def split_workspace(tokens: int, width: int, device, configs: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """A mix kernel's split partials (flat [tiles, splits, block_t, width + 1]) and per-tile arrival counts (zero:
    each tile's last CTA zeroes its count again), large enough for each of `configs` (the autotuner runs them all
    on one set of arguments); one-element stand-ins, which no kernel touches, when none of them splits."""
    split = [c for c in configs if c["splits"] > 1]
    if not split:
        if device not in _NO_SPLITS:
            _NO_SPLITS[device] = (torch.empty(1, device=device), torch.zeros(1, device=device, dtype=torch.int32))
        return _NO_SPLITS[device]
    tiles = [-(-tokens // c["block_t"]) for c in split]
    part = max(t * c["splits"] * c["block_t"] for t, c in zip(tiles, split))
    return (torch.empty(part * (width + 1), device=device), torch.zeros(max(tiles), device=device, dtype=torch.int32))


def build_mix_kernels(apply, make_mix, config: dict, small: dict | None) -> tuple:
    """(apply kernel, mix kernel, (small-token mix kernel, its config) or None), built concurrently: `apply` and
    `make_mix(config)`, and `make_mix(small)` when `small` is a config other than `config`."""
    mixes = [config] + ([small] if small and small != config else [])
    apply_kernel, mix, *rest = compile_kernels(apply, *(make_mix(c) for c in mixes))
    return apply_kernel, mix, ((rest[0], small) if rest else None)


def mix_for_tokens(small, default, tokens: int, device) -> tuple:
    """(mix kernel, its config) for a call of `tokens`: `small` (the op's small-token kernel and config, or None) up
    to its token limit (its grid fills the GPU where the default's would leave most SMs idle), else `default`."""
    if small is not None and tokens <= small_tokens_limit(small[1]["splits"], sm_count(device)):
        return small
    return default


class MHCForwardPreTileLang(Op):
    """mHC pre forward: ``op(x, phi, alpha, bias) -> (h_in, h_post, h_res)``; see golden/mhc_pre.py.

    x [..., n, D] bf16 (HF's [B, S, n, D], or any leading dimensions), phi [n*n+2n, n*D] fp32, alpha [3] fp32,
    bias [n*n+2n] fp32 (CUDA, contiguous). The leading dimensions are free at call time (one compiled kernel
    serves any number of tokens; the constructor's B and S are only checked); n and D are fixed at
    construction. h_res [..., n, n] is the raw logits, or with ``sinkhorn_iters`` >= 1 their Sinkhorn
    projection comb (DeepSeek-V4 runs 20). ``return_aux=True`` also returns inv_rms [...], h_pre [..., n] and
    h_mix [..., n*n+2n] (x @ phi^T before the inv_rms scale; fp32), which the backward needs. The matmul runs
    on bf16 tensor cores with phi split into hi + lo parts. The default path is the two kernels (nothing
    persistent: it keeps running at its share when another stream holds SMs). ``single_pass=True`` (only where
    `fused_fits`: D a multiple of 1024 with n*D >= 8192 and its ring fitting, e.g. n = 4, D = 2048 or 4096)
    runs the cluster single pass instead: up to 1.6x faster on a GPU that no other stream shares (4096
    tokens; 8% at 16384), but it waits for any kernel that holds SMs in every GPC (module docstring); its
    config keys are ``x_slots`` and ``phi_stages``. ``num_sms`` (default None: the whole GPU) bounds its
    persistent clusters and side kernel, for callers that keep SMs for communication; the two kernels have no
    persistent grid and need no budget. Without a ``config``, small token counts (up to `small_tokens_limit`:
    ~2000 on 132 SMs, e.g. a decode step's batch) run a second mix kernel whose 64-token tiles split their columns
    over up to 8 CTAs (`forward_small_config`), as the default's tiles would leave most SMs idle.
    """

    op_name = "mhc_pre"
    # The bench shapes, without and with DeepSeek-V4's 20 Sinkhorn iterations.
    warm_specs = tuple(dict(B=1, S=16384, n=4, D=D, sinkhorn_iters=k) for D in (4096, 7168) for k in (0, 20))

    @classmethod
    def default_config(cls, spec: dict) -> dict:
        return forward_default_config(spec["n"], spec["D"])

    @classmethod
    def config_space(cls, spec: dict) -> list[dict]:
        return forward_config_space(spec["n"], spec["D"])

    @classmethod
    def tunable_kernel(cls, spec: dict):
        """The mix kernel (the default path's; the opt-in single pass is not autotuned)."""
        return mhc_pre_mix_kernel

    def __init__(self, B: int, S: int, n: int, D: int, rms_eps: float = 1e-6, hc_eps: float = 1e-6,
                 sinkhorn_iters: int = 0, config: dict | None = None, *, num_sms: int | None = None,
                 single_pass: bool = False):
        check_int("B", B, lo=1)
        check_int("S", S, lo=1)
        check_int("n", n, lo=1, hi=8)
        check_int("D", D, lo=8, hi=16384, multiple_of=8)
        rms_eps = check_float("rms_eps", rms_eps, lo=0)
        hc_eps = check_float("hc_eps", hc_eps, lo=0)
        check_sinkhorn_iters(sinkhorn_iters)
        self.num_sms = check_num_sms(num_sms)
        check_bool("single_pass", single_pass)
        if single_pass and not fused_fits(n, D):
            raise ValueError(f"single_pass: expected False for n={n}, D={D} (the single pass needs D a multiple of "
                             f"{_CLUSTER * 64}, n*D >= 8192 and its ring in shared memory), got True")
        if single_pass and self.num_sms < _CLUSTER:
            raise ValueError(f"num_sms: expected >= {_CLUSTER} with single_pass=True (one {_CLUSTER}-CTA cluster), "
                             f"got {self.num_sms}")
        self.n, self.D, self.sinkhorn_iters = n, D, sinkhorn_iters
        # sinkhorn_iters is not part of the spec: it changes neither the tunable kernel nor its config.
        self.spec = {"n": n, "D": D, "rms_eps": rms_eps, "hc_eps": hc_eps}
        self.config = resolve_config(self.op_name, self.spec, config, forward_default_config(n, D, single_pass))
        if single_pass:
            check_int("config['x_slots']", self.config["x_slots"], lo=fused_chunks(n, D))
            check_int("config['phi_stages']", self.config["phi_stages"], lo=2)
            smem = fused_smem_bytes(n, **self.config)
        else:
            check_int("config['block_t']", self.config["block_t"], lo=64, hi=128, multiple_of=64)
            check_int("config['block_k']", self.config["block_k"], lo=64, hi=_D_PAD, multiple_of=64)
            check_int("config['num_stages']", self.config["num_stages"], lo=1, hi=4)
            check_choice("config['threads']", self.config["threads"], _thread_choices(self.config["block_t"]))
            check_int("config['splits']", self.config["splits"], lo=1, hi=16)
            check_splits(self.config["splits"], mix_chunks(n, D, self.config["block_k"]), self.config["num_stages"],
                         f"n={n}, D={D} (block_k={self.config['block_k']})")
            smem = mix_smem_bytes(n, **self.config)
        if smem > SMEM_BUDGET:
            raise ValueError(f"config: expected a config within {SMEM_BUDGET} bytes of shared memory, "
                             f"got {self.config} needing {smem}")
        self._split = compile_kernel(mhc_phi_split_kernel(n, D))
        self._phi_parts = {}
        self._fused = self._mix = self._apply = self._side = self._small = None
        if single_pass:
            self._fused = compile_kernel(mhc_pre_fused_kernel(**self.spec, **self.config))
            self._side = compile_kernel(mhc_pre_mix_kernel(**self.spec, **_SIDE_CONFIG, apply=True))
        else:
            # Without a config of the caller's, small token counts get their own split mix kernel (`_mix_for`).
            self._apply, self._mix, self._small = build_mix_kernels(
                mhc_pre_apply_kernel(n, D),
                lambda c: mhc_pre_mix_kernel(**self.spec, **c, sinkhorn_iters=sinkhorn_iters),
                self.config, forward_small_config(n, D) if config is None else None)
        # the mix kernel projects h_res itself; the single pass leaves it to the Sinkhorn kernel
        self._sinkhorn = (compile_kernel(mhc_pre_sinkhorn_kernel(n, sinkhorn_iters, hc_eps))
                          if sinkhorn_iters and single_pass else None)

    def check_inputs(self, x, phi, alpha, bias) -> None:
        n, D = self.n, self.D
        N = n * n + 2 * n
        check_x(x, n, D)
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

    @staticmethod
    def _outputs(x):
        """Empty h_in, h_post, h_res, inv_rms, h_pre, h_mix for x's tokens (flattened)."""
        n, D = x.shape[-2:]
        tokens = x.numel() // (n * D)
        f32 = dict(device=x.device, dtype=torch.float32)
        return (torch.empty(tokens, D, device=x.device, dtype=torch.bfloat16), torch.empty(tokens, n, **f32),
                torch.empty(tokens, n * n, **f32), torch.empty(tokens, **f32), torch.empty(tokens, n, **f32),
                torch.empty(tokens, n * n + 2 * n, **f32))

    def _mix_for(self, tokens: int, device) -> tuple:
        return mix_for_tokens(self._small, (self._mix, self.config), tokens, device)

    def _kernel_args(self, x, phi, alpha, bias, outs, configs=None):
        """Arguments of the tunable kernel: the fused kernel takes all outputs and the cluster count, the mix
        kernel all outputs with h_in last (it writes h_in only as the side kernel), then its split workspace
        (for `configs`, default the op's own)."""
        head = (x.view(outs[0].shape[0], *x.shape[-2:]), *self._split_phi(phi), alpha, bias)
        if self._fused is None:
            work = split_workspace(outs[0].shape[0], phi_split_rows(self.n), x.device, configs or [self.config])
            return head + outs[1:] + outs[:1] + work
        # One CTA per SM whatever its shared memory: 256 threads of up to 240 registers fill the file. As many
        # clusters as the GPU holds, within the SM budget.
        clusters = min(max_active_clusters(_CLUSTER, 256, SMEM_BUDGET, x.device.index), self.num_sms // _CLUSTER)
        return head + outs + (clusters,)

    def _launch_fused(self, x2, hi, lo, alpha, bias, *outs_and_clusters):
        """The single pass over the first tokens and the side kernel over the last ones (`side_tokens`), on
        the SMs of the budget that no cluster takes."""
        *outs, clusters = outs_and_clusters
        tokens = x2.shape[0]
        side = side_tokens(tokens, min(self.num_sms, sm_count(x2.device)) - _CLUSTER * clusters)
        m = tokens - side
        self._fused(x2[:m], hi, lo, alpha, bias, *(o[:m] for o in outs), clusters)
        if side:  # the mix kernel's order: h_in last
            self._side(x2[m:], hi, lo, alpha, bias, *(o[m:] for o in outs[1:]), outs[0][m:],
                       *split_workspace(side, phi_split_rows(self.n), x2.device, [_SIDE_CONFIG]))

    def tune_args(self, x, phi, alpha, bias):
        """Arguments of the tunable kernel (``tunable_kernel``) for these inputs, with a split workspace large
        enough for every config of the space (the tuner runs them all on these arguments)."""
        self.check_inputs(x, phi, alpha, bias)
        return self._kernel_args(x, phi, alpha, bias, self._outputs(x), self.config_space(self.spec))

    def __call__(self, x, phi, alpha, bias, return_aux: bool = False):
        self.check_inputs(x, phi, alpha, bias)
        *lead, n, D = x.shape
        h_in, h_post, h_res, inv_rms, h_pre, h_mix = outs = self._outputs(x)
        mix, config = (None, None) if self._fused is not None else self._mix_for(h_in.shape[0], x.device)
        args = self._kernel_args(x, phi, alpha, bias, outs, [config] if config else None)
        if h_in.shape[0]:
            if self._fused is not None:
                self._launch_fused(*args)
            else:
                mix(*args)
                self._apply(args[0], h_pre, h_in)
            if self._sinkhorn is not None:  # the logits the kernels wrote become comb, in place
                self._sinkhorn(h_res)
        result = (h_in.view(*lead, D), h_post.view(*lead, n), h_res.view(*lead, n, n))
        aux = (inv_rms.view(lead), h_pre.view(*lead, n), h_mix.view(*lead, n * n + 2 * n))
        return result + aux if return_aux else result
