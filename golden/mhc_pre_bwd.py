"""Golden mHC pre backward: the gradients of ``golden.mhc_pre.mhc_forward_pre``.

Per token, with v = x flattened to K = n*D, s = inv_rms, m = h_mix = phi @ v and the forward's
pre-activations z = a_g * s * m + bias (a_g = alpha[0], alpha[1], alpha[2] for the pre, post and res
groups of m), the chain rule gives, from the output gradients g_in [D], g_post [n], g_res [n*n]:

    p_i     = g_in . x_i                                    # d loss / d h_pre[i]
    g_z     = [p * sig'(z_pre), 2 * g_post * sig'(z_post), g_res]    # d loss / d z, sig' = sig(1-sig)
    u       = a_g * g_z
    g_m     = s * u                                         # d loss / d h_mix
    g_s     = u . m                                         # d loss / d inv_rms
    grad_v  = phi^T g_m - (g_s * s^3 / K) * v + h_pre (x) g_in      # inv_rms' = -s^3 v / K
    grad_phi   = sum_tokens g_m (x) v
    grad_bias  = sum_tokens g_z
    grad_alpha = sum_tokens sum_{j in group} g_z_j * s * m_j

With ``sinkhorn_iters`` >= 1 the h_res output is the Sinkhorn projection of the logits z_res, and g_res above is
d loss / d z_res: ``sinkhorn_backward`` carries the output gradient back through the normalizations (reverse
mode, the recurrence the kernel runs, see docs/design/mhc.md):
    x' = x / d, d = (sums of x along the axis) + hc_eps:   g_x = (g_x' - (sums of g_x' * x' along the axis)) / d
    c = softmax(z) + hc_eps:                                g_z = c0 * (g_c - sum_k g_c,k * c0_k),  c0 = softmax(z)
"""

from __future__ import annotations

import math

import torch

from golden.mhc_pre import mhc_forward_pre


def sinkhorn_backward(logits: torch.Tensor, grad_comb: torch.Tensor, iters: int,
                      hc_eps: float = 1e-6) -> torch.Tensor:
    """d loss / d logits [..., n, n] of ``golden.mhc_pre.sinkhorn(logits, iters, hc_eps)`` from d loss / d comb,
    by the reverse recurrence of the module docstring (every intermediate kept here; the kernel recomputes
    them instead)."""
    soft = torch.softmax(logits, dim=-1)
    comb = soft + hc_eps
    steps = []  # (axis, output, denominators) of every normalization, in forward order
    for k in range(2 * iters - 1):
        axis = -2 if k % 2 == 0 else -1  # columns first, then rows and columns alternately
        den = comb.sum(dim=axis, keepdim=True) + hc_eps
        comb = comb / den
        steps.append((axis, comb, den))
    g = grad_comb.to(comb.dtype)
    for axis, out, den in reversed(steps):
        g = (g - (g * out).sum(dim=axis, keepdim=True)) / den
    return soft * (g - (g * soft).sum(dim=-1, keepdim=True))


def mhc_backward_pre(x: torch.Tensor, phi: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor,
                     grad_h_in: torch.Tensor | None = None, grad_h_post: torch.Tensor | None = None,
                     grad_h_res: torch.Tensor | None = None, rms_eps: float = 1e-6, hc_eps: float = 1e-6,
                     sinkhorn_iters: int = 0):
    """Closed-form gradients of ``mhc_forward_pre`` (x [..., n, D]) -> (grad_x in x's dtype, grad_phi,
    grad_alpha, grad_bias) in the compute dtype (fp32, fp64 if any input is fp64). A ``None`` output gradient
    is zero. With ``sinkhorn_iters`` >= 1, ``grad_h_res`` is the gradient of comb, carried back to the logits by
    ``sinkhorn_backward``; ``hc_eps`` enters only there (elsewhere it only shifts h_pre)."""
    *lead, n, D = x.shape
    K, N = n * D, math.prod(lead)
    acc = torch.float64 if torch.float64 in (x.dtype, phi.dtype) else torch.float32
    v = x.to(acc).reshape(N, K)
    phi, alpha, bias = phi.to(acc), alpha.to(acc), bias.to(acc)
    m = v @ phi.t()
    s = torch.rsqrt(v.square().mean(dim=-1) + rms_eps)

    def grad_or_zero(g, shape):
        return torch.zeros(shape, dtype=acc, device=x.device) if g is None else g.to(acc).reshape(shape)

    g_in = grad_or_zero(grad_h_in, (N, D))
    g_post = grad_or_zero(grad_h_post, (N, n))
    g_res = grad_or_zero(grad_h_res, (N, n * n))
    if sinkhorn_iters and grad_h_res is not None:
        logits = alpha[2] * s[:, None] * m[:, 2 * n:] + bias[2 * n:]
        g_res = sinkhorn_backward(logits.reshape(N, n, n), g_res.reshape(N, n, n), sinkhorn_iters,
                                  hc_eps).reshape(N, n * n)

    sig_pre = torch.sigmoid(alpha[0] * s[:, None] * m[:, :n] + bias[:n])
    sig_post = torch.sigmoid(alpha[1] * s[:, None] * m[:, n:2 * n] + bias[n:2 * n])
    p = torch.einsum("tid,td->ti", v.reshape(N, n, D), g_in)
    g_z = torch.cat([p * sig_pre * (1 - sig_pre), 2 * g_post * sig_post * (1 - sig_post), g_res], dim=1)
    group = torch.tensor([0] * n + [1] * n + [2] * (n * n), device=x.device)
    u = g_z * alpha[group]
    g_m = s[:, None] * u
    g_s = (u * m).sum(dim=1)
    h_pre = sig_pre + hc_eps

    grad_v = g_m @ phi - (g_s * s ** 3 / K)[:, None] * v + (h_pre[:, :, None] * g_in[:, None, :]).reshape(N, K)
    grad_phi = g_m.t() @ v
    grad_bias = g_z.sum(dim=0)
    per_group = (g_z * s[:, None] * m).sum(dim=0)
    grad_alpha = torch.zeros(3, dtype=acc, device=x.device).index_add_(0, group, per_group)
    return grad_v.reshape(x.shape).to(x.dtype), grad_phi, grad_alpha, grad_bias


def mhc_backward_pre_autograd(x: torch.Tensor, phi: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor,
                              grad_h_in: torch.Tensor | None = None, grad_h_post: torch.Tensor | None = None,
                              grad_h_res: torch.Tensor | None = None, rms_eps: float = 1e-6,
                              hc_eps: float = 1e-6, dtype: torch.dtype = torch.float32, sinkhorn_iters: int = 0):
    """The same gradients by torch autograd through the golden forward, on inputs upcast to ``dtype``
    (the reference the compiled backward is checked and timed against)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (x, phi, alpha, bias)]
    outs = mhc_forward_pre(*leaves, rms_eps=rms_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters)
    pairs = [(o, g.to(dtype)) for o, g in zip(outs, (grad_h_in, grad_h_post, grad_h_res)) if g is not None]
    grads = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads))
