"""htree as ``torch.library`` custom ops and the public, differentiable functional form ``htree_attention``.

    llm_tile_ops::htree_forward(q, k, v, compression_rate, top_k_per_layer, max_top_nodes, rope_base, scale) -> o
    llm_tile_ops::htree_forward_train(q, k, v, ...) -> (o, lse, selections)
    llm_tile_ops::htree_backward(do, q, k, v, o, lse, selections, ...) -> (dq, dk, dv)

``htree_forward_train`` is the forward that keeps what the backward needs (lse [B, T, H] fp32 and the selections
[L-1, B, T, Hkv, top_k] int16, both non-differentiable), differentiable in q, k and v through ``htree_backward``;
``htree_attention`` calls it when a gradient is needed, else the plain ``htree_forward`` (which is differentiable
too, by recomputing the forward in its backward). Each has a fake (shapes and dtypes only), so torch.compile
(fullgraph=True) traces forward and backward in one graph; each specialization's op object is built once per
process (``op_instance``), so a training loop builds nothing after its first step."""

from typing import Optional

import torch
from torch import Tensor

from ..common.library import NAMESPACE, op_instance
from ..common.validate import check_float, check_int
from .backward import HTreeBackwardTileLang
from .forward import HTreeForwardTileLang
from .tree import layer_sizes


def _spec(q, k, v, compression_rate, top_k_per_layer, max_top_nodes, rope_base, scale) -> dict:
    """The specialization of a call (heads and head dims from the tensors' shapes)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor [B, T, heads, dim], got shape {list(t.shape)}")
    return dict(num_heads=q.shape[2], num_kv_heads=k.shape[2], head_dim=q.shape[3], v_head_dim=v.shape[3],
                compression_rate=compression_rate, top_k_per_layer=top_k_per_layer, max_top_nodes=max_top_nodes,
                rope_base=rope_base, dtype=q.dtype, scale=scale)


@torch.library.custom_op(f"{NAMESPACE}::htree_forward", mutates_args=(), device_types="cuda")
def htree_forward(q: Tensor, k: Tensor, v: Tensor, compression_rate: int, top_k_per_layer: int,
                  max_top_nodes: int, rope_base: float, scale: Optional[float]) -> Tensor:
    spec = _spec(q, k, v, compression_rate, top_k_per_layer, max_top_nodes, rope_base, scale)
    return op_instance(HTreeForwardTileLang, **spec)(q, k, v)


@htree_forward.register_fake
def _htree_forward_fake(q, k, v, compression_rate, top_k_per_layer, max_top_nodes, rope_base, scale):
    return q.new_empty(*q.shape[:3], v.shape[3])


@torch.library.custom_op(f"{NAMESPACE}::htree_forward_train", mutates_args=(), device_types="cuda")
def htree_forward_train(q: Tensor, k: Tensor, v: Tensor, compression_rate: int, top_k_per_layer: int,
                        max_top_nodes: int, rope_base: float, scale: Optional[float]) -> tuple[Tensor, Tensor, Tensor]:
    spec = _spec(q, k, v, compression_rate, top_k_per_layer, max_top_nodes, rope_base, scale)
    return op_instance(HTreeForwardTileLang, **spec).forward_for_backward(q, k, v)


@htree_forward_train.register_fake
def _htree_forward_train_fake(q, k, v, compression_rate, top_k_per_layer, max_top_nodes, rope_base, scale):
    B, T, H = q.shape[:3]
    L = len(layer_sizes(T, compression_rate, max_top_nodes)[0])
    return (q.new_empty(B, T, H, v.shape[3]), q.new_empty(B, T, H, dtype=torch.float32),
            q.new_empty(L - 1, B, T, k.shape[2], top_k_per_layer, dtype=torch.int16))


@torch.library.custom_op(f"{NAMESPACE}::htree_backward", mutates_args=(), device_types="cuda")
def htree_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, selections: Tensor,
                   compression_rate: int, top_k_per_layer: int, max_top_nodes: int, rope_base: float,
                   scale: Optional[float]) -> tuple[Tensor, Tensor, Tensor]:
    spec = _spec(q, k, v, compression_rate, top_k_per_layer, max_top_nodes, rope_base, scale)
    # fp32 products as torch's matmuls would run them now ("medium" allows bf16 there: TF32 here)
    precision = "highest" if torch.get_float32_matmul_precision() == "highest" else "high"
    # the forward's own selections: no value checks (no host synchronization)
    return op_instance(HTreeBackwardTileLang, **spec, fp32_precision=precision)(do, q, k, v, o, lse, selections,
                                                                               validate=False)


@htree_backward.register_fake
def _htree_backward_fake(do, q, k, v, o, lse, selections, compression_rate, top_k_per_layer, max_top_nodes, rope_base,
                         scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_train(ctx, inputs, output):
    q, k, v, *args = inputs
    o, lse, selections = output
    ctx.save_for_backward(q, k, v, o, lse, selections)
    ctx.args = tuple(args)
    ctx.mark_non_differentiable(lse, selections)


def _backward_train(ctx, do, _dlse, _dsel):
    q, k, v, o, lse, selections = ctx.saved_tensors
    dq, dk, dv = htree_backward(do.contiguous(), q, k, v, o, lse, selections, *ctx.args)
    return dq, dk, dv, None, None, None, None, None


htree_forward_train.register_autograd(_backward_train, setup_context=_setup_train)


def _setup_forward(ctx, inputs, output):
    q, k, v, *args = inputs
    ctx.save_for_backward(q, k, v)
    ctx.args = tuple(args)


def _backward_forward(ctx, do):
    """The plain forward kept nothing: its backward recomputes (o, lse, selections) first."""
    q, k, v = ctx.saved_tensors
    o, lse, selections = htree_forward_train(q, k, v, *ctx.args)
    dq, dk, dv = htree_backward(do.contiguous(), q, k, v, o, lse, selections, *ctx.args)
    return dq, dk, dv, None, None, None, None, None


htree_forward.register_autograd(_backward_forward, setup_context=_setup_forward)


def htree_attention(q: Tensor, k: Tensor, v: Tensor, compression_rate: int = 16, top_k_per_layer: int = 512,
                    max_top_nodes: int = 8192, rope_base: float = 10000.0, scale: Optional[float] = None) -> Tensor:
    """Hierarchical tree sparse attention (defined by ``golden.htree.htree_forward``): q [B, T, H, K], k [B, T, Hkv, K],
    v [B, T, Hkv, V] (CUDA, one of fp32 / fp16 / bf16, contiguous) -> o [B, T, H, V] in q's dtype, differentiable in
    q, k and v (the selections held constant; ``HTreeBackwardTileLang``, whose fp32 products follow
    ``torch.get_float32_matmul_precision()``: "highest", torch's default, keeps fp32 accuracy, "high" or "medium"
    runs them in TF32). ``scale`` defaults to K ** -0.5. When a
    gradient is needed it runs ``llm_tile_ops::htree_forward_train``, which keeps o, lse and the selections for the
    backward (per token, beyond q, k, v: H V + 4 H + 2 (L-1) Hkv top_k bytes), else ``llm_tile_ops::htree_forward``;
    each builds (or loads) its op objects for the shapes' specialization on its first call in a process."""
    for name, value in (("compression_rate", compression_rate), ("top_k_per_layer", top_k_per_layer),
                        ("max_top_nodes", max_top_nodes)):
        check_int(name, value)
    rope_base = check_float("rope_base", rope_base, positive=True)
    scale = None if scale is None else check_float("scale", scale, positive=True)
    args = (compression_rate, top_k_per_layer, max_top_nodes, rope_base, scale)
    if torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in (q, k, v)):
        return torch.ops.llm_tile_ops.htree_forward_train(q, k, v, *args)[0]
    return torch.ops.llm_tile_ops.htree_forward(q, k, v, *args)
