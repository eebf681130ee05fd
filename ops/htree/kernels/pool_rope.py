"""The tree's layers (``htree_pool_kernel``: each node the mean of its existing children) and rotated copies of
K (``htree_rope_kernel``: the top layer at its buffer positions, or the nodes below it at their child index)."""

from .fragments import rope_pair

import tilelang.language as T  # noqa: E402


def htree_pool_kernel(num_kv_heads: int, head_dim: int, v_head_dim: int, compression_rate: int,
                      dtype: str, block_i: int = 32, threads: int = 128):
    """Dst[b, dst_off + i] = mean of Src[b, src_off + i*r + c] over existing children c < r."""
    H, K, V, r = num_kv_heads, head_dim, v_head_dim, compression_rate
    B, NS, ND = T.dynamic("B"), T.dynamic("NS"), T.dynamic("ND")

    @T.prim_func
    def htree_pool(SrcK: T.Tensor((B, NS, H, K), dtype), SrcV: T.Tensor((B, NS, H, V), dtype),
                   DstK: T.Tensor((B, ND, H, K), dtype), DstV: T.Tensor((B, ND, H, V), dtype),
                   src_off: T.int32, src_len: T.int32, dst_off: T.int32, dst_len: T.int32):
        with T.Kernel(T.ceildiv(dst_len, block_i), H, B, threads=threads) as (bi, h, b):
            for i, d in T.Parallel(block_i, K + V):
                node = bi * block_i + i
                count = T.min(r, src_len - node * r)
                if node < dst_len:
                    if d < K:
                        total = sum(T.if_then_else(c < count, T.cast(SrcK[b, T.min(src_off + node * r + c, NS - 1), h,
                                                                           T.min(d, K - 1)], "float32"), 0.0)
                                    for c in range(r))
                        DstK[b, dst_off + node, h, d] = T.cast(total / T.cast(count, "float32"), dtype)
                    else:
                        total = sum(T.if_then_else(c < count, T.cast(SrcV[b, T.min(src_off + node * r + c, NS - 1), h,
                                                                           T.max(d - K, 0)], "float32"), 0.0)
                                    for c in range(r))
                        DstV[b, dst_off + node, h, d - K] = T.cast(total / T.cast(count, "float32"), dtype)

    return htree_pool


def htree_rope_kernel(num_kv_heads: int, head_dim: int, dtype: str, period: int = 0, block_i: int = 32,
                      threads: int = 128):
    """Dst[b, h, i] = Src[b, src_off + i, h] rotated at position i (i % period with a period): the top layer's
    candidates are the same nodes at the same buffer positions for every query, so they are rotated once,
    not per query; the nodes below the top are rotated at their child index for htree_layer16_kernel."""
    H, K = num_kv_heads, head_dim
    half = K // 2
    B, NS, NT, NC = T.dynamic("B"), T.dynamic("NS"), T.dynamic("NT"), T.dynamic("NC")

    @T.prim_func
    def htree_rope(Src: T.Tensor((B, NS, H, K), dtype), Cos: T.Tensor((NC, half), "float32"),
                   Sin: T.Tensor((NC, half), "float32"), Dst: T.Tensor((B, H, NT, K), dtype), src_off: T.int32):
        with T.Kernel(T.ceildiv(NT, block_i), H, B, threads=threads) as (bi, h, b):
            for i, d in T.Parallel(block_i, half):
                node = bi * block_i + i
                if node < NT:
                    x = T.cast(Src[b, src_off + node, h, d], "float32")
                    y = T.cast(Src[b, src_off + node, h, d + half], "float32")
                    pos = T.bitwise_and(node, period - 1) if period else node
                    lo, hi = rope_pair(x, y, Cos[pos, d], Sin[pos, d])
                    Dst[b, h, node, d] = T.cast(lo, dtype)
                    Dst[b, h, node, d + half] = T.cast(hi, dtype)

    return htree_rope
