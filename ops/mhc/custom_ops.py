"""mHC as ``torch.library`` custom ops, and the functions built on them: the differentiable ``mhc_pre`` and
``mhc_post``, and ``mhc_post_pre`` for inference.

    llm_tile_ops::mhc_pre_fwd(x, phi, alpha, bias, rms_eps, hc_eps, sinkhorn_iters=0)
        -> (h_in, h_post, h_res, inv_rms, h_pre, h_mix)
    llm_tile_ops::mhc_pre_bwd(x, phi, alpha, bias, inv_rms, h_pre, h_mix, grad_h_in?, grad_h_post?, grad_h_res?,
                              hc_eps=1e-6, sinkhorn_iters=0)
        -> (grad_x, grad_phi, grad_alpha, grad_bias)
    llm_tile_ops::mhc_post(residual, layer_out, post, comb) -> out
    llm_tile_ops::mhc_post_bwd(residual, layer_out, post, comb, grad_out)
        -> (grad_residual, grad_layer_out, grad_post, grad_comb)
    llm_tile_ops::mhc_post_pre(residual, layer_out, post, comb, phi, alpha, bias, rms_eps, hc_eps, sinkhorn_iters)
        -> (new_residual, h_in, h_post, h_res)                                   (inference: no autograd)

x and residual are [..., n, D] (any leading dimensions; the other tensors share them). With sinkhorn_iters >= 1, h_res is
the Sinkhorn projection comb and grad_h_res its gradient.

Each runs the op class of its (n, D), epsilons and Sinkhorn iterations, built once per process
(``op_instance``), so that a training loop, eager or under ``torch.compile``, builds nothing after its first
step. Each has a fake
implementation (shapes and dtypes only), so ``torch.compile(fullgraph=True)`` traces through them.
``mhc_pre_fwd`` is differentiable in x, phi, alpha and bias through ``mhc_pre_bwd``; its aux outputs
(inv_rms, h_pre, h_mix: what the backward needs) are marked non-differentiable. An absent output gradient
(None) selects a backward variant that never reads it.
"""

from typing import Optional

import torch
from torch import Tensor

from ..common.library import NAMESPACE, op_instance
from ..common.validate import check_float
from .post import MHCPostBackwardTileLang, MHCPostPreTileLang, MHCPostTileLang
from .pre import MHCForwardPreTileLang, check_sinkhorn_iters, check_x
from .pre_bwd import MHCBackwardPreTileLang


def _stream_dims(x) -> tuple[int, int]:
    """(n, D) of x [..., n, D]; checked before any op is built for them."""
    check_x(x)
    return x.shape[-2], x.shape[-1]


@torch.library.custom_op(f"{NAMESPACE}::mhc_pre_fwd", mutates_args=(), device_types="cuda")
def mhc_pre_fwd(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, rms_eps: float, hc_eps: float,
                sinkhorn_iters: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    n, D = _stream_dims(x)
    op = op_instance(MHCForwardPreTileLang, B=1, S=1, n=n, D=D, rms_eps=rms_eps, hc_eps=hc_eps,
                     sinkhorn_iters=sinkhorn_iters)
    return op(x, phi, alpha, bias, return_aux=True)


@mhc_pre_fwd.register_fake
def _(x, phi, alpha, bias, rms_eps, hc_eps, sinkhorn_iters=0):
    if x.dim() < 2:
        raise ValueError(f"x: expected shape [..., n, D], got {list(x.shape)}")
    check_sinkhorn_iters(sinkhorn_iters)
    *lead, n, D = x.shape
    f32 = torch.float32
    return (x.new_empty(*lead, D), x.new_empty(*lead, n, dtype=f32), x.new_empty(*lead, n, n, dtype=f32),
            x.new_empty(lead, dtype=f32), x.new_empty(*lead, n, dtype=f32),
            x.new_empty(*lead, n * n + 2 * n, dtype=f32))


@torch.library.custom_op(f"{NAMESPACE}::mhc_pre_bwd", mutates_args=(), device_types="cuda")
def mhc_pre_bwd(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, inv_rms: Tensor, h_pre: Tensor,
                h_mix: Tensor, grad_h_in: Optional[Tensor], grad_h_post: Optional[Tensor],
                grad_h_res: Optional[Tensor], hc_eps: float = 1e-6,
                sinkhorn_iters: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    n, D = _stream_dims(x)
    # Without Sinkhorn hc_eps does not enter the backward: one op for every value.
    op = op_instance(MHCBackwardPreTileLang, B=1, S=1, n=n, D=D, hc_eps=hc_eps if sinkhorn_iters else 1e-6,
                     sinkhorn_iters=sinkhorn_iters)
    grad_x, grad_phi, grad_alpha, grad_bias = op(x, phi, alpha, bias, inv_rms, h_pre, h_mix, grad_h_in,
                                                 grad_h_post, grad_h_res)
    # grad_alpha and grad_bias are slices of one sum; a custom op's outputs may not alias each other.
    return grad_x, grad_phi, grad_alpha.clone(), grad_bias


@mhc_pre_bwd.register_fake
def _(x, phi, alpha, bias, inv_rms, h_pre, h_mix, grad_h_in, grad_h_post, grad_h_res, hc_eps=1e-6, sinkhorn_iters=0):
    check_sinkhorn_iters(sinkhorn_iters)
    f32 = torch.float32
    return (x.new_empty(x.shape), phi.new_empty(phi.shape, dtype=f32), alpha.new_empty(alpha.shape, dtype=f32),
            bias.new_empty(bias.shape, dtype=f32))


def _setup_context(ctx, inputs, output):
    x, phi, alpha, bias, _rms_eps, hc_eps, *rest = inputs
    inv_rms, h_pre, h_mix = output[3:]
    ctx.hc_eps, ctx.sinkhorn_iters = hc_eps, (rest[0] if rest else 0)
    ctx.save_for_backward(x, phi, alpha, bias, inv_rms, h_pre, h_mix)
    ctx.mark_non_differentiable(inv_rms, h_pre, h_mix)
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None: never read


def _backward(ctx, grad_h_in, grad_h_post, grad_h_res, *_aux):
    grads = [None if g is None else g.contiguous() for g in (grad_h_in, grad_h_post, grad_h_res)]
    grad_x, grad_phi, grad_alpha, grad_bias = mhc_pre_bwd(*ctx.saved_tensors, *grads, ctx.hc_eps, ctx.sinkhorn_iters)
    return grad_x, grad_phi, grad_alpha, grad_bias, None, None, None


mhc_pre_fwd.register_autograd(_backward, setup_context=_setup_context)


def mhc_pre(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, rms_eps: float = 1e-6,
            hc_eps: float = 1e-6, sinkhorn_iters: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Differentiable mHC pre: (h_in, h_post, h_res) of the compiled forward (``llm_tile_ops::mhc_pre_fwd``),
    with the compiled backward (``llm_tile_ops::mhc_pre_bwd``) for x, phi, alpha and bias under
    ``loss.backward()``. x [..., n, D]; shapes and dtypes as ``MHCForwardPreTileLang``. With
    ``sinkhorn_iters`` >= 1 (DeepSeek-V4: 20) h_res is the Sinkhorn projection comb, differentiable through
    the iterations. Works under ``torch.compile``."""
    rms_eps = check_float("rms_eps", rms_eps, lo=0)
    hc_eps = check_float("hc_eps", hc_eps, lo=0)
    check_sinkhorn_iters(sinkhorn_iters)
    h_in, h_post, h_res, *_ = mhc_pre_fwd(x, phi, alpha, bias, rms_eps, hc_eps, sinkhorn_iters)
    return h_in, h_post, h_res


# ----------------------------------------------------------------------------- post
def _post_dims(residual) -> tuple[int, int]:
    """(n, D) of residual [..., n, D]; the op class checks their range before it builds anything."""
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual: expected a torch.Tensor, got {type(residual).__name__}")
    if residual.dim() < 2:
        raise ValueError(f"residual: expected shape [..., n, D], got {list(residual.shape)}")
    return residual.shape[-2], residual.shape[-1]


@torch.library.custom_op(f"{NAMESPACE}::mhc_post", mutates_args=(), device_types="cuda")
def mhc_post_op(residual: Tensor, layer_out: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    n, D = _post_dims(residual)
    return op_instance(MHCPostTileLang, n=n, D=D)(residual, layer_out, post, comb)


@mhc_post_op.register_fake
def _(residual, layer_out, post, comb):
    _post_dims(residual)
    return residual.new_empty(residual.shape)


@torch.library.custom_op(f"{NAMESPACE}::mhc_post_bwd", mutates_args=(), device_types="cuda")
def mhc_post_bwd_op(residual: Tensor, layer_out: Tensor, post: Tensor, comb: Tensor,
                    grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    n, D = _post_dims(residual)
    return op_instance(MHCPostBackwardTileLang, n=n, D=D)(residual, layer_out, post, comb, grad_out)


@mhc_post_bwd_op.register_fake
def _(residual, layer_out, post, comb, grad_out):
    _post_dims(residual)
    return (residual.new_empty(residual.shape), layer_out.new_empty(layer_out.shape), post.new_empty(post.shape),
            comb.new_empty(comb.shape))


def _post_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _post_backward(ctx, grad_out):
    grads = mhc_post_bwd_op(*ctx.saved_tensors, grad_out.contiguous())
    return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad))


mhc_post_op.register_autograd(_post_backward, setup_context=_post_setup_context)


def mhc_post(residual: Tensor, layer_out: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """Differentiable mHC post (DeepSeek-V4's hyper-connection expand): residual [..., n, D] bf16, layer_out [..., D]
    bf16, post [..., n] fp32, comb [..., n, n] fp32 (CUDA, contiguous, the same leading dimensions) ->
    [..., n, D] bf16, out[k] = post[k] * layer_out + sum_j comb[j, k] * residual[j] (fp32 math, one rounding).
    ``loss.backward()`` runs the compiled backward (``llm_tile_ops::mhc_post_bwd``) for all four inputs; works under
    ``torch.compile(fullgraph=True)``. Defined by ``golden.mhc_post.mhc_post``."""
    return mhc_post_op(residual, layer_out, post, comb)


@torch.library.custom_op(f"{NAMESPACE}::mhc_post_pre", mutates_args=(), device_types="cuda")
def mhc_post_pre_op(residual: Tensor, layer_out: Tensor, post: Tensor, comb: Tensor, phi: Tensor, alpha: Tensor,
                    bias: Tensor, rms_eps: float, hc_eps: float,
                    sinkhorn_iters: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    n, D = _post_dims(residual)
    op = op_instance(MHCPostPreTileLang, n=n, D=D, rms_eps=rms_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters)
    return op(residual, layer_out, post, comb, phi, alpha, bias)


@mhc_post_pre_op.register_fake
def _(residual, layer_out, post, comb, phi, alpha, bias, rms_eps, hc_eps, sinkhorn_iters):
    *lead, n, D = residual.shape
    f32 = torch.float32
    return (residual.new_empty(residual.shape), residual.new_empty(*lead, D), residual.new_empty(*lead, n, dtype=f32),
            residual.new_empty(*lead, n, n, dtype=f32))


def mhc_post_pre(residual: Tensor, layer_out: Tensor, post: Tensor, comb: Tensor, phi: Tensor, alpha: Tensor,
                 bias: Tensor, rms_eps: float = 1e-6, hc_eps: float = 1e-6,
                 sinkhorn_iters: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Inference: one sublayer's mHC post and the next sublayer's pre in one pass over the residual ->
    (new_residual [..., n, D] bf16, h_in [..., D] bf16, h_post [..., n] fp32, h_res [..., n, n] fp32), the same
    as ``mhc_post`` followed by ``mhc_pre(new_residual, phi, alpha, bias, rms_eps, hc_eps, sinkhorn_iters)``.
    Shapes and dtypes as ``MHCPostPreTileLang``; works under ``torch.compile(fullgraph=True)``; no gradients.
    Defined by ``golden.mhc_post.mhc_post_pre``."""
    rms_eps = check_float("rms_eps", rms_eps, lo=0)
    hc_eps = check_float("hc_eps", hc_eps, lo=0)
    check_sinkhorn_iters(sinkhorn_iters)
    return mhc_post_pre_op(residual, layer_out, post, comb, phi, alpha, bias, rms_eps, hc_eps, sinkhorn_iters)
