"""The backward's elementwise kernels: ``htree_bwd_delta_kernel`` (D = rowsum(dO * O) per query head, fp32) and
``htree_bwd_unpool_kernel`` (the mean pooling's gradient: a node's accumulated dK, dV flow to each of its existing
children divided by their count, one layer at a time from the top; into layer 0, the result in the inputs' dtype)."""

from ...common import runtime  # noqa: F401  (sets the kernel cache dir before TileLang is imported)

import tilelang.language as T  # noqa: E402


def htree_bwd_delta_kernel(num_heads: int, v_head_dim: int, dtype: str, block_r: int = 32, threads: int = 128):
    """Dl[b, t, h] = sum_d dO[b, t, h, d] * O[b, t, h, d] in fp32."""
    H, V = num_heads, v_head_dim
    B, Tn = T.dynamic("B"), T.dynamic("T")

    @T.prim_func
    def htree_bwd_delta(dO: T.Tensor((B, Tn, H, V), dtype), O: T.Tensor((B, Tn, H, V), dtype),
                        Dl: T.Tensor((B, Tn, H), "float32")):
        with T.Kernel(T.ceildiv(Tn * H, block_r), B, threads=threads) as (bx, b):
            prod = T.alloc_fragment((block_r, V), "float32")
            total = T.alloc_fragment((block_r,), "float32")
            for i, d in T.Parallel(block_r, V):
                row = T.min(bx * block_r + i, Tn * H - 1)
                prod[i, d] = T.cast(dO[b, row // H, row % H, d], "float32") * T.cast(O[b, row // H, row % H, d],
                                                                                     "float32")
            T.reduce_sum(prod, total, dim=1)
            for i in T.Parallel(block_r):
                row = bx * block_r + i
                if row < Tn * H:
                    Dl[b, row // H, row % H] = total[i]

    return htree_bwd_delta


def htree_bwd_unpool_kernel(num_kv_heads: int, head_dim: int, v_head_dim: int, compression_rate: int, dtype: str,
                            final: bool, block_i: int = 32, threads: int = 128):
    """One layer l - 1 of the push-down, from the nodes of layer l (rows src_off + i // r of the accumulators, each
    over count = min(r, dst_len - (i // r) r) children):
      final=False: AccK/AccV[b, dst_off + i] += Acc[b, src_off + i // r] / count, i < dst_len (layers above 0);
      final=True: dK/dV[b, i] = Acc[b, i] (+ the parent's share when has_parent), i < T, in ``dtype`` (layer 0)."""
    H, K, V, r = num_kv_heads, head_dim, v_head_dim, compression_rate
    B, NA, Tn = T.dynamic("B"), T.dynamic("NA"), T.dynamic("T")

    def share(Acc, b, src_off, i, h, d, dst_len):
        """The parent's gradient per child."""
        count = T.min(r, dst_len - (i // r) * r)
        return Acc[b, T.min(src_off + i // r, NA - 1), h, d] / T.cast(count, "float32")

    if not final:
        @T.prim_func
        def htree_bwd_unpool(AccK: T.Tensor((B, NA, H, K), "float32"), AccV: T.Tensor((B, NA, H, V), "float32"),
                             dst_off: T.int32, dst_len: T.int32, src_off: T.int32):
            with T.Kernel(T.ceildiv(dst_len, block_i), H, B, threads=threads) as (bi, h, b):
                for i, d in T.Parallel(block_i, K + V):
                    node = bi * block_i + i
                    if node < dst_len:
                        if d < K:
                            AccK[b, dst_off + node, h, d] += share(AccK, b, src_off, node, h, T.min(d, K - 1), dst_len)
                        else:
                            AccV[b, dst_off + node, h, d - K] += share(AccV, b, src_off, node, h, T.max(d - K, 0),
                                                                       dst_len)

        return htree_bwd_unpool

    @T.prim_func
    def htree_bwd_unpool_out(AccK: T.Tensor((B, NA, H, K), "float32"), AccV: T.Tensor((B, NA, H, V), "float32"),
                             dK: T.Tensor((B, Tn, H, K), dtype), dV: T.Tensor((B, Tn, H, V), dtype), src_off: T.int32,
                             has_parent: T.int32):
        with T.Kernel(T.ceildiv(Tn, block_i), H, B, threads=threads) as (bi, h, b):
            for i, d in T.Parallel(block_i, K + V):
                node = bi * block_i + i
                if node < Tn:
                    if d < K:
                        dK[b, node, h, T.min(d, K - 1)] = T.cast(AccK[b, node, h, T.min(d, K - 1)] + T.if_then_else(
                            has_parent != 0, share(AccK, b, src_off, node, h, T.min(d, K - 1), Tn), 0.0), dtype)
                    else:
                        dV[b, node, h, T.max(d - K, 0)] = T.cast(AccV[b, node, h, T.max(d - K, 0)] + T.if_then_else(
                            has_parent != 0, share(AccV, b, src_off, node, h, T.max(d - K, 0), Tn), 0.0), dtype)

    return htree_bwd_unpool_out
