"""The score kernel of HSA extend: one GEMM per (query tile, kv head) of a request's new tokens against the reprs
of its candidate pages, writing the same sortable keys as the decode's score kernel (one row per new token), so
the decode's top-k and attention kernels run on them unchanged.

A tile is `tokens` consecutive new tokens of one request, its rows (token, query head of the kv head's group)
stacked into M = tokens * G. Per step of `block_pages` candidate pages the CTA gathers their reprs (one row of
head_dim per page, through the request's page table, whose ids and the reprs' valid bits are staged `chunk` pages at
a time; the next step's reprs are gathered during this one's scores and keys) and multiplies: the G per-head dots of
a token are exact products of its 16-bit query and the repr, summed in fp32 (the group strategy's score,
sum_g q_g . r = (sum_g q_g) . r, without rounding the summed query to 16 bits) or maxed (the head strategy's). Every
token of the tile walks the candidates of its last one (the most); a token's own count masks the rest."""

import tilelang.language as T

from .common import first_local, score_to_key, u32


def extend_tile_tokens(num_heads: int, num_kv_heads: int, rows: int = 64) -> int:
    """New tokens per query tile: `rows` rows of a GEMM (64: one wgmma M tile, the attention's tiles; 128: the
    scores', two warpgroups), at least one token."""
    return max(1, rows // (num_heads // num_kv_heads))


def hsa_extend_score_kernel(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: str,
                            selection_strategy: str, window_size: int, scale: float, tokens: int,
                            block_pages: int = 64, chunk: int = 1024):
    """keys[row, h, j] for the candidate pages j < n_cand(row) of every new token `row` (n_cand from its decode
    length row_lens[row] = p + 1): sortable bits of the score, 0 when the repr is invalid. Tile t covers rows
    tile_row0[t] .. of request tile_req[t] (-1: a spare tile, idle) up to `tokens` of them within the request: a
    warpgroup per 64 rows of the GEMM (tokens x G of them), each repr step gathered once for the whole tile."""
    G = num_heads // num_kv_heads
    M = tokens * G
    threads = 128 * max(1, M // 64)
    total_q, batch, max_pages, num_pages, num_tiles = T.dynamic("total_q, batch, max_pages, num_pages, num_tiles")
    f32 = "float32"

    def n_cand(L):
        return first_local(L, page_size, window_size) // page_size

    @T.prim_func
    def hsa_extend_score(q: T.Tensor((total_q, num_heads, head_dim), dtype),
                         page_table: T.Tensor((batch, max_pages), "int32"),
                         cum_seq_lens_q: T.Tensor((batch + 1,), "int32"),
                         row_lens: T.Tensor((total_q,), "int32"),
                         tile_req: T.Tensor((num_tiles,), "int32"),
                         tile_row0: T.Tensor((num_tiles,), "int32"),
                         chunk_repr: T.Tensor((num_pages, num_kv_heads, head_dim), dtype),
                         repr_valid: T.Tensor((num_pages,), "uint8"),
                         keys: T.Tensor((total_q, num_kv_heads, max_pages), "uint32")):
        with T.Kernel(num_tiles, num_kv_heads, threads=threads) as (t, h):
            q_s = T.alloc_shared((M, head_dim), dtype)
            r_s = T.alloc_shared((block_pages, head_dim), dtype)
            s_f = T.alloc_fragment((M, block_pages), f32)
            # padded rows: the accumulator's stores of 8 rows at a time spread over the banks (2 wavefronts, not 8)
            s_s = T.alloc_shared((M, block_pages + 4), f32)
            cands = T.alloc_shared((tokens,), "int32")  # per token of the tile: its candidate count (0 past the end)
            # the chunk's page ids and valid bits by plain loads (a gather's index must not come from an async copy
            # still in flight); 0 past the candidates, never used
            pids = T.alloc_shared((chunk,), "int32")
            valid = T.alloc_shared((chunk,), "uint8")
            b = tile_req[t]
            if b >= 0:
                row0 = tile_row0[t]
                last = T.min(row0 + tokens, cum_seq_lens_q[b + 1]) - 1
                n_max = n_cand(row_lens[last])  # the tile's last token has the most candidates
                for i in T.Parallel(tokens):
                    cands[i] = T.if_then_else(row0 + i <= last, n_cand(row_lens[T.min(row0 + i, last)]), 0)
                for m, d in T.Parallel(M, head_dim):  # rows past the request's end repeat its last token
                    q_s[m, d] = q[T.min(row0 + m // G, last), h * G + m % G, d]
                for c in T.serial(T.ceildiv(n_max, chunk)):
                    c0 = c * chunk
                    for j in T.Parallel(chunk):
                        pids[j] = 0
                        if c0 + j < n_max:
                            pids[j] = page_table[b, c0 + j]
                        valid[j] = repr_valid[pids[j]]
                    # steps of block_pages candidates: the next step's reprs land during this one's scores and keys
                    for st in T.Pipelined(T.ceildiv(T.min(n_max - c0, chunk), block_pages), num_stages=1):
                        j0 = st * block_pages
                        for j, d in T.Parallel(block_pages, head_dim):
                            r_s[j, d] = chunk_repr[pids[j0 + j], h, d]
                        T.gemm(q_s, r_s, s_f, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                        T.copy(s_f, s_s[:, :block_pages])
                        for i, j in T.Parallel(tokens, block_pages):
                            if c0 + j0 + j < cands[i]:
                                dots = [s_s[i * G + g, j] for g in range(G)]
                                if selection_strategy == "group":
                                    score = sum(dots[1:], dots[0])
                                else:
                                    score = dots[0]
                                    for x in dots[1:]:
                                        score = T.max(score, x)
                                keys[row0 + i, h, c0 + j0 + j] = T.if_then_else(
                                    valid[j0 + j] != 0, score_to_key(score * scale), u32(0))

    return hsa_extend_score
