"""Golden mHC pre forward (manifold-constrained hyper-connections, arXiv 2512.24880, Eq. 14-16).

Per token, with vecX = x flattened to n*D:
    h_mix   = vecX @ phi^T
    inv_rms = rsqrt(mean(vecX^2) + rms_eps)
    h_pre   = sigmoid(alpha[0] * inv_rms * h_mix[:n]     + bias[:n]) + hc_eps
    h_post  = 2 * sigmoid(alpha[1] * inv_rms * h_mix[n:2n] + bias[n:2n])
    h_res   = alpha[2] * inv_rms * h_mix[2n:].view(n, n) + bias[2n:].view(n, n)
    h_in    = sum_i h_pre[i] * x[i, :]
"""

from __future__ import annotations

import math

import torch


def random_inputs(B: int, S: int, n: int, D: int, device="cpu", dtype=torch.bfloat16):
    """Random (x, phi, alpha, bias) at the scales of a trained layer (h_mix of order 1)."""
    N = n * n + 2 * n
    x = torch.randn(B, S, n, D, device=device).to(dtype)
    phi = torch.randn(N, n * D, device=device) / math.sqrt(n * D)
    alpha = torch.rand(3, device=device) + 0.5
    bias = torch.randn(N, device=device) * 0.1
    return x, phi, alpha, bias


def mhc_forward_pre(x: torch.Tensor, phi: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor,
                    rms_eps: float = 1e-6, hc_eps: float = 1e-6, return_aux: bool = False):
    """x [B,S,n,D], phi [n*n+2n, n*D], alpha [3], bias [n*n+2n] -> (h_in [B,S,D] in x's dtype,
    h_post [B,S,n] fp32, h_res [B,S,n,n] fp32), plus (inv_rms [B,S], h_pre [B,S,n], h_mix [B,S,n*n+2n])
    with ``return_aux``. Computes in fp32 (fp64 if any input is fp64)."""
    B, S, n, D = x.shape
    acc = torch.float64 if torch.float64 in (x.dtype, phi.dtype) else torch.float32
    xf = x.to(acc).reshape(B, S, n * D)
    h_mix = xf @ phi.to(acc).t()
    inv_rms = torch.rsqrt(xf.square().mean(dim=-1) + rms_eps)
    alpha, bias = alpha.to(acc), bias.to(acc)
    scaled = h_mix * inv_rms[..., None]
    h_pre = torch.sigmoid(alpha[0] * scaled[..., :n] + bias[:n]) + hc_eps
    h_post = 2 * torch.sigmoid(alpha[1] * scaled[..., n:2 * n] + bias[n:2 * n])
    h_res = (alpha[2] * scaled[..., 2 * n:] + bias[2 * n:]).reshape(B, S, n, n)
    h_in = (h_pre[..., None] * xf.reshape(B, S, n, D)).sum(dim=2).to(x.dtype)
    if return_aux:
        return h_in, h_post, h_res, inv_rms, h_pre, h_mix
    return h_in, h_post, h_res
