"""The warp-specialized persistent kernel (fp16/bf16, pages of >= 16 rows), FlashAttention-3 style.

One CTA per SM walks (query tile, head group) work items, pulled from a device counter as it gets free (a
dynamic schedule, as FA3's: a CTA whose SM another stream holds takes fewer items). In the producer
warpgroup one warp loads each item's Q tile by TMA (two Q buffers where they fit, so a whole item ahead) and
hands the item's scalars (sequence, position, KV steps) to the others in shared memory with it; another warp
loads whole pages of K and V by TMA (one copy per page, or `block_N` slice of a larger page, and 128-byte
column band) into a ring of `num_stages` buffers, one full / free mbarrier pair per buffer, running into the
next item as soon as its Q tile has landed (its Q copies never wait on the ring). Two consumer warpgroups (64 query rows
each) issue the scores of KV tile j and the P @ V product of tile j-1 together, so the softmax of tile j
overlaps that product on the tensor cores. The causal mask is applied only to tiles that cross the
diagonal. A full tile's O is staged in its Q buffer and stored by TMA (per-thread stores of the
accumulator cost ~3 us per item).

From 32-row pages, CTA pairs (clusters) take two adjacent query tiles of one head group and share each
K / V tile: rank 0 multicasts it into both CTAs' rings, halving the L2 reads. On an H200 this kernel runs
at the board's power cap, and the saved energy buys clock (1545 -> 1630 MHz at 4x4k).

An 8-bit (FP8) cache: the scores run on FP8 tensor cores from K as stored, the Q tile split into e4m3 terms per
item (two for bf16 q, three for fp16: exact); V is widened to fp16 by the producer warpgroup's two other warps into
a ring of its own, off the consumers' critical path, for an fp16 P @ V. With `fp8_compute` both products run on FP8 (as
FlashAttention-3's FP8 mode): q rounded to one e4m3 term, P rounded to e4m3 through shared memory, and the two warps
transpose V's stages (FP8 products read both operands K-major) instead of widening them. In a CTA pair warp 8
loads both 8-bit streams (the converter warps free V's stages ahead of the consumers).
"""

from collections import namedtuple

import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from ...common.runtime import max_active_clusters
from ..tiling import BITS, WS_BLOCK_M, WS_THREADS, q_terms, ws_smem_bytes, ws_smem_fits
from .tile_plan import TilePlan

# Registers per thread of the producer and consumer warpgroups (by whether V is transposed for an FP8 P @ V):
# 128 x producer + 256 x consumer within the 168 x 384 of the launch.
PRODUCER_REGS = {False: 40, True: 72}
CONSUMER_REGS = {False: 232, True: 216}
# loads Q tiles; warp 8 loads K and V (K alone in a cluster of 16-bit caches, V then on warp 10), never waiting on Q
WS_Q_WARP = 9
# Slots of a work item's scalars in shared memory: the Q warp writes them, the K/V warp and the consumers
# read them.
# _LAST: 1 on the item past the last one (idle: no KV step, nothing stored), after which every role stops.
_STEPS, _KV_LEN, _POS0, _Q_BEGIN, _Q0, _HEAD0, _ROWS, _LO, _KT0, _LAST, _SEQ = range(11)

# What a producer warp needs to fill one K or V ring: the cache, the ring, its free / full mbarriers.
_KVStream = namedtuple("_KVStream", "cache ring free full")
# The kernel's buffers, handed to its phases: global tensors, shared rings and their mbarriers, and the
# consumers' register fragments. (Per-thread scalars, `T.alloc_var`, go to the phases one by one as
# `T.Ref` arguments: a var read through a tuple would not load.)
_Global = namedtuple("_Global", "Q KCache VCache BlockTables SeqLens CumSeqLensQ AlibiSlopes KVScales TileSeq "
                                 "TileQ0 Out Lse Sched")
# The ring the consumers read V from (ring, full / free mbarriers, depth): V's TMA ring, or for an 8-bit cache the
# ring its converter warps fill (fp16, or e4m3 transposed for an FP8 P @ V).
_Ring = namedtuple("_Ring", "ring full free depth")
# q_use: the Q tiles the scores read (q_ring, or with an 8-bit cache its e4m3 terms, see TilePlan.split_q).
_Shared = namedtuple("_Shared", "q_ring k_ring v_ring k_full v_full k_free v_free q_full q_free item_s v_use q_use")
# kv_mult: [k_scale, v_scale] of an 8-bit cache, in registers; q_scales: the q split's row scales (shared),
# q_mult: each row's score multiplier (that scale times k_scale).
_Frags = namedtuple("_Frags", "acc_s acc_p acc_o m_prev m_cur rescale row_sum denom slope kv_mult q_scales q_mult")


@T.macro
def release(free, st, tx, cluster):
    # A reader is done with stage st: every thread arrives, or with a cluster one lane per warp on rank 0's
    # barrier (rank 0 refills the stage in every CTA of the cluster).
    if cluster == 1:
        T.barrier_arrive(free[st])
    elif tx % 32 == 0:
        T.mbarrier_arrive(free[st], 0)


def ring_stage(i, depth):
    """The buffer of a ring of `depth` buffers taking its i-th use (KV step, or work item for Q)."""
    return i % depth


def ring_phase(i, depth):
    """The mbarrier phase of that use of its buffer."""
    return (i // depth) % 2


class _ProducerPhases:
    """The producer warpgroup's macros: the K/V warp(s) filling the K and V rings (`kv_rings`), the Q warp
    loading each item's Q tile and scalars (`issue_q`), and the role split between them (`producer`)."""

    def __init__(self, plan: TilePlan, num_stages: int, q_stages: int, cluster: int, num_clusters: int,
                 head_groups: int, fp8_pv: bool):
        num_tiles = plan.dims[4]
        multicast = (1 << cluster) - 1 if cluster > 1 else None  # the CTAs a K/V copy lands in

        def work_tile(gm, rank, work):
            """plan.tile of work item `work`, part `rank`: items are (tile, head group) pairs, longest first;
            past the last one, an idle item."""
            tile = T.min(work // head_groups, num_tiles - 1)
            return plan.tile(gm.TileSeq, gm.TileQ0, gm.CumSeqLensQ, gm.SeqLens, tile, work % head_groups,
                             work < num_tiles * head_groups, rank, cluster)

        @T.macro
        def next_work(gm, cid, rank, tx, w, work: T.Ref, spin: T.Ref):
            # The cluster's w-th item: cid, then the next free one of the counter Sched[0], pulled when the
            # cluster gets to it (dynamic: a CTA that starts late, its SM held by another stream, takes fewer
            # items; an item's math does not depend on who runs it). Lane 0 of the Q warp pulls, the warp
            # gets it by shuffle. In a cluster, rank 0 pulls and posts it to the other rank in the one-slot
            # mailbox Sched[1 + cid] (0: empty, else item + 1); the pair is co-resident, so the spin-waits
            # cannot stall on a CTA that is not running.
            if w == 0:
                work = cid
            else:
                if tx == WS_Q_WARP * 32:
                    if cluster == 1:
                        work = T.atomic_add(gm.Sched[0], 1, return_prev=True) + num_clusters
                    elif rank == 0:
                        work = T.atomic_add(gm.Sched[0], 1, return_prev=True) + num_clusters
                        spin = 1
                        while spin != 0:
                            spin = T.atomic_load(gm.Sched[1 + cid], memory_order="acquire")
                        T.atomic_store(gm.Sched[1 + cid], work + 1, memory_order="release")
                    else:
                        spin = 0
                        while spin == 0:
                            spin = T.atomic_load(gm.Sched[1 + cid], memory_order="acquire")
                        T.atomic_store(gm.Sched[1 + cid], 0, memory_order="release")
                        work = spin - 1
                work = T.shfl_sync(work, 0)

        @T.macro
        def finish(gm, rank, tx, done: T.Ref):
            # After the Q warp's last item: the last cluster to finish zeroes the counter (and its own count,
            # Sched[-1]), so the buffer is ready for the next launch (no other pull can follow).
            if tx == WS_Q_WARP * 32 and rank == 0:
                # acq_rel: every other cluster's last pull is ordered before the reset
                done = T.atomic_add(gm.Sched[num_clusters + 1], 1, return_prev=True, memory_order="acq_rel")
                if done == num_clusters - 1:
                    T.atomic_store(gm.Sched[0], 0)
                    T.atomic_store(gm.Sched[num_clusters + 1], 0)

        @T.macro
        def claim(free, full, st, phase, rank):
            # The K/V warp may fill stage st (rank 0: released in every CTA) or, on the other ranks, expect
            # its next fill (its previous fill has landed, so this arrival counts toward the next phase).
            if cluster > 1 and rank != 0:
                T.barrier_wait(full[st], phase ^ 1)
            else:
                T.barrier_wait(free[st], phase ^ 1)

        @T.macro
        def kv_rings(streams, q_full, BlockTables, item_s, rank):
            # A producer warp's K and/or V streams (_KVStream): every KV step of every item, behind the item's
            # Q tile.
            step = T.alloc_var("int32", init=0)  # KV steps loaded: ring stage and phase
            w = T.alloc_var("int32", init=0)
            more = T.alloc_var("int32", init=1)
            while more > 0:
                qb = ring_stage(w, q_stages)
                T.barrier_wait(q_full[qb], ring_phase(w, q_stages))
                more = 1 - item_s[qb, _LAST]  # read now: the slot is refilled once the consumers are done
                kt0_p = item_s[qb, _KT0]
                lo_p = item_s[qb, _LO]
                steps_p = item_s[qb, _STEPS]
                kv_len_p = item_s[qb, _KV_LEN]
                kv_head = item_s[qb, _HEAD0] // plan.groups
                seq = item_s[qb, _SEQ]
                for kt in T.serial(kt0_p, steps_p):
                    st = ring_stage(step, num_stages)
                    phase = ring_phase(step, num_stages)
                    blocks = plan.page_ids(BlockTables, seq, kv_len_p, kt, lo_p)
                    for kv in streams:  # (not unpacked: a builder assignment would rename the buffers)
                        claim(kv.free, kv.full, st, phase, rank)
                        plan.load_pages(kv.cache, kv.ring, blocks, kv_head, kt, kv.full, st, multicast)
                        T.barrier_arrive(kv.full[st])
                    step = step + 1
                w = w + 1

        convert_v = plan.transpose_v if fp8_pv else plan.widen_v

        @T.macro
        def convert(src, dst, q_full, item_s, lane):
            # The two converter warps of an 8-bit cache (`lane` 0-63): every KV step's V stage (`src`,
            # _KVStream) widened (or for an FP8 P @ V transposed) into the next buffer of `dst` (_Ring) for the
            # consumers' P @ V, off their critical path; keys past the sequence end as 0 (they may hold NaN, and
            # 0 * NaN is not 0).
            step = T.alloc_var("int32", init=0)
            w = T.alloc_var("int32", init=0)
            more = T.alloc_var("int32", init=1)
            while more > 0:
                qb = ring_stage(w, q_stages)
                T.barrier_wait(q_full[qb], ring_phase(w, q_stages))
                more = 1 - item_s[qb, _LAST]  # the slot stays valid: the consumers wait for this warp's tiles
                kt0_p = item_s[qb, _KT0]
                steps_p = item_s[qb, _STEPS]
                kv_len_p = item_s[qb, _KV_LEN]
                for kt in T.serial(kt0_p, steps_p):
                    st = ring_stage(step, num_stages)
                    cs = ring_stage(step, dst.depth)
                    T.barrier_wait(src.full[st], ring_phase(step, num_stages))
                    T.barrier_wait(dst.free[cs], ring_phase(step, dst.depth) ^ 1)
                    convert_v(src.ring, st, dst.ring, cs, kt, kv_len_p, lane)
                    T.fence_proxy_async()  # the shared stores, before the products (async proxy) read them
                    if cluster > 1:
                        T.sync_warp()  # every lane's loads are done before its warp's one arrival
                    release(src.free, st, lane, cluster)
                    T.barrier_arrive(dst.full[cs])
                    step = step + 1
                w = w + 1

        @T.macro
        def issue_q(gm, sm, rank, tx, w, work):
            # Q tile and scalars of the cluster's w-th item (work item `work`), handed to the consumers and the
            # K/V warp through q_full (its arrival releases the scalars' shared stores).
            _, seq, _, head0, q_begin, q_len, q0, kv_len, pos0, rows, lo, kt0, steps = work_tile(gm, rank, work)
            last = T.if_then_else(work < num_tiles * head_groups, 0, 1)
            qb = ring_stage(w, q_stages)
            T.barrier_wait(sm.q_free[qb], ring_phase(w, q_stages) ^ 1)
            plan.load_q_tma(gm.Q, sm.q_ring, sm.q_full, qb, q_begin, q0, q_len, head0)
            if tx == WS_Q_WARP * 32:
                for slot, v in ((_STEPS, steps), (_KV_LEN, kv_len), (_POS0, pos0),
                                (_Q_BEGIN, q_begin), (_Q0, q0), (_HEAD0, head0), (_ROWS, rows), (_LO, lo), (_KT0, kt0),
                                (_LAST, last), (_SEQ, seq)):
                    sm.item_s[qb, slot] = v
            T.barrier_arrive(sm.q_full[qb])

        @T.macro
        def producer(gm, sm, cid, rank, tx):
            # The producer warpgroup: K/V warp(s), and a Q warp that also writes the item scalars.
            # at 24 the page-id math spills (128 B at 16-row pages); V's 8 x 8 byte transposes hold 32 more
            T.set_max_nreg(PRODUCER_REGS[fp8_pv], 0)
            k_stream = _KVStream(gm.KCache, sm.k_ring, sm.k_free, sm.k_full)
            v_stream = _KVStream(gm.VCache, sm.v_ring, sm.v_free, sm.v_full)
            if tx < WS_Q_WARP * 32:  # warp 8: K and V, or K alone when a cluster shares 16-bit ones
                # (a cluster's stage waits on every CTA's consumers: K's lookahead must not queue
                # behind V's slower free slot, 4.5% at 4x4k on an H200; an 8-bit V stage is freed by the
                # converter warps, ahead of the consumers)
                kv_rings([k_stream, v_stream] if cluster == 1 or plan.fp8 else [k_stream], sm.q_full,
                         gm.BlockTables, sm.item_s, rank)
            elif tx < WS_Q_WARP * 32 + 32:
                w = T.alloc_var("int32", init=0)
                work = T.alloc_var("int32", init=0)
                spin = T.alloc_var("int32", init=0)
                while work < num_tiles * head_groups:  # ends after handing over the idle item past the last
                    next_work(gm, cid, rank, tx, w, work, spin)
                    issue_q(gm, sm, rank, tx, w, work)
                    w = w + 1
                finish(gm, rank, tx, spin)
            elif plan.fp8:  # warps 10 and 11: V widened (transposed)
                convert(v_stream, sm.v_use, sm.q_full, sm.item_s, tx - WS_Q_WARP * 32 - 32)
            elif tx < WS_Q_WARP * 32 + 64:
                if cluster > 1:  # warp 10: V
                    kv_rings([v_stream], sm.q_full, gm.BlockTables, sm.item_s, rank)

        self.producer = producer


class _ConsumerPhases:
    """The consumer warpgroups' macros: a work item's start (`begin_item`), one KV step (`kv_step`), the
    last P @ V (`last_pv`), the output store (`store_item`), and the loop over the items (`consumer`)."""

    def __init__(self, plan: TilePlan, head_dim: int, dtype: str, use_alibi: bool, num_stages: int,
                 q_stages: int, cluster: int, tma_out: bool, fp8_pv: bool):
        block_M, block_N, accum = WS_BLOCK_M, plan.block_N, "float32"
        fp8 = plan.fp8  # scores on FP8 from K as stored (q split in e4m3 terms), V widened (or transposed)
        v_cluster = 1 if fp8 else cluster  # the V ring they read: the cluster's TMA ring, or their own converted one

        @T.macro
        def stage_p(rf, tx):
            # P for the next P @ V: kept in registers, or for an FP8 one rounded to e4m3 into each consumer
            # warpgroup's rows of a shared tile (FP8 products read A from shared memory K-major).
            T.copy(rf.acc_s, rf.acc_p)
            if fp8_pv:
                T.fence_proxy_async()  # the shared stores, before the products (async proxy) read them
                T.sync_threads(2 + tx // 128, 128)

        @T.macro
        def begin_item(gm, sm, rf, qb, w, last: T.Ref, kt0: T.Ref, steps: T.Ref, kv_len: T.Ref, pos0: T.Ref,
                       q_begin: T.Ref, q0: T.Ref, head0: T.Ref, rows: T.Ref, tx):
            # Fresh accumulators, then the item's Q tile and scalars from the Q warp.
            T.fill(rf.acc_o, 0)
            T.fill(rf.denom, 0)
            T.fill(rf.m_cur, -T.infinity(accum))
            T.barrier_wait(sm.q_full[qb], ring_phase(w, q_stages))
            last = sm.item_s[qb, _LAST]
            kt0 = sm.item_s[qb, _KT0]
            steps = sm.item_s[qb, _STEPS]
            kv_len = sm.item_s[qb, _KV_LEN]
            pos0 = sm.item_s[qb, _POS0]
            q_begin = sm.item_s[qb, _Q_BEGIN]
            q0 = sm.item_s[qb, _Q0]
            head0 = sm.item_s[qb, _HEAD0]
            rows = sm.item_s[qb, _ROWS]
            if fp8:
                plan.split_q(sm.q_ring, qb, sm.q_use, rf.q_scales, rf.q_mult, rf.kv_mult[0], tx)
                T.fence_proxy_async()  # the shared stores, before the products (async proxy) read them
                T.sync_threads(1, 256)
            if use_alibi:
                plan.load_slopes(gm.AlibiSlopes, rf.slope, head0)

        @T.macro
        def kv_step(gm, sm, rf, qb, i, kt0: T.Ref, step: T.Ref, pos0: T.Ref, kv_len: T.Ref, tx):
            # Scores of the item's i-th step (KV tile kt0 + i), then P @ V of step i-1 behind them: the
            # softmax below runs while the tensor cores finish that product. acc_p, which that product
            # reads, was written by step i-1 (step 0 issues no P @ V). K comes from its TMA ring (as stored, an
            # 8-bit cache's too), V from `sm.v_use`.
            v = sm.v_use
            kt = kt0 + i
            st = ring_stage(step + i, num_stages)
            prev = ring_stage(step + i - 1, v.depth)
            T.barrier_wait(sm.k_full[st], ring_phase(step + i, num_stages))
            for q, q_tile in enumerate(sm.q_use):  # bf16 / fp16 q, or its e4m3 terms
                T.wgmma_gemm(q_tile[qb, :, :], sm.k_ring[st, :, :], rf.acc_s, transpose_B=True,
                             clear_accum=q == 0, policy=T.GemmWarpPolicy.FullRow)
            if i > 0:
                T.barrier_wait(v.full[prev], ring_phase(step + i - 1, v.depth))
                T.wgmma_gemm(rf.acc_p, v.ring[prev, :, :], rf.acc_o, transpose_B=fp8_pv,
                             policy=T.GemmWarpPolicy.FullRow)
                T.wait_wgmma(1)
            else:
                T.wait_wgmma(0)
            release(sm.k_free, st, tx, cluster)
            plan.shape_scores(rf.acc_s, rf.slope, kt, pos0, (lambda i: rf.q_mult[i]) if fp8 else None)
            plan.softmax_step(rf.acc_s, rf.m_cur, rf.m_prev, rf.rescale, rf.row_sum, rf.denom)
            T.wait_wgmma(0)
            if i > 0:
                release(v.free, prev, tx, v_cluster)
            for i, d in T.Parallel(block_M, head_dim):
                rf.acc_o[i, d] *= rf.rescale[i]
            stage_p(rf, tx)

        @T.macro
        def last_pv(gm, sm, rf, step: T.Ref, kt0: T.Ref, steps: T.Ref, kv_len: T.Ref, tx):
            # P @ V of the last step (past the sequence end, the V rows are zeroed: here for a 16-bit cache, by
            # the converter warp for an 8-bit one).
            v = sm.v_use
            if steps > kt0:
                last = ring_stage(step + steps - kt0 - 1, v.depth)
                T.barrier_wait(v.full[last], ring_phase(step + steps - kt0 - 1, v.depth))
                if not fp8 and steps * block_N > kv_len:
                    plan.zero_v_tail(v.ring, steps - 1, kv_len, last)
                T.gemm(rf.acc_p, v.ring[last, :, :], rf.acc_o, transpose_B=fp8_pv, policy=T.GemmWarpPolicy.FullRow)
                release(v.free, last, tx, v_cluster)

        @T.macro
        def store_item(gm, sm, rf, qb, q_begin: T.Ref, q0: T.Ref, head0: T.Ref, rows: T.Ref, tx):
            # O of the item, then its Q buffer back to the Q warp.
            if tma_out and rows == plan.tokens:
                # The scores' products, the Q tile's only readers, are done: O goes through it.
                for i, d in T.Parallel(block_M, head_dim):
                    sm.q_ring[qb, i, d] = T.cast(plan.output(rf.acc_o, rf.denom, i, d, rf.kv_mult[1]), dtype)
                T.fence_proxy_async()  # the shared stores, before the TMA engine reads them
                T.sync_threads(1, 256)
                plan.store_out_tma(gm.Out, sm.q_ring, qb, q_begin, q0, head0, tx // 32, 8)
            else:
                plan.store_out(gm.Out, rf.acc_o, rf.denom, q_begin, q0, head0, rows, rf.kv_mult[1])
            plan.store_lse(gm.Lse, rf.m_cur, rf.denom, q_begin, q0, head0, rows)
            T.tma_store_wait(0)  # the O store's reads of the Q buffer, before handing it back
            T.barrier_arrive(sm.q_free[qb])

        @T.macro
        def consumer(gm, sm, rf, step: T.Ref, last: T.Ref, kt0: T.Ref, steps: T.Ref, kv_len: T.Ref, pos0: T.Ref,
                     q_begin: T.Ref, q0: T.Ref, head0: T.Ref, rows: T.Ref, tx):
            # The two consumer warpgroups: 64 query rows each.
            T.set_max_nreg(CONSUMER_REGS[fp8_pv], 1)
            if plan.fp8:
                for k in T.serial(2):
                    rf.kv_mult[k] = gm.KVScales[k]
            w = T.alloc_var("int32", init=0)
            last = 0
            while last == 0:
                qb = ring_stage(w, q_stages)
                begin_item(gm, sm, rf, qb, w, last, kt0, steps, kv_len, pos0, q_begin, q0, head0, rows, tx)
                for i in T.serial(steps - kt0):
                    kv_step(gm, sm, rf, qb, i, kt0, step, pos0, kv_len, tx)
                last_pv(gm, sm, rf, step, kt0, steps, kv_len, tx)
                store_item(gm, sm, rf, qb, q_begin, q0, head0, rows, tx)
                step = step + steps - kt0
                w = w + 1

        self.consumer = consumer


def paged_prefill_ws_kernel(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: str,
                            use_alibi: bool, kv_layout: str, scale: float, num_ctas: int, window_left: int = -1,
                            soft_cap: float = 0.0, kv_dtype: str | None = None, block_N: int = 128,
                            num_stages: int = 2, cluster: int = 1, v_widen: int = 1, fp8_compute: bool = False):
    """Warp-specialized causal paged attention (module docstring), fp16/bf16, pages of >= 16 rows.
    Persistent: `num_ctas` CTAs (one per SM) pull the (tile, head group) work items from the counter in
    `Sched` (zeros at launch; the kernel leaves it zeroed), so the producer loads the next item's first K/V
    tiles while the consumers finish the current one.

    With `cluster` > 1 a work item is `cluster` adjacent query tiles of one head group, one per CTA of a
    cluster, and all walk the same KV tiles (the last one's diagonal; the others mask the excess): rank 0
    loads each K / V tile once by TMA multicast into every CTA's ring, so the L2 serves a `cluster`-th of
    the K/V bytes. Rank 0 refills a stage once the consumers of all CTAs have released it (one arrival per
    consumer warp on rank 0's free barrier); the other ranks' producers only announce the bytes they
    expect, once the stage's previous fill has landed. K and V then have a producer warp each.

    An 8-bit cache (`kv_dtype`): the scores run on FP8 tensor cores from K's TMA ring as stored, with
    each Q tile split once per item into e4m3 terms (TilePlan.split_q; two for bf16 q, three for fp16); producer
    warps 10 and 11 widen each landed V stage to fp16 (one cvt per pair of elements) into a ring of `v_widen` tiles,
    off the consumers' critical path, for an fp16 P @ V. `fp8_compute` (an 8-bit cache): q rounded to one e4m3
    term, P to e4m3, V transposed by those warps, both products on FP8 tensor cores."""
    block_M = WS_BLOCK_M
    plan = TilePlan(num_heads, num_kv_heads, head_dim, page_size, dtype, use_alibi, kv_layout, scale,
                    block_M, block_N, window_left, soft_cap, kv_dtype)
    kv_dtype, kv_bits = plan.kv_dtype, BITS[plan.kv_dtype]
    total_q, num_seqs, num_blocks, max_blocks, num_tiles = plan.dims
    head_groups = num_heads // plan.pack
    accum = "float32"
    # The producer loads the next item's Q while the consumers work on this one, when two Q tiles fit.
    terms = q_terms(dtype, fp8_compute)
    fp8_pv = kv_bits == 8 and fp8_compute
    q_stages = 2 if ws_smem_fits(2, block_N, num_stages, head_dim, kv_bits, v_widen, dtype, fp8_pv) else 1
    # Full tiles stage O in their Q buffer and store it by TMA, split over the 8 consumer warps.
    tma_out = plan.tokens % 8 == 0
    # A persistent grid of clusters holds only those resident at once (one CTA per SM).
    num_clusters = num_ctas if cluster == 1 else min(num_ctas // cluster, max_active_clusters(
        cluster, WS_THREADS, ws_smem_bytes(q_stages, block_N, num_stages, head_dim, kv_bits, v_widen, dtype, fp8_pv)))
    producer = _ProducerPhases(plan, num_stages, q_stages, cluster, num_clusters, head_groups, fp8_pv).producer
    consumer = _ConsumerPhases(plan, head_dim, dtype, use_alibi, num_stages, q_stages, cluster, tma_out,
                               fp8_pv).consumer

    @T.prim_func
    def paged_prefill_ws(
        Q: T.StridedTensor(plan.q_shape, plan.q_strides, dtype),
        KCache: T.Tensor(plan.kv_shape, kv_dtype),
        VCache: T.Tensor(plan.kv_shape, kv_dtype),
        BlockTables: T.Tensor((num_seqs, max_blocks), "int32"),
        SeqLens: T.Tensor((num_seqs,), "int32"),
        CumSeqLensQ: T.Tensor((num_seqs + 1,), "int32"),
        AlibiSlopes: T.Tensor((num_heads,), "float32"),
        KVScales: T.Tensor((2,), "float32"),
        TileSeq: T.Tensor((num_tiles,), "int32"),
        TileQ0: T.Tensor((num_tiles,), "int32"),
        Out: T.StridedTensor(plan.q_shape, plan.out_strides, dtype),
        Lse: T.Tensor(plan.q_shape[:2], accum),
        # item counter, cluster mailboxes, finished clusters (at [num_clusters + 1]): zeros, any longer length
        Sched: T.Tensor((T.dynamic("sched_len"),), "int32"),
    ):
        with T.Kernel(cluster, num_clusters, threads=WS_THREADS,
                      cluster_dims=(cluster, 1, 1) if cluster > 1 else None) as (rank, cid):
            q_ring = T.alloc_shared((q_stages, block_M, head_dim), dtype)
            k_ring = T.alloc_shared((num_stages, block_N, head_dim), kv_dtype)
            v_ring = T.alloc_shared((num_stages, block_N, head_dim), kv_dtype)
            # An 8-bit cache's P @ V runs on fp16 whatever q's dtype (e4m3 -> fp16 is one cvt per pair of
            # elements; P in [0, 1] keeps more bits), or on e4m3 with fp8_compute.
            pv_dtype = kv_dtype if fp8_pv else "float16" if kv_bits == 8 else dtype
            q_use = [q_ring]
            q_scales = q_mult = None
            if kv_bits == 8:
                q_use = [T.alloc_shared((q_stages, block_M, head_dim), kv_dtype) for _ in range(terms)]
                q_scales = T.alloc_shared((block_M,), accum)
                q_mult = T.alloc_fragment((block_M,), accum)
                # No product reads q_ring then: give it the swizzled layout the scores' operand would (its TMA
                # copies need one).
                T.annotate_layout({q_ring: make_swizzled_layout(q_ring)})
            k_full = T.alloc_barrier([32] * num_stages)  # the K/V warp arrives, TMA bytes complete it
            v_full = T.alloc_barrier([32] * num_stages)
            if kv_bits == 8 and cluster == 1:  # V: the two converter warps' threads arrive when done reading
                k_free = T.alloc_barrier([256] * num_stages)
                v_free = T.alloc_barrier([64] * num_stages)
            elif kv_bits == 8:  # at rank 0's: the consumer warps (K), the converter warps (V) of every CTA
                k_free = T.alloc_cluster_barrier([8 * cluster] * num_stages)
                v_free = T.alloc_cluster_barrier([2 * cluster] * num_stages)
            elif cluster == 1:  # consumer threads arrive when done reading
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
            last = T.alloc_var("int32")
            kt0 = T.alloc_var("int32")
            steps = T.alloc_var("int32")
            kv_len = T.alloc_var("int32")
            pos0 = T.alloc_var("int32")
            q_begin = T.alloc_var("int32")
            q0 = T.alloc_var("int32")
            head0 = T.alloc_var("int32")
            rows = T.alloc_var("int32")
            acc_s = T.alloc_fragment((block_M, block_N), accum)
            # P, the A operand of P @ V: registers, or shared for an FP8 product
            acc_p = (T.alloc_shared if fp8_pv else T.alloc_fragment)((block_M, block_N), pv_dtype)
            acc_o = T.alloc_fragment((block_M, head_dim), accum)
            m_prev = T.alloc_fragment((block_M,), accum)
            m_cur = T.alloc_fragment((block_M,), accum)
            rescale = T.alloc_fragment((block_M,), accum)
            row_sum = T.alloc_fragment((block_M,), accum)
            denom = T.alloc_fragment((block_M,), accum)
            slope = T.alloc_fragment((block_M,), accum)
            kv_mult = T.alloc_local((2,), accum)
            step = T.alloc_var("int32", init=0)  # KV steps done by this CTA: ring stage and phase
            tx = T.get_thread_binding()
            if cluster > 1:
                # TileLang launches clusters with programmatic stream serialization allowed, so this grid
                # may start before the stream's previous kernel (the schedule, or the caller's writes of
                # Q / K / V) has finished; only this wait makes their results visible.
                T.pdl_sync()

            gm = _Global(Q, KCache, VCache, BlockTables, SeqLens, CumSeqLensQ, AlibiSlopes, KVScales, TileSeq,
                         TileQ0, Out, Lse, Sched)
            v_use = _Ring(v_ring, v_full, v_free, num_stages)
            if kv_bits == 8:  # V's widened (transposed) ring: the converter warps arrive when written, the consumers
                # when read
                v_tile = (head_dim, block_N) if fp8_pv else (block_N, head_dim)
                v_use = _Ring(T.alloc_shared((v_widen, *v_tile), pv_dtype),
                              T.alloc_barrier([64] * v_widen), T.alloc_barrier([256] * v_widen), v_widen)
            sm = _Shared(q_ring, k_ring, v_ring, k_full, v_full, k_free, v_free, q_full, q_free, item_s, v_use, q_use)
            rf = _Frags(acc_s, acc_p, acc_o, m_prev, m_cur, rescale, row_sum, denom, slope, kv_mult, q_scales, q_mult)
            if tx >= 256:  # producer warpgroup
                producer(gm, sm, cid, rank, tx)
            else:  # consumer warpgroups
                consumer(gm, sm, rf, step, last, kt0, steps, kv_len, pos0, q_begin, q0, head0, rows, tx)
            if cluster > 1:  # no CTA leaves while the other may still multicast into it or arrive on it
                T.cluster_sync()

    return paged_prefill_ws
