"""Paged attention prefill (`PagedAttentionPrefillTileLang`): FlashAttention over a paged KV cache.

Why this shape: each CTA owns one *query tile* (a few new tokens of one sequence, for the `pack`
query heads of one kv head, stacked into the `block_M` rows of the tile) and streams that
sequence's KV positions in tiles of `block_N` through shared memory with an online softmax. So
the KV cache is read once per (query tile, kv head) instead of three times per token and head as
in the naive kernel, and packing the heads of a GQA group divides the K/V traffic by `pack`. Both
products run on the tensor cores (fp32 inputs run as TF32).

A query tile must know its sequence. Rather than a host-side loop (a sync), a small device-side
schedule is built from `cum_seq_lens_q` with torch ops: tile -> (sequence, first query token),
sorted by decreasing KV length so the longest tiles start first (load balance over ragged
batches). The grid is an upper bound on the tile count, `(total_q + num_seqs * (tokens - 1)) //
tokens`; spare CTAs exit at once.

K/V tiles are loaded by whole pages when block_size >= _PAGE_LOADS_FROM (32): one TMA copy per page (or per
`block_N` slice of a larger page) and 128-byte column band, addressed through the block table.
The KV loop has no data-dependent branch around it (an idle tile runs zero steps), so TileLang
warp-specializes it: a producer warpgroup issues the TMA copies into a 2-stage mbarrier ring
while the consumer warpgroups compute. Pages past the sequence's last one repeat it (the table
entries there may be invalid), and V rows past the sequence end are zeroed in shared memory
(P is 0 there, but the slots may hold NaN). Smaller pages are gathered row by row with cp.async,
the position clamped to the sequence's last token. The causal mask (and ALiBi bias) is applied
to the scores; KV tiles past the diagonal of the query tile are never visited.
"""


import math

import torch

from ._runtime import check_choice, check_int, check_tensor, compile_kernel, resolve_config

import tilelang.language as T  # noqa: E402  (after _runtime set the cache dir)

_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_HEAD_SIZES = (64, 128, 256)
_BITS = {"float16": 16, "bfloat16": 16, "float32": 32}
_LOG2E = 1.4426950408889634
# Page size from which K/V tiles are loaded by whole-page TMA copies. At 16 rows a 128-row tile
# needs 32 copies per KV step (8 pages x 2 column bands x K/V), each with its own mbarrier pair, and
# the row gathers win (H200, same run: (b) bs16 311 vs 250 TFLOP/s, bs32 313 vs 355, bs64 313 vs 378).
_PAGE_LOADS_FROM = 32


def head_pack(num_heads: int, num_kv_heads: int, block_M: int) -> int:
    """How many query heads of one kv head share a CTA (rows of its M tile): the largest divisor
    of the group size that still leaves >= 16 tokens per tile."""
    groups = num_heads // num_kv_heads
    return max(d for d in range(1, groups + 1) if groups % d == 0 and d <= max(1, block_M // 16))


def paged_prefill_kernel(num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
                         dtype: str, use_alibi: bool, kv_layout: str, scale: float,
                         block_M: int = 128, block_N: int = 128, num_stages: int = 1, threads: int = 256):
    """Causal paged attention over a schedule of query tiles (see the module docstring).

    Tile t covers query tokens [TileQ0[t], TileQ0[t] + block_M // pack) of sequence TileSeq[t]
    (< 0: idle), for `pack` query heads of one kv head: M-row r is token r // pack, head r % pack."""
    groups = num_heads // num_kv_heads
    pack = head_pack(num_heads, num_kv_heads, block_M)
    tokens = block_M // pack  # per tile; rows past tokens * pack are padding
    total_q, num_seqs, num_blocks, max_blocks, num_tiles = T.dynamic(
        "total_q, num_seqs, num_blocks, max_blocks, num_tiles")
    if kv_layout == "HND":
        kv_shape = (num_blocks, num_kv_heads, block_size, head_size)
    else:
        kv_shape = (num_blocks, block_size, num_kv_heads, head_size)
    q_shape = (total_q, num_heads, head_size)
    accum = "float32"
    scale_log2 = scale * _LOG2E  # scores live in the log2 domain: exp2 is one instruction
    paged = block_size >= _PAGE_LOADS_FROM  # whole-page (TMA) loads; smaller pages are gathered row by row
    pages = list(range(max(1, block_N // block_size)))  # page copies per KV tile (Python-unrolled)
    rows_per_copy = min(block_size, block_N)
    band = min(head_size, 1024 // _BITS[dtype])  # 128 bytes: the widest TMA box of a swizzled tile
    bands = list(range(0, head_size, band))

    def page_rows(kt, p):
        off = (kt * block_N + p * rows_per_copy) % block_size
        return slice(off, off + rows_per_copy)

    @T.macro
    def load_pages(cache, dst, blocks, kv_head, kt):
        # One bulk copy per (page or block_N slice of a page, 128-byte column band): a band is one
        # contiguous run of the swizzled shared tile, as the TMA lowering requires.
        for p in pages:
            for c in bands:
                dst_rows = slice(p * rows_per_copy, (p + 1) * rows_per_copy)
                if kv_layout == "HND":
                    T.copy(cache[blocks[p], kv_head, page_rows(kt, p), c:c + band], dst[dst_rows, c:c + band])
                else:
                    T.copy(cache[blocks[p], page_rows(kt, p), kv_head, c:c + band], dst[dst_rows, c:c + band])

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
        Q: T.Tensor(q_shape, dtype),
        KCache: T.Tensor(kv_shape, dtype),
        VCache: T.Tensor(kv_shape, dtype),
        BlockTables: T.Tensor((num_seqs, max_blocks), "int32"),
        SeqLens: T.Tensor((num_seqs,), "int32"),
        CumSeqLensQ: T.Tensor((num_seqs + 1,), "int32"),
        AlibiSlopes: T.Tensor((num_heads,), "float32"),
        TileSeq: T.Tensor((num_tiles,), "int32"),
        TileQ0: T.Tensor((num_tiles,), "int32"),
        Out: T.Tensor(q_shape, dtype),
    ):
        with T.Kernel(num_heads // pack, num_tiles, threads=threads) as (head_group, tile):
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

            # No branch on idle tiles around the KV loop (it would keep the loads from being
            # pipelined): an idle tile reads sequence 0's scalars, runs zero KV steps and
            # writes nothing.
            busy = TileSeq[tile] >= 0
            seq = T.max(TileSeq[tile], 0)
            head0 = head_group * pack
            kv_head = head0 // groups
            q0 = TileQ0[tile]
            q_begin = CumSeqLensQ[seq]
            q_len = CumSeqLensQ[seq + 1] - q_begin
            kv_len = SeqLens[seq]
            pos0 = kv_len - q_len + q0  # KV position of the tile's first query row
            rows = T.if_then_else(busy, T.min(tokens, q_len - q0), 0)  # valid tokens in this tile

            for i, d in T.Parallel(block_M, head_size):  # tokens past q_len repeat its last one
                q_s[i, d] = Q[q_begin + T.max(T.min(q0 + i // pack, q_len - 1), 0), head0 + i % pack, d]
            if use_alibi:
                for i in T.Parallel(block_M):
                    slope[i] = AlibiSlopes[head0 + i % pack] * _LOG2E
            T.fill(acc_o, 0)
            T.fill(denom, 0)
            T.fill(m_cur, -T.infinity(accum))

            for kt in T.Pipelined(T.if_then_else(busy, T.ceildiv(pos0 + rows, block_N), 0), num_stages=num_stages):
                # One KV tile: scores, online-softmax update, accumulate P @ V.
                if paged:
                    # The page ids are the loop body's leading bindings: the warp-specialization
                    # pass keeps those in the producer branch (read once for K and V, ahead of
                    # the copies). Pages past the sequence's last one repeat it (table entries
                    # there may be invalid); those rows are masked.
                    blocks = []
                    for p in pages:
                        blk = BlockTables[seq, T.min(kt * block_N + p * rows_per_copy, kv_len - 1) // block_size]
                        blocks.append(blk)
                    load_pages(KCache, k_s, blocks, kv_head, kt)
                    load_pages(VCache, v_s, blocks, kv_head, kt)
                else:
                    gather_rows(KCache, k_s, BlockTables, seq, kv_head, kv_len, kt)
                T.clear(acc_s)
                T.gemm(q_s, k_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(block_M, block_N):
                    rel = kt * block_N + j - (pos0 + i // pack)  # t - (history + token): visible if <= 0
                    if use_alibi:
                        acc_s[i, j] = T.if_then_else(rel <= 0, acc_s[i, j] * scale_log2 + slope[i] * rel,
                                                     -T.infinity(accum))
                    else:
                        acc_s[i, j] = T.if_then_else(rel <= 0, acc_s[i, j] * scale_log2,
                                                     -T.infinity(accum))
                # Online softmax: every valid row has a finite score in KV tile 0, so the
                # running max is finite from then on.
                T.copy(m_cur, m_prev)
                T.reduce_max(acc_s, m_cur, dim=1, clear=False)
                for i in T.Parallel(block_M):
                    rescale[i] = T.exp2(m_prev[i] - m_cur[i])
                for i, j in T.Parallel(block_M, block_N):
                    acc_s[i, j] = T.exp2(acc_s[i, j] - m_cur[i])
                T.reduce_sum(acc_s, row_sum, dim=1)
                for i in T.Parallel(block_M):
                    denom[i] = denom[i] * rescale[i] + row_sum[i]
                T.copy(acc_s, acc_p)
                for i, d in T.Parallel(block_M, head_size):
                    acc_o[i, d] *= rescale[i]
                if paged:
                    if (kt + 1) * block_N > kv_len:
                        # Page slots past the sequence end may hold anything (NaN): P is 0 there,
                        # but 0 * NaN is not, so those V rows are zeroed.
                        for j, d in T.Parallel(block_N, head_size):
                            v_s[j, d] = T.if_then_else(kt * block_N + j < kv_len, v_s[j, d], T.cast(0, dtype))
                else:
                    gather_rows(VCache, v_s, BlockTables, seq, kv_head, kv_len, kt)
                T.gemm(acc_p, v_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

            for i, d in T.Parallel(block_M, head_size):
                if i // pack < rows:
                    Out[q_begin + q0 + i // pack, head0 + i % pack, d] = T.cast(acc_o[i, d] / denom[i], dtype)

    return paged_prefill


def _default_config(head_size: int, dtype: str, block_size: int = 16) -> dict:
    """Tiles that fit shared memory (Q, plus K and V per pipeline stage) and registers. Whole-page
    (TMA) loads run two stages; the row gathers of smaller pages do not lower with two."""
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
        # Two software-pipeline stages do not lower with the row-gather loads (small pages).
        stages = (1, 2) if spec.get("block_size", 16) >= _PAGE_LOADS_FROM else (0, 1)
        big = spec.get("head_size", 128) == 256 or spec.get("dtype") == "float32"
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
        self.num_heads, self.num_kv_heads, self.head_size, self.block_size = (
            num_heads, num_kv_heads, head_size, block_size)
        self.dtype, self.use_alibi, self.kv_layout, self.validate = dtype, use_alibi, kv_layout, validate
        self.spec = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_size": head_size,
                     "block_size": block_size, "dtype": _DTYPES[dtype], "use_alibi": use_alibi,
                     "kv_layout": kv_layout, "scale": float(scale)}
        self.config = resolve_config(self.op_name, self.spec, config,
                                     _default_config(head_size, _DTYPES[dtype], block_size))
        self._no_alibi = {}
        # Fast math: exp2 and the final division as single approximate instructions (well inside
        # the error of the bf16/fp16 probabilities fed to the second product).
        self.kernel = compile_kernel(paged_prefill_kernel(**self.spec, **self.config),
                                     pass_configs={"tl.enable_fast_math": True})

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
        """Query tiles -> (sequence or -1, first query row), longest KV first; on the device."""
        block_m = self.config["block_M"] // head_pack(self.num_heads, self.num_kv_heads, self.config["block_M"])
        num_seqs = seq_lens.shape[0]
        q_lens = cum_seq_lens_q[1:] - cum_seq_lens_q[:-1]
        tiles = (q_lens + block_m - 1) // block_m
        tile_end = torch.cumsum(tiles, 0, dtype=torch.int32)
        idx = torch.arange((total_q + num_seqs * (block_m - 1)) // block_m, device=seq_lens.device,
                           dtype=torch.int32)
        seq = torch.searchsorted(tile_end, idx, right=True, out_int32=True)
        idle = seq >= num_seqs
        seq_c = seq.clamp(max=num_seqs - 1).long()
        q0 = (idx - (tile_end - tiles)[seq_c]) * block_m
        work = torch.where(idle, -1, seq_lens[seq_c] - q_lens[seq_c] + q0)
        order = torch.argsort(work, descending=True)
        return torch.where(idle, -1, seq)[order], q0[order].to(torch.int32)

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
