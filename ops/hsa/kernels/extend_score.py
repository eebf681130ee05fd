"""The score kernel of HSA extend: one GEMM per (query tile, kv head) of a request's new tokens against the reprs
of its candidate pages, writing the same sortable keys as the decode's score kernel (one row per new token) by score
tile (``schedule.key_tiles_shape``: each step of a tile stores one box of them from its accumulator), which the
extend's build of the decode's top-k reads.

A tile is `tokens` consecutive new tokens of one request, one GEMM row per token: the G query heads of the kv
head's group are G products, accumulated into one [tokens, pages] tile (group) or kept apart and maxed (head), each
an exact product of a 16-bit query and a repr summed in fp32 (the group strategy's score, sum_g q_g . r =
(sum_g q_g) . r, without rounding the summed query to 16 bits). The reprs arrive in logical page order (``reprs``:
each request's candidate reprs gathered once per call, `HSAExtendTileLang.select`), so each step's `block_pages` of
them is one TMA box for the whole tile, the next steps' landing during this one's products and keys. Every token
of the tile walks the candidates of its last one (the most); a token's own count masks the rest."""

import tilelang.language as T

from ..schedule import KEY_PAGES, score_block_pages
from .common import first_local, score_to_key, u32


def hsa_extend_score_kernel(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: str,
                            selection_strategy: str, window_size: int, scale: float, tokens: int,
                            block_pages: int | None = None, num_stages: int = 2, threads: int = 256):
    """keys[h, t, j // KEY_PAGES, i, j % KEY_PAGES] (``schedule.key_tiles_shape``; fp32 bits of the uint32 keys) for
    the candidate pages j < n_cand(row) of every new token, row tile_row0[t] + i of tile t (n_cand from its decode
    length row_lens[row] = p + 1): sortable bits of the score, 0 when the repr is invalid (NaN in reprs). Tile t
    covers rows tile_row0[t] .. of request tile_req[t] up to `tokens` of them within the request; a call scores the
    tiles of requests req_base .. req_base + chunk_reqs - 1 (others, and spare tiles of request -1, idle), reprs[b,
    j] being request req_base + b's logical page j's repr."""
    G = num_heads // num_kv_heads
    heads = G if selection_strategy == "head" else 1  # accumulators
    if block_pages is None:
        block_pages = score_block_pages(selection_strategy, G, head_dim, tokens, num_stages, threads)
    assert KEY_PAGES % block_pages == 0, "a step's keys are one box within a page block"
    total_q, batch, max_pages, num_tiles, chunk_reqs, page_blocks = T.dynamic(
        "total_q, batch, max_pages, num_tiles, chunk_reqs, page_blocks")
    f32 = "float32"

    def n_cand(L):
        return first_local(L, page_size, window_size) // page_size

    @T.prim_func
    def hsa_extend_score(q: T.Tensor((total_q, num_heads, head_dim), dtype),
                         cum_seq_lens_q: T.Tensor((batch + 1,), "int32"),
                         row_lens: T.Tensor((total_q,), "int32"),
                         tile_req: T.Tensor((num_tiles,), "int32"),
                         tile_row0: T.Tensor((num_tiles,), "int32"),
                         reprs: T.Tensor((chunk_reqs, max_pages, num_kv_heads, head_dim), dtype),
                         keys: T.Tensor((num_kv_heads, num_tiles, page_blocks, tokens, KEY_PAGES), f32),
                         req_base: T.int32):
        with T.Kernel(num_tiles, num_kv_heads, threads=threads) as (t, h):
            q_s = [T.alloc_shared((tokens, head_dim), dtype) for _ in range(G)]
            r_s = T.alloc_shared((block_pages, head_dim), dtype)
            acc = [T.alloc_fragment((tokens, block_pages), f32) for _ in range(heads)]
            # tile_req[t] read where used: bound to a name, the warp-specialized split read it before its definition
            if T.And(tile_req[t] >= req_base, tile_req[t] < req_base + chunk_reqs):
                row0 = tile_row0[t]
                last = T.min(row0 + tokens, cum_seq_lens_q[tile_req[t] + 1]) - 1
                n_max = n_cand(row_lens[last])  # the tile's last token has the most candidates
                # rows past the request's end hold the next request's tokens (or zeros past total_q)
                for g, q_g in enumerate(q_s):
                    T.copy(q[row0:row0 + tokens, h * G + g, :], q_g)
                for st in T.Pipelined(T.ceildiv(n_max, block_pages), num_stages=num_stages):
                    j0 = st * block_pages
                    T.copy(reprs[tile_req[t] - req_base, j0:j0 + block_pages, h, :], r_s)
                    for g, q_g in enumerate(q_s):
                        T.gemm(q_g, r_s, acc[g % heads], transpose_B=True, clear_accum=g < heads,
                               policy=T.GemmWarpPolicy.FullRow)
                    # The step's keys (an invalid page's repr arrives as NaN: key 0, no per-key load of a valid
                    # bit), as fp32 bits in the accumulator, stored as one box of the tile's keys (8-byte stores).
                    # Rows past the request's end and pages past a row's candidates hold keys no one reads.
                    for i, j in T.Parallel(tokens, block_pages):
                        score = acc[0][i, j]
                        for a in acc[1:]:
                            score = T.max(score, a[i, j])
                        acc[0][i, j] = T.reinterpret(T.if_then_else(T.isnan(score), u32(0),
                                                                    score_to_key(score * scale)), f32)
                    T.copy(acc[0], keys[h, t, j0 // KEY_PAGES, :, j0 % KEY_PAGES:j0 % KEY_PAGES + block_pages])

    return hsa_extend_score
