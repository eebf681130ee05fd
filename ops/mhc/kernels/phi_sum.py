"""grad_phi from the grad kernels' per-token-group partials of its transpose."""

from ...common import runtime  # noqa: F401  (the kernel cache dir before TileLang is imported)
from ..tiling import _dims

import tilelang.language as T  # noqa: E402


def mhc_pre_bwd_phi_sum_kernel(n: int, D: int, token_groups: int, block_d: int, cols: int = 64,
                               threads: int = 128):
    """grad_phi [M, n*D] from the grad kernels' per-token-group partials of its transpose, summed in group
    order (deterministic); through shared memory so that both the reads and the writes are whole rows."""
    M, _, NP, _, Dc = _dims(n, D, block_d)

    @T.prim_func
    def mhc_pre_bwd_phi_sum(
        PartPhiT: T.Tensor((token_groups, n, Dc, NP), "float32"),
        GradPhi: T.Tensor((M, n * D), "float32"),
    ):
        with T.Kernel(T.ceildiv(D, cols), n, threads=threads) as (bx, i):
            k0 = bx * cols
            tile = T.alloc_shared((cols, NP), "float32")
            for k, r in T.Parallel(cols, NP):
                kk = T.min(k0 + k, Dc - 1)
                tile[k, r] = sum((PartPhiT[g, i, kk, r] for g in range(1, token_groups)), PartPhiT[0, i, kk, r])
            for r, k in T.Parallel(M, cols):
                if k0 + k < D:
                    GradPhi[r, i * D + k0 + k] = tile[k, r]

    return mhc_pre_bwd_phi_sum
