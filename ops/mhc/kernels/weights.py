"""A token's pre weights from its h_mix row and sum of squares (HF's DeepseekV4HyperConnection), as the forward
kernels' epilogues write them (``fwd_mix``, ``fwd_fused``, ``post_pre``): expressions, traced in place."""

from ...common import runtime  # noqa: F401  (the kernel cache dir before TileLang is imported)

import tilelang.language as T  # noqa: E402


def inv_rms(sumsq, n: int, D: int, rms_eps: float):
    """rsqrt(mean(x^2) + rms_eps) over a token's n * D values."""
    return T.rsqrt(sumsq / (n * D) + rms_eps)


def h_pre(Alpha, rms, mix, bias, hc_eps: float):
    return T.sigmoid(Alpha[0] * rms * mix + bias) + hc_eps


def h_post(Alpha, rms, mix, bias):
    return 2 * T.sigmoid(Alpha[1] * rms * mix + bias)


def h_res_logit(Alpha, rms, mix, bias):
    """The comb logit (h_res without Sinkhorn)."""
    return Alpha[2] * rms * mix + bias
