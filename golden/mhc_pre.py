"""Golden mHC pre forward (manifold-constrained hyper-connections, arXiv 2512.24880, Eq. 14-16; DeepSeek-V4's
hyper-connection as HF transformers' ``DeepseekV4HyperConnection`` defines it).

Per token, with x [n, D] and vecX = x flattened to n*D:
    h_mix   = vecX @ phi^T
    inv_rms = rsqrt(mean(vecX^2) + rms_eps)
    h_pre   = sigmoid(alpha[0] * inv_rms * h_mix[:n]     + bias[:n]) + hc_eps
    h_post  = 2 * sigmoid(alpha[1] * inv_rms * h_mix[n:2n] + bias[n:2n])
    h_res   = alpha[2] * inv_rms * h_mix[2n:].view(n, n) + bias[2n:].view(n, n)      (the comb logits)
    h_in    = sum_i h_pre[i] * x[i, :]
and with ``sinkhorn_iters`` = k >= 1, h_res is replaced by its Sinkhorn-Knopp projection ``comb``:
    comb    = softmax(h_res, over the last axis) + hc_eps
    comb    = comb / (column sums + hc_eps)
    k - 1 times: comb = comb / (row sums + hc_eps); comb = comb / (column sums + hc_eps)
(k = 0 keeps the raw logits.)
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


def sinkhorn(logits: torch.Tensor, iters: int, hc_eps: float = 1e-6) -> torch.Tensor:
    """The Sinkhorn-Knopp projection of comb logits [..., n, n] (``iters`` >= 1 row / column rounds, the first
    one the softmax's), in the logits' dtype; differentiable by autograd."""
    comb = torch.softmax(logits, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return comb


def mhc_forward_pre(x: torch.Tensor, phi: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor,
                    rms_eps: float = 1e-6, hc_eps: float = 1e-6, return_aux: bool = False,
                    sinkhorn_iters: int = 0):
    """x [..., n, D], phi [n*n+2n, n*D], alpha [3], bias [n*n+2n] -> (h_in [..., D] in x's dtype,
    h_post [..., n] fp32, h_res [..., n, n] fp32: the raw logits, or with ``sinkhorn_iters`` >= 1 their
    Sinkhorn projection comb), plus (inv_rms [...], h_pre [..., n], h_mix [..., n*n+2n]) with ``return_aux``.
    Computes in fp32 (fp64 if any input is fp64)."""
    *lead, n, D = x.shape
    acc = torch.float64 if torch.float64 in (x.dtype, phi.dtype) else torch.float32
    xf = x.to(acc).reshape(*lead, n * D)
    h_mix = xf @ phi.to(acc).t()
    inv_rms = torch.rsqrt(xf.square().mean(dim=-1) + rms_eps)
    alpha, bias = alpha.to(acc), bias.to(acc)
    scaled = h_mix * inv_rms[..., None]
    h_pre = torch.sigmoid(alpha[0] * scaled[..., :n] + bias[:n]) + hc_eps
    h_post = 2 * torch.sigmoid(alpha[1] * scaled[..., n:2 * n] + bias[n:2 * n])
    h_res = (alpha[2] * scaled[..., 2 * n:] + bias[2 * n:]).reshape(*lead, n, n)
    if sinkhorn_iters:
        h_res = sinkhorn(h_res, sinkhorn_iters, hc_eps)
    h_in = (h_pre[..., None] * xf.reshape(*lead, n, D)).sum(dim=-2).to(x.dtype)
    if return_aux:
        return h_in, h_post, h_res, inv_rms, h_pre, h_mix
    return h_in, h_post, h_res
