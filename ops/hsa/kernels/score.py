"""The score kernel of HSA selection: one sortable key per (request, kv head, candidate page) from the
dot of the request's query (group: the sum of the G query heads; head: each head, the best kept) with the
page's repr. A bandwidth kernel without tensor cores (see docs/design/hsa.md)."""

import tilelang.language as T

from ..schedule import VEC, score_layout
from .common import first_local, score_to_key, u32


def hsa_score_kernel(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: str,
                     selection_strategy: str, window_size: int, scale: float,
                     pages_per_thread: int = 32, unroll: int = 2, blocks_per_sm: int | None = None):
    """keys[b, h, j] for candidate pages j < n_cand(b): sortable bits of the score, 0 when the repr is
    invalid. A bandwidth kernel without tensor cores: each thread reads 16 bytes (8 dims of one kv head)
    of a page's repr row per page, dots them with its query slice in fp32, and the head's lanes reduce
    with shuffles. A CTA covers rows x pages_per_thread pages of a request, in batches of `unroll` pages
    per thread, double-buffered in registers: batch i + 1's loads are issued before batch i is consumed,
    and the page ids (page_table) of batch i + 2 are fetched meanwhile, so a thread always has two
    batches in flight and the chain page_table -> reprs is off the critical path. ``blocks_per_sm``
    (CTAs per SM the register use must allow) trades CTAs for pages in flight per thread (``unroll``)."""
    G = num_heads // num_kv_heads
    hc, rows = score_layout(num_kv_heads, head_dim)
    lph = head_dim // VEC
    threads = rows * hc * lph
    n_iter = max(2, -(-pages_per_thread // unroll))
    n_iter += n_iter % 2  # batches go in pairs (one per register buffer)
    block_pages = rows * n_iter * unroll
    NQ = 1 if selection_strategy == "group" else G  # query vectors a thread dots with each repr slice
    if blocks_per_sm is None:
        # 1024 threads of loads per SM (<= 64 registers) when a thread holds one query slice.
        blocks_per_sm = max(1, (1024 if NQ == 1 else 512) // threads)
    batch, max_pages, num_pages = T.dynamic("batch, max_pages, num_pages")
    f32 = "float32"

    # Register buffer `buf` (a Python int) holds one batch: reprs e, their valid bytes, page ids pid (-1:
    # none). Page of (batch it, slot u): j0 + (it * unroll + u) * rows + row.
    @T.macro
    def fetch_ids(pid, buf, it, page_table, b, j0, row, n_cand, max_pages):
        for u in T.unroll(unroll):
            j = j0 + (it * unroll + u) * rows + row
            pid[buf, u] = T.if_then_else(it < n_iter and j < n_cand, page_table[b, T.min(j, max_pages - 1)], -1)

    @T.macro
    def issue(e, valid, pid, buf, chunk_repr, repr_valid, h, lane):
        for u in T.unroll(unroll):
            valid[buf, u] = T.uint8(0)
            if pid[buf, u] >= 0:
                for v in T.vectorized(VEC):
                    e[buf, u, v] = chunk_repr[pid[buf, u], h, lane * VEC + v]
                valid[buf, u] = repr_valid[pid[buf, u]]

    @T.macro
    def consume(e, valid, buf, it, qv, part, keys_s, hh, row, lane):
        for u in T.unroll(unroll):
            for g in T.unroll(NQ):
                part[g] = 0
                for v in T.unroll(VEC):
                    part[g] += T.cast(e[buf, u, v], f32) * qv[g, v]
                # The head's lph lanes are aligned within the warp: xor offsets < lph stay in it.
                for k in T.unroll(lph.bit_length() - 1):
                    part[g] += T.shfl_xor(part[g], lph >> (k + 1))
            for g in T.unroll(1, NQ):  # head strategy: the best of the group's scores
                part[0] = T.max(part[0], part[g])
            if lane == 0:
                keys_s[hh, (it * unroll + u) * rows + row] = T.if_then_else(
                    valid[buf, u] != 0, score_to_key(part[0] * scale), u32(0))

    @T.prim_func
    def hsa_score(q: T.Tensor((batch, num_heads, head_dim), dtype),
                  page_table: T.Tensor((batch, max_pages), "int32"),
                  seq_lens: T.Tensor((batch,), "int32"),
                  chunk_repr: T.Tensor((num_pages, num_kv_heads, head_dim), dtype),
                  repr_valid: T.Tensor((num_pages,), "uint8"),
                  keys: T.Tensor((batch, num_kv_heads, max_pages), "uint32")):
        with T.Kernel(T.ceildiv(max_pages, block_pages), num_kv_heads // hc, batch, threads=threads) as (c, hb, b):
            T.annotate_min_blocks_per_sm(blocks_per_sm)
            tx = T.get_thread_binding()
            row = tx // (hc * lph)
            hh = tx % (hc * lph) // lph
            lane = tx % lph
            h = hb * hc + hh
            keys_s = T.alloc_shared((hc, block_pages), "uint32")
            qv = T.alloc_local((NQ, VEC), f32)
            # Two register buffers of one batch each: reprs, their valid bytes, and page ids (-1: none).
            e = T.alloc_local((2, unroll, VEC), dtype)
            valid = T.alloc_local((2, unroll), "uint8")
            pid = T.alloc_local((2, unroll), "int32")
            part = T.alloc_local((NQ,), f32)
            L = seq_lens[b]
            lo = first_local(L, page_size, window_size)
            n_cand = lo // page_size
            j0 = c * block_pages
            ids_at = (page_table, b, j0, row, n_cand, max_pages)
            repr_at = (chunk_repr, repr_valid, h, lane)
            key_at = (qv, part, keys_s, hh, row, lane)
            if j0 < n_cand:
                fetch_ids(pid, 0, 0, *ids_at)
                fetch_ids(pid, 1, 1, *ids_at)
                issue(e, valid, pid, 0, *repr_at)
                fetch_ids(pid, 0, 2, *ids_at)
                for v in T.unroll(VEC):
                    if selection_strategy == "group":
                        qv[0, v] = 0
                        for g in T.unroll(G):
                            qv[0, v] += T.cast(q[b, h * G + g, lane * VEC + v], f32)
                    else:
                        for g in T.unroll(G):
                            qv[g, v] = T.cast(q[b, h * G + g, lane * VEC + v], f32)
                for it2 in T.serial(n_iter // 2):
                    it = it2 * 2
                    issue(e, valid, pid, 1, *repr_at)  # batch it + 1
                    fetch_ids(pid, 1, it + 3, *ids_at)
                    consume(e, valid, 0, it, *key_at)
                    issue(e, valid, pid, 0, *repr_at)  # batch it + 2
                    fetch_ids(pid, 0, it + 4, *ids_at)
                    consume(e, valid, 1, it + 1, *key_at)
                T.sync_threads()
                for i in T.serial(T.ceildiv(hc * block_pages, threads)):
                    idx = i * threads + tx
                    r = idx % block_pages
                    if idx < hc * block_pages and j0 + r < n_cand:
                        keys[b, hb * hc + idx // block_pages, j0 + r] = keys_s[idx // block_pages, r]

    return hsa_score
