"""Per-row formulas shared by the backward's kernels (TileLang expressions, inlined where used); the math
is golden/mhc_pre_bwd.py's."""

from ...common import runtime  # noqa: F401  (the kernel cache dir before TileLang is imported)

import tilelang.language as T  # noqa: E402


def _alpha_group(r, n: int):
    """The alpha that scales row r of phi: 0 (h_pre rows), 1 (h_post rows), 2 (h_res rows)."""
    return T.if_then_else(r < n, 0, T.if_then_else(r < 2 * n, 1, 2))


def _grad_z(r, n: int, M: int, sig, p, g_post, g_res):
    """d loss / d pre-activation z of row r (golden's g_z), sig = sigmoid(z); zero for the padding rows."""
    return T.if_then_else(r < n, p * sig * (1 - sig), T.if_then_else(
        r < 2 * n, 2 * g_post * sig * (1 - sig), T.if_then_else(r < M, g_res, T.float32(0))))


def _x_coef(g_s, s, n: int, D: int):
    """c, the coefficient of x in grad_x: d loss / d inv_rms times d inv_rms / d x = -s^3 x / (n*D)."""
    return -g_s * s * s * s / (n * D)
