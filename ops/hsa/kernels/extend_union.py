"""The attention kernel of HSA extend: one CTA per (query tile, kv head) runs the tile's tokens over the union of
the pages they selected, each page read once for the whole tile, then over the tile's local pages.

A tile is `tokens` consecutive new tokens of one request (the score kernel's tiles), its rows (token, query head of
the kv head's group) stacked into M = tokens * G. Items are pages: first the union's selected pages (ascending
physical ids, built on the device by ``union_pages``; a mask per page says which of the tile's tokens selected it),
then the logical pages of the tile's local tokens. Per item and row the decode's merge: the page's softmax (m, l) and
P V, weighted into the row's running (o, logit max, sum) by exp2(logit - max) / l, where the logit is the page's
z = scale q . repr (softmax combine, selected pages) or its log-sum-exp (local pages, and every page of the token
combine). A row takes an item only if its token selected the page, or, for a local page, if the page holds some of
its local tokens [lo, p]; the keys outside that range are masked. Rows past the request's end repeat its last token
and are not written."""

import tilelang.language as T

from ...common.hw import LOG2E, SMEM_PER_SM
from ..schedule import ZCOLS
from .common import first_local, merge_state, page_merge


def union_ctas_per_sm(rows: int, head_dim: int, page_size: int, dtype: str, most: int = 3) -> int:
    """CTAs per SM by the kernel's shared memory (q, K, V, the reprs' and P tiles, z; 1 KiB reserved per CTA),
    at most ``most`` (128 threads each, ~150 registers at the bench shape: 3 fit the register file)."""
    e = 4 if dtype == "float32" else 2
    smem = (rows * head_dim + 2 * page_size * head_dim + ZCOLS * head_dim + rows * page_size) * e + rows * ZCOLS * 4
    return max(1, min(most, SMEM_PER_SM // (smem + 1024)))


def hsa_extend_union_kernel(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: str,
                            window_size: int, combine: str, scale: float, tokens: int, part: int = 0,
                            threads: int = 128):
    """Partial slot ``part`` (o_part: the normalized output; logit_part: its log-sum-exp, natural units, -inf when
    empty) of the rows of every planned tile (``tile_req[t]`` >= 0) from its union pages
    ``pages[t, h, :counts[t, h]]`` (masks: bit i = the tile's token i selected the page) and its local pages. With no
    union page this is the rows' local attention, the slot the page-major path's combine merges with the pages'."""
    G = num_heads // num_kv_heads
    M = tokens * G
    fuse_z = combine == "softmax"
    total_q, batch, max_pages, num_slots, num_pages, num_tiles, cap, num_parts = T.dynamic(
        "total_q, batch, max_pages, num_slots, num_pages, num_tiles, cap, num_parts")
    f32 = "float32"
    unit = scale * LOG2E
    merge = page_merge(unit, fuse_z)

    @T.prim_func
    def hsa_extend_union(q: T.Tensor((total_q, num_heads, head_dim), dtype),
                         k_buffer: T.Tensor((num_slots, num_kv_heads, head_dim), dtype),
                         v_buffer: T.Tensor((num_slots, num_kv_heads, head_dim), dtype),
                         page_table: T.Tensor((batch, max_pages), "int32"),
                         cum_seq_lens_q: T.Tensor((batch + 1,), "int32"),
                         row_lens: T.Tensor((total_q,), "int32"),
                         tile_req: T.Tensor((num_tiles,), "int32"),
                         tile_row0: T.Tensor((num_tiles,), "int32"),
                         chunk_repr: T.Tensor((num_pages, num_kv_heads, head_dim), dtype),
                         pages: T.Tensor((num_tiles, num_kv_heads, cap), "int32"),
                         masks: T.Tensor((num_tiles, num_kv_heads, cap), "int64"),
                         counts: T.Tensor((num_tiles, num_kv_heads), "int32"),
                         o_part: T.Tensor((total_q, num_parts, num_heads, head_dim), dtype),
                         logit_part: T.Tensor((total_q, num_parts, num_heads), f32)):
        with T.Kernel(num_tiles, num_kv_heads, threads=threads) as (t, h):
            # registers budgeted for as many CTAs as shared memory holds (3 at the bench shape), so that one CTA's
            # page loads overlap another's math
            T.annotate_min_blocks_per_sm(union_ctas_per_sm(M, head_dim, page_size, dtype))
            q_s = T.alloc_shared((M, head_dim), dtype)
            k_s = T.alloc_shared((page_size, head_dim), dtype)
            v_s = T.alloc_shared((page_size, head_dim), dtype)
            e_s = T.alloc_shared((ZCOLS, head_dim), dtype)
            z_s = T.alloc_shared((M, ZCOLS), f32)
            z = T.alloc_fragment((M, ZCOLS), f32)
            acc_s = T.alloc_fragment((M, page_size), f32)
            p_s = T.alloc_shared((M, page_size), dtype)  # P via shared: every warp needs all of its rows
            acc_o = T.alloc_fragment((M, head_dim), f32)
            m_run = T.alloc_fragment((M,), f32)  # running max of merge logits
            l_run = T.alloc_fragment((M,), f32)  # running sum of exp2(merge logit - m_run)
            m_pg = T.alloc_fragment((M,), f32)
            l_pg = T.alloc_fragment((M,), f32)
            alpha = T.alloc_fragment((M,), f32)
            weight = T.alloc_fragment((M,), f32)
            st = merge_state(acc_s, p_s, acc_o, m_run, l_run, m_pg, l_pg, alpha, weight)
            row_lo = T.alloc_fragment((M,), "int32")  # the item's keys [row_lo, row_hi) the row sees
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
                # local pages: from the first token's first local page to the last token's last page
                pl0 = T.alloc_var("int32", init=first_local(row_lens[row0], page_size, window_size) // page_size)
                n_sel = T.alloc_var("int32", init=counts[t, h])
                n_items = T.alloc_var("int32", init=n_sel + T.ceildiv(row_lens[last], page_size) - pl0)
                T.clear(acc_o)
                T.fill(m_run, -T.infinity(f32))
                T.clear(l_run)
                for c in T.serial(T.ceildiv(n_items, ZCOLS)):
                    c0 = c * ZCOLS
                    if fuse_z:  # the chunk's selected pages' z = q . repr, one product
                        for r, d in T.Parallel(ZCOLS, head_dim):
                            e_s[r, d] = T.cast(0, dtype)
                            if c0 + r < n_sel:
                                e_s[r, d] = chunk_repr[T.max(pages[t, h, c0 + r], 0), h, d]
                        T.gemm(q_s, e_s, z, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
                        T.copy(z, z_s)
                    for it in T.Pipelined(T.min(ZCOLS, n_items - c0), num_stages=1):
                        i = c0 + it
                        is_sel = i < n_sel
                        j_loc = pl0 + i - n_sel  # logical page of a local item
                        sel_pid = pages[t, h, T.min(i, cap - 1)]
                        mask = masks[t, h, T.min(i, cap - 1)]
                        pid = T.if_then_else(is_sel, T.max(sel_pid, 0),
                                             page_table[b, T.clamp(j_loc, 0, max_pages - 1)])
                        T.copy(k_buffer[pid * page_size:(pid + 1) * page_size, h, :], k_s)
                        # Slots past the request's end may hold anything: P is 0 there, but 0 * NaN is not. (Plain
                        # loads: TileLang's pipeline planner takes no second write to an async-copied tile, so V
                        # cannot be copied by cp.async and then zeroed there.)
                        for n, d in T.Parallel(page_size, head_dim):
                            v_s[n, d] = T.if_then_else(T.Or(is_sel, j_loc * page_size + n < row_lens[last]),
                                                       v_buffer[pid * page_size + n, h, d], T.cast(0, dtype))
                        for m in T.Parallel(M):
                            L = tok_len[m // G]
                            lo = first_local(L, page_size, window_size)
                            sel_hit = T.And(T.And(sel_pid >= 0, L > 0),
                                            T.bitwise_and(T.shift_right(mask, T.cast(m // G, "int64")), 1) != 0)
                            row_lo[m] = T.if_then_else(is_sel, 0, T.max(lo - j_loc * page_size, 0))
                            row_hi[m] = T.if_then_else(is_sel, T.if_then_else(sel_hit, page_size, 0),
                                                       T.min(L - j_loc * page_size, page_size))
                        merge(q_s, k_s, v_s, st, row_lo, row_hi, None, z_s, it, is_sel)
                for m, d in T.Parallel(M, head_dim):
                    if row0 + m // G <= last:
                        o_part[row0 + m // G, part, h * G + m % G, d] = T.cast(
                            T.if_then_else(l_run[m] > 0, acc_o[m, d] / l_run[m], 0), dtype)
                for m in T.Parallel(M):
                    if row0 + m // G <= last:
                        logit_part[row0 + m // G, part, h * G + m % G] = T.if_then_else(
                            l_run[m] > 0, (m_run[m] + T.log2(l_run[m])) / LOG2E, -T.infinity(f32))

    return hsa_extend_union
