"""mHC post (`MHCPostTileLang`, `MHCPostBackwardTileLang`): the hyper-connection expand of DeepSeek-V4's decoder
layer, out[k] = post[k] * layer_out + sum_j comb[j, k] * residual[j] per token (golden/mhc_post.py), and its
gradients; and for inference the post fused with the next sublayer's pre (`MHCPostPreTileLang`). Kernels:
ops/mhc/kernels/post.py, post_pre.py (with the pre's apply, phi split and Sinkhorn kernels); design:
docs/design/mhc.md (mHC post section).

Any leading dimensions (HF passes [B, S, n, D]; [T, n, D] works the same): they are flattened to tokens, and
residual, layer_out, post and comb must share them. One compiled kernel serves any number of tokens."""

from __future__ import annotations

import torch

from ..common.hw import SMEM_BUDGET
from ..common.protocol import Op
from ..common.runtime import compile_kernel, resolve_config
from ..common.validate import check_choice, check_float, check_int, check_tensor
from .kernels.fwd_mix import mhc_pre_apply_kernel
from .kernels.phi_split import mhc_phi_split_kernel
from .kernels.post import mhc_post_bwd_kernel, mhc_post_kernel
from .kernels.post_pre import VEC, mhc_post_mix_kernel
from .pre import build_mix_kernels, check_sinkhorn_iters, mix_for_tokens, split_workspace
from .tiling import _D_PAD, _round_up, check_splits, phi_split_rows, small_splits, splits_fit

MAX_N, MAX_D = 8, 16384  # the pre's range: the post feeds the next pre
_THREADS = (128, 256)


def check_post_dims(n, D) -> None:
    """n residual streams of D columns: n in 1..8, D a multiple of 8 (16-byte rows) up to 16384."""
    check_int("n", n, lo=1, hi=MAX_N)
    check_int("D", D, lo=8, hi=MAX_D, multiple_of=8)


def check_post_inputs(n: int, D: int, residual, layer_out, post, comb, **more) -> tuple[int, ...]:
    """Check the post's operands (and ``more``: name -> (tensor, dtype, trailing shape) sharing residual's leading
    dimensions) before any launch; returns the leading dimensions. Shapes first (all of them, so a mismatch of
    leading dimensions is named as such), then dtypes, then devices (residual's), contiguity and alignment."""
    operands = {"residual": (residual, torch.bfloat16, (n, D)), "layer_out": (layer_out, torch.bfloat16, (D,)),
                "post": (post, torch.float32, (n,)), "comb": (comb, torch.float32, (n, n)), **more}
    for name, (t, _, _) in operands.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    lead = None
    for name, (t, _, tail) in operands.items():
        k = len(tail)
        if t.dim() < k or tuple(t.shape[t.dim() - k:]) != tail:
            want = ", ".join(str(s) for s in tail)
            raise ValueError(f"{name}: expected shape [..., {want}], got {list(t.shape)}")
        if lead is None:
            lead = tuple(t.shape[:t.dim() - k])
        elif tuple(t.shape[:t.dim() - k]) != lead:
            raise ValueError(f"{name}: expected the leading dimensions {list(lead)} of residual, "
                             f"got {list(t.shape[:t.dim() - k])}")
    for name, (t, dtype, _) in operands.items():
        if t.dtype != dtype:
            raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    for name, (t, _, _) in operands.items():
        check_tensor(name, t, device=residual.device if name != "residual" else None)
        if t.data_ptr() % 16:  # the kernels' 16-byte vector accesses and TMA boxes
            raise ValueError(f"{name}: expected a 16-byte aligned tensor, got data_ptr() % 16 == {t.data_ptr() % 16} "
                             "(a view at an odd offset: pass a copy)")
    return lead


def _default_tokens_per_thread(n: int) -> int:
    """Tokens per thread of the forward: about 20 loads of 16 bytes in flight per thread (n + 1 per token), a
    power of two."""
    return 1 << max(0, (20 // (n + 1)).bit_length() - 1)


class MHCPostTileLang(Op):
    """mHC post forward: ``op(residual, layer_out, post, comb) -> out``; see golden/mhc_post.py.

    residual [..., n, D] bf16, layer_out [..., D] bf16, post [..., n] fp32, comb [..., n, n] fp32 (CUDA,
    contiguous, the same leading dimensions) -> out [..., n, D] bf16, out[k] = post[k] * layer_out +
    sum_j comb[j, k] * residual[j] in fp32, rounded once. n (1-8) and D (a multiple of 8 up to 16384) are fixed
    at construction; the leading dimensions are free at call time. The differentiable functional form (a
    ``torch.library`` custom op): ``ops.mhc.custom_ops.mhc_post``.
    """

    op_name = "mhc_post"
    warm_specs = (dict(n=4, D=4096), dict(n=4, D=7168))  # the bench shapes

    @classmethod
    def default_config(cls, spec: dict) -> dict:
        return {"threads": 128, "tokens_per_thread": _default_tokens_per_thread(spec["n"])}

    @classmethod
    def config_space(cls, spec: dict) -> list[dict]:
        return [{"threads": th, "tokens_per_thread": u} for th in _THREADS for u in (1, 2, 4, 8)
                if u * (spec["n"] + 1) <= 40]

    @classmethod
    def tunable_kernel(cls, spec: dict):
        return mhc_post_kernel

    def __init__(self, n: int, D: int, config: dict | None = None):
        check_post_dims(n, D)
        self.n, self.D = n, D
        self.spec = {"n": n, "D": D}
        self.config = resolve_config(self.op_name, self.spec, config, self.default_config(self.spec))
        check_choice("config['threads']", self.config["threads"], _THREADS)
        check_int("config['tokens_per_thread']", self.config["tokens_per_thread"], lo=1, hi=16)
        self._kernel = compile_kernel(mhc_post_kernel(n, D, **self.config))

    def check_inputs(self, residual, layer_out, post, comb) -> tuple[int, ...]:
        return check_post_inputs(self.n, self.D, residual, layer_out, post, comb)

    def _args(self, residual, layer_out, post, comb, out):
        n, D = self.n, self.D
        tokens = out.numel() // (n * D)
        return (residual.view(tokens, n, D), layer_out.view(tokens, D), post.view(tokens, n),
                comb.view(tokens, n, n), out.view(tokens, n, D))

    def tune_args(self, residual, layer_out, post, comb):
        self.check_inputs(residual, layer_out, post, comb)
        return self._args(residual, layer_out, post, comb, torch.empty_like(residual))

    def __call__(self, residual, layer_out, post, comb):
        self.check_inputs(residual, layer_out, post, comb)
        out = torch.empty_like(residual)
        if out.numel():
            self._kernel(*self._args(residual, layer_out, post, comb, out))
        return out


def _default_unroll(n: int) -> int:
    """Column steps of loads in flight per lane of the backward (2n + 1 loads each), as registers allow."""
    return 4 if n == 1 else 2 if n <= 4 else 1


class MHCPostBackwardTileLang(Op):
    """mHC post backward: ``op(residual, layer_out, post, comb, grad_out) -> (grad_residual, grad_layer_out,
    grad_post, grad_comb)``; see golden/mhc_post.py (``mhc_post_backward``).

    The forward's inputs and grad_out [..., n, D] bf16 (the same leading dimensions); the gradients come in their
    inputs' dtypes and shapes (bf16, bf16, fp32, fp32). grad_post and grad_comb are dot products over D, reduced in
    a fixed order (bitwise reproducible, no atomics). n and D are fixed at construction.
    """

    op_name = "mhc_post_bwd"
    warm_specs = (dict(n=4, D=4096), dict(n=4, D=7168))

    @classmethod
    def default_config(cls, spec: dict) -> dict:
        return {"threads": 128, "unroll": _default_unroll(spec["n"])}

    @classmethod
    def config_space(cls, spec: dict) -> list[dict]:
        return [{"threads": th, "unroll": u} for th in _THREADS for u in (1, 2, 4) if u * (2 * spec["n"] + 1) <= 36]

    @classmethod
    def tunable_kernel(cls, spec: dict):
        return mhc_post_bwd_kernel

    def __init__(self, n: int, D: int, config: dict | None = None):
        check_post_dims(n, D)
        self.n, self.D = n, D
        self.spec = {"n": n, "D": D}
        self.config = resolve_config(self.op_name, self.spec, config, self.default_config(self.spec))
        check_choice("config['threads']", self.config["threads"], _THREADS)
        check_int("config['unroll']", self.config["unroll"], lo=1, hi=8)
        self._kernel = compile_kernel(mhc_post_bwd_kernel(n, D, **self.config))

    def check_inputs(self, residual, layer_out, post, comb, grad_out) -> tuple[int, ...]:
        return check_post_inputs(self.n, self.D, residual, layer_out, post, comb,
                                 grad_out=(grad_out, torch.bfloat16, (self.n, self.D)))

    def _outputs(self, residual, layer_out, post, comb):
        return (torch.empty_like(residual), torch.empty_like(layer_out), torch.empty_like(post),
                torch.empty_like(comb))

    def _args(self, inputs, outputs):
        n, D = self.n, self.D
        tokens = inputs[0].numel() // (n * D)
        shapes = ((tokens, n, D), (tokens, D), (tokens, n), (tokens, n, n))
        return (*(t.view(s) for t, s in zip(inputs[:4], shapes)), inputs[4].view(tokens, n, D),
                *(t.view(s) for t, s in zip(outputs, shapes)))

    def tune_args(self, residual, layer_out, post, comb, grad_out):
        inputs = (residual, layer_out, post, comb, grad_out)
        self.check_inputs(*inputs)
        return self._args(inputs, self._outputs(*inputs[:4]))

    def __call__(self, residual, layer_out, post, comb, grad_out):
        inputs = (residual, layer_out, post, comb, grad_out)
        self.check_inputs(*inputs)
        outputs = self._outputs(*inputs[:4])
        if residual.numel():
            self._kernel(*self._args(inputs, outputs))
        return outputs


# ----------------------------------------------------------------------------- post -> pre (inference)
def post_mix_smem_bytes(n: int, block_k: int, num_stages: int, block_t: int, **_) -> int:
    """Shared memory of `mhc_post_mix`: per stage the residual's n tiles, the layer output's and phi's [hi; lo]
    tile of every stream; once the new residual's n tiles, and the epilogue's h_mix, sums of squares and the
    threads' partial sums (counted apart, though TileLang may place them over the dead stages)."""
    NG = phi_split_rows(n)
    stage = (n + 1) * block_t * block_k * 2 + n * 2 * NG * block_k * 2
    return num_stages * stage + n * block_t * block_k * 2 + block_t * (2 * NG + 1 + block_k // VEC) * 4


def post_mix_config_space(n: int, D: int) -> list[dict]:
    """Chunk widths dividing _D_PAD (phi's padding), 1-4 stages, 64 or 128 tokens a tile (phi is read once per
    tile), one to four warpgroups (at least one per 64 tokens) and 1, 2 or 4 CTAs per tile, within shared
    memory."""
    tiles = ((64, 128), (64, 256), (64, 512), (128, 256), (128, 512))  # (block_t, threads)
    return [dict(block_t=bt, threads=th, block_k=bk, num_stages=s, splits=sp) for bt, th in tiles
            for bk in (16, 32, 64, 128) for s in range(1, 5) for sp in (1, 2, 4)
            if post_mix_smem_bytes(n, bk, s, bt) <= SMEM_BUDGET and splits_fit(-(-D // bk), s, sp)]


def post_mix_default_config(n: int, D: int) -> dict:
    """Two warpgroups (the new residual's elementwise work is what bounds one: H200, n = 4, D = 4096, 730 -> 578 us)
    on 64-token tiles, the widest chunk up to 64 columns, two stages (a third where it also fits), one CTA per
    tile. Not 128-token tiles, though they read phi half as often (571 us): one CTA fills an SM, so 16384 tokens
    make 128 CTAs, about one wave, which a GPU shared with another stream runs as two (1.22 ms with 16 of 132 SMs
    held, above the 1.11 ms bound); nor split chunks (`splits`), which cost 8-13% alone (docs/design/mhc_post.md)."""
    space = post_mix_config_space(n, D)
    for th in (256, 128):
        fits = [c for c in space if c["block_t"] == 64 and c["threads"] == th and c["num_stages"] >= 2
                and c["block_k"] <= 64 and c["splits"] == 1]
        if fits:
            bk = max(c["block_k"] for c in fits)
            return dict(block_t=64, threads=th, block_k=bk, splits=1,
                        num_stages=min(3, max(c["num_stages"] for c in fits if c["block_k"] == bk)))
    raise ValueError(f"n: expected a stream count whose tiles fit in shared memory, got {n}")


def post_mix_small_config(n: int, D: int) -> dict | None:
    """The post -> pre mix kernel for small token counts (tiling.SMALL_SPLITS): the default's 64-token tiles with
    their column chunks split as `tiling.small_splits` says (None where there are too few columns to split)."""
    config = post_mix_default_config(n, D)
    splits = small_splits(-(-D // config["block_k"]), config["num_stages"])
    return splits and dict(config, splits=splits)


class MHCPostPreTileLang(Op):
    """One sublayer's mHC post and the next sublayer's pre, for inference:
    ``op(residual, layer_out, post, comb, phi, alpha, bias) -> (new_residual, h_in, h_post, h_res)``, the same as
    ``new_residual = mhc_post(residual, layer_out, post, comb)`` followed by the pre
    (``MHCForwardPreTileLang``) on it; see golden/mhc_post.py (``mhc_post_pre``).

    residual [..., n, D] bf16, layer_out [..., D] bf16, post [..., n] fp32, comb [..., n, n] fp32 (the same
    leading dimensions), and the next pre's phi [n*n+2n, n*D], alpha [3], bias [n*n+2n] fp32 (CUDA, contiguous)
    -> new_residual [..., n, D] bf16, h_in [..., D] bf16, h_post [..., n] fp32, h_res [..., n, n] fp32 (the comb
    logits, or with ``sinkhorn_iters`` >= 1 their Sinkhorn projection). Two kernels: `mhc_post_mix` (reads the
    residual once, writes the new one once, and computes the pre's mixing weights on the way, with
    ``sinkhorn_iters`` their Sinkhorn projection in its epilogue) and the pre's `mhc_pre_apply` (h_in, from the
    new residual).
    Without a ``config``, small token counts (up to `tiling.small_tokens_limit`) run a second mix kernel whose tiles
    split their column chunks over up to 8 CTAs (`post_mix_small_config`). No gradients: training runs
    ``mhc_post`` and ``mhc_pre``.
    """

    op_name = "mhc_post_pre"
    warm_specs = (dict(n=4, D=4096), dict(n=4, D=7168))  # the bench shapes

    @classmethod
    def default_config(cls, spec: dict) -> dict:
        return post_mix_default_config(spec["n"], spec["D"])

    @classmethod
    def config_space(cls, spec: dict) -> list[dict]:
        return post_mix_config_space(spec["n"], spec["D"])

    @classmethod
    def tunable_kernel(cls, spec: dict):
        return mhc_post_mix_kernel

    def __init__(self, n: int, D: int, rms_eps: float = 1e-6, hc_eps: float = 1e-6, sinkhorn_iters: int = 0,
                 config: dict | None = None):
        check_post_dims(n, D)
        rms_eps = check_float("rms_eps", rms_eps, lo=0)
        hc_eps = check_float("hc_eps", hc_eps, lo=0)
        check_sinkhorn_iters(sinkhorn_iters)
        self.n, self.D, self.sinkhorn_iters = n, D, sinkhorn_iters
        # As for the pre, sinkhorn_iters is not part of the spec: it only adds the projection to the mix kernel's
        # epilogue and changes neither its config nor what the tuner times.
        self.spec = {"n": n, "D": D, "rms_eps": rms_eps, "hc_eps": hc_eps}
        self.config = resolve_config(self.op_name, self.spec, config, self.default_config(self.spec))
        check_choice("config['block_t']", self.config["block_t"], (64, 128))
        check_choice("config['threads']", self.config["threads"], (128, 256, 512))
        if self.config["block_t"] > self.config["threads"] // 2:
            raise ValueError(f"config: expected a warpgroup (128 threads) per 64 tokens of block_t, got {self.config}")
        check_choice("config['block_k']", self.config["block_k"], (16, 32, 64, 128))
        check_int("config['num_stages']", self.config["num_stages"], lo=1, hi=4)
        check_choice("config['splits']", self.config["splits"], (1, 2, 4, 8))
        check_splits(self.config["splits"], -(-D // self.config["block_k"]), self.config["num_stages"],
                     f"D={D} (block_k={self.config['block_k']})")
        smem = post_mix_smem_bytes(n, **self.config)
        if smem > SMEM_BUDGET:
            raise ValueError(f"config: expected a config within {SMEM_BUDGET} bytes of shared memory, "
                             f"got {self.config} needing {smem}")
        self._split = compile_kernel(mhc_phi_split_kernel(n, D))
        # Without a config of the caller's, small token counts get their own split mix kernel (as the pre's).
        self._apply, self._mix, self._small = build_mix_kernels(
            mhc_pre_apply_kernel(n, D), lambda c: mhc_post_mix_kernel(**self.spec, **c, sinkhorn_iters=sinkhorn_iters),
            self.config,
            post_mix_small_config(n, D) if config is None else None)

    def check_inputs(self, residual, layer_out, post, comb, phi, alpha, bias) -> tuple[int, ...]:
        lead = check_post_inputs(self.n, self.D, residual, layer_out, post, comb)
        N, dev = self.n * self.n + 2 * self.n, residual.device
        check_tensor("phi", phi, torch.float32, (N, self.n * self.D), device=dev)
        check_tensor("alpha", alpha, torch.float32, (3,), device=dev)
        check_tensor("bias", bias, torch.float32, (N,), device=dev)
        return lead

    def _mix_for(self, tokens: int, device) -> tuple:
        return mix_for_tokens(self._small, (self._mix, self.config), tokens, device)

    def _args(self, residual, layer_out, post, comb, phi, alpha, bias, configs=None):
        """The mix kernel's arguments (phi split into a fresh [hi; lo] buffer): inputs, the outputs new residual,
        h_post, h_res, h_pre (flattened tokens), then the split workspace (for `configs`, default the op's own)."""
        n, D = self.n, self.D
        tokens, dev = residual.numel() // (n * D), residual.device
        NG = phi_split_rows(n)
        phi_hl = torch.empty(2 * NG, n, _round_up(D, _D_PAD), device=dev, dtype=torch.bfloat16)
        if tokens:
            self._split(phi, phi_hl[:NG], phi_hl[NG:])
        f32 = dict(device=dev, dtype=torch.float32)
        return (residual.view(tokens, n, D), layer_out.view(tokens, D), post.view(tokens, n), comb.view(tokens, n, n),
                phi_hl, alpha, bias, torch.empty(tokens, n, D, device=dev, dtype=torch.bfloat16),
                torch.empty(tokens, n, **f32), torch.empty(tokens, n * n, **f32), torch.empty(tokens, n, **f32),
                *split_workspace(tokens, 2 * NG, dev, configs or [self.config]))

    def tune_args(self, residual, layer_out, post, comb, phi, alpha, bias):
        """The mix kernel's arguments, with a split workspace for every config of the space (the tuner runs them
        all on these arguments)."""
        self.check_inputs(residual, layer_out, post, comb, phi, alpha, bias)
        return self._args(residual, layer_out, post, comb, phi, alpha, bias, self.config_space(self.spec))

    def __call__(self, residual, layer_out, post, comb, phi, alpha, bias):
        lead = self.check_inputs(residual, layer_out, post, comb, phi, alpha, bias)
        n, D = self.n, self.D
        mix, config = self._mix_for(residual.numel() // (n * D), residual.device)
        args = self._args(residual, layer_out, post, comb, phi, alpha, bias, [config])
        new_residual, h_post, h_res, h_pre = args[-6:-2]
        h_in = torch.empty(h_pre.shape[0], D, device=residual.device, dtype=torch.bfloat16)
        if h_in.shape[0]:
            mix(*args)
            self._apply(new_residual, h_pre, h_in)
        return (new_residual.view(*lead, n, D), h_in.view(*lead, D), h_post.view(*lead, n),
                h_res.view(*lead, n, n))
