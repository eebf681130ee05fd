"""HF transformers' DeepSeek-V4 on our mHC ops, patched in place (forward and backward).

    from ops.integrations.hf_deepseek_v4 import patch_deepseek_v4, unpatch_deepseek_v4
    patch_deepseek_v4(model)      # a DeepseekV4Model / ForCausalLM, a DeepseekV4DecoderLayer or a HyperConnection
    ...                           # forward and loss.backward() now run ops.mhc_pre / ops.mhc_post
    unpatch_deepseek_v4(model)    # HF's own code again

What is replaced, per instance (the classes are untouched):

- ``DeepseekV4HyperConnection.forward(hidden_streams) -> (post, comb, collapsed)``: by one call of
  ``ops.mhc_pre(x, phi=fn, alpha=scale, bias=base, rms_eps=input_norm.eps, hc_eps=hc_eps,
  sinkhorn_iters=max(1, hc_sinkhorn_iters))``, returning (h_post, h_res = comb, h_in). HF's parameters are
  used as they are: ``fn`` [(2+n)*n, n*D] is phi (rows pre | post | comb, comb row-major: the same layout),
  ``scale`` [3] is alpha, ``base`` [(2+n)*n] is bias. Our op takes them in fp32: HF checkpoints keep them
  in fp32 (``_keep_in_fp32_modules_strict``), where ``.float()`` is free; a model cast wholesale to bf16
  pays one cast per call (fn: (2+n)*n * n*D values, 1.5 MB of fp32 at n = 4, D = 4096, a few us), and
  autograd casts the gradients back, as HF's own ``self.fn.float()`` does.
- ``DeepseekV4DecoderLayer.forward``: HF's body (the same sublayer calls, in the same order) with each
  post mixing ``post.to(dtype) * out + comb.to(dtype)^T @ residual`` replaced by
  ``ops.mhc_post(residual, out, post, comb)`` (fp32 post and comb, fp32 math, one rounding to bf16).

Inputs our ops do not take (not bf16, or not on a CUDA device) run HF's original code unchanged, with a
one-time warning on the ``llm_tile_ops`` logger. Shapes our ops do not support (n > 8, D not a multiple of 8
or > 16384, more than 100 Sinkhorn iterations) are refused at patch time. The mHC backward supports
n in {1, 2, 3, 4, 6, 8} (it raises at backward time for n = 5 or 7). Not replaced: ``DeepseekV4HyperHead``
(the model's final pre-only collapse, once per model). Design notes: docs/design/hf_deepseek_v4.md.
"""

from __future__ import annotations

import logging
import types

import torch
from torch import nn

try:
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as _hf
except ImportError as exc:  # transformers absent, or older than DeepSeek-V4
    raise ImportError("ops.integrations.hf_deepseek_v4 needs HF transformers with DeepSeek-V4 "
                      "(transformers >= 5.17): pip install 'transformers>=5.17'") from exc

from ..mhc import mhc_post, mhc_pre
from ..mhc.post import MAX_D, MAX_N
from ..mhc.tiling import SINKHORN_MAX_ITERS

__all__ = ["patch_deepseek_v4", "unpatch_deepseek_v4", "is_patched", "hc_arguments"]

logger = logging.getLogger("llm_tile_ops")

HyperConnection = _hf.DeepseekV4HyperConnection
DecoderLayer = _hf.DeepseekV4DecoderLayer
_HF_HC_FORWARD = HyperConnection.forward
_HF_LAYER_FORWARD = DecoderLayer.forward

# The functions the patched forwards call, looked up at call time (the CPU tests put the goldens here).
_pre = mhc_pre
_post = mhc_post


def _accepts(x: torch.Tensor) -> bool:
    """Whether our ops take this residual (else HF's own code runs): bf16 on a CUDA device."""
    return x.is_cuda and x.dtype == torch.bfloat16


_warned: set = set()


def _fallback(x: torch.Tensor, where: str) -> None:
    key = (where, x.dtype, x.device.type)
    if key not in _warned:
        _warned.add(key)
        logger.warning("hf_deepseek_v4: %s got a %s tensor on %s; our mHC ops take bf16 on CUDA, so HF's own "
                       "code runs for it", where, x.dtype, x.device.type)


def hc_arguments(hc: nn.Module) -> dict:
    """The arguments of ``ops.mhc_pre`` equivalent to this ``DeepseekV4HyperConnection``: phi, alpha, bias (HF's
    ``fn``, ``scale``, ``base`` in fp32: the parameters themselves when they are fp32, else a cast that autograd
    differentiates), rms_eps, hc_eps, sinkhorn_iters.

    HF's forward always runs the softmax and the first column normalization (then ``hc_sinkhorn_iters - 1``
    row / column rounds), so HF's 0 is our 1: our 0 means no projection at all (raw logits)."""
    return dict(phi=hc.fn.float().contiguous(), alpha=hc.scale.float().contiguous(),
                bias=hc.base.float().contiguous(), rms_eps=float(hc.input_norm.eps), hc_eps=float(hc.hc_eps),
                sinkhorn_iters=max(1, int(hc.hc_sinkhorn_iters)))


def _hc_forward(self, hidden_streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``DeepseekV4HyperConnection.forward`` on ``ops.mhc_pre``: [B, S, n, D] -> (post [B, S, n] fp32,
    comb [B, S, n, n] fp32, collapsed [B, S, D] in the input's dtype), as HF returns them."""
    if not _accepts(hidden_streams):
        _fallback(hidden_streams, "DeepseekV4HyperConnection")
        return _HF_HC_FORWARD(self, hidden_streams)
    h_in, h_post, comb = _pre(hidden_streams.contiguous(), **hc_arguments(self))
    return h_post, comb, h_in


def _layer_forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None,
                   **kwargs) -> torch.Tensor:
    """``DeepseekV4DecoderLayer.forward`` (transformers 5.17) with each post mixing on ``ops.mhc_post``."""
    if not _accepts(hidden_states):
        _fallback(hidden_states, "DeepseekV4DecoderLayer")
        return _HF_LAYER_FORWARD(self, hidden_states, input_ids=input_ids, **kwargs)
    hidden_states = hidden_states.contiguous()
    post, comb, collapsed = self.attn_hc(hidden_states)
    attn_output, _ = self.self_attn(self.input_layernorm(collapsed), **kwargs)
    hidden_states = _post(hidden_states, attn_output.contiguous(), post, comb)

    post, comb, collapsed = self.ffn_hc(hidden_states)
    mlp_output = self.mlp(self.post_attention_layernorm(collapsed), input_ids=input_ids)
    return _post(hidden_states, mlp_output.contiguous(), post, comb)


_PATCHES = ((HyperConnection, _HF_HC_FORWARD, _hc_forward), (DecoderLayer, _HF_LAYER_FORWARD, _layer_forward))


def _patch_of(module: nn.Module):
    """(HF's forward, ours) for a module of a patchable class, else None."""
    for cls, hf_forward, ours in _PATCHES:
        if isinstance(module, cls):
            return hf_forward, ours
    return None


def is_patched(module: nn.Module) -> bool:
    """Whether this module's own forward (not its children's) is the adapter's."""
    bound = module.__dict__.get("forward")
    return getattr(bound, "__func__", None) in (_hc_forward, _layer_forward)


def _check_hc(name: str, hc: nn.Module) -> None:
    """Refuse, before anything is patched, a hyper-connection our ops cannot run."""
    for attr in ("fn", "base", "scale", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "input_norm"):
        if not hasattr(hc, attr):
            raise TypeError(f"{name}: expected HF's DeepseekV4HyperConnection with attribute {attr!r} "
                            "(transformers >= 5.17); this one has none")
    n = int(hc.hc_mult)
    if not 1 <= n <= MAX_N:
        raise ValueError(f"{name}: expected hc_mult in 1..{MAX_N} for our mHC ops, got {n}")
    N = (2 + n) * n
    if hc.fn.dim() != 2 or hc.fn.shape[0] != N or hc.fn.shape[1] % n or tuple(hc.base.shape) != (N,) or \
            tuple(hc.scale.shape) != (3,):
        raise ValueError(f"{name}: expected fn [{N}, n*D], base [{N}], scale [3] (n = {n}), got "
                         f"{list(hc.fn.shape)}, {list(hc.base.shape)}, {list(hc.scale.shape)}")
    D = hc.fn.shape[1] // n
    if D % 8 or not 8 <= D <= MAX_D:
        raise ValueError(f"{name}: expected hidden_size a multiple of 8 in 8..{MAX_D} for our mHC ops, got {D}")
    if int(hc.hc_sinkhorn_iters) > SINKHORN_MAX_ITERS:
        raise ValueError(f"{name}: expected hc_sinkhorn_iters <= {SINKHORN_MAX_ITERS} for our mHC ops, "
                         f"got {hc.hc_sinkhorn_iters}")


def patch_deepseek_v4(module: nn.Module) -> nn.Module:
    """Run every ``DeepseekV4HyperConnection`` and ``DeepseekV4DecoderLayer`` in ``module`` (itself included) on
    our mHC ops, forward and backward, by replacing their ``forward`` on the instance. HF's parameters stay
    where they are (nothing is copied or re-registered: state_dict, optimizers and checkpoints are unaffected).
    Idempotent; returns ``module``.

    Raises ValueError where the module holds no DeepSeek-V4 layer or hyper-connection or one our ops cannot run
    (checked for all of them before any is patched), TypeError where a layer's class overrides HF's forward (the
    replacement restates HF's own)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    targets = [(name or type(module).__name__, m) for name, m in module.named_modules() if _patch_of(m)]
    if not targets:
        raise ValueError(f"module: expected a DeepSeek-V4 model, decoder layer or hyper-connection "
                         f"(transformers' modeling_deepseek_v4), found none in {type(module).__name__}")
    for name, m in targets:
        hf_forward, _ = _patch_of(m)
        if getattr(type(m), "forward") is not hf_forward:
            raise TypeError(f"{name}: {type(m).__name__} overrides HF's forward; the adapter replaces HF's own "
                            "forward only")
        if isinstance(m, HyperConnection):
            _check_hc(name, m)
    for _, m in targets:
        _, ours = _patch_of(m)
        m.forward = types.MethodType(ours, m)
    return module


def unpatch_deepseek_v4(module: nn.Module) -> nn.Module:
    """Undo ``patch_deepseek_v4`` on ``module`` and its children (HF's forward again); returns ``module``."""
    for m in module.modules():
        if is_patched(m):
            del m.forward
    return module
