"""The page-major attention of HSA extend and the combine of its partials.

Every new token selects `topk` pages per kv head, and at the bench shapes a page is selected by tens to hundreds of
a request's new tokens. `hsa_extend_pages` runs one CTA per (physical page, kv head): it reads the page's K and V
once and goes through the list of the (token, slot) entries that selected it (built on the device by
``HSAExtendTileLang.page_entries``), in blocks of rows (entry, query head of the group), each row's softmax over the
page alone. It writes each row's normalized page output and merge logit (the page's log-sum-exp in token combine,
z = scale q . repr in softmax combine) into the token's partial slot: a page is read once per launch instead of
once per token, and the partials cost ~(head_dim x 2 + 4) bytes per (token, query head, slot) written and read.
A page selected by a token is complete and wholly before its local window, so no key is masked. Rows are
independent: the result does not depend on how the entries are blocked or ordered (deterministic).

`hsa_extend_combine` merges a token's topk + 1 partial slots (the selected pages and the local tokens, written by
``kernels/extend_local.py``) per query head: o = sum_s exp(logit_s - max) o_s / sum_s exp(logit_s - max), 0 when no
slot has anything."""

import tilelang.language as T

from ...common.hw import LOG2E

ZN = 16  # the z product's N: the page's repr in row 0, zeros below (one mma N tile)


def hsa_extend_pages_kernel(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, topk: int,
                            dtype: str, combine: str, scale: float, block_m: int = 64, chunk: int = 256,
                            threads: int = 128):
    """o_part[row, slot, h * G + g] and logit_part[row, slot, h * G + g] of every entry (row, slot) in
    ``entry_row / entry_slot[group_start[h * num_pages + p] : group_start[h * num_pages + p + 1]]``: its
    token's query heads over page p of kv head h. A group's entries go ``chunk`` at a time through shared memory."""
    G = num_heads // num_kv_heads
    eb = block_m // G  # entries per block of rows: row m is entry m // G, head m % G
    fuse_z = combine == "softmax"
    total_q, num_slots, num_pages, num_entries, num_parts = T.dynamic(
        "total_q, num_slots, num_pages, num_entries, num_parts")
    f32 = "float32"
    unit = scale * LOG2E

    @T.prim_func
    def hsa_extend_pages(q: T.Tensor((total_q, num_heads, head_dim), dtype),
                         k_buffer: T.Tensor((num_slots, num_kv_heads, head_dim), dtype),
                         v_buffer: T.Tensor((num_slots, num_kv_heads, head_dim), dtype),
                         chunk_repr: T.Tensor((num_pages, num_kv_heads, head_dim), dtype),
                         group_start: T.Tensor((num_kv_heads * num_pages + 1,), "int32"),
                         entry_row: T.Tensor((num_entries,), "int32"),
                         entry_slot: T.Tensor((num_entries,), "int32"),
                         o_part: T.Tensor((total_q, num_parts, num_heads, head_dim), dtype),
                         logit_part: T.Tensor((total_q, num_parts, num_heads), f32)):
        # the partial slots as rows (token, slot): an entry's destination is one staged int32 index (total_q x
        # num_parts < 2^31: the partials of more slots would not fit in memory)
        o_dst = T.reshape(o_part, (total_q * num_parts, num_heads, head_dim))
        logit_dst = T.reshape(logit_part, (total_q * num_parts, num_heads))
        with T.Kernel(num_pages, num_kv_heads, threads=threads) as (p, h):
            k_s = T.alloc_shared((page_size, head_dim), dtype)
            v_s = T.alloc_shared((page_size, head_dim), dtype)
            e_s = T.alloc_shared((ZN, head_dim), dtype)
            q_s = T.alloc_shared((block_m, head_dim), dtype)
            # padded rows: the accumulator's stores of 8 rows at a time land in distinct banks
            o_s = T.alloc_shared((block_m, head_dim + 8), dtype)
            acc_s = T.alloc_fragment((block_m, page_size), f32)
            p_f = T.alloc_fragment((block_m, page_size), dtype)  # P as the A operand from registers
            acc_o = T.alloc_fragment((block_m, head_dim), f32)
            z = T.alloc_fragment((block_m, ZN), f32)
            z_row = T.alloc_fragment((block_m,), f32)
            m_pg = T.alloc_fragment((block_m,), f32)
            l_pg = T.alloc_fragment((block_m,), f32)
            inv_l = T.alloc_fragment((block_m,), f32)  # one division per row, not per output element
            # the chunk's entries' partial-slot rows (the query gather reads its token rows from global memory:
            # an index staged in shared memory made TileLang put a block barrier before each of its 8 cp.async
            # rounds)
            dst_s = T.alloc_shared((chunk,), "int32")
            e0 = group_start[h * num_pages + p]
            n = group_start[h * num_pages + p + 1] - e0
            if n > 0:
                # K and V by cp.async, waited with the first block's query rows (the pipeline's first wait): their
                # latency overlaps the entry lists' loads and the gather's issue
                T.async_copy(k_buffer[p * page_size:(p + 1) * page_size, h, :], k_s)
                T.async_copy(v_buffer[p * page_size:(p + 1) * page_size, h, :], v_s)
                if fuse_z:
                    for r, d in T.Parallel(ZN, head_dim):
                        e_s[r, d] = T.if_then_else(r == 0, chunk_repr[p, h, d], T.cast(0, dtype))
                for c in T.serial(T.ceildiv(n, chunk)):
                    c0 = c * chunk
                    nc = T.min(n - c0, chunk)
                    for i in T.Parallel(chunk):
                        e = e0 + c0 + T.min(i, nc - 1)
                        dst_s[i] = entry_row[e] * num_parts + entry_slot[e]
                    for it in T.Pipelined(T.ceildiv(nc, eb), num_stages=1):
                        # the block's query rows, gathered (the next block's while this one computes)
                        for m, d in T.Parallel(block_m, head_dim):
                            q_s[m, d] = q[entry_row[e0 + c0 + T.min(it * eb + m // G, nc - 1)], h * G + m % G, d]
                        if fuse_z:  # issued without a wait: the scores' product below waits for both
                            T.wgmma_gemm(q_s, e_s, z, transpose_B=True, clear_accum=True,
                                         policy=T.GemmWarpPolicy.FullRow)
                        T.gemm(q_s, k_s, acc_s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                        if fuse_z:
                            T.reduce_sum(z, z_row, dim=1)  # column 0 (the others are 0: exact)
                        T.reduce_max(acc_s, m_pg, dim=1)
                        for m, j in T.Parallel(block_m, page_size):
                            acc_s[m, j] = T.exp2(acc_s[m, j] * unit - m_pg[m] * unit)
                        T.reduce_sum(acc_s, l_pg, dim=1)
                        T.copy(acc_s, p_f)
                        T.gemm(p_f, v_s, acc_o, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                        for m in T.Parallel(block_m):
                            inv_l[m] = 1 / l_pg[m]
                        for m, d in T.Parallel(block_m, head_dim):
                            o_s[m, d] = T.cast(acc_o[m, d] * inv_l[m], dtype)
                        for m in T.Parallel(block_m):
                            i = it * eb + m // G
                            if i < nc:
                                # natural units, as the combine's
                                logit_dst[dst_s[i], h * G + m % G] = (
                                    z_row[m] * scale if fuse_z else m_pg[m] * scale + T.log(l_pg[m]))
                        for m, d in T.Parallel(block_m, head_dim):
                            i = it * eb + m // G
                            if i < nc:
                                o_dst[dst_s[i], h * G + m % G, d] = o_s[m, d]

    return hsa_extend_pages


def combine_heads(num_heads: int, head_dim: int) -> int:
    """Query heads per combine CTA: an fp32 accumulator of at most 4096 values (32 registers a thread)."""
    hb = max(1, min(num_heads, 4096 // head_dim))
    while num_heads % hb:
        hb -= 1
    return hb


def hsa_extend_combine_kernel(num_heads: int, head_dim: int, num_parts: int, dtype: str, threads: int = 128):
    """out[row, h] = the merge of o_part[row, :, h] by the softmax of logit_part[row, :, h] (0: nothing)."""
    HB = combine_heads(num_heads, head_dim)
    total_q = T.dynamic("total_q")
    f32 = "float32"

    @T.prim_func
    def hsa_extend_combine(o_part: T.Tensor((total_q, num_parts, num_heads, head_dim), dtype),
                           logit_part: T.Tensor((total_q, num_parts, num_heads), f32),
                           out: T.Tensor((total_q, num_heads, head_dim), dtype)):
        with T.Kernel(total_q, num_heads // HB, threads=threads) as (row, hb):
            w_s = T.alloc_shared((num_parts, HB), f32)
            o_s = T.alloc_shared((HB, head_dim), dtype)
            acc = T.alloc_fragment((HB, head_dim), f32)
            total = T.alloc_shared((HB,), f32)
            T.copy(logit_part[row, :, hb * HB:(hb + 1) * HB], w_s)
            for j in T.Parallel(HB):  # a thread per head: the slots' softmax weights
                mx = T.alloc_var(f32, init=-T.infinity(f32))
                tot = T.alloc_var(f32, init=0)
                for s in T.serial(num_parts):
                    mx = T.max(mx, w_s[s, j])
                for s in T.serial(num_parts):
                    # each weight kept in a register for the sum: no shared read after this thread's own write
                    # (TileLang's barrier analysis took that for a cross-thread conflict inside the branch)
                    e = T.if_then_else(mx > -T.infinity(f32), T.exp(w_s[s, j] - mx), 0)
                    w_s[s, j] = e
                    tot += e
                total[j] = tot
            T.clear(acc)
            for s in T.Pipelined(num_parts, num_stages=3):
                T.copy(o_part[row, s, hb * HB:(hb + 1) * HB, :], o_s)
                for j, d in T.Parallel(HB, head_dim):
                    # an empty slot's o is never written: 0, not 0 * garbage
                    acc[j, d] += T.if_then_else(w_s[s, j] > 0, w_s[s, j] * T.cast(o_s[j, d], f32), 0)
            for j, d in T.Parallel(HB, head_dim):
                out[row, hb * HB + j, d] = T.cast(T.if_then_else(total[j] > 0, acc[j, d] / total[j], 0), dtype)

    return hsa_extend_combine
