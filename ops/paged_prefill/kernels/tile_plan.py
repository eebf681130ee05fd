"""What both paged prefill kernels share: the shapes of a specialization, the query tile of a CTA, page
copies, the causal / window / ALiBi mask and the soft-cap, the online-softmax step and the output (and
log-sum-exp) stores, as TileLang macros."""

import tilelang.language as T

from ...common.hw import LOG2E
from ...common.tl.softmax import NEG, online_softmax_step
from ..tiling import BITS, head_pack, tile_tokens


# A 4 x 4 byte transpose of four 32-bit words a, b, c, d (rows): PAIR_BYTES[k] = __byte_perm selectors of
# (a, b) and (c, d) interleaving their bytes 2k, 2k + 1; ROW_BYTES[i] of the two results, output row 2k + i.
PAIR_BYTES = (0x5140, 0x7362)
ROW_BYTES = (0x5410, 0x7632)


def transpose_block(lane, b, block_N, head_dim):
    """(first key, first dim) of the 8 x 8 byte block of V that converter lane `lane` (0-63) transposes in round
    `b` of `TilePlan.transpose_v` (Python ints or TileLang expressions)."""
    key_blocks, dim_blocks = block_N // 8, head_dim // 8
    jb = lane % key_blocks
    return jb * 8, (jb + b * (64 // key_blocks) + lane // key_blocks) % dim_blocks * 8


class TilePlan:
    """What both kernels share: shapes, the query tile of a CTA, page copies, mask, softmax and the
    output store. M-row r of a tile is token r // pack, head r % pack."""

    def __init__(self, num_heads, num_kv_heads, head_dim, page_size, dtype, use_alibi, kv_layout, scale,
                 block_M, block_N, window_left=-1, soft_cap=0.0, kv_dtype=None):
        self.groups = num_heads // num_kv_heads
        self.pack = pack = head_pack(num_heads, num_kv_heads, block_M)
        self.tokens = tile_tokens(num_heads, num_kv_heads, block_M)  # rows past tokens * pack are padding
        self.block_N = block_N
        self.kv_dtype = kv_dtype = dtype if kv_dtype is None else kv_dtype
        # An 8-bit cache is converted exactly to q's dtype; its scales multiply the scores (k_scale, before
        # the cap and ALiBi) and the output (v_scale), as FA3's descale factors.
        self.fp8 = BITS[kv_dtype] == 8
        self.window_left, self.capped = window_left, soft_cap > 0
        self.dims = T.dynamic("total_q, num_seqs, num_blocks, max_blocks, num_tiles")
        total_q, _, num_blocks, _, _ = self.dims
        self.kv_shape = ((num_blocks, num_kv_heads, page_size, head_dim) if kv_layout == "HND" else
                         (num_blocks, page_size, num_kv_heads, head_dim))
        self.q_shape = (total_q, num_heads, head_dim)
        # q and out may be views (a slice of a fused QKV projection): any token and head strides.
        self.q_strides = (*T.dynamic("q_stride_t, q_stride_h"), 1)
        self.out_strides = (*T.dynamic("out_stride_t, out_stride_h"), 1)
        self.pages = list(range(max(1, block_N // page_size)))  # page copies per KV tile (Python-unrolled)
        rows_per_copy = min(page_size, block_N)
        band = min(head_dim, 1024 // BITS[dtype])  # 128 bytes: the widest TMA box of a swizzled tile
        # An 8-bit ring is only converted, never read by wgmma: TileLang keeps it unswizzled, where a TMA box
        # must be a contiguous run, i.e. whole rows (head_dim <= 256 bytes, within the box limit).
        kv_band = head_dim if BITS[kv_dtype] == 8 else band
        accum = "float32"
        # The softmax runs in the log2 domain (exp2 is one instruction) on raw scores times `unit_log2`:
        # unscaled q . k (its max taken before the scale, one FFMA + EX2 per score), or, with a soft cap,
        # the capped scaled score (tanh needs the scale first).
        unit_log2 = LOG2E if self.capped else scale * LOG2E
        unit = 1.0 if self.capped else scale  # a score unit, in natural-log units

        def page_rows(kt, p):
            off = (kt * block_N + p * rows_per_copy) % page_size
            return slice(off, off + rows_per_copy)

        def page_ids(BlockTables, seq, kv_len, kt, lo):
            # Pages past the sequence's last one repeat it, and with a window, pages before the first one
            # any query row sees (position `lo`) repeat that one: table entries there may be invalid (freed).
            return [BlockTables[seq, T.min(self.clamp_lo(kt * block_N + p * rows_per_copy, lo), kv_len - 1)
                                // page_size] for p in self.pages]
        self.page_ids = page_ids
        self.clamp_lo = lambda pos, lo: T.max(pos, lo) if window_left >= 0 else pos

        @T.macro
        def load_pages(cache, dst, blocks, kv_head, kt, bars=None, st=None, multicast=None):
            # One bulk copy per (page or block_N slice of a page, 128-byte column band): a band is one
            # contiguous run of the swizzled shared tile, as the TMA lowering requires. `dst` is a
            # [block_N, head_dim] tile (T.copy: TileLang adds the mbarriers) or, with `bars`, stage
            # `st` of a ring whose copies all complete on bars[st] (T.tma_copy), multicast to the cluster
            # CTAs of the `multicast` mask when given.
            for p in self.pages:
                for c in range(0, head_dim, kv_band):
                    rows = slice(p * rows_per_copy, (p + 1) * rows_per_copy)
                    if kv_layout == "HND":
                        src = cache[blocks[p], kv_head, page_rows(kt, p), c:c + kv_band]
                    else:
                        src = cache[blocks[p], page_rows(kt, p), kv_head, c:c + kv_band]
                    if bars is None:
                        T.copy(src, dst[rows, c:c + kv_band])
                    else:
                        T.tma_copy(src, dst[st, rows, c:c + kv_band], barrier=bars[st], cluster_mask=multicast,
                                   leader_scope_threads=32)
        self.load_pages = load_pages

        @T.macro
        def load_q(Q, q_s, q_begin, q0, q_len, head0):
            for i, d in T.Parallel(block_M, head_dim):  # tokens past q_len repeat its last one
                q_s[i, d] = Q[q_begin + T.max(T.min(q0 + i // pack, q_len - 1), 0), head0 + i % pack, d]
        self.load_q = load_q

        @T.macro
        def load_q_tma(Q, q_ring, bars, qb, q_begin, q0, q_len, head0):
            # Stage qb of a Q ring, completing on bars[qb]: tile rows (token, head) are token-major, so
            # one copy per token of its `pack` heads (a [tokens, pack] box is 3D, which TileLang's TMA
            # lowering does not take), or one copy of all tokens when pack == 1. Rows past q_len
            # are padding (never stored): with pack == 1 they read the next tokens or TMA's zeros.
            for c in range(0, head_dim, band):
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
            # In score units (the softmax scales them): alibi slope / unit.
            for i in T.Parallel(block_M):
                slope[i] = AlibiSlopes[head0 + i % pack] / unit
        self.load_slopes = load_slopes

        def score(x, k_mult, i):
            # A raw score of the tile: q . k of the stored (8-bit: times k_scale, or row i's `k_mult(i)`) K,
            # soft-capped.
            if self.fp8:
                x = x * (k_mult(i) if callable(k_mult) else k_mult)
            return soft_cap * T.tanh(x * (scale / soft_cap)) if self.capped else x

        @T.macro
        def map_scores(acc_s, k_mult):
            # k_scale and the soft cap alone, on a tile that needs no mask.
            for i, j in T.Parallel(block_M, block_N):
                acc_s[i, j] = score(acc_s[i, j], k_mult, i)

        @T.macro
        def mask_scores(acc_s, slope, kt, pos0, k_mult=None):
            # Soft cap, ALiBi (slope in score units), the causal mask (-inf) and the window's left edge:
            # a finite NEG there, because a row may see none of a window's first tile (its running max
            # then stays finite and the next tile's rescale, exp2(NEG - m) = 0, clears what it summed).
            for i, j in T.Parallel(block_M, block_N):
                rel = kt * block_N + j - (pos0 + i // pack)  # t - p: visible if -window_left <= rel <= 0
                x = score(acc_s[i, j], k_mult, i)
                if use_alibi:
                    x = x + slope[i] * rel
                if window_left >= 0:
                    x = T.if_then_else(rel < -window_left, T.cast(NEG, accum), x)
                acc_s[i, j] = T.if_then_else(rel <= 0, x, -T.infinity(accum))
        self.mask_scores = mask_scores

        def needs_mask(kt, pos0):
            """Whether KV tile kt needs mask_scores for a query tile from position pos0: ALiBi, the
            diagonal, or the window's left edge (any of the tile's rows)."""
            if use_alibi:
                return True
            diagonal = (kt + 1) * block_N > pos0 + 1
            if window_left >= 0:
                return T.Or(diagonal, kt * block_N + window_left < pos0 + self.tokens - 1)
            return diagonal

        @T.macro
        def shape_scores(acc_s, slope, kt, pos0, k_mult=None):
            # The full mask where the tile needs one, else k_scale and the soft cap alone (if any).
            if self.capped or self.fp8:
                if needs_mask(kt, pos0):
                    mask_scores(acc_s, slope, kt, pos0, k_mult)
                else:
                    map_scores(acc_s, k_mult)
            elif needs_mask(kt, pos0):
                mask_scores(acc_s, slope, kt, pos0)
        self.shape_scores = shape_scores

        self.softmax_step = online_softmax_step(unit_log2)

        @T.macro
        def store_lse(Lse, m_cur, denom, q_begin, q0, head0, rows):
            # ln sum exp of the final scores: m * unit + ln(denom) (m, the running max in score units).
            for i in T.Parallel(block_M):
                if i // pack < rows:
                    Lse[q_begin + q0 + i // pack, head0 + i % pack] = m_cur[i] * unit + T.log(denom[i])
        self.store_lse = store_lse

        @T.macro
        def zero_v_tail(v_s, kt, kv_len, st=None):
            # Page slots past the sequence end may hold anything (NaN): P is 0 there, but 0 * NaN is not.
            # `v_s` is a [block_N, head_dim] tile, or a ring with `st` its stage.
            for j, d in T.Parallel(block_N, head_dim):
                idx = (j, d) if st is None else (st, j, d)
                v_s[idx] = T.if_then_else(kt * block_N + j < kv_len, v_s[idx], T.cast(0, dtype))
        self.zero_v_tail = zero_v_tail

        @T.macro
        def widen_v(ring, st, dst, ds, kt, kv_len, lane):
            # 64 threads (`lane`) widen stage st of an 8-bit V ring into stage ds of the fp16 ring `dst` (exact:
            # e4m3 values fit fp16; one cvt per pair of elements), 8 bytes per thread a round, rows past the
            # sequence end as 0 (they may hold NaN). The loads of `batch` rounds go first: the compiler cannot
            # move a shared load above an earlier shared store (the rings are one allocation to it), so a round
            # at a time would serialize on latency.
            vec, batch = 8, 4
            rounds = block_N * head_dim // (64 * vec)
            raw = T.alloc_local((batch, vec), ring.dtype)
            for b in T.serial(rounds // batch):
                for u in T.unroll(batch):
                    e0 = ((b * batch + u) * 64 + lane) * vec
                    for e in T.vectorized(vec):
                        raw[u, e] = ring[st, e0 // head_dim, e0 % head_dim + e]
                for u in T.unroll(batch):
                    e0 = ((b * batch + u) * 64 + lane) * vec
                    j = e0 // head_dim
                    for e in T.vectorized(vec):
                        dst[ds, j, e0 % head_dim + e] = T.if_then_else(
                            kt * block_N + j < kv_len, T.cast(raw[u, e], "float16"), T.cast(0, "float16"))
        self.widen_v = widen_v

        def byte_perm(x, y, selector):
            return T.call_extern("uint32", "__byte_perm", x, y, selector)

        @T.macro
        def transpose_v(ring, st, dst, ds, kt, kv_len, lane):
            # 64 threads (`lane`) transpose stage st of an 8-bit V ring [block_N, head_dim] into stage ds of `dst`
            # [head_dim, block_N] (FP8 products read B K-major: keys contiguous), an 8 x 8 block of bytes per thread
            # a round: 8-byte loads of 8 keys' rows, four 4 x 4 byte transposes of 8 byte permutes each, 8-byte
            # stores of 8 dims' rows; keys past the sequence end as 0 (they may hold NaN). Each 16 lanes take the 16
            # key blocks (at block_N 128) and dim blocks rotated by the key block: a load of 16 lanes reads 16
            # different 8-byte columns of V's rows (one 128-byte line each), a store writes row r of 16 dim blocks
            # (rows r mod 8 alike) at 16 different key chunks of the swizzled `dst`: no bank conflicts either way.
            raw = T.alloc_local((8, 8), ring.dtype)
            tr = T.alloc_local((8, 8), ring.dtype)
            rw = T.view(raw, (8, 2), "uint32")  # rw[key, h]: dims 4 h .. 4 h + 3 of a key
            tw = T.view(tr, (8, 2), "uint32")  # tw[dim, h]: keys 4 h .. 4 h + 3 of a dim
            for b in T.unroll(block_N * head_dim // (64 * 64)):
                j0, d0 = transpose_block(lane, b, block_N, head_dim)
                for c in T.unroll(8):
                    for e in T.vectorized(8):
                        raw[c, e] = ring[st, j0 + c, d0 + e]
                if (kt + 1) * block_N > kv_len:  # the sequence's last tile
                    for c in T.unroll(8):
                        for h in T.unroll(2):
                            rw[c, h] = T.if_then_else(kt * block_N + j0 + c < kv_len, rw[c, h], T.uint32(0))
                for hd in T.unroll(2):  # dims 4 hd ..: word hd of the keys' rows
                    for hk in T.unroll(2):  # keys 4 hk ..: word hk of the dims' rows
                        k4 = [rw[4 * hk + i, hd] for i in range(4)]
                        for k, pair in enumerate(PAIR_BYTES):
                            ab, cd = byte_perm(k4[0], k4[1], pair), byte_perm(k4[2], k4[3], pair)
                            for i, row in enumerate(ROW_BYTES):
                                tw[4 * hd + 2 * k + i, hk] = byte_perm(ab, cd, row)
                for r in T.unroll(8):
                    for e in T.vectorized(8):
                        dst[ds, d0 + r, j0 + e] = tr[r, e]
        self.transpose_v = transpose_v

        @T.macro
        def split_q(q_ring, qb, terms, scale_s, q_mult, k_mult, tx):
            # Q tile qb as a sum of e4m3 terms for the FP8 scores (`terms`: one tile each), by the 256 consumer
            # threads (`tx`), two per row: each row scaled by a power of two s that puts its largest |q| in
            # [128, 256), then term t = e4m3(what the terms before it left of q / s). Each term keeps 4
            # significant bits, so two hold a bf16 q and three an fp16 one exactly wherever |q / s| is large
            # enough for the last term to be a normal e4m3 (>= 2 for bf16, >= 32 for fp16), and within
            # 2^-10 s below (its subnormals: 2^-17 of the row's largest). Two FP8 products cost one 16-bit one.
            # q_mult[i] = s_i * k_scale, through `scale_s` (shared, one per row).
            half = head_dim // 2
            row, c0 = tx // 2, tx % 2 * half
            m = T.alloc_var(accum)
            v = T.alloc_local((8,), q_ring.dtype)
            m = 0.0
            for c in T.serial(half // 8):
                for e in T.vectorized(8):
                    v[e] = q_ring[qb, row, c0 + c * 8 + e]
                for e in T.unroll(8):
                    m = T.max(m, T.abs(T.cast(v[e], accum)))
            m = T.max(m, T.shfl_xor(m, 1))
            # m's biased exponent ex (at least 7: a row of zeros gets any finite scale): 1 / s = 2^(134 - ex)
            ex = T.max(T.shift_right(T.reinterpret(m, "int32"), 23), 7)
            inv = T.reinterpret(T.shift_left(261 - ex, 23), "float32")
            rest = T.alloc_local((8,), accum)
            term = T.alloc_local((8,), "float8_e4m3fn")
            for c in T.serial(half // 8):
                for e in T.vectorized(8):
                    v[e] = q_ring[qb, row, c0 + c * 8 + e]
                for e in T.unroll(8):
                    rest[e] = T.cast(v[e], accum) * inv  # exact
                for tile in terms:  # a Python loop: unrolled while tracing
                    for e in T.unroll(8):
                        term[e] = T.cast(rest[e], "float8_e4m3fn")
                        rest[e] = rest[e] - T.cast(term[e], accum)  # exact
                    for e in T.vectorized(8):
                        tile[qb, row, c0 + c * 8 + e] = term[e]
            if tx % 2 == 0:
                scale_s[row] = T.reinterpret(T.shift_left(ex - 7, 23), "float32")  # s = 2^(ex - 134)
            T.sync_threads(1, 256)
            for i in T.Parallel(block_M):
                q_mult[i] = scale_s[i] * k_mult
        self.split_q = split_q

        @T.macro
        def store_out_tma(Out, ring, qb, q_begin, q0, head0, warp, warps):
            # Warp `warp` of `warps` stores its share of the O tile staged in stage qb of a ring (a full
            # tile: every token row is valid) by TMA, one copy per token (as load_q_tma) and band, issued
            # by one lane of the warp; the caller waits for the reads before reusing the stage.
            per_warp = self.tokens // warps
            for i in range(per_warp):
                for c in range(0, head_dim, band):
                    t = warp * per_warp + i
                    T.tma_copy(ring[qb, t * pack:(t + 1) * pack, c:c + band],
                               Out[q_begin + q0 + t, head0:head0 + pack, c:c + band], leader_scope_threads=32)
        self.store_out_tma = store_out_tma

        def output(acc_o, denom, i, d, v_mult):
            """Row i, column d of the normalized O (8-bit cache: times v_scale)."""
            return acc_o[i, d] * (v_mult / denom[i]) if self.fp8 else acc_o[i, d] / denom[i]
        self.output = output

        @T.macro
        def store_out(Out, acc_o, denom, q_begin, q0, head0, rows, v_mult=None):
            for i, d in T.Parallel(block_M, head_dim):
                if i // pack < rows:
                    Out[q_begin + q0 + i // pack, head0 + i % pack, d] = T.cast(output(acc_o, denom, i, d, v_mult),
                                                                                dtype)
        self.store_out = store_out

    def tile(self, TileSeq, TileQ0, CumSeqLensQ, SeqLens, tile, head_group, exists=True, part=0, parts=1):
        """The CTA's query tile: (busy, seq, kv_head, head0, q_begin, q_len, q0, kv_len, pos0, rows, lo,
        kt0, steps): KV tiles kt0 .. steps - 1 hold its keys, from position lo on (lo, kt0 > 0 only with a
        window; positions before lo are masked, and read from lo's page).
        A schedule tile holds `parts` query tiles of `tokens` tokens (the CTAs of a cluster, which share
        its KV tiles); this CTA takes query tile `part`, whose rows may all lie past the sequence end
        (rows = 0), and all of them run the same KV steps: from the window's left edge of the schedule
        tile's first token to the diagonal of its last one. An idle tile (or
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
        lo, kt0 = 0, 0
        if self.window_left >= 0:  # KV tiles wholly left of every row's window are never read
            lo = T.if_then_else(busy, T.max(kv_len - q_len + first - self.window_left, 0), 0)
            kt0 = T.min(lo // self.block_N, steps)
        return busy, seq, head0 // self.groups, head0, q_begin, q_len, q0, kv_len, pos0, rows, lo, kt0, steps

