"""Pieces the htree kernels share: constants, TF32 splits, RoPE pairs, mma.sync tiles in registers, operand
stores into shared memory, the packed importance keys, and the layer kernels' warp
states."""

import math
import struct

from ...common.tl.mma import mma
from ..tree import RIGHTMOST_IMPORTANCE

import tilelang.language as T  # noqa: E402  (after the runtime set the cache dir)

FLT_MIN = 1.1754943508222875e-38
RIGHTMOST_KEY = struct.unpack("<i", struct.pack("<f", RIGHTMOST_IMPORTANCE))[0]  # its fp32 bits


def uses_layer_kernels(dtype: str, K: int, V: int, G: int, r: int) -> bool:
    """Whether layer 0 runs in its own kernel: htree_layer0_kernel (fp32, K and V in {32, 64}, G <= 16) or
    htree_layer16_kernel (16-bit, r >= 16: a 16-candidate tile never spans two parents; the middle layers too)."""
    if dtype == "float32":
        return K in (32, 64) and V in (32, 64) and G <= 16
    return r >= 16


def tf32_hi(x):
    """The TF32-exact high part of fp32 x (low 13 mantissa bits cleared); x minus it is exact in fp32."""
    return T.reinterpret(T.bitwise_and(T.reinterpret(x, "int32"), T.int32(-8192)), "float32")


def tf32_round(x):
    """fp32 x rounded to the nearest TF32 value (half a TF32 ulp added, low 13 mantissa bits cleared): a one-product
    TF32 operand, rounded rather than truncated by the tensor cores."""
    return T.reinterpret(T.bitwise_and(T.reinterpret(x, "int32") + T.int32(4096), T.int32(-8192)), "float32")


@T.macro
def split_halves(v, hi, lo, i):
    """hi[i], lo[i] = the split-TF32 halves of fp32 v (local buffers)."""
    hi[i] = tf32_hi(v)
    lo[i] = v - hi[i]


def rope_pair(x, y, cos, sin):
    """Rotate-half RoPE of the pair (x, y) = (v[i], v[i + K/2]) at the angle of (cos, sin)."""
    return x * cos - y * sin, x * sin + y * cos


def split_operands(dtype: str, fp32_precision: str = "highest") -> bool:
    """Whether operands are split-TF32 halves (fp32 at "highest") rather than one plane."""
    return dtype == "float32" and fp32_precision == "highest"


def tf32_tiles(fp32_precision: str = "highest"):
    """(operand, product) macros of the fp32 fragment kernels: operand(x, hi, lo, i) stores fp32 x as TF32 operand
    element i (split halves at "highest", rounded at "high"); product(ah, al, ai, bh, bl, bi, c, ci) adds one
    m16n8k8 tile, c[ci:ci+4] += a b (split: hi hi + hi lo + lo hi)."""
    split = split_operands("float32", fp32_precision)

    @T.macro
    def operand(x, hi, lo, i):
        if split:
            split_halves(x, hi, lo, i)
        else:
            hi[i] = tf32_round(x)

    @T.macro
    def product(ah, al, ai, bh, bl, bi, c, ci):
        mma(ah, ai, bh, bi, c, ci)
        if split:
            mma(ah, ai, bl, bi, c, ci)
            mma(al, ai, bh, bi, c, ci)

    return operand, product


def child(parents, p, r: int, top_k: int):
    """Node of candidate p below the top: child p % r of parent p // r (parents in shared memory)."""
    return parents[T.min(p >> int(math.log2(r)), top_k - 1)] * r + T.bitwise_and(p, r - 1)


def operand_stores(dtype: str, half: int):
    """Macros storing fp32 values as mma operands of ``dtype`` (fp32: split-TF32 halves in two tiles):
    put(x, dst, dst_lo, i, j), and put_rotated for a RoPE pair (i, i + half)."""
    split = dtype == "float32"

    @T.macro
    def put(x, dst, dst_lo, i, j):
        if split:  # the TF32-exact high part and the fp32 remainder
            hi = tf32_hi(x)
            dst[i, j] = hi
            dst_lo[i, j] = x - hi
        else:
            dst[i, j] = T.cast(x, dtype)

    @T.macro
    def put_rotated(x, y, cos, sin, mul, ok, dst, dst_lo, row, i):
        """dst[row, i], dst[row, i + half] = mul * rotate-half RoPE of the pair (x, y); 0 unless ok."""
        lo, hi = rope_pair(x, y, cos, sin)
        lo = T.if_then_else(ok, mul * lo, 0.0)
        hi = T.if_then_else(ok, mul * hi, 0.0)
        put(lo, dst, dst_lo, row, i)
        put(hi, dst, dst_lo, row, i + half)

    return put, put_rotated


@T.macro
def split_product(a_s, a_lo, b_s, b_lo, acc):
    """acc += a @ b^T from split-TF32 halves (hi*hi + hi*lo + lo*hi)."""
    T.gemm(a_s, b_s, acc, transpose_B=True)
    T.gemm(a_s, b_lo, acc, transpose_B=True)
    T.gemm(a_lo, b_s, acc, transpose_B=True)


def head_sum(buf, num_heads: int, row, j):
    """sum_g buf[row + g, j] over num_heads rows, in head order like the golden."""
    total = buf[row, j]
    for g in range(1, num_heads):
        total = total + buf[row + g, j]
    return total


def packed_key(prob, num_heads: int, row, j, p, n, pos_mask: int):
    """Candidate p's packed importance key: the fp32 sum of its heads' probabilities (rows row .. row +
    num_heads - 1 of prob, column j; the rightmost candidate n - 1 gets RIGHTMOST_IMPORTANCE) with its low LOG_N
    bits replaced by ~p, so keys are distinct and order ties by the smaller position."""
    bits = T.if_then_else(p == n - 1, RIGHTMOST_KEY, T.reinterpret(head_sum(prob, num_heads, row, j), "int32"))
    return T.bitwise_or(T.bitwise_and(bits, ~pos_mask), T.bitwise_and(T.bitwise_not(p), pos_mask))


# ----------------------------------------------------------------------------- the layer kernels' warp states
@T.macro
def warp_state_in(PartML, m_w, l_w, b, ts, h, w, gr, tg, G: int):
    """Rows gr and gr + 8 (heads) of the layers above, for a layer kernel's warp: their maximum is every warp's
    reference, their sum warp 0's (lane tg == 0; the others start empty)."""
    for rr in T.unroll(2):
        g = gr + 8 * rr
        m_w[rr] = T.if_then_else(g < G, PartML[b, ts, h * G + T.min(g, G - 1), 0], 0.0)
        l_w[rr] = T.if_then_else(w == 0 and tg == 0 and g < G, PartML[b, ts, h * G + T.min(g, G - 1), 1], 0.0)


@T.macro
def warp_scales(m_w, l_w, mx, al, red, w, gr, tg):
    """The four warps' softmax states on one reference: mx[rr] = row gr + 8 rr's maximum over the warps, al[rr] =
    this warp's rescale to it; red[w] = the warps' rescaled sums, red[4] the maxima (summed in a fixed order by
    warp_state_out)."""
    for rr in T.unroll(2):
        l_w[rr] += T.shfl_xor(l_w[rr], 1)
        l_w[rr] += T.shfl_xor(l_w[rr], 2)
    if tg == 0:
        for rr in T.unroll(2):
            red[w, gr + 8 * rr] = m_w[rr]
    T.sync_threads()
    for rr in T.unroll(2):
        mx[rr] = T.max(T.max(red[0, gr + 8 * rr], red[1, gr + 8 * rr]), T.max(red[2, gr + 8 * rr], red[3, gr + 8 * rr]))
        al[rr] = T.exp2(m_w[rr] - mx[rr])
    T.sync_threads()  # every warp has read the maxima: red's rows take the sums, rescaled to the common one
    if tg == 0:
        for rr in T.unroll(2):
            red[w, gr + 8 * rr] = l_w[rr] * al[rr]
            if w == 0:
                red[4, gr + 8 * rr] = mx[rr]


@T.macro
def warp_state_out(o_sh, red, PartO, PartML, b, ts, h, G: int):
    """The combined state (o_sh: the warps' rescaled U, red: warp_scales') back to PartO / PartML."""
    for g, d in T.Parallel(G, o_sh.shape[1]):
        PartO[b, ts, h * G + g, d] = o_sh[g, d]
    for g in T.Parallel(G):
        PartML[b, ts, h * G + g, 0] = red[4, g]
        PartML[b, ts, h * G + g, 1] = (red[0, g] + red[1, g]) + (red[2, g] + red[3, g])
