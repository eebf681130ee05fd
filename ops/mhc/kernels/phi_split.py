"""phi's bf16 hi + lo copy, the tensor-core operand of the forward's and the backward's products."""

from ...common import runtime  # noqa: F401  (the kernel cache dir before TileLang is imported)
from ..tiling import _D_PAD, _round_up, phi_split_rows

import tilelang.language as T  # noqa: E402


def mhc_phi_split_kernel(n: int, D: int, block_d: int = _D_PAD, threads: int = 128):
    """phi fp32 [N, n*D] -> bf16 hi and lo parts [NG, n, Dp], NG = phi_split_rows(n) and Dp = D rounded
    up to _D_PAD: rows N..NG-1 and columns D..Dp-1 are zero."""
    N, NG = n * n + 2 * n, phi_split_rows(n)
    Dp = _round_up(D, _D_PAD)

    @T.prim_func
    def mhc_phi_split(Phi: T.Tensor((N, n * D), "float32"), PhiHi: T.Tensor((NG, n, Dp), "bfloat16"),
                      PhiLo: T.Tensor((NG, n, Dp), "bfloat16")):
        with T.Kernel(Dp // block_d, n, NG, threads=threads) as (bd, i, r):
            for d in T.Parallel(block_d):
                col = bd * block_d + d
                v = T.if_then_else(r < N and col < D, Phi[T.min(r, N - 1), i * D + T.min(col, D - 1)],
                                   T.float32(0))
                hi = T.cast(v, "bfloat16")
                PhiHi[r, i, col] = hi
                PhiLo[r, i, col] = T.cast(v - T.cast(hi, "float32"), "bfloat16")

    return mhc_phi_split
