"""Golden mHC post (DeepSeek-V4's hyper-connection expand, as HF transformers' ``DeepseekV4DecoderLayer``
applies it), its gradients, and the post of one sublayer followed by the pre of the next.

Per token, with residual streams x [n, D], the sublayer's output y [D], post [n] and comb [n, n]:
    out[k] = post[k] * y + sum_j comb[j, k] * x[j]          k = 0..n-1   (comb used transposed: comb^T @ x)
in fp32 (fp64 if any input is fp64), rounded once to the residual's dtype. Its gradients, from g = d loss / d out:
    grad_x[j]       = sum_k comb[j, k] * g[k]
    grad_y          = sum_k post[k] * g[k]
    grad_post[k]    = <g[k], y>
    grad_comb[j, k] = <g[k], x[j]>
"""

from __future__ import annotations

import torch

from golden.mhc_pre import mhc_forward_pre


def random_inputs(lead, n: int, D: int, device="cpu", dtype=torch.bfloat16):
    """Random (residual [*lead, n, D], layer_out [*lead, D], post [*lead, n], comb [*lead, n, n]) at the scales of
    a trained layer: post in (0, 2) as 2 * sigmoid, comb positive with rows summing to about 1."""
    lead = tuple(lead)
    residual = torch.randn(*lead, n, D, device=device).to(dtype)
    layer_out = torch.randn(*lead, D, device=device).to(dtype)
    post = 2 * torch.sigmoid(torch.randn(*lead, n, device=device))
    comb = torch.softmax(torch.randn(*lead, n, n, device=device), dim=-1) + 1e-6
    return residual, layer_out, post, comb


def _compute_dtype(*tensors) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def mhc_post(residual: torch.Tensor, layer_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """residual [..., n, D], layer_out [..., D], post [..., n], comb [..., n, n] -> [..., n, D] in residual's dtype:
    out[..., k, :] = post[..., k] * layer_out + sum_j comb[..., j, k] * residual[..., j, :]. Differentiable."""
    acc = _compute_dtype(residual, layer_out, post, comb)
    x, y, p, c = (t.to(acc) for t in (residual, layer_out, post, comb))
    out = p[..., :, None] * y[..., None, :] + c.transpose(-1, -2) @ x
    return out.to(residual.dtype)


def mhc_post_backward(residual: torch.Tensor, layer_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                      grad_out: torch.Tensor):
    """Closed-form gradients of ``mhc_post`` -> (grad_residual, grad_layer_out, grad_post, grad_comb), each in its
    input's dtype, computed in fp32 (fp64 if any input is fp64)."""
    acc = _compute_dtype(residual, layer_out, post, comb, grad_out)
    x, y, p, c, g = (t.to(acc) for t in (residual, layer_out, post, comb, grad_out))
    grad_x = c @ g                                   # [.., j, D] = sum_k comb[j, k] g[k]
    grad_y = (p[..., :, None] * g).sum(dim=-2)       # sum_k post[k] g[k]
    grad_post = (g * y[..., None, :]).sum(dim=-1)    # <g[k], y>
    grad_comb = x @ g.transpose(-1, -2)              # [.., j, k] = <x[j], g[k]>
    return (grad_x.to(residual.dtype), grad_y.to(layer_out.dtype), grad_post.to(post.dtype),
            grad_comb.to(comb.dtype))


def mhc_post_backward_autograd(residual, layer_out, post, comb, grad_out, dtype: torch.dtype = torch.float32):
    """The same gradients by torch autograd through ``mhc_post`` on inputs upcast to ``dtype`` (the reference the
    compiled backward is checked against), returned in ``dtype``."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (residual, layer_out, post, comb)]
    out = mhc_post(*leaves)
    return torch.autograd.grad(out, leaves, grad_out.to(dtype))


def mhc_post_pre(residual: torch.Tensor, layer_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                 phi: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor, rms_eps: float = 1e-6,
                 hc_eps: float = 1e-6, sinkhorn_iters: int = 0):
    """One sublayer's post, then the next sublayer's pre (``golden.mhc_pre.mhc_forward_pre``) on the new residual
    -> (new residual [..., n, D] in residual's dtype, h_in [..., D], h_post [..., n], h_res / comb [..., n, n])."""
    new_residual = mhc_post(residual, layer_out, post, comb)
    h_in, h_post, h_res = mhc_forward_pre(new_residual, phi, alpha, bias, rms_eps, hc_eps,
                                          sinkhorn_iters=sinkhorn_iters)
    return new_residual, h_in, h_post, h_res
