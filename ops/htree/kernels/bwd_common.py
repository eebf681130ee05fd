"""What the htree backward kernels share: operand tiles in shared memory (fp32: split-TF32 halves, or TF32), the
products acc += a @ b^T on them, and the RoPE rotation and its inverse.

Products are acc += A B^T (``product``, A [M, k] and B [N, k], both K-major) or acc += A B (``product_nn``, B [k, N]),
on operands in shared memory; fp32 operands are typed float32 (mma.sync TF32 products, which take both forms; a
TF32 warpgroup product would take only the first). fp32 operands are split into a TF32-exact high part and its
remainder and multiplied hi*hi + hi*lo + lo*hi (as in the forward), so fp32 scores, probabilities and gradients keep
close to fp32 accuracy: ``fp32_precision="highest"``. With "high" (torch's name for TF32 matmuls, and what Triton's
default fp32 dot computes) each operand is rounded to TF32 once and every product is one TF32 product: a third of
the tensor-core work and half the operand bytes, with fp16's 10-bit mantissa."""

from ...common.hw import LOG2E
from .fragments import split_operands, tf32_hi, tf32_round

import tilelang.language as T  # noqa: E402

LN2 = 1.0 / LOG2E
FLAG_PAD = 16  # the winner flags' padding columns: the first takes the host's scattered -1 entries, and rows of
# nbuf + 16 bytes keep the 16-byte strides the top kernels' TMA copies need

FP32_PRECISIONS = ("highest", "high")  # torch.get_float32_matmul_precision's names ("medium" is taken as "high")


def uses_fp32_fragments(dtype: str, head_dim: int, v_head_dim: int, num_groups: int, compression_rate: int) -> bool:
    """Whether the backward's rows and nodes kernels are the fp32 register-fragment ones (``bwd_rows32``,
    ``bwd_nodes32``): fp32, K and V in {32, 64} (what their registers hold), G <= 16 (one 16-row tile of heads) and
    r >= 16 (a 16-row tile of candidates or children is one parent's)."""
    return (dtype == "float32" and head_dim in (32, 64) and v_head_dim in (32, 64) and num_groups <= 16
            and compression_rate >= 16)


def tiles(dtype: str, policy=None, fp32_precision: str = "highest", tf32_typed: bool = False):
    """(alloc, put, product, product_nn) for operands of ``dtype``:
    alloc(shape) -> (tile, lo): a shared operand tile and, for fp32, the tile of its low halves (else a stub);
    put(x, dst, dst_lo, i, j): store fp32 x as the operand element (i, j) (fp32 at "high": rounded to TF32);
    product(a, a_lo, b, b_lo, acc): acc += a @ b^T (fp32: three TF32 products), with the warp policy given;
    product_nn(a, a_lo, b, b_lo, acc): acc += a @ b.
    tf32_typed: fp32 tiles typed TF32, which TileLang multiplies with wgmma (``product`` only: a TF32 warpgroup
    product takes both operands K-major)."""
    split = split_operands(dtype, fp32_precision)
    rounded = dtype == "float32" and not split
    kw = {} if policy is None else {"policy": policy}
    tile_dtype = T.tfloat32 if tf32_typed and dtype == "float32" else dtype

    def alloc(shape):
        return T.alloc_shared(shape, tile_dtype), T.alloc_shared(shape if split else (1, 1), tile_dtype)

    @T.macro
    def put(x, dst, dst_lo, i, j):
        if split:
            hi = tf32_hi(x)
            dst[i, j] = hi
            dst_lo[i, j] = x - hi
        elif rounded:
            dst[i, j] = tf32_round(x)
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


@T.macro
def warp_double_buffer(k, count, prefetch_next):
    """Before a warp computes the k-th of its `count` items from stage k % 2 of its own double buffer: the other stage
    (item k - 1's, read by now) takes item k + 1's loads (``prefetch_next(stage)``: cp.async, one commit), or an empty
    commit after the last item, so that item k's group is always the second newest; then wait for it."""
    T.sync_warp()  # item k - 1 is read: its stage takes item k + 1
    if k + 1 < count:
        prefetch_next(1 - k % 2)
    else:
        T.ptx_commit_group()
    T.ptx_wait_group(1)
    T.sync_warp()


def lower_layer_tiles(tile, prefetch=None):
    """The macro running a fragment rows kernel's ``tile`` (bwd_rows16, bwd_rows32) over a row's layers below the top,
    l = num_lower - 1 .. 0: the layer's candidate count n and its parents into shared memory, then warp w takes
    every fourth 16-candidate tile, w, w + 4, ... (layer 0: the tokens, KRot0 and Vt; above: the nodes, KRotN and
    NodesV from LayerOff[l], their winners flagged).
    With ``prefetch`` (a macro issuing a tile's loads by cp.async into stage st of the warp's buffers, one commit),
    each warp copies its next tile while it computes the current one, which ``tile`` then reads from stage st."""
    @T.macro
    def on_source(K, Vs, row_off, nk, nv, flagged, tables, smem, regs, b, ts, h, l, n, p0, w, gr, tg, st, issue):
        """Tile p0 of a layer whose K / V rows are those of K and Vs from row_off (nk / nv of them): its loads
        issued into stage st (``issue``), else computed."""
        if issue:
            prefetch(K, Vs, row_off, nk, nv, tables, smem, b, h, n, p0, w, gr, tg, st)
        elif prefetch is None:
            tile(K, Vs, row_off, nk, nv, tables, smem, regs, b, ts, h, l, n, p0, gr, tg, flagged)
        else:
            tile(K, Vs, row_off, nk, nv, tables, smem, regs, b, ts, h, l, n, p0, gr, tg, flagged, w, st)

    @T.macro
    def on_layer(KRot0, Vt, KRotN, NodesV, Tn, NR, NN, LayerOff, tables, smem, regs, b, ts, h, l, n, p0, w, gr, tg,
                 st, issue):
        """Layer l's tile p0: the tokens (layer 0) or the nodes from LayerOff[l], their winners flagged."""
        if l == 0:
            on_source(KRot0, Vt, 0, Tn, Tn, False, tables, smem, regs, b, ts, h, l, n, p0, w, gr, tg, st, issue)
        else:
            on_source(KRotN, NodesV, LayerOff[l], NR, NN, True, tables, smem, regs, b, ts, h, l, n, p0, w, gr, tg, st,
                      issue)

    @T.macro
    def walk(KRot0, Vt, KRotN, NodesV, Tn, NR, NN, Par, NCand, LayerOff, tables, smem, regs, b, ts, h, w, gr, tg,
             num_lower):
        parents = smem[0]
        layer = (KRot0, Vt, KRotN, NodesV, Tn, NR, NN, LayerOff, tables, smem, regs, b, ts, h)
        for li in T.serial(num_lower):
            l = num_lower - 1 - li
            n = NCand[l, b, ts, h]
            T.sync_threads()  # every warp is done with the layer above's parents
            for i in T.Parallel(parents.shape[0]):
                parents[i] = Par[l, b, ts, h, i]
            T.sync_threads()
            n_it = T.ceildiv(T.max(T.ceildiv(n, 16) - w, 0), 4)
            if prefetch is not None:
                if n_it > 0:
                    T.sync_warp()  # the warp's last tile of the layer above is read
                    on_layer(*layer, l, n, w * 16, w, gr, tg, 0, True)
            for it in T.serial(n_it):
                p0 = (w + 4 * it) * 16
                if prefetch is None:
                    on_layer(*layer, l, n, p0, w, gr, tg, 0, False)
                else:
                    warp_double_buffer(it, n_it, lambda st: on_layer(*layer, l, n, p0 + 64, w, gr, tg, st, True))
                    on_layer(*layer, l, n, p0, w, gr, tg, it % 2, False)

    return walk
