"""The local tokens of HSA extend: one CTA per (query tile, kv head) runs the tile's tokens over their local pages
(each token's [lo, p]: the window and its own incomplete last page), each page read once for the whole tile, and
writes each row's normalized output and log-sum-exp into the last partial slot, which the combine merges with the
selected pages' slots (``kernels/extend_pages.py``).

A tile is `tokens` consecutive new tokens of one request (the score kernel's tiles), its rows (token, query head of
the kv head's group) stacked into M = tokens * G. It walks the logical pages from its first token's first local page
to its last token's last page, merging each into the rows by the decode's page merge (the page's softmax over the
keys the row sees, weighted by its log-sum-exp); a row sees a page's keys within its own [lo, p] and nothing else.
Rows past the request's end repeat its last token and are not written."""

import tilelang.language as T

from ...common.hw import LOG2E, SMEM_PER_SM
from .common import alloc_merge_state, first_local, page_merge


def local_ctas_per_sm(rows: int, head_dim: int, page_size: int, dtype: str, most: int = 3) -> int:
    """CTAs per SM by the kernel's shared memory (q, K, V and P tiles; 1 KiB reserved per CTA), at most ``most``
    (128 threads each, ~150 registers at the bench shape: 3 fit the register file)."""
    e = 4 if dtype == "float32" else 2
    smem = (rows * head_dim + 2 * page_size * head_dim + rows * page_size) * e
    return max(1, min(most, SMEM_PER_SM // (smem + 1024)))


def hsa_extend_local_kernel(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: str,
                            window_size: int, scale: float, tokens: int, part: int, threads: int = 128):
    """Partial slot ``part`` (o_part: the normalized output; logit_part: its log-sum-exp, natural units, -inf when
    empty) of the rows of every planned tile (``tile_req[t]`` >= 0) over their local tokens."""
    G = num_heads // num_kv_heads
    M = tokens * G
    total_q, batch, max_pages, num_slots, num_tiles, num_parts = T.dynamic(
        "total_q, batch, max_pages, num_slots, num_tiles, num_parts")
    f32 = "float32"
    merge = page_merge(scale * LOG2E, fuse_z=False)

    @T.prim_func
    def hsa_extend_local(q: T.Tensor((total_q, num_heads, head_dim), dtype),
                         k_buffer: T.Tensor((num_slots, num_kv_heads, head_dim), dtype),
                         v_buffer: T.Tensor((num_slots, num_kv_heads, head_dim), dtype),
                         page_table: T.Tensor((batch, max_pages), "int32"),
                         cum_seq_lens_q: T.Tensor((batch + 1,), "int32"),
                         row_lens: T.Tensor((total_q,), "int32"),
                         tile_req: T.Tensor((num_tiles,), "int32"),
                         tile_row0: T.Tensor((num_tiles,), "int32"),
                         o_part: T.Tensor((total_q, num_parts, num_heads, head_dim), dtype),
                         logit_part: T.Tensor((total_q, num_parts, num_heads), f32)):
        with T.Kernel(num_tiles, num_kv_heads, threads=threads) as (t, h):
            # registers budgeted for as many CTAs as shared memory holds (3 at the bench shape), so that one CTA's
            # page loads overlap another's math
            T.annotate_min_blocks_per_sm(local_ctas_per_sm(M, head_dim, page_size, dtype))
            q_s = T.alloc_shared((M, head_dim), dtype)
            k_s = T.alloc_shared((page_size, head_dim), dtype)
            v_s = T.alloc_shared((page_size, head_dim), dtype)
            st = alloc_merge_state(M, page_size, head_dim, dtype)
            row_lo = T.alloc_fragment((M,), "int32")  # the page's keys [row_lo, row_hi) the row sees
            row_hi = T.alloc_fragment((M,), "int32")
            tok_len = T.alloc_shared((tokens,), "int32")  # per token: its decode length p + 1 (0 past the end)
            b = tile_req[t]
            if b >= 0:
                row0 = tile_row0[t]
                last = T.min(row0 + tokens, cum_seq_lens_q[b + 1]) - 1
                for i in T.Parallel(tokens):
                    tok_len[i] = T.if_then_else(row0 + i <= last, row_lens[T.min(row0 + i, last)], 0)
                for m, d in T.Parallel(M, head_dim):  # rows past the request's end repeat its last token
                    q_s[m, d] = q[T.min(row0 + m // G, last), h * G + m % G, d]
                pl0 = first_local(row_lens[row0], page_size, window_size) // page_size
                T.clear(st.acc_o)
                T.fill(st.m_run, -T.infinity(f32))
                T.clear(st.l_run)
                for it in T.Pipelined(T.ceildiv(row_lens[last], page_size) - pl0, num_stages=1):
                    j = pl0 + it  # the logical page
                    pid = page_table[b, T.min(j, max_pages - 1)]
                    T.copy(k_buffer[pid * page_size:(pid + 1) * page_size, h, :], k_s)
                    # Slots past the request's end may hold anything: P is 0 there, but 0 * NaN is not. Their V
                    # rows are read from the page's last key of the request instead (every page of the loop holds
                    # one), so V comes by cp.async with K, a page ahead, and is never written twice.
                    last_key = T.min(row_lens[last] - 1 - j * page_size, page_size - 1)
                    for n, d in T.Parallel(page_size, head_dim):
                        v_s[n, d] = v_buffer[pid * page_size + T.min(n, last_key), h, d]
                    for m in T.Parallel(M):
                        L = tok_len[m // G]
                        row_lo[m] = T.max(first_local(L, page_size, window_size) - j * page_size, 0)
                        row_hi[m] = T.min(L - j * page_size, page_size)
                    merge(q_s, k_s, v_s, st, row_lo, row_hi, None, None, None, None)
                for m, d in T.Parallel(M, head_dim):
                    if row0 + m // G <= last:
                        o_part[row0 + m // G, part, h * G + m % G, d] = T.cast(
                            T.if_then_else(st.l_run[m] > 0, st.acc_o[m, d] / st.l_run[m], 0), dtype)
                for m in T.Parallel(M):
                    if row0 + m // G <= last:
                        logit_part[row0 + m // G, part, h * G + m % G] = T.if_then_else(
                            st.l_run[m] > 0, (st.m_run[m] + T.log2(st.l_run[m])) / LOG2E, -T.infinity(f32))

    return hsa_extend_local
