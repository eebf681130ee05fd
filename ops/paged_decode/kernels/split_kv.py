"""The split-KV ("flash decoding") paged decode kernel: one CTA per (split, head group, sequence)."""

import tilelang.language as T

from ...common.hw import LOG2E
from ..schedule import PAGE_COPIES_FROM, THREADS, block_m, head_pack
from .common import kv_tile_range, split_count, split_steps


def paged_decode_split_kernel(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: str,
                              kv_dtype: str, use_alibi: bool, window_left: int, logits_soft_cap: float,
                              scale: float, kv_layout: str, num_q_tokens: int, block_N: int = 64,
                              num_stages: int = 2, min_blocks: int = 1, **split_rule):
    """The CTA (split sp, head group hg, sequence b) packs the ``pack`` query heads of hg times the
    sequence's nq new tokens into the rows of one tile (row r: token r // pack, head r % pack), so each
    K / V tile is read once for all of them, and streams its split's KV tiles (block_N tokens, gathered
    through the block table) through a software pipeline of ``num_stages`` with an online softmax in the
    log2 domain. A sequence of one split writes ``Out`` / ``Lse`` directly; otherwise split sp writes
    its normalized partial (o, lse) to ``OPart`` / ``LsePart`` for the combine kernel. ``Sched[0]`` is
    the split length in tiles (the plan's). The cache scales (``KScale[0]``, ``VScale[0]``: the real value
    is stored x scale) fold into the softmax scale and the output; FP8 caches are copied to shared memory
    as stored and widened to fp16 there (one ``cvt`` per pair of elements; bf16 takes three on sm_90), q and P
    rounded to fp16 for the products (exact for q in fp16's range: bf16's 8-bit significands fit fp16's 11).
    ``min_blocks``: CTAs per SM the register allocation must allow (more CTAs keep more K / V bytes in flight).
    ``split_rule``: the config's host-side keys (the plan's split rule), not used by the kernel."""
    G = num_heads // num_kv_heads
    nq = num_q_tokens
    pack = head_pack(num_heads, num_kv_heads, nq)
    rows = pack * nq
    M = block_m(rows)
    fp8 = kv_dtype != dtype
    mma_dtype = "float16" if fp8 else dtype  # the products' operand type (FP8 caches: fp16, see above)
    copies = page_size >= PAGE_COPIES_FROM
    rows_per_copy = min(page_size, block_N)
    page_copies = list(range(block_N // rows_per_copy))  # Python lists: unrolled at trace time
    # 128-byte column bands: the widest TMA box of a 128B-swizzled shared tile.
    band = min(head_dim, 128 // (1 if kv_dtype.startswith("float8") else 2))
    bands = list(range(0, head_dim, band))
    f32 = "float32"
    total_q, batch, num_pages, max_pages, ws_rows, num_splits = T.dynamic(
        "total_q, batch, num_pages, max_pages, ws_rows, num_splits")
    kv_shape = ((num_pages, num_kv_heads, page_size, head_dim) if kv_layout == "HND" else
                (num_pages, page_size, num_kv_heads, head_dim))
    cap = logits_soft_cap

    def page_ids(BlockTables, b, L, kt):
        # Positions past the sequence end read its last page again (table entries there may be invalid);
        # they are masked, and their V rows zeroed.
        return [BlockTables[b, T.min(kt * block_N + p * rows_per_copy, L - 1) // page_size] for p in page_copies]

    @T.macro
    def load_tile(cache, dst, pids, BlockTables, b, kvh, L, kt):
        if copies:  # one copy per page (or block_N slice of a page) and band
            for p in page_copies:
                off = (kt * block_N + p * rows_per_copy) % page_size
                for c in bands:
                    if kv_layout == "HND":
                        src = cache[pids[p], kvh, off:off + rows_per_copy, c:c + band]
                    else:
                        src = cache[pids[p], off:off + rows_per_copy, kvh, c:c + band]
                    dst_rows = slice(p * rows_per_copy, (p + 1) * rows_per_copy)
                    if fp8:
                        T.copy(src, dst[c // band, dst_rows, :])
                    else:
                        T.copy(src, dst[dst_rows, c:c + band])
        else:  # small pages: row by row
            for j, d in T.Parallel(block_N, head_dim):
                pos = T.min(kt * block_N + j, L - 1)
                pid = BlockTables[b, pos // page_size]
                idx = (d // band, j, d % band) if fp8 else (j, d)
                if kv_layout == "HND":
                    dst[idx] = cache[pid, kvh, pos % page_size, d]
                else:
                    dst[idx] = cache[pid, pos % page_size, kvh, d]

    @T.prim_func
    def paged_decode_split(
        Q: T.Tensor((total_q, num_heads, head_dim), dtype),
        KCache: T.Tensor(kv_shape, kv_dtype),
        VCache: T.Tensor(kv_shape, kv_dtype),
        BlockTables: T.Tensor((batch, max_pages), "int32"),
        SeqLens: T.Tensor((batch,), "int32"),
        AlibiSlopes: T.Tensor((num_heads,), f32),
        KScale: T.Tensor((1,), f32),
        VScale: T.Tensor((1,), f32),
        Sched: T.Tensor((1,), "int32"),
        Out: T.Tensor((total_q, num_heads, head_dim), dtype),
        Lse: T.Tensor((total_q, num_heads), f32),
        OPart: T.Tensor((ws_rows, num_splits, nq, num_heads, head_dim), f32),
        LsePart: T.Tensor((ws_rows, num_splits, nq, num_heads), f32),
    ):
        with T.Kernel(num_splits, num_heads // pack, batch, threads=THREADS) as (sp, hg, b):
            T.annotate_min_blocks_per_sm(min_blocks)
            q_s = T.alloc_shared((M, head_dim), mma_dtype)
            k_s = T.alloc_shared((block_N, head_dim), mma_dtype)
            v_s = T.alloc_shared((block_N, head_dim), mma_dtype)
            if fp8:
                # Band-major ([band, row, column]): each page copy fills a contiguous box (the tiles are
                # read by plain loads, so TileLang lays them out unswizzled).
                k_in = T.alloc_shared((len(bands), block_N, band), kv_dtype)
                v_in = T.alloc_shared((len(bands), block_N, band), kv_dtype)
            p_s = T.alloc_shared((M, block_N), mma_dtype)  # P via shared: every warp needs all of its rows
            acc_s = T.alloc_fragment((M, block_N), f32)
            acc_o = T.alloc_fragment((M, head_dim), f32)
            m_run = T.alloc_fragment((M,), f32)
            m_use = T.alloc_fragment((M,), f32)
            m_tile = T.alloc_fragment((M,), f32)
            l_run = T.alloc_fragment((M,), f32)
            l_tile = T.alloc_fragment((M,), f32)
            alpha = T.alloc_fragment((M,), f32)
            slope = T.alloc_fragment((M,), f32)

            L = T.alloc_var("int32", init=SeqLens[b])
            kvh = hg // (G // pack)
            head0 = hg * pack
            first, n_tiles = kv_tile_range(L, nq, block_N, window_left)
            tiles_per_split = T.alloc_var("int32", init=Sched[0])
            n_split = T.alloc_var("int32", init=split_count(n_tiles, tiles_per_split, num_splits))
            k_first = T.alloc_var("int32", init=first + sp * tiles_per_split)
            steps = T.alloc_var("int32", init=split_steps(sp, n_split, n_tiles, tiles_per_split))
            qk_scale = T.alloc_var(f32, init=scale * KScale[0])

            for r, d in T.Parallel(M, head_dim):
                q_s[r, d] = T.if_then_else(r < rows, T.cast(Q[b * nq + T.min(r // pack, nq - 1), head0 + r % pack, d],
                                                            mma_dtype), T.cast(0, mma_dtype))
            if use_alibi:
                for r in T.Parallel(M):
                    slope[r] = AlibiSlopes[head0 + r % pack]
            T.clear(acc_o)
            T.clear(l_run)
            T.fill(m_run, -T.infinity(f32))

            for it in T.Pipelined(steps, num_stages=num_stages):
                kt = k_first + it
                # The page ids lead the loop body: the warp-specialization pass keeps them in the producer
                # branch, read once for K and V ahead of the copies.
                pids = page_ids(BlockTables, b, L, kt) if copies else None
                if fp8:
                    load_tile(KCache, k_in, pids, BlockTables, b, kvh, L, kt)
                    load_tile(VCache, v_in, pids, BlockTables, b, kvh, L, kt)
                    # Both tiles widened in one pass between the same two barriers (V beside K, not after the
                    # scores: measured 3-9% faster); V zeroed past the sequence end, as below.
                    for j, d in T.Parallel(block_N, head_dim):
                        k_s[j, d] = T.cast(k_in[d // band, j, d % band], mma_dtype)
                        v_s[j, d] = T.if_then_else(kt * block_N + j < L, T.cast(v_in[d // band, j, d % band],
                                                                                mma_dtype), T.cast(0, mma_dtype))
                else:
                    load_tile(KCache, k_s, pids, BlockTables, b, kvh, L, kt)
                    load_tile(VCache, v_s, pids, BlockTables, b, kvh, L, kt)
                T.gemm(q_s, k_s, acc_s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
                for r, j in T.Parallel(M, block_N):
                    t = kt * block_N + j
                    p = L - nq + r // pack  # the row's query position
                    x = acc_s[r, j] * qk_scale
                    if cap > 0:
                        x = cap * T.tanh(x / cap)
                    if use_alibi:
                        x = x + slope[r] * T.cast(t - p, f32)
                    visible = t <= p
                    if window_left >= 0:
                        visible = T.And(visible, t >= p - window_left)
                    if M > rows:
                        visible = T.And(visible, r < rows)
                    acc_s[r, j] = T.if_then_else(visible, x * LOG2E, -T.infinity(f32))
                T.reduce_max(acc_s, m_tile, dim=1)
                for r in T.Parallel(M):
                    # A row may see no key of this tile (window, later draft tokens, padding): its max stays
                    # -inf and exp2 is taken from 0 instead (P = 0, no NaN).
                    m_use[r] = T.if_then_else(T.max(m_run[r], m_tile[r]) > -T.infinity(f32),
                                              T.max(m_run[r], m_tile[r]), 0)
                    alpha[r] = T.exp2(m_run[r] - m_use[r])
                    m_run[r] = T.max(m_run[r], m_tile[r])
                for r, j in T.Parallel(M, block_N):
                    acc_s[r, j] = T.exp2(acc_s[r, j] - m_use[r])
                T.reduce_sum(acc_s, l_tile, dim=1)
                for r in T.Parallel(M):
                    l_run[r] = l_run[r] * alpha[r] + l_tile[r]
                for r, d in T.Parallel(M, head_dim):
                    acc_o[r, d] *= alpha[r]
                T.copy(acc_s, p_s)
                # Slots past the sequence end may hold anything (NaN): P is 0 there, but 0 * NaN is not.
                if copies and not fp8:
                    if (kt + 1) * block_N > L:
                        for j, d in T.Parallel(block_N, head_dim):
                            v_s[j, d] = T.if_then_else(kt * block_N + j < L, v_s[j, d], T.cast(0, dtype))
                T.gemm(p_s, v_s, acc_o, policy=T.GemmWarpPolicy.FullCol)

            v_mult = T.alloc_var(f32, init=VScale[0])
            # The split / direct choice stays outside the parallel loops: TileLang's lowering of a casting
            # store under nested conditions hoists the store out of the inner ones.
            if n_split == 1:
                if sp == 0:
                    for r, d in T.Parallel(M, head_dim):
                        if r < rows:
                            Out[b * nq + r // pack, head0 + r % pack, d] = T.cast(
                                T.if_then_else(l_run[r] > 0, acc_o[r, d] * v_mult / l_run[r], 0), dtype)
                    for r in T.Parallel(M):
                        if r < rows:
                            Lse[b * nq + r // pack, head0 + r % pack] = T.if_then_else(
                                l_run[r] > 0, (m_run[r] + T.log2(l_run[r])) / LOG2E, -T.infinity(f32))
            elif sp < n_split:
                for r, d in T.Parallel(M, head_dim):
                    if r < rows:
                        OPart[b, sp, r // pack, head0 + r % pack, d] = T.if_then_else(
                            l_run[r] > 0, acc_o[r, d] * v_mult / l_run[r], 0)
                for r in T.Parallel(M):
                    if r < rows:
                        LsePart[b, sp, r // pack, head0 + r % pack] = T.if_then_else(
                            l_run[r] > 0, (m_run[r] + T.log2(l_run[r])) / LOG2E, -T.infinity(f32))

    return paged_decode_split
