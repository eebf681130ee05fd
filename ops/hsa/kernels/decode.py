"""The sparse decode kernel of HSA (split-K over a request's items: its selected pages, then the pages of
its local tokens) and the combine of the splits' partial (o, lse) (see docs/design/hsa.md)."""

import tilelang.language as T

from ...common.hw import LOG2E
from ..schedule import QROWS_DECODE, ZCOLS
from .common import alloc_merge_state, first_local, page_merge


def hsa_decode_kernel(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, topk: int,
                      dtype: str, window_size: int, combine: str, scale: float):
    """Per (split, kv head, request): merge the split's items (pages) into partial (o, lse) per query
    head. The split count is the partials' split axis (the grid's x, chosen by the caller from the batch);
    a request's topk + n_local items are cut into that many contiguous ranges of equal length, which the
    caller keeps <= ZCOLS (``schedule.num_splits``)."""
    G = num_heads // num_kv_heads
    GM = QROWS_DECODE
    # Warps split the N of every product (M is one 16-row tile): N = page_size needs >= 8 per warp.
    threads = 32 * min(4, page_size // 8)
    fuse_z = combine == "softmax"
    batch, max_pages, num_slots, num_pages, num_splits = T.dynamic(
        "batch, max_pages, num_slots, num_pages, num_splits")
    f32 = "float32"
    merge = page_merge(scale * LOG2E, fuse_z)

    @T.prim_func
    def hsa_decode(q: T.Tensor((batch, num_heads, head_dim), dtype),
                   k_buffer: T.Tensor((num_slots, num_kv_heads, head_dim), dtype),
                   v_buffer: T.Tensor((num_slots, num_kv_heads, head_dim), dtype),
                   page_table: T.Tensor((batch, max_pages), "int32"),
                   seq_lens: T.Tensor((batch,), "int32"),
                   chunk_repr: T.Tensor((num_pages, num_kv_heads, head_dim), dtype),
                   selected_page_ids: T.Tensor((batch, num_kv_heads, topk), "int32"),
                   o_part: T.Tensor((batch, num_heads, num_splits, head_dim), f32),
                   lse_part: T.Tensor((batch, num_heads, num_splits), f32)):
        with T.Kernel(num_splits, num_kv_heads, batch, threads=threads) as (sp, h, b):
            q_s = T.alloc_shared((GM, head_dim), dtype)
            k_s = T.alloc_shared((page_size, head_dim), dtype)
            v_s = T.alloc_shared((page_size, head_dim), dtype)
            e_s = T.alloc_shared((ZCOLS, head_dim), dtype)
            z_s = T.alloc_shared((GM, ZCOLS), f32)
            z = T.alloc_fragment((GM, ZCOLS), f32)
            st = alloc_merge_state(GM, page_size, head_dim, dtype)
            L = seq_lens[b]
            lo = first_local(L, page_size, window_size)
            p0 = lo // page_size
            n_local = T.ceildiv(L, page_size) - p0
            # Items of this split (vars: computed once); past the request's items a split is empty. The
            # min only matters for seq_lens past the page table (validate=False): z_s has ZCOLS columns.
            per_split = T.alloc_var("int32", init=T.min(T.ceildiv(topk + n_local, num_splits), ZCOLS))
            i0 = sp * per_split
            n_it = T.alloc_var("int32", init=T.clamp(topk + n_local - i0, 0, per_split))

            for g, d in T.Parallel(GM, head_dim):
                q_s[g, d] = T.if_then_else(g < G, q[b, h * G + T.min(g, G - 1), d], T.cast(0, dtype))
            T.clear(st.acc_o)
            T.fill(st.m_run, -T.infinity(f32))
            T.clear(st.l_run)
            if fuse_z:
                for r, d in T.Parallel(ZCOLS, head_dim):
                    e_s[r, d] = T.cast(0, dtype)
                    if r < n_it and i0 + r < topk:
                        if selected_page_ids[b, h, i0 + r] >= 0:
                            e_s[r, d] = chunk_repr[selected_page_ids[b, h, i0 + r], h, d]
                T.gemm(q_s, e_s, z, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
                T.copy(z, z_s)

            # One stage (K/V of the next page still load during this one's math): the trip count is dynamic.
            for it in T.Pipelined(n_it, num_stages=1):
                # Item i -> physical page and its valid token range [tok_lo, tok_hi). Every iteration
                # loads a page (a hole, -1, reads page 0 with no valid token) so the loop pipelines.
                i = i0 + it
                is_sel = i < topk
                j_loc = p0 + i - topk  # logical page of a local item
                is_loc = not is_sel and i - topk < n_local
                sel_pid = selected_page_ids[b, h, T.min(i, topk - 1)]
                valid = (is_sel and sel_pid >= 0) or is_loc
                pid = T.if_then_else(is_sel, T.max(sel_pid, 0),
                                     T.if_then_else(is_loc, page_table[b, T.min(j_loc, max_pages - 1)], 0))
                tok_lo = T.if_then_else(is_loc, lo - j_loc * page_size, 0)
                tok_hi = T.if_then_else(valid, T.if_then_else(is_loc, L - j_loc * page_size, page_size), 0)
                T.copy(k_buffer[pid * page_size:(pid + 1) * page_size, h, :], k_s)
                T.copy(v_buffer[pid * page_size:(pid + 1) * page_size, h, :], v_s)
                merge(q_s, k_s, v_s, st, tok_lo, tok_hi, valid, z_s, it, is_sel)

            for g, d in T.Parallel(GM, head_dim):
                if g < G:
                    o_part[b, h * G + g, sp, d] = T.if_then_else(st.l_run[g] > 0, st.acc_o[g, d] / st.l_run[g],
                                                                 0)
            for g in T.Parallel(GM):
                if g < G:
                    lse_part[b, h * G + g, sp] = T.if_then_else(
                        st.l_run[g] > 0, (st.m_run[g] + T.log2(st.l_run[g])) / LOG2E, -T.infinity(f32))

    return hsa_decode


def hsa_combine_kernel(num_heads: int, head_dim: int, dtype: str):
    """o[b, h] = sum over splits of exp(lse_s) o_s / sum of exp(lse_s); 0 when every split is empty."""
    batch, num_splits = T.dynamic("batch, num_splits")
    f32 = "float32"

    @T.prim_func
    def hsa_combine(o_part: T.Tensor((batch, num_heads, num_splits, head_dim), f32),
                    lse_part: T.Tensor((batch, num_heads, num_splits), f32),
                    o: T.Tensor((batch, num_heads, head_dim), dtype)):
        with T.Kernel(num_heads, batch, threads=head_dim) as (hq, b):
            acc = T.alloc_fragment((head_dim,), f32)
            m = T.alloc_var(f32)
            total = T.alloc_var(f32)
            w = T.alloc_var(f32)
            m = -T.infinity(f32)
            for s in T.serial(num_splits):
                m = T.max(m, lse_part[b, hq, s])
            total = 0
            T.clear(acc)
            if m > -T.infinity(f32):
                for s in T.serial(num_splits):
                    w = T.exp(lse_part[b, hq, s] - m)
                    total += w
                    for d in T.Parallel(head_dim):
                        acc[d] += w * o_part[b, hq, s, d]
            for d in T.Parallel(head_dim):
                o[b, hq, d] = T.cast(T.if_then_else(total > 0, acc[d] / total, 0), dtype)

    return hsa_combine
