"""The split-KV paged decode kernel whose four warps split the keys of each KV tile (query tiles of one 16-row mma
tile, head_dim 64 / 128; 16-bit and FP8 caches), every fragment placed by hand: K and V are read from shared memory
16 bytes a load, straight into the mma.sync B fragments (FP8 widened to fp16 there by `cvt`, nothing 16-bit written
back), q and P never leave registers.

One CTA per (split, head group, sequence), as ``split_kv``: the ``pack`` query heads times the nq tokens are the 16
rows of one m16n8k16 tile (rows <= 16). Warp w takes keys w KW .. w KW + KW - 1 of each tile (``block_N`` = 4 x KW)
and keeps its own online softmax and output over the split; the four are merged once at the end, in warp order
(deterministic). So the scores' accumulators are already the P operand of P @ V (no exchange of P through shared
memory, no block-wide reduction per tile), and q sits in registers as the scores' A fragments for the whole split.
The dot products are free in the order of head_dim, and the output in the order of its columns, so the fragments
are assigned to make each lane's elements contiguous:
  - scores, k-step kb: lane (g, t)'s k-positions 2t, 2t + 1, 2t + 8, 2t + 9 are dims t TD + 4 kb + 0..3 (TD =
    head_dim / 4), of q (A) and of K row 8 j + g (B): a lane reads TD contiguous elements of each K row it needs;
  - P @ V, n-tile nb: B's column g is dim g NB + nb (NB = head_dim / 8), so a lane reads NB contiguous elements of
    each of its four V rows (keys 2t, 2t + 1, 2t + 8, 2t + 9 of the k-step) and pairs the rows in registers; the
    accumulators' columns 2t + e are dims (2t + e) NB + nb.
Tiles arrive in a ring of ``num_stages`` with one block barrier per tile, in shared rows XOR-swizzled in 16-byte
units per 128-byte line (fragment loads free of bank conflicts at head_dim 128, FP8 and 16-bit by TMA: `k_dim` and
`v_dim` rotate the order of a lane's 16-byte runs), either
  - by TMA (tiles of at most ``TMA_PAGES_PER_TILE`` pages): warp 0 copies each page (or block_N slice) and 128-byte
    column band of K and V, completing on the stage's mbarrier; table entries past the sequence end are never read
    (the last page is read again), and V rows past the end, which may hold NaN where P is 0, are zeroed in
    registers; or
  - by cp.async (smaller pages, where one thread would issue many small boxes behind as many table reads): 16 bytes
    a copy, each row gathered through the block table, positions past the end clamped to its last key (finite,
    masked)."""

import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from ...common.hw import LOG2E
from ...common.tl.mma import mma
from ..schedule import THREADS, head_pack, loads_by_tma
from .common import kv_tile_range, split_count, split_steps

WARPS = THREADS // 32


def swizzled(row, col, head_dim: int, unit: int):
    """Offset in a K / V tile of (row, column), ``unit`` elements a 16-byte unit: the unit XOR the 128-byte line's
    index (mod 8), the pattern of TMA's 128-byte swizzle."""
    lin = row * head_dim + col
    line = lin // (8 * unit)
    return line * 8 * unit + T.bitwise_xor(lin % (8 * unit) // unit, line % 8) * unit + lin % unit


def k_dim(t, k, head_dim: int, unit: int):
    """The dim of the k-th of the head_dim / 4 K (and q) elements of quad lane t. Its 16-byte units are taken in a
    rotated order where a lane holds four (16-bit, head_dim 128): lanes t and t + 2 would otherwise read the same
    bank group of the tile's two 128-byte column bands."""
    td = head_dim // 4
    return t * td + ((k + unit * (t // 2 * 2)) % td if td // unit == 4 else k)


def v_dim(n, x, head_dim: int, unit: int):
    """The dim of B's column n (the lane group g of a V load, or an output column) at its x-th of head_dim / 8
    elements. Units in a rotated order where a column holds two (16-bit, head_dim 128): lane groups g and g + 1 would
    otherwise read the same bank group."""
    nb = head_dim // 8
    return n * nb + (x + unit * (n % max(1, nb // unit))) % nb


def paged_decode_warps_kernel(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: str,
                              kv_dtype: str, use_alibi: bool, window_left: int, logits_soft_cap: float, scale: float,
                              kv_layout: str, num_q_tokens: int, block_N: int = 64, num_stages: int = 2,
                              min_blocks: int = 3, **split_rule):
    """Arguments, launch and results as ``paged_decode_split_kernel`` (the module's docstring says how the work is
    split). ``block_N``: keys per tile (64 or 128: 16 or 32 per warp); ``num_stages``: tiles in the ring;
    ``min_blocks``: CTAs per SM the registers are capped for. ``split_rule``: the plan's keys, unused here."""
    G = num_heads // num_kv_heads
    nq = num_q_tokens
    pack = head_pack(num_heads, num_kv_heads, nq)
    rows = pack * nq
    D, S = head_dim, num_stages
    fp8 = kv_dtype != dtype
    md = "float16" if fp8 else dtype  # the products' operand type (FP8 widened to fp16: one cvt a pair)
    unit = 16 if fp8 else 8  # elements a 16-byte unit
    KW = block_N // WARPS  # keys per warp per tile
    JN, PK = KW // 8, KW // 16  # n-tiles of the scores, k-steps of P @ V
    KB, TD, NB = D // 16, D // 4, D // 8  # k-steps of the scores; a lane's K elements a row; n-tiles of P @ V
    CH = D // unit  # 16-byte units of a row
    RPI = THREADS // CH  # rows one cp.async round covers
    OS = 4 * NB + 4  # a lane's accumulators in the merge, padded (the lanes' float4 stores spread over the banks)
    band = min(D, 8 * unit)  # 128-byte column bands: TMA's widest swizzled box
    tma = loads_by_tma(page_size, block_N)
    rows_per_copy = min(page_size, block_N)
    page_copies = list(range(block_N // rows_per_copy))  # Python lists: unrolled at trace time
    cap = logits_soft_cap
    f32 = "float32"
    total_q, batch, num_pages, max_pages, ws_rows, num_splits = T.dynamic(
        "total_q, batch, num_pages, max_pages, ws_rows, num_splits")
    kv_shape = ((num_pages, num_kv_heads, page_size, head_dim) if kv_layout == "HND" else
                (num_pages, page_size, num_kv_heads, head_dim))

    def cache_at(cache, pid, kvh, pos, cols):
        return cache[pid, kvh, pos, cols] if kv_layout == "HND" else cache[pid, pos, kvh, cols]

    @T.macro
    def issue_tma(KCache, VCache, BlockTables, rings, full, pids, b, kvh, L, kt, st):
        """Warp 0: tile kt's K and V pages into stage st, completing on full[st]. The page ids are read into
        registers first: read at each copy, every read would wait behind the copy before it (an asm barrier)."""
        for p in page_copies:
            pids[p] = BlockTables[b, T.min(kt * block_N + p * rows_per_copy, L - 1) // page_size]
        for p in page_copies:
            off = (kt * block_N + p * rows_per_copy) % page_size
            for ring, cache in zip(rings, (KCache, VCache)):
                for c in range(0, D, band):
                    T.tma_copy(cache_at(cache, pids[p], kvh, slice(off, off + rows_per_copy), slice(c, c + band)),
                               ring[st, p * rows_per_copy:(p + 1) * rows_per_copy, c:c + band],
                               barrier=full[st], leader_scope_threads=32)
        T.barrier_arrive(full[st])

    @T.macro
    def issue_rows(KCache, VCache, BlockTables, rings, b, kvh, L, kt, st, tx):
        """Every thread: tile kt's K and V rows into stage st, 16 bytes a copy (rows tx / CH + RPI i)."""
        for i in T.unroll(block_N // RPI):
            row = tx // CH + RPI * i
            col = tx % CH * unit
            pos = T.min(kt * block_N + row, L - 1)
            pid = BlockTables[b, pos // page_size]
            for ring, cache in zip(rings, (KCache, VCache)):
                T.ptx_cp_async(T.access_ptr(ring[st, swizzled(row, col, D, unit)], "w", unit),
                               T.access_ptr(cache_at(cache, pid, kvh, pos % page_size, col), "r", unit), unit)

    def at(ring, st, row, col, e):
        """Element e (< unit) past column col (a multiple of the unit) of a row of stage st."""
        return ring[st, row, col + e] if tma else ring[st, swizzled(row, col, D, unit) + e]

    @T.macro
    def issue(KCache, VCache, BlockTables, rings, full, pids, b, kvh, L, kt, st, tx):
        if tma:
            if tx < 32:
                issue_tma(KCache, VCache, BlockTables, rings, full, pids, b, kvh, L, kt, st)
        else:
            issue_rows(KCache, VCache, BlockTables, rings, b, kvh, L, kt, st, tx)

    @T.prim_func
    def paged_decode_warps(
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
            if tma:  # [stage, row, column] in TMA's 128-byte swizzle
                rings = (T.alloc_shared((S, block_N, D), kv_dtype), T.alloc_shared((S, block_N, D), kv_dtype))
                T.annotate_layout({r: make_swizzled_layout(r) for r in rings})
                full = T.alloc_barrier([32] * S)  # warp 0 arrives, the TMA bytes complete it
                pids = T.alloc_local((len(page_copies),), "int32")
            else:  # [stage, offset] swizzled by hand (`swizzled`)
                rings = (T.alloc_shared((S, block_N * D), kv_dtype), T.alloc_shared((S, block_N * D), kv_dtype))
                full = pids = None

            o_s = T.alloc_shared((WARPS, 32, OS), f32)  # the warps' outputs for the merge
            ml_s = T.alloc_shared((WARPS, 16, 2), f32)  # and their rows' (max, sum)
            qa = T.alloc_local((KB * 8,), md)  # q as the scores' A fragments
            q_in = T.alloc_local((TD,), dtype)
            k_in = T.alloc_local((TD,), kv_dtype)
            kf = T.alloc_local((TD,), md)
            v_in = T.alloc_local((4 * NB,), kv_dtype)
            vp = T.alloc_local((4 * NB,), kv_dtype)
            vf = T.alloc_local((4 * NB,), md)
            sc = T.alloc_local((4 * JN,), f32)
            pa = T.alloc_local((8 * PK,), md)
            o = T.alloc_local((4 * NB,), f32)
            m_run = T.alloc_local((2,), f32)
            l_run = T.alloc_local((2,), f32)
            m_use = T.alloc_local((2,), f32)
            alpha = T.alloc_local((2,), f32)
            slope = T.alloc_local((2,), f32)
            qpos = T.alloc_local((2,), "int32")
            res = T.alloc_local((NB,), f32)

            tx = T.get_thread_binding()
            w, lane = tx // 32, tx % 32
            g, t = lane // 4, lane % 4
            L = T.alloc_var("int32", init=SeqLens[b])
            kvh = hg // (G // pack)
            head0 = hg * pack
            first, n_tiles = kv_tile_range(L, nq, block_N, window_left)
            tiles_per_split = T.alloc_var("int32", init=Sched[0])
            n_split = T.alloc_var("int32", init=split_count(n_tiles, tiles_per_split, num_splits))
            k_first = T.alloc_var("int32", init=first + sp * tiles_per_split)
            steps = T.alloc_var("int32", init=split_steps(sp, n_split, n_tiles, tiles_per_split))
            qk_scale = T.alloc_var(f32, init=scale * KScale[0])

            for st in T.unroll(S - 1):  # the ring's first tiles in flight before q is read
                if st < steps:
                    issue(KCache, VCache, BlockTables, rings, full, pids, b, kvh, L, k_first + st, st, tx)
                if not tma:
                    T.ptx_commit_group()

            # q's rows g and g + 8 (row r: token r // pack, head r % pack; rows >= rows are zero)
            for rr in T.unroll(2):
                r = g + 8 * rr
                token = b * nq + T.min(r // pack, nq - 1)
                for c in T.unroll(TD // 8):
                    for e in T.vectorized(8):
                        q_in[8 * c + e] = Q[token, head0 + r % pack, k_dim(t, 8 * c, D, unit) + e]
                for kb in T.unroll(KB):
                    for h in T.unroll(2):
                        for e in T.unroll(2):
                            qa[8 * kb + 4 * h + 2 * rr + e] = T.if_then_else(
                                r < rows, T.cast(q_in[4 * kb + 2 * h + e], md), T.cast(0, md))
                qpos[rr] = L - nq + T.min(r // pack, nq - 1)
                if use_alibi:
                    slope[rr] = AlibiSlopes[head0 + r % pack]
                m_run[rr] = -T.infinity(f32)
                l_run[rr] = 0
            for i in T.unroll(4 * NB):
                o[i] = 0

            for it in T.serial(steps):
                if not tma:
                    T.ptx_wait_group(S - 2)
                T.sync_threads()  # (cp.async: tile it landed for every thread;) every warp is done with tile it - 1
                if it + S - 1 < steps:
                    nxt = it + S - 1
                    issue(KCache, VCache, BlockTables, rings, full, pids, b, kvh, L, k_first + nxt, nxt % S, tx)
                if not tma:
                    T.ptx_commit_group()
                st = it % S
                kt = k_first + it
                if tma:
                    T.mbarrier_wait_parity(full[st], (it // S) % 2)
                # scores of the warp's keys: [4 j + e] is row g + 8 (e // 2), key w KW + 8 j + 2 t + e % 2
                for j in T.unroll(JN):
                    row = w * KW + 8 * j + g
                    for c in T.unroll(TD // unit):
                        for e in T.vectorized(unit):
                            k_in[unit * c + e] = at(rings[0], st, row, k_dim(t, unit * c, D, unit), e)
                    for x in T.unroll(TD // 2):
                        for e in T.vectorized(2):
                            kf[2 * x + e] = T.cast(k_in[2 * x + e], md)
                    for e in T.unroll(4):
                        sc[4 * j + e] = 0
                    for kb in T.unroll(KB):
                        mma(qa, 8 * kb, kf, 4 * kb, sc, 4 * j, md)
                for j in T.unroll(JN):
                    for e in T.unroll(4):
                        rr = e // 2
                        key = kt * block_N + w * KW + 8 * j + 2 * t + e % 2
                        x = sc[4 * j + e] * qk_scale
                        if cap > 0:
                            x = cap * T.tanh(x / cap)
                        if use_alibi:
                            x = x + slope[rr] * T.cast(key - qpos[rr], f32)
                        visible = T.And(key <= qpos[rr], g + 8 * rr < rows)
                        if window_left >= 0:
                            visible = T.And(visible, key >= qpos[rr] - window_left)
                        sc[4 * j + e] = T.if_then_else(visible, x * LOG2E, -T.infinity(f32))
                # the warp's online softmax per row (the quad's four lanes hold a row's KW keys)
                for rr in T.unroll(2):
                    mt = T.alloc_var(f32, init=-T.infinity(f32))
                    for j in T.unroll(JN):
                        for e in T.unroll(2):
                            mt = T.max(mt, sc[4 * j + 2 * rr + e])
                    mt = T.max(mt, T.shfl_xor(mt, 1))
                    mt = T.max(mt, T.shfl_xor(mt, 2))
                    # a row that saw no key yet keeps a -inf max and takes exp2 from 0 (P = 0, no NaN)
                    mt = T.max(m_run[rr], mt)
                    m_use[rr] = T.if_then_else(mt > -T.infinity(f32), mt, 0)
                    alpha[rr] = T.exp2(m_run[rr] - m_use[rr])
                    m_run[rr] = mt
                    l_run[rr] *= alpha[rr]
                for j in T.unroll(JN):
                    for e in T.unroll(4):
                        sc[4 * j + e] = T.exp2(sc[4 * j + e] - m_use[e // 2])
                        l_run[e // 2] += sc[4 * j + e]
                for i in T.unroll(4 * NB):
                    o[i] *= alpha[i % 4 // 2]
                for i in T.unroll(8 * PK):
                    pa[i] = T.cast(sc[i], md)
                # O += P V: per k-step, the lane's V rows 2t, 2t + 1, 2t + 8, 2t + 9 (dims g NB ..), paired in
                # registers ([4 nb + 2 h + e]: key 8 h + 2 t + e, dim g NB + nb)
                for pk in T.unroll(PK):
                    for h in T.unroll(2):
                        for e in T.unroll(2):
                            row = w * KW + 16 * pk + 8 * h + 2 * t + e
                            for c in T.unroll(max(1, NB // unit)):
                                col = v_dim(g, unit * c, D, unit)
                                for x in T.vectorized(min(NB, unit)):
                                    v_in[(2 * h + e) * NB + unit * c + x] = at(rings[1], st, row, col, x)
                            if tma:  # slots past the sequence end may hold NaN, where P is 0 (0 * NaN is not)
                                if kt * block_N + row >= L:
                                    for x in T.unroll(NB):
                                        v_in[(2 * h + e) * NB + x] = T.cast(0, kv_dtype)
                    for nb in T.unroll(NB):
                        for h in T.unroll(2):
                            for e in T.unroll(2):
                                vp[4 * nb + 2 * h + e] = v_in[(2 * h + e) * NB + nb]
                    for x in T.unroll(2 * NB):
                        for e in T.vectorized(2):
                            vf[2 * x + e] = T.cast(vp[2 * x + e], md)
                    for nb in T.unroll(NB):
                        mma(pa, 8 * pk, vf, 4 * nb, o, 4 * nb, md)

            # merge the warps in warp order: rows g, g + 8 of every warp's (max, sum, output)
            for rr in T.unroll(2):
                l_run[rr] += T.shfl_xor(l_run[rr], 1)
                l_run[rr] += T.shfl_xor(l_run[rr], 2)
            T.sync_threads()
            for i in T.unroll(NB):
                for e in T.vectorized(4):
                    o_s[w, lane, 4 * i + e] = o[4 * i + e]
            if t == 0:
                for rr in T.unroll(2):
                    ml_s[w, g + 8 * rr, 0] = m_run[rr]
                    ml_s[w, g + 8 * rr, 1] = l_run[rr]
            T.sync_threads()
            v_mult = T.alloc_var(f32, init=VScale[0])
            # warp w finishes n-tiles w NB / 4 .. of every lane's rows: [i] is n-tile w NB / 4 + i // 4, row
            # g + 8 (i % 4 // 2), dim (2 t + i % 2) NB + that n-tile
            NW = NB // WARPS
            for rr in T.unroll(2):
                r = g + 8 * rr
                mx = T.alloc_var(f32, init=-T.infinity(f32))
                for u in T.unroll(WARPS):
                    mx = T.max(mx, ml_s[u, r, 0])
                mx = T.if_then_else(mx > -T.infinity(f32), mx, 0)
                total = T.alloc_var(f32, init=0)
                for u in T.unroll(WARPS):
                    total += ml_s[u, r, 1] * T.exp2(ml_s[u, r, 0] - mx)
                for i in T.unroll(NW):
                    for e in T.unroll(2):
                        acc = T.alloc_var(f32, init=0)
                        for u in T.unroll(WARPS):
                            acc += o_s[u, lane, 4 * (w * NW + i) + 2 * rr + e] * T.exp2(ml_s[u, r, 0] - mx)
                        res[e * NW + i] = T.if_then_else(total > 0, acc * v_mult / total, 0)
                lse = T.if_then_else(total > 0, (mx + T.log2(total)) / LOG2E, -T.infinity(f32))
                if r < rows:
                    qrow = b * nq + r // pack
                    head = head0 + r % pack
                    # the split / direct choice per thread, outside any parallel loop
                    if n_split == 1:
                        if sp == 0:
                            for e in T.unroll(2):
                                col = v_dim(2 * t + e, w * NW, D, unit)
                                for i in T.vectorized(NW):
                                    Out[qrow, head, col + i] = T.cast(res[e * NW + i], dtype)
                            if w == 0 and t == 0:
                                Lse[qrow, head] = lse
                    elif sp < n_split:
                        for e in T.unroll(2):
                            col = v_dim(2 * t + e, w * NW, D, unit)
                            for i in T.vectorized(NW):
                                OPart[b, sp, r // pack, head, col + i] = res[e * NW + i]
                        if w == 0 and t == 0:
                            LsePart[b, sp, r // pack, head] = lse

    return paged_decode_warps
