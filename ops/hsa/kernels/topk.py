"""The top-k kernel of HSA selection: per (request, kv head), the topk best keys of the score kernel's row,
ties to the smaller logical page, written best first as physical page ids and fp32 scores. Rows with a
crowded histogram bin fall back to the radix select of ``radix_select`` (see docs/design/hsa.md)."""

import tilelang.language as T

from ..schedule import HIST_BITS, IDX_BITS, KEY_PAGES, RADIX, RANK_MAX, RANK_UNROLL
from .common import KeyTiles, first_local, key_to_score, u32
from ...common.tl.radix import suffix_sum
from .radix_select import KEY_BATCH, load_batch, scatter, select


def bin_of(key, hist_bits: int):
    """Histogram bin of a key: its top hist_bits bits."""
    return T.cast(key >> u32(32 - hist_bits), "int32")


def from_bin(thr, hist_bits: int):
    """What ``scatter`` collects after the histogram pass, as wins(key, logical page): the keys in bin thr and
    above."""
    return lambda key, page: bin_of(key, hist_bits) >= thr


@T.macro
def count_keys(keys, kbuf, key_hist, b, h, n, tx, threads: int, hist_bits: int):
    """Pass 1: key_hist[bin] += 1 for every candidate key (!= 0) of the row keys[b, h, :n]; a barrier
    follows."""
    for it in T.serial(T.ceildiv(n, threads * KEY_BATCH)):
        load_batch(keys, kbuf, b, h, n, it, tx, threads)
        for e in T.unroll(KEY_BATCH):
            if kbuf[e] != u32(0):
                T.atomic_add(key_hist[bin_of(kbuf[e], hist_bits)], 1)
    T.sync_threads()


@T.macro
def write_ranked(comp, n, k_eff, page_table, b, h, selected_page_ids, selected_scores, topk: int, threads: int):
    """comp[:n] holds candidates (zeros after them); the one of rank i < k_eff in their order goes to slot
    i, slots k_eff..topk-1 get -1 / -inf. A rank is the number of candidates before it, counted in one
    pass over shared memory."""
    idx_top = (1 << IDX_BITS) - 1
    tx = T.get_thread_binding()
    mine = T.alloc_var("uint64")
    rank = T.alloc_var("int32")
    for it in T.serial(T.ceildiv(topk, threads)):
        i = it * threads + tx
        if i >= k_eff and i < topk:
            selected_page_ids[b, h, i] = -1
            selected_scores[b, h, i] = -T.infinity("float32")
    for it in T.serial(T.ceildiv(n, threads)):
        if it * threads + tx < n:
            mine = comp[it * threads + tx]
            rank = 0
            # Zeros past n never outrank a candidate: no bound check in the unrolled loop.
            for m0 in T.serial(T.ceildiv(n, RANK_UNROLL)):
                for mm in T.unroll(RANK_UNROLL):
                    rank += T.if_then_else(comp[m0 * RANK_UNROLL + mm] > mine, 1, 0)
            if rank < k_eff:
                page = idx_top - T.cast(mine & T.uint64(idx_top), "int32")
                selected_page_ids[b, h, rank] = page_table[b, page]
                selected_scores[b, h, rank] = key_to_score(T.cast(mine >> IDX_BITS, "uint32"))


def hsa_topk_kernel(num_kv_heads: int, page_size: int, topk: int, window_size: int, threads: int = RADIX,
                    hist_bits: int = HIST_BITS, tile_rows: int = 0):
    """Top-k of the key rows keys[b, h, :n_cand(b)] by (key, smaller logical page first), one CTA of `threads`
    (32 to RADIX, a power of two) per (request, kv head). A first pass over the row counts its keys by their top
    `hist_bits` bits in shared memory; the bin of the k-th key bounds the candidates: the keys in it and above.
    When they are at most RANK_MAX (the usual case: one bin is 1/8 of an octave of scores at the default 12 bits)
    a second pass collects them and each is ranked by counting. Otherwise (a crowded bin, e.g. many equal
    scores, or topk > RANK_MAX) a radix select over the row finds the k winners first. Winners go to
    selected_page_ids / selected_scores best first, padded with -1 / -inf. Fewer threads and bins suit short
    rows (HSA extend's: many rows of ~1000 keys, each CTA's time mostly latency): more rows in flight per SM.
    `tile_rows` > 0: the keys by score tiles of that many rows (HSA extend's, ``schedule.key_tiles_shape``), row b's
    at key_rows[b] (its tile x tile_rows + its row in the tile)."""
    NT = threads
    NW = NT // 32
    BINS = 1 << hist_bits
    BPT = BINS // NT  # histogram bins per thread
    n_comp = -(-max(topk, RANK_MAX) // NT) * NT
    batch, max_pages, num_tiles, page_blocks = T.dynamic("batch, max_pages, num_tiles, page_blocks")

    @T.macro
    def top_of_row(keys, n, page_table, b, h, selected_page_ids, selected_scores):
        tx = T.get_thread_binding()
        comp = T.alloc_shared((n_comp,), "uint64")
        key_hist = T.alloc_shared((BINS,), "int32")
        suffix = T.alloc_shared((NT + 1,), "int32")
        warp_sum = T.alloc_shared((NW,), "int32")
        cut = T.alloc_shared((2,), "int32")  # the bin of the k-th key, and the keys in it and above
        filled = T.alloc_shared((1,), "int32")  # candidates collected
        counts = T.alloc_local((BPT,), "int32")
        kbuf = T.alloc_local((KEY_BATCH,), "uint32")
        acc = T.alloc_var("int32", 0)
        k_eff = T.alloc_var("int32")
        thr = T.alloc_var("int32")  # cut[0] in a register: reading the shared copy between the
        # collecting threads' atomics would make TileLang put a barrier before each key
        for i in T.unroll(n_comp // NT):
            comp[i * NT + tx] = T.uint64(0)
        for i in T.unroll(BPT):
            key_hist[i * NT + tx] = 0
        T.sync_threads()
        count_keys(keys, kbuf, key_hist, b, h, n, tx, NT, hist_bits)
        for v in T.vectorized(BPT):
            counts[v] = key_hist[tx * BPT + v]
        # TileLang lays the buffers below over the histogram (its last read is above): no write before
        # every thread has read its bins.
        T.sync_threads()
        for v in T.unroll(BPT):
            acc += counts[v]
        if tx == 0:
            cut[0] = BINS  # no candidates: no bin qualifies
            cut[1] = 0
            filled[0] = 0
        suffix_sum(acc, suffix, warp_sum, NT)
        k_eff = T.min(topk, suffix[0])
        # The one thread whose bins hold the k-th key (counting from the top) finds its bin.
        if suffix[tx] >= k_eff and suffix[tx + 1] < k_eff:
            acc = suffix[tx + 1]
            for v in T.unroll(BPT):
                if acc < k_eff and acc + counts[BPT - 1 - v] >= k_eff:
                    cut[0] = tx * BPT + BPT - 1 - v
                    cut[1] = acc + counts[BPT - 1 - v]
                acc += counts[BPT - 1 - v]
        T.sync_threads()
        thr = cut[0]
        if cut[1] <= RANK_MAX:
            # The bound always holds (the histogram counted these keys); it keeps the stores in comp.
            scatter(keys, b, h, n, from_bin(thr, hist_bits), filled, 0, n_comp, comp, NT, IDX_BITS)
            write_ranked(comp, cut[1], k_eff, page_table, b, h, selected_page_ids, selected_scores, topk, NT)
        else:
            select(keys, b, h, n, k_eff, comp, NT, IDX_BITS)
            write_ranked(comp, k_eff, k_eff, page_table, b, h, selected_page_ids, selected_scores, topk, NT)

    if tile_rows:
        @T.prim_func
        def hsa_topk_tiles(key_buf: T.Tensor((num_kv_heads, num_tiles, page_blocks, tile_rows, KEY_PAGES),
                                             "uint32"),
                           key_rows: T.Tensor((batch,), "int32"),
                           page_table: T.Tensor((batch, max_pages), "int32"),
                           seq_lens: T.Tensor((batch,), "int32"),
                           selected_page_ids: T.Tensor((batch, num_kv_heads, topk), "int32"),
                           selected_scores: T.Tensor((batch, num_kv_heads, topk), "float32")):
            with T.Kernel(num_kv_heads, batch, threads=NT) as (h, b):
                key_row = T.alloc_var("int32", init=key_rows[b])
                n = first_local(seq_lens[b], page_size, window_size) // page_size
                top_of_row(KeyTiles(key_buf, key_row, tile_rows), n, page_table, b, h, selected_page_ids,
                           selected_scores)
        return hsa_topk_tiles

    @T.prim_func
    def hsa_topk(keys: T.Tensor((batch, num_kv_heads, max_pages), "uint32"),
                 page_table: T.Tensor((batch, max_pages), "int32"),
                 seq_lens: T.Tensor((batch,), "int32"),
                 selected_page_ids: T.Tensor((batch, num_kv_heads, topk), "int32"),
                 selected_scores: T.Tensor((batch, num_kv_heads, topk), "float32")):
        with T.Kernel(num_kv_heads, batch, threads=NT) as (h, b):
            top_of_row(keys, first_local(seq_lens[b], page_size, window_size) // page_size, page_table, b, h,
                       selected_page_ids, selected_scores)

    return hsa_topk
