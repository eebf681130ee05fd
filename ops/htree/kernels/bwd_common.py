"""What the htree backward kernels share: operand tiles in shared memory (fp32: split-TF32 halves), the products
acc += a @ b^T on them, and the RoPE rotation and its inverse.

Products are acc += A B^T (``product``, A [M, k] and B [N, k], both K-major) or acc += A B (``product_nn``, B [k, N]),
on operands in shared memory; fp32 operands are typed float32 (mma.sync TF32 products, which take both forms; a
TF32 warpgroup product would take only the first). fp32 operands are split into a TF32-exact high part and its
remainder and multiplied hi*hi + hi*lo + lo*hi (as in the forward), so fp32 scores, probabilities and gradients keep
close to fp32 accuracy."""

from ...common.hw import LOG2E
from .fragments import tf32_hi

import tilelang.language as T  # noqa: E402

LN2 = 1.0 / LOG2E
FLAG_PAD = 16  # the winner flags' padding columns: the first takes the host's scattered -1 entries, and rows of
# nbuf + 16 bytes keep the 16-byte strides the top kernels' TMA copies need


def tiles(dtype: str, policy=None):
    """(alloc, put, product, product_nn) for operands of ``dtype``:
    alloc(shape) -> (tile, lo): a shared operand tile and, for fp32, the tile of its low halves (else a stub);
    put(x, dst, dst_lo, i, j): store fp32 x as the operand element (i, j);
    product(a, a_lo, b, b_lo, acc): acc += a @ b^T (fp32: three TF32 products), with the warp policy given;
    product_nn(a, a_lo, b, b_lo, acc): acc += a @ b."""
    split = dtype == "float32"
    kw = {} if policy is None else {"policy": policy}

    def alloc(shape):
        return T.alloc_shared(shape, dtype), T.alloc_shared(shape if split else (1, 1), dtype)

    @T.macro
    def put(x, dst, dst_lo, i, j):
        if split:
            hi = tf32_hi(x)
            dst[i, j] = hi
            dst_lo[i, j] = x - hi
        else:
            dst[i, j] = T.cast(x, dtype)

    @T.macro
    def product(a, a_lo, b, b_lo, acc):
        T.gemm(a, b, acc, transpose_B=True, **kw)
        if split:
            T.gemm(a, b_lo, acc, transpose_B=True, **kw)
            T.gemm(a_lo, b, acc, transpose_B=True, **kw)

    @T.macro
    def product_nn(a, a_lo, b, b_lo, acc):
        T.gemm(a, b, acc, **kw)
        if split:
            T.gemm(a, b_lo, acc, **kw)
            T.gemm(a_lo, b, acc, **kw)

    return alloc, put, product, product_nn


def rotate(x, y, cos, sin):
    """Rotate-half RoPE of the pair (x, y) = (v[i], v[i + K/2]) at the angle of (cos, sin)."""
    return x * cos - y * sin, x * sin + y * cos


def unrotate(x, y, cos, sin):
    """The inverse (transpose) of ``rotate``: the gradient of a rotated pair back to the unrotated one."""
    return x * cos + y * sin, y * cos - x * sin
