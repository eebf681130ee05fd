"""Paged attention prefill (`PagedAttentionPrefillTileLang`): FlashAttention over a paged KV cache.

Why this shape: each CTA owns one *query tile* (a few new tokens of one sequence, for the `pack`
query heads of one kv head, stacked into the `block_M` rows of the tile) and streams that
sequence's KV positions in tiles of `block_N` through shared memory with an online softmax. So
the KV cache is read once per (query tile, kv head) instead of three times per token and head as
in the naive kernel, and packing the heads of a GQA group divides the K/V traffic by `pack`. Both
products run on the tensor cores (fp32 inputs run as TF32).

A query tile must know its sequence. Rather than a host-side loop (a sync), one small kernel
(`paged_prefill_schedule_kernel`) builds the schedule on the device from `cum_seq_lens_q`: tile ->
(sequence, first query token), sorted by decreasing KV length so the longest tiles start first
(load balance over ragged batches). The tile count is an upper bound,
`(total_q + num_seqs * (tokens - 1)) // tokens`; spare tiles are idle (no KV steps, no output).

Two kernels share that plan:
- `paged_prefill_ws_kernel` (fp16/bf16, pages of >= 16 rows), FlashAttention-3 style and
  persistent (one CTA per SM walks (tile, head group) items). In the producer warpgroup one warp
  loads each item's Q tile by TMA (two Q buffers where they fit, so a whole item ahead) and hands
  the item's scalars (sequence, position, KV steps) to the others in shared memory with it; another
  warp loads whole pages of K and V by TMA (one copy per page, or `block_N` slice of a larger page,
  and 128-byte column band) into a ring of `num_stages` buffers, one full / free mbarrier pair per
  buffer, running into the next item as soon as its Q tile has landed (its Q copies never wait on the
  ring); two consumer warpgroups (64 query rows each) issue the scores of KV tile j and the P @ V
  product of tile j-1 together, so the softmax of tile j overlaps that product on the tensor cores.
  From 32-row pages, CTA pairs (clusters) take two adjacent query tiles of one head group and share
  each K / V tile: rank 0 multicasts it into both CTAs' rings, halving the L2 reads. On an H200 this
  kernel runs at the board's power cap, and the saved energy buys clock (1545 -> 1630 MHz at (a)).
  The causal mask is applied only to tiles that cross the diagonal. A full tile's O is staged in its
  Q buffer and stored by TMA (per-thread stores of the accumulator cost ~3 us per item).
- `paged_prefill_gather_kernel` (fp32 as TF32, whose P goes through shared memory; pages under 16
  rows, gathered row by row with cp.async): one software pipeline, TileLang warp-specializes its
  whole-page loads (pages of >= 32 rows) on its own.
Pages past the sequence's last one repeat it (the table entries there may be invalid); positions
past the sequence end are masked, and their V rows zeroed in shared memory (P is 0 there, but the
slots may hold NaN). KV tiles past the diagonal of the query tile are never visited.
"""


import math
from collections import namedtuple

import torch

from ._runtime import (check_choice, check_int, check_tensor, compile_kernel, max_active_clusters, resolve_config,
                       sm_count)

import tilelang.language as T  # noqa: E402  (after _runtime set the cache dir)

_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_HEAD_SIZES = (64, 128, 256)
_BITS = {"float16": 16, "bfloat16": 16, "float32": 32}
_LOG2E = 1.4426950408889634
# The gather kernel loads K/V by whole pages (TMA) from this page size on, and gathers rows below it
# (H200, same run, 16-row pages: rows 311 vs pages 250 TFLOP/s, each page copy with its own mbarrier).
_PAGE_LOADS_FROM = 32
# The warp-specialized kernel takes pages from 16 rows (one mbarrier per stage for all its copies).
_WS_PAGES_FROM = 16
_WS_BLOCK_M = 128  # two consumer warpgroups of 64 query rows
# CTA pairs share K/V tiles by multicast from this page size on (H200: -5% at 32-row pages; none at 16, which
# take 8 copies per tile).
_MULTICAST_PAGES_FROM = 32
_WS_THREADS = 384  # producer warpgroup + 2 consumer warpgroups
_WS_Q_WARP = 9  # loads Q tiles; warp 8 loads K and V (K alone in a cluster, V then on warp 10), never waiting on Q
# Slots of a work item's scalars in shared memory: the Q warp writes them, the K/V warp and the consumers
# read them.
_STEPS, _KV_LEN, _POS0, _Q_BEGIN, _Q0, _HEAD0, _ROWS, _SEQ = range(8)
_WS_SMEM_LIMIT = 220 * 1024  # of the 227 KB a CTA may use; the rest is barriers and alignment


# What a producer warp needs to fill one K or V ring: the cache, the ring, its free / full mbarriers.
_KVStream = namedtuple("_KVStream", "cache ring free full")


def _ws_smem_bytes(q_tiles: int, block_N: int, num_stages: int, head_size: int) -> int:
    """Shared memory of the warp-specialized kernel's Q tiles and K / V rings (16-bit)."""
    return (q_tiles * _WS_BLOCK_M + 2 * num_stages * block_N) * head_size * 2


def _ws_smem_fits(q_tiles: int, block_N: int, num_stages: int, head_size: int) -> bool:
    """Whether they fit the shared memory a CTA may use."""
    return _ws_smem_bytes(q_tiles, block_N, num_stages, head_size) <= _WS_SMEM_LIMIT


def head_pack(num_heads: int, num_kv_heads: int, block_M: int) -> int:
    """How many query heads of one kv head share a CTA (rows of its M tile): the largest divisor
    of the group size that still leaves >= 16 tokens per tile."""
    groups = num_heads // num_kv_heads
    return max(d for d in range(1, groups + 1) if groups % d == 0 and d <= max(1, block_M // 16))


def tile_tokens(num_heads: int, num_kv_heads: int, block_M: int) -> int:
    """New tokens per query tile (its block_M rows hold them times head_pack query heads)."""
    return block_M // head_pack(num_heads, num_kv_heads, block_M)


def warp_specialized(dtype: str, block_size: int) -> bool:
    """Which kernel serves a specialization (module docstring)."""
    return dtype != "float32" and block_size >= _WS_PAGES_FROM


class _TilePlan:
    """What both kernels share: shapes, the query tile of a CTA, page copies, mask, softmax and the
    output store. M-row r of a tile is token r // pack, head r % pack."""

    def __init__(self, num_heads, num_kv_heads, head_size, block_size, dtype, use_alibi, kv_layout, scale,
                 block_M, block_N):
        self.groups = num_heads // num_kv_heads
        self.pack = pack = head_pack(num_heads, num_kv_heads, block_M)
        self.tokens = tile_tokens(num_heads, num_kv_heads, block_M)  # rows past tokens * pack are padding
        self.block_N = block_N
        self.dims = T.dynamic("total_q, num_seqs, num_blocks, max_blocks, num_tiles")
        total_q, _, num_blocks, _, _ = self.dims
        self.kv_shape = ((num_blocks, num_kv_heads, block_size, head_size) if kv_layout == "HND" else
                         (num_blocks, block_size, num_kv_heads, head_size))
        self.q_shape = (total_q, num_heads, head_size)
        self.pages = list(range(max(1, block_N // block_size)))  # page copies per KV tile (Python-unrolled)
        rows_per_copy = min(block_size, block_N)
        band = min(head_size, 1024 // _BITS[dtype])  # 128 bytes: the widest TMA box of a swizzled tile
        accum = "float32"
        scale_log2 = scale * _LOG2E  # exp2 is one instruction: softmax runs in the log2 domain

        def page_rows(kt, p):
            off = (kt * block_N + p * rows_per_copy) % block_size
            return slice(off, off + rows_per_copy)

        def page_ids(BlockTables, seq, kv_len, kt):
            # Pages past the sequence's last one repeat it (table entries there may be invalid).
            return [BlockTables[seq, T.min(kt * block_N + p * rows_per_copy, kv_len - 1) // block_size]
                    for p in self.pages]
        self.page_ids = page_ids

        @T.macro
        def load_pages(cache, dst, blocks, kv_head, kt, bars=None, st=None, multicast=None):
            # One bulk copy per (page or block_N slice of a page, 128-byte column band): a band is one
            # contiguous run of the swizzled shared tile, as the TMA lowering requires. `dst` is a
            # [block_N, head_size] tile (T.copy: TileLang adds the mbarriers) or, with `bars`, stage
            # `st` of a ring whose copies all complete on bars[st] (T.tma_copy), multicast to the cluster
            # CTAs of the `multicast` mask when given.
            for p in self.pages:
                for c in range(0, head_size, band):
                    rows = slice(p * rows_per_copy, (p + 1) * rows_per_copy)
                    if kv_layout == "HND":
                        src = cache[blocks[p], kv_head, page_rows(kt, p), c:c + band]
                    else:
                        src = cache[blocks[p], page_rows(kt, p), kv_head, c:c + band]
                    if bars is None:
                        T.copy(src, dst[rows, c:c + band])
                    else:
                        T.tma_copy(src, dst[st, rows, c:c + band], barrier=bars[st], cluster_mask=multicast,
                                   leader_scope_threads=32)
        self.load_pages = load_pages

        @T.macro
        def load_q(Q, q_s, q_begin, q0, q_len, head0):
            for i, d in T.Parallel(block_M, head_size):  # tokens past q_len repeat its last one
                q_s[i, d] = Q[q_begin + T.max(T.min(q0 + i // pack, q_len - 1), 0), head0 + i % pack, d]
        self.load_q = load_q

        @T.macro
        def load_q_tma(Q, q_ring, bars, qb, q_begin, q0, q_len, head0):
            # Stage qb of a Q ring, completing on bars[qb]: tile rows (token, head) are token-major, so
            # one copy per token of its `pack` heads (a [tokens, pack] box is 3D, which TileLang's TMA
            # lowering does not take), or one copy of all tokens when pack == 1. Rows past q_len
            # are padding (never stored): with pack == 1 they read the next tokens or TMA's zeros.
            for c in range(0, head_size, band):
                if pack == 1:
                    T.tma_copy(Q[q_begin + q0:q_begin + q0 + self.tokens, head0, c:c + band],
                               q_ring[qb, :, c:c + band], barrier=bars[qb], leader_scope_threads=32)
                else:
                    for t in range(self.tokens):
                        tok = q_begin + T.max(T.min(q0 + t, q_len - 1), 0)
                        T.tma_copy(Q[tok, head0:head0 + pack, c:c + band],
                                   q_ring[qb, t * pack:(t + 1) * pack, c:c + band], barrier=bars[qb],
                                   leader_scope_threads=32)
        self.load_q_tma = load_q_tma

        @T.macro
        def load_slopes(AlibiSlopes, slope, head0):
            # In units of raw scores (the softmax scales them): alibi slope / scale.
            for i in T.Parallel(block_M):
                slope[i] = AlibiSlopes[head0 + i % pack] / scale
        self.load_slopes = load_slopes

        @T.macro
        def mask_scores(acc_s, slope, kt, pos0):
            # Causal mask (and ALiBi, in units of raw scores: slope = alibi slope / scale).
            for i, j in T.Parallel(block_M, block_N):
                rel = kt * block_N + j - (pos0 + i // pack)  # t - (history + token): visible if <= 0
                if use_alibi:
                    acc_s[i, j] = T.if_then_else(rel <= 0, acc_s[i, j] + slope[i] * rel, -T.infinity(accum))
                else:
                    acc_s[i, j] = T.if_then_else(rel <= 0, acc_s[i, j], -T.infinity(accum))
        self.mask_scores = mask_scores

        @T.macro
        def softmax_step(acc_s, m_cur, m_prev, rescale, row_sum, denom):
            # Online softmax of raw scores: P = exp2(scale_log2 * (s - m)), one FFMA + EX2 per score.
            # Every valid row has a finite score in KV tile 0, so the running max is finite from then on.
            T.copy(m_cur, m_prev)
            T.reduce_max(acc_s, m_cur, dim=1, clear=False)
            for i in T.Parallel(block_M):
                rescale[i] = T.exp2((m_prev[i] - m_cur[i]) * scale_log2)
            for i, j in T.Parallel(block_M, block_N):
                acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - m_cur[i] * scale_log2)
            T.reduce_sum(acc_s, row_sum, dim=1)
            for i in T.Parallel(block_M):
                denom[i] = denom[i] * rescale[i] + row_sum[i]
        self.softmax_step = softmax_step

        @T.macro
        def zero_v_tail(v_s, kt, kv_len, st=None):
            # Page slots past the sequence end may hold anything (NaN): P is 0 there, but 0 * NaN is not.
            # `v_s` is a [block_N, head_size] tile, or a ring with `st` its stage.
            for j, d in T.Parallel(block_N, head_size):
                idx = (j, d) if st is None else (st, j, d)
                v_s[idx] = T.if_then_else(kt * block_N + j < kv_len, v_s[idx], T.cast(0, dtype))
        self.zero_v_tail = zero_v_tail

        @T.macro
        def store_out_tma(Out, ring, qb, q_begin, q0, head0, warp, warps):
            # Warp `warp` of `warps` stores its share of the O tile staged in stage qb of a ring (a full
            # tile: every token row is valid) by TMA, one copy per token (as load_q_tma) and band, issued
            # by one lane of the warp; the caller waits for the reads before reusing the stage.
            per_warp = self.tokens // warps
            for i in range(per_warp):
                for c in range(0, head_size, band):
                    t = warp * per_warp + i
                    T.tma_copy(ring[qb, t * pack:(t + 1) * pack, c:c + band],
                               Out[q_begin + q0 + t, head0:head0 + pack, c:c + band], leader_scope_threads=32)
        self.store_out_tma = store_out_tma

        @T.macro
        def store_out(Out, acc_o, denom, q_begin, q0, head0, rows):
            for i, d in T.Parallel(block_M, head_size):
                if i // pack < rows:
                    Out[q_begin + q0 + i // pack, head0 + i % pack, d] = T.cast(acc_o[i, d] / denom[i], dtype)
        self.store_out = store_out

    def tile(self, TileSeq, TileQ0, CumSeqLensQ, SeqLens, tile, head_group, exists=True, part=0, parts=1):
        """The CTA's query tile: (busy, seq, kv_head, head0, q_begin, q_len, q0, kv_len, pos0, rows, steps).
        A schedule tile holds `parts` query tiles of `tokens` tokens (the CTAs of a cluster, which share
        its KV tiles); this CTA takes query tile `part`, whose rows may all lie past the sequence end
        (rows = 0), and all of them run the KV steps up to the schedule tile's diagonal. An idle tile (or
        one that does not `exist`: `tile` is then clamped by the caller) reads sequence 0's scalars, runs
        zero KV steps and writes nothing."""
        busy = T.And(exists, TileSeq[tile] >= 0)
        seq = T.max(TileSeq[tile], 0)
        head0 = head_group * self.pack
        first = TileQ0[tile]
        q_begin = CumSeqLensQ[seq]
        q_len = CumSeqLensQ[seq + 1] - q_begin
        kv_len = SeqLens[seq]
        span = T.if_then_else(busy, T.min(parts * self.tokens, q_len - first), 0)  # valid tokens of all parts
        steps = T.if_then_else(busy, T.ceildiv(kv_len - q_len + first + span, self.block_N), 0)
        q0 = first + part * self.tokens
        pos0 = kv_len - q_len + q0  # KV position of the tile's first query row
        rows = T.max(T.min(self.tokens, span - part * self.tokens), 0)  # valid tokens in this tile
        return busy, seq, head0 // self.groups, head0, q_begin, q_len, q0, kv_len, pos0, rows, steps


def paged_prefill_ws_kernel(num_heads: int, num_kv_heads: int, head_size: int, block_size: int, dtype: str,
                            use_alibi: bool, kv_layout: str, scale: float, num_ctas: int, block_N: int = 128,
                            num_stages: int = 2, cluster: int = 1):
    """Warp-specialized causal paged attention (module docstring), fp16/bf16, pages of >= 16 rows.
    Persistent: `num_ctas` CTAs (one per SM) take the (tile, head group) work items round-robin, so the
    producer loads the next item's first K/V tiles while the consumers finish the current one.

    With `cluster` > 1 a work item is `cluster` adjacent query tiles of one head group, one per CTA of a
    cluster, and all walk the same KV tiles (the last one's diagonal; the others mask the excess): rank 0
    loads each K / V tile once by TMA multicast into every CTA's ring, so the L2 serves a `cluster`-th of
    the K/V bytes. Rank 0 refills a stage once the consumers of all CTAs have released it (one arrival per
    consumer warp on rank 0's free barrier); the other ranks' producers only announce the bytes they
    expect, once the stage's previous fill has landed. K and V then have a producer warp each."""
    block_M = _WS_BLOCK_M
    plan = _TilePlan(num_heads, num_kv_heads, head_size, block_size, dtype, use_alibi, kv_layout, scale,
                     block_M, block_N)
    total_q, num_seqs, num_blocks, max_blocks, num_tiles = plan.dims
    head_groups = num_heads // plan.pack
    accum = "float32"
    # The producer loads the next item's Q while the consumers work on this one, when two Q tiles fit.
    q_stages = 2 if _ws_smem_fits(2, block_N, num_stages, head_size) else 1
    # Full tiles stage O in their Q buffer and store it by TMA, split over the 8 consumer warps.
    tma_out = plan.tokens % 8 == 0
    # A persistent grid of clusters holds only those resident at once (one CTA per SM).
    num_clusters = num_ctas if cluster == 1 else min(num_ctas // cluster, max_active_clusters(
        cluster, _WS_THREADS, _ws_smem_bytes(q_stages, block_N, num_stages, head_size)))
    multicast = (1 << cluster) - 1 if cluster > 1 else None  # the CTAs a K/V copy lands in

    def ring_stage(i, depth=num_stages):
        """The buffer of a ring of `depth` buffers taking its i-th use (KV step, or work item for Q)."""
        return i % depth

    def ring_phase(i, depth=num_stages):
        """The mbarrier phase of that use of its buffer."""
        return (i // depth) % 2

    def work_tile(TileSeq, TileQ0, CumSeqLensQ, SeqLens, cid, rank, w):
        """plan.tile of the w-th work item of cluster `cid`, part `rank`. Items are (tile, head group)
        pairs, longest first, dealt to the clusters in rounds that alternate direction: dealt round-robin,
        cluster 0 would get the longest item of every round (3% of (a)'s time in the slowest CTA's surplus)."""
        work = w * num_clusters + T.if_then_else(w % 2 == 0, cid, num_clusters - 1 - cid)
        tile = T.min(work // head_groups, num_tiles - 1)
        return plan.tile(TileSeq, TileQ0, CumSeqLensQ, SeqLens, tile, work % head_groups,
                         work < num_tiles * head_groups, rank, cluster)

    @T.macro
    def release(free, st, tx):
        # The consumers are done reading stage st: every thread arrives, or with a cluster one lane per
        # consumer warp on rank 0's barrier (rank 0 refills the stage in every CTA of the cluster).
        if cluster == 1:
            T.barrier_arrive(free[st])
        elif tx % 32 == 0:
            T.mbarrier_arrive(free[st], 0)

    @T.macro
    def claim(free, full, st, phase, rank):
        # The K/V warp may fill stage st (rank 0: released in every CTA) or, on the other ranks, expect
        # its next fill (its previous fill has landed, so this arrival counts toward the next phase).
        if cluster > 1 and rank != 0:
            T.barrier_wait(full[st], phase ^ 1)
        else:
            T.barrier_wait(free[st], phase ^ 1)

    @T.macro
    def kv_rings(streams, q_full, BlockTables, item_s, items, rank):
        # A producer warp's K and/or V streams (_KVStream): every KV step of every item, behind the item's
        # Q tile.
        step = T.alloc_var("int32", init=0)  # KV steps loaded: ring stage and phase
        for w in T.serial(items):
            qb = ring_stage(w, q_stages)
            T.barrier_wait(q_full[qb], ring_phase(w, q_stages))
            steps_p = item_s[qb, _STEPS]
            kv_len_p = item_s[qb, _KV_LEN]
            kv_head = item_s[qb, _HEAD0] // plan.groups
            seq = item_s[qb, _SEQ]
            for kt in T.serial(steps_p):
                st = ring_stage(step)
                phase = ring_phase(step)
                blocks = plan.page_ids(BlockTables, seq, kv_len_p, kt)
                for kv in streams:  # (not unpacked: a builder assignment would rename the buffers)
                    claim(kv.free, kv.full, st, phase, rank)
                    plan.load_pages(kv.cache, kv.ring, blocks, kv_head, kt, kv.full, st, multicast)
                    T.barrier_arrive(kv.full[st])
                step = step + 1

    @T.macro
    def issue_q(Q, q_ring, q_full, q_free, item_s, TileSeq, TileQ0, CumSeqLensQ, SeqLens, cid, rank, tx, w):
        # Q tile and scalars of item w, handed to the consumers and the K/V warp through q_full (its
        # arrival releases the scalars' shared stores).
        _, seq, _, head0, q_begin, q_len, q0, kv_len, pos0, rows, steps = work_tile(
            TileSeq, TileQ0, CumSeqLensQ, SeqLens, cid, rank, w)
        qb = ring_stage(w, q_stages)
        T.barrier_wait(q_free[qb], ring_phase(w, q_stages) ^ 1)
        plan.load_q_tma(Q, q_ring, q_full, qb, q_begin, q0, q_len, head0)
        if tx == _WS_Q_WARP * 32:
            for slot, v in ((_STEPS, steps), (_KV_LEN, kv_len), (_POS0, pos0),
                            (_Q_BEGIN, q_begin), (_Q0, q0), (_HEAD0, head0), (_ROWS, rows), (_SEQ, seq)):
                item_s[qb, slot] = v
        T.barrier_arrive(q_full[qb])

    @T.prim_func
    def paged_prefill_ws(
        Q: T.Tensor(plan.q_shape, dtype),
        KCache: T.Tensor(plan.kv_shape, dtype),
        VCache: T.Tensor(plan.kv_shape, dtype),
        BlockTables: T.Tensor((num_seqs, max_blocks), "int32"),
        SeqLens: T.Tensor((num_seqs,), "int32"),
        CumSeqLensQ: T.Tensor((num_seqs + 1,), "int32"),
        AlibiSlopes: T.Tensor((num_heads,), "float32"),
        TileSeq: T.Tensor((num_tiles,), "int32"),
        TileQ0: T.Tensor((num_tiles,), "int32"),
        Out: T.Tensor(plan.q_shape, dtype),
    ):
        with T.Kernel(cluster, num_clusters, threads=_WS_THREADS,
                      cluster_dims=(cluster, 1, 1) if cluster > 1 else None) as (rank, cid):
            q_ring = T.alloc_shared((q_stages, block_M, head_size), dtype)
            k_ring = T.alloc_shared((num_stages, block_N, head_size), dtype)
            v_ring = T.alloc_shared((num_stages, block_N, head_size), dtype)
            k_full = T.alloc_barrier([32] * num_stages)  # the K/V warp arrives, TMA bytes complete it
            v_full = T.alloc_barrier([32] * num_stages)
            if cluster == 1:  # consumer threads arrive when done reading
                k_free = T.alloc_barrier([256] * num_stages)
                v_free = T.alloc_barrier([256] * num_stages)
            else:  # the consumer warps of every CTA of the cluster arrive (at rank 0's)
                k_free = T.alloc_cluster_barrier([8 * cluster] * num_stages)
                v_free = T.alloc_cluster_barrier([8 * cluster] * num_stages)
            q_full = T.alloc_barrier([32] * q_stages)  # the Q warp
            q_free = T.alloc_barrier([256] * q_stages)
            # The Q warp hands each item's scalars to the consumers and the K/V warp with its Q tile (their
            # global loads would otherwise stall them at every item start).
            item_s = T.alloc_shared((q_stages, _SEQ + 1), "int32")
            steps = T.alloc_var("int32")
            kv_len = T.alloc_var("int32")
            pos0 = T.alloc_var("int32")
            q_begin = T.alloc_var("int32")
            q0 = T.alloc_var("int32")
            head0 = T.alloc_var("int32")
            rows = T.alloc_var("int32")
            acc_s = T.alloc_fragment((block_M, block_N), accum)
            acc_p = T.alloc_fragment((block_M, block_N), dtype)
            acc_o = T.alloc_fragment((block_M, head_size), accum)
            m_prev = T.alloc_fragment((block_M,), accum)
            m_cur = T.alloc_fragment((block_M,), accum)
            rescale = T.alloc_fragment((block_M,), accum)
            row_sum = T.alloc_fragment((block_M,), accum)
            denom = T.alloc_fragment((block_M,), accum)
            slope = T.alloc_fragment((block_M,), accum)
            step = T.alloc_var("int32", init=0)  # KV steps done by this CTA: ring stage and phase
            tx = T.get_thread_binding()
            items = T.ceildiv(num_tiles * head_groups, num_clusters)  # rounds of work (work_tile)
            if cluster > 1:
                # TileLang launches clusters with programmatic stream serialization allowed, so this grid
                # may start before the stream's previous kernel (the schedule, or the caller's writes of
                # Q / K / V) has finished; only this wait makes their results visible.
                T.pdl_sync()

            if tx >= 256:  # producer warpgroup: K/V warp(s), and a Q warp that also writes the item scalars
                T.set_max_nreg(40, 0)  # at 24 the page-id math spills (128 B at 16-row pages)
                k_stream = _KVStream(KCache, k_ring, k_free, k_full)
                v_stream = _KVStream(VCache, v_ring, v_free, v_full)
                if tx < _WS_Q_WARP * 32:  # warp 8: K and V, or K alone when a cluster shares them
                    # (a cluster's stage waits on every CTA's consumers: K's lookahead must not queue
                    # behind V's slower free slot, 4.5% at (a) on an H200)
                    kv_rings([k_stream, v_stream] if cluster == 1 else [k_stream], q_full, BlockTables, item_s,
                             items, rank)
                elif tx < _WS_Q_WARP * 32 + 32:
                    for w in T.serial(items):
                        issue_q(Q, q_ring, q_full, q_free, item_s, TileSeq, TileQ0, CumSeqLensQ, SeqLens, cid, rank,
                                tx, w)
                elif tx < _WS_Q_WARP * 32 + 64:
                    if cluster > 1:  # warp 10: V
                        kv_rings([v_stream], q_full, BlockTables, item_s, items, rank)
            else:  # consumer warpgroups: 64 query rows each
                T.set_max_nreg(232, 1)  # 128 x 40 + 256 x 232 fits the 168 x 384 of the launch
                for w in T.serial(items):
                    qb = ring_stage(w, q_stages)
                    T.fill(acc_o, 0)
                    T.fill(denom, 0)
                    T.fill(m_cur, -T.infinity(accum))
                    T.barrier_wait(q_full[qb], ring_phase(w, q_stages))
                    steps = item_s[qb, _STEPS]
                    kv_len = item_s[qb, _KV_LEN]
                    pos0 = item_s[qb, _POS0]
                    q_begin = item_s[qb, _Q_BEGIN]
                    q0 = item_s[qb, _Q0]
                    head0 = item_s[qb, _HEAD0]
                    rows = item_s[qb, _ROWS]
                    if use_alibi:
                        plan.load_slopes(AlibiSlopes, slope, head0)
                    for kt in T.serial(steps):
                        # Scores of step kt, then P @ V of step kt-1 behind them: the softmax below
                        # runs while the tensor cores finish that product.
                        st = ring_stage(step + kt)
                        prev = ring_stage(step + kt - 1)
                        T.barrier_wait(k_full[st], ring_phase(step + kt))
                        T.wgmma_gemm(q_ring[qb, :, :], k_ring[st, :, :], acc_s, transpose_B=True, clear_accum=True,
                                     policy=T.GemmWarpPolicy.FullRow)
                        if kt > 0:
                            T.barrier_wait(v_full[prev], ring_phase(step + kt - 1))
                            T.wgmma_gemm(acc_p, v_ring[prev, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
                            T.wait_wgmma(1)
                        else:
                            T.wait_wgmma(0)
                        release(k_free, st, tx)
                        if use_alibi or (kt + 1) * block_N > pos0 + 1:  # the tile crosses the diagonal
                            plan.mask_scores(acc_s, slope, kt, pos0)
                        plan.softmax_step(acc_s, m_cur, m_prev, rescale, row_sum, denom)
                        T.wait_wgmma(0)
                        if kt > 0:
                            release(v_free, prev, tx)
                        for i, d in T.Parallel(block_M, head_size):
                            acc_o[i, d] *= rescale[i]
                        T.copy(acc_s, acc_p)
                    if steps > 0:  # P @ V of the last step
                        last = ring_stage(step + steps - 1)
                        T.barrier_wait(v_full[last], ring_phase(step + steps - 1))
                        if steps * block_N > kv_len:
                            plan.zero_v_tail(v_ring, steps - 1, kv_len, last)
                        T.gemm(acc_p, v_ring[last, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
                        release(v_free, last, tx)
                    if tma_out and rows == plan.tokens:
                        # The scores' products, the Q tile's only readers, are done: O goes through it.
                        for i, d in T.Parallel(block_M, head_size):
                            q_ring[qb, i, d] = T.cast(acc_o[i, d] / denom[i], dtype)
                        T.fence_proxy_async()  # the shared stores, before the TMA engine reads them
                        T.sync_threads(1, 256)
                        plan.store_out_tma(Out, q_ring, qb, q_begin, q0, head0, tx // 32, 8)
                    else:
                        plan.store_out(Out, acc_o, denom, q_begin, q0, head0, rows)
                    T.tma_store_wait(0)  # the O store's reads of the Q buffer, before handing it back
                    T.barrier_arrive(q_free[qb])
                    step = step + steps
            if cluster > 1:  # no CTA leaves while the other may still multicast into it or arrive on it
                T.cluster_sync()

    return paged_prefill_ws


def paged_prefill_gather_kernel(num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
                                dtype: str, use_alibi: bool, kv_layout: str, scale: float,
                                block_M: int = 128, block_N: int = 128, num_stages: int = 1, threads: int = 256):
    """Causal paged attention with one software pipeline (module docstring): fp32 and small pages."""
    plan = _TilePlan(num_heads, num_kv_heads, head_size, block_size, dtype, use_alibi, kv_layout, scale,
                     block_M, block_N)
    total_q, num_seqs, num_blocks, max_blocks, num_tiles = plan.dims
    accum = "float32"
    paged = block_size >= _PAGE_LOADS_FROM  # whole-page (TMA) loads; smaller pages are gathered row by row

    @T.macro
    def gather_rows(cache, dst, tables, seq, kv_head, kv_len, kt):
        for j, d in T.Parallel(block_N, head_size):
            pos = T.min(kt * block_N + j, kv_len - 1)  # clamped: never reads past the sequence
            block = tables[seq, pos // block_size]
            if kv_layout == "HND":
                dst[j, d] = cache[block, kv_head, pos % block_size, d]
            else:
                dst[j, d] = cache[block, pos % block_size, kv_head, d]

    @T.prim_func
    def paged_prefill(
        Q: T.Tensor(plan.q_shape, dtype),
        KCache: T.Tensor(plan.kv_shape, dtype),
        VCache: T.Tensor(plan.kv_shape, dtype),
        BlockTables: T.Tensor((num_seqs, max_blocks), "int32"),
        SeqLens: T.Tensor((num_seqs,), "int32"),
        CumSeqLensQ: T.Tensor((num_seqs + 1,), "int32"),
        AlibiSlopes: T.Tensor((num_heads,), "float32"),
        TileSeq: T.Tensor((num_tiles,), "int32"),
        TileQ0: T.Tensor((num_tiles,), "int32"),
        Out: T.Tensor(plan.q_shape, dtype),
    ):
        with T.Kernel(num_heads // plan.pack, num_tiles, threads=threads) as (head_group, tile):
            q_s = T.alloc_shared((block_M, head_size), dtype)
            k_s = T.alloc_shared((block_N, head_size), dtype)
            v_s = T.alloc_shared((block_N, head_size), dtype)
            acc_s = T.alloc_fragment((block_M, block_N), accum)
            if dtype == "float32":  # TF32 products take P from shared memory (no register layout)
                acc_p = T.alloc_shared((block_M, block_N), dtype)
            else:
                acc_p = T.alloc_fragment((block_M, block_N), dtype)
            acc_o = T.alloc_fragment((block_M, head_size), accum)
            m_prev = T.alloc_fragment((block_M,), accum)
            m_cur = T.alloc_fragment((block_M,), accum)
            rescale = T.alloc_fragment((block_M,), accum)
            row_sum = T.alloc_fragment((block_M,), accum)
            denom = T.alloc_fragment((block_M,), accum)
            slope = T.alloc_fragment((block_M,), accum)

            # No branch on idle tiles around the KV loop (it would keep the loads from being pipelined).
            _, seq, kv_head, head0, q_begin, q_len, q0, kv_len, pos0, rows, steps = plan.tile(
                TileSeq, TileQ0, CumSeqLensQ, SeqLens, tile, head_group)
            plan.load_q(Q, q_s, q_begin, q0, q_len, head0)
            if use_alibi:
                plan.load_slopes(AlibiSlopes, slope, head0)
            T.fill(acc_o, 0)
            T.fill(denom, 0)
            T.fill(m_cur, -T.infinity(accum))

            for kt in T.Pipelined(steps, num_stages=num_stages):
                if paged:
                    # The page ids are the loop body's leading bindings: the warp-specialization
                    # pass keeps those in the producer branch (read once for K and V, ahead of
                    # the copies).
                    blocks = plan.page_ids(BlockTables, seq, kv_len, kt)
                    plan.load_pages(KCache, k_s, blocks, kv_head, kt)
                    plan.load_pages(VCache, v_s, blocks, kv_head, kt)
                else:
                    gather_rows(KCache, k_s, BlockTables, seq, kv_head, kv_len, kt)
                T.clear(acc_s)
                T.gemm(q_s, k_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                plan.mask_scores(acc_s, slope, kt, pos0)
                plan.softmax_step(acc_s, m_cur, m_prev, rescale, row_sum, denom)
                T.copy(acc_s, acc_p)
                for i, d in T.Parallel(block_M, head_size):
                    acc_o[i, d] *= rescale[i]
                if paged:
                    if (kt + 1) * block_N > kv_len:
                        plan.zero_v_tail(v_s, kt, kv_len)
                else:
                    gather_rows(VCache, v_s, BlockTables, seq, kv_head, kv_len, kt)
                T.gemm(acc_p, v_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

            plan.store_out(Out, acc_o, denom, q_begin, q0, head0, rows)

    return paged_prefill


def paged_prefill_schedule_kernel(tokens: int, threads: int = 256):
    """The query tiles of a batch (`tokens` new tokens per tile) ordered by decreasing KV work, as
    TileSeq[rank] (sequence, or -1 for the spare tiles at the end) and TileQ0[rank] (first query row).
    One thread per tile: a tile's work key is its first row's KV position (history + q0), strictly
    increasing along a sequence, so its rank counts per sequence in O(1) (ties go to the lower
    sequence): O(num_seqs) per tile, one launch instead of a dozen small torch ops per call."""
    num_seqs, num_tiles = T.dynamic("num_seqs, num_tiles")

    def tiles_of(CumSeqLensQ, s):
        return T.ceildiv(CumSeqLensQ[s + 1] - CumSeqLensQ[s], tokens)

    def history(SeqLens, CumSeqLensQ, s):
        return SeqLens[s] - (CumSeqLensQ[s + 1] - CumSeqLensQ[s])

    @T.prim_func
    def paged_prefill_schedule(SeqLens: T.Tensor((num_seqs,), "int32"),
                               CumSeqLensQ: T.Tensor((num_seqs + 1,), "int32"),
                               TileSeq: T.Tensor((num_tiles,), "int32"), TileQ0: T.Tensor((num_tiles,), "int32")):
        with T.Kernel(T.ceildiv(num_tiles, threads), threads=threads) as bx:
            tile = bx * threads + T.get_thread_binding()
            seq = T.alloc_var("int32", init=-1)
            first = T.alloc_var("int32", init=0)  # tiles of the sequences before `seq`
            total = T.alloc_var("int32", init=0)
            rank = T.alloc_var("int32", init=0)
            for s in T.serial(num_seqs):
                if T.And(seq < 0, tile < total + tiles_of(CumSeqLensQ, s)):
                    seq = s
                    first = total
                total = total + tiles_of(CumSeqLensQ, s)
            if tile < num_tiles:
                if seq >= 0:
                    key = history(SeqLens, CumSeqLensQ, seq) + (tile - first) * tokens
                    for s in T.serial(num_seqs):
                        # sequence s's tiles j with j * tokens > d rank first (and j * tokens == d, for s < seq)
                        d = key - history(SeqLens, CumSeqLensQ, s)
                        n = tiles_of(CumSeqLensQ, s)
                        rank = rank + T.if_then_else(d < 0, n, T.max(0, n - d // tokens - 1))
                        rank = rank + T.if_then_else(T.And(T.And(s < seq, d >= 0), T.And(d % tokens == 0,
                                                                                          d // tokens < n)), 1, 0)
                    TileSeq[rank] = seq
                    TileQ0[rank] = (tile - first) * tokens
                else:  # spare tiles: past every real one (whose ranks are 0 .. total - 1)
                    TileSeq[tile] = -1
                    TileQ0[tile] = 0

    return paged_prefill_schedule


def paged_prefill_kernel(num_heads: int, num_kv_heads: int, head_size: int, block_size: int, dtype: str,
                         use_alibi: bool, kv_layout: str, scale: float, num_ctas: int, **config):
    """The kernel of a specialization (`warp_specialized` picks the family) with its config.
    `num_ctas` (the device's SM count) bounds the persistent grid of the warp-specialized kernel; the
    gather kernel launches one CTA per query tile and head group."""
    args = (num_heads, num_kv_heads, head_size, block_size, dtype, use_alibi, kv_layout, scale)
    if warp_specialized(dtype, block_size):
        return paged_prefill_ws_kernel(*args, num_ctas=num_ctas, **config)
    return paged_prefill_gather_kernel(*args, **config)


def _default_config(head_size: int, dtype: str, block_size: int = 16) -> dict:
    """Tiles that fit shared memory (Q, plus K and V per pipeline stage) and registers."""
    if warp_specialized(dtype, block_size):  # Q + 2 stages of K and V: 160 KB, 192 KB at head_size 256
        return {"block_N": 64 if head_size == 256 else 128, "num_stages": 2,
                "cluster": 2 if block_size >= _MULTICAST_PAGES_FROM else 1}
    # Whole-page (TMA) loads run two stages; the row gathers of smaller pages do not lower with two.
    stages = 2 if block_size >= _PAGE_LOADS_FROM else 1
    if dtype == "float32":
        return {"block_M": 64, "block_N": 32 if head_size == 256 else 64, "num_stages": stages, "threads": 128}
    if head_size == 256:
        return {"block_M": 64, "block_N": 64, "num_stages": stages, "threads": 128}
    return {"block_M": 128, "block_N": 128, "num_stages": stages, "threads": 256}


def _as_int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)


class PagedAttentionPrefillTileLang:
    """Causal paged attention prefill: ``op(q, k_cache, v_cache, block_tables, seq_lens,
    cum_seq_lens_q, alibi_slopes=None, out=None) -> out``; semantics in ``golden.paged_prefill``.

    fp16/bf16 run on the tensor cores with fp32 accumulation; fp32 inputs run as TF32 products
    (10-bit mantissa operands, fp32 accumulation and softmax).

    ``validate=True`` (default) checks the values of ``cum_seq_lens_q``, ``seq_lens`` and the needed
    ``block_tables`` entries: a few small device reductions and ONE host synchronization per call.
    ``validate=False`` skips them (shapes, dtypes and devices are still checked): the call then
    makes no host synchronization and can be captured in a CUDA graph, and the caller guarantees
    the values are valid (invalid values give undefined results; TileLang's bounds guards still
    keep every access inside the tensors).
    """

    op_name = "paged_prefill"
    DEFAULT_CONFIG = _default_config(128, "bfloat16")
    tunable_kernel = staticmethod(paged_prefill_kernel)

    @staticmethod
    def config_space(**spec) -> list[dict]:
        head_size, dtype = spec.get("head_size", 128), spec.get("dtype", "bfloat16")
        block_size = spec.get("block_size", 16)
        if warp_specialized(dtype, block_size):
            # Q plus num_stages x (K and V tiles) within shared memory.
            return [{"block_N": n, "num_stages": s, "cluster": c} for n in (64, 128) for s in (2, 3) for c in (1, 2)
                    if _ws_smem_fits(1, n, s, head_size)]
        # Two software-pipeline stages do not lower with the row-gather loads (small pages).
        stages = (1, 2) if block_size >= _PAGE_LOADS_FROM else (0, 1)
        big = head_size == 256 or dtype == "float32"
        tiles = ([(64, 64, 128), (64, 32, 128)] if big else
                 [(128, 128, 256), (128, 64, 256), (64, 128, 128), (64, 64, 128)])
        return [{"block_M": m, "block_N": n, "num_stages": s, "threads": t} for m, n, t in tiles for s in stages]

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
                 dtype: torch.dtype, use_alibi: bool = False, scale: float | None = None,
                 kv_layout: str = "HND", validate: bool = True, config: dict | None = None):
        check_int("num_heads", num_heads, lo=1)
        check_int("num_kv_heads", num_kv_heads, lo=1)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads: expected a multiple of num_kv_heads={num_kv_heads}, got {num_heads}")
        check_int("head_size", head_size)
        check_choice("head_size", head_size, _HEAD_SIZES)
        check_int("block_size", block_size, lo=1, hi=256, power_of_two=True)
        if dtype not in _DTYPES:
            raise TypeError(f"dtype: expected one of {list(_DTYPES)}, got {dtype!r}")
        if not isinstance(use_alibi, bool):
            raise TypeError(f"use_alibi: expected a bool, got {type(use_alibi).__name__}")
        check_choice("kv_layout", kv_layout, ("HND", "NHD"))
        scale = head_size ** -0.5 if scale is None else scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise TypeError(f"scale: expected a finite float, got {scale!r}")
        if scale <= 0:  # the softmax takes its running max on unscaled scores
            raise ValueError(f"scale: expected a positive value, got {scale!r}")
        self.num_heads, self.num_kv_heads, self.head_size, self.block_size = (
            num_heads, num_kv_heads, head_size, block_size)
        self.dtype, self.use_alibi, self.kv_layout, self.validate = dtype, use_alibi, kv_layout, validate
        self.spec = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_size": head_size,
                     "block_size": block_size, "dtype": _DTYPES[dtype], "use_alibi": use_alibi,
                     "kv_layout": kv_layout, "scale": float(scale), "num_ctas": sm_count()}
        self.config = resolve_config(self.op_name, self.spec, config,
                                     _default_config(head_size, _DTYPES[dtype], block_size))
        self._no_alibi = {}
        # Fast math: exp2 and the final division as single approximate instructions (well inside
        # the error of the bf16/fp16 probabilities fed to the second product).
        self.kernel = compile_kernel(paged_prefill_kernel(**self.spec, **self.config),
                                     pass_configs={"tl.enable_fast_math": True})
        tile_m = self.config.get("block_M", _WS_BLOCK_M)
        # A schedule tile is the query tiles of all CTAs of a cluster (module docstring).
        self.tile_tokens = tile_tokens(num_heads, num_kv_heads, tile_m) * self.config.get("cluster", 1)
        self.schedule_kernel = compile_kernel(paged_prefill_schedule_kernel(self.tile_tokens))

    # ------------------------------------------------------------------ checks
    def _kv_shape(self, num_blocks: int) -> list:
        hkv, bs, d = self.num_kv_heads, self.block_size, self.head_size
        return [num_blocks, hkv, bs, d] if self.kv_layout == "HND" else [num_blocks, bs, hkv, d]

    def check_inputs(self, q, k_cache, v_cache, block_tables, seq_lens, cum_seq_lens_q,
                     alibi_slopes=None, out=None) -> None:
        """Device, dtype, shape and contiguity of every tensor (no host synchronization)."""
        check_tensor("q", q, self.dtype, [None, self.num_heads, self.head_size])
        dev = q.device
        check_tensor("k_cache", k_cache, self.dtype, self._kv_shape(None), dev)
        check_tensor("v_cache", v_cache, self.dtype, list(k_cache.shape), dev)
        check_tensor("block_tables", block_tables, (torch.int32, torch.int64), [None, None], dev)
        num_seqs = block_tables.shape[0]
        check_tensor("seq_lens", seq_lens, (torch.int32, torch.int64), [num_seqs], dev)
        check_tensor("cum_seq_lens_q", cum_seq_lens_q, (torch.int32, torch.int64), [num_seqs + 1], dev)
        if self.use_alibi:
            if alibi_slopes is None:
                raise ValueError("alibi_slopes: expected a [num_heads] fp32 tensor (use_alibi=True), got None")
            check_tensor("alibi_slopes", alibi_slopes, torch.float32, [self.num_heads], dev)
        elif alibi_slopes is not None:
            raise ValueError("alibi_slopes: given but the op was built with use_alibi=False")
        if out is not None:
            check_tensor("out", out, self.dtype, list(q.shape), dev)

    def check_values(self, q, k_cache, block_tables, seq_lens, cum_seq_lens_q) -> None:
        """Value checks on the device, then one host synchronization for all of them."""
        cum, lens = cum_seq_lens_q.long(), seq_lens.long()
        q_lens = cum[1:] - cum[:-1]
        needed = (lens + self.block_size - 1) // self.block_size
        cols = torch.arange(block_tables.shape[1], device=q.device)
        used = cols[None, :] < needed[:, None]
        ids = block_tables.long()
        bad_ids = used & ((ids < 0) | (ids >= k_cache.shape[0]))
        flags = torch.stack([cum[0] != 0, (q_lens < 0).any(), cum[-1] != q.shape[0], (lens < q_lens).any(),
                             (needed > block_tables.shape[1]).any(), bad_ids.any()]).tolist()
        messages = [
            "cum_seq_lens_q: expected to start at 0",
            "cum_seq_lens_q: expected non-decreasing values",
            f"cum_seq_lens_q: expected to end at total_q_tokens={q.shape[0]}",
            "seq_lens: expected seq_lens[s] >= q_len of sequence s (history + new tokens)",
            f"block_tables: a sequence needs more blocks than its row holds ({block_tables.shape[1]})",
            f"block_tables: a needed block id is out of range [0, {k_cache.shape[0]})",
        ]
        for flag, message in zip(flags, messages):
            if flag:
                raise ValueError(message)

    # ------------------------------------------------------------------ launch
    def schedule(self, total_q: int, seq_lens: torch.Tensor, cum_seq_lens_q: torch.Tensor):
        """Query tiles -> (sequence or -1, first query row), longest KV first; on the device (int32
        inputs). The tile count is an upper bound: spare tiles come last, with sequence -1."""
        num_seqs, tokens = seq_lens.shape[0], self.tile_tokens
        num_tiles = (total_q + num_seqs * (tokens - 1)) // tokens
        tile_seq = torch.empty(num_tiles, dtype=torch.int32, device=seq_lens.device)
        tile_q0 = torch.empty_like(tile_seq)
        self.schedule_kernel(seq_lens, cum_seq_lens_q, tile_seq, tile_q0)
        return tile_seq, tile_q0

    def tune_args(self, q, k_cache, v_cache, block_tables, seq_lens, cum_seq_lens_q, alibi_slopes=None):
        seq_lens, cum = _as_int32(seq_lens), _as_int32(cum_seq_lens_q)
        tile_seq, tile_q0 = self.schedule(q.shape[0], seq_lens, cum)
        if alibi_slopes is None:  # the kernel ignores it then; a cached buffer keeps calls allocation-free
            alibi_slopes = self._no_alibi.get(q.device)
            if alibi_slopes is None:
                alibi_slopes = self._no_alibi[q.device] = torch.zeros(self.num_heads, device=q.device)
        return (q, k_cache, v_cache, _as_int32(block_tables), seq_lens, cum, alibi_slopes, tile_seq, tile_q0,
                torch.empty_like(q))

    def __call__(self, q, k_cache, v_cache, block_tables, seq_lens, cum_seq_lens_q, alibi_slopes=None,
                 out=None):
        self.check_inputs(q, k_cache, v_cache, block_tables, seq_lens, cum_seq_lens_q, alibi_slopes, out)
        if self.validate:
            self.check_values(q, k_cache, block_tables, seq_lens, cum_seq_lens_q)
        if out is None:
            out = torch.empty_like(q)
        if q.shape[0] == 0:
            return out
        args = self.tune_args(q, k_cache, v_cache, block_tables, seq_lens, cum_seq_lens_q, alibi_slopes)
        with torch.cuda.device(q.device):
            self.kernel(*args[:-1], out)
        return out
