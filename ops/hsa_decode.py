"""HSA decode (`HSADecodeTileLang`): top-k page selection plus sparse paged decode on SGLang's paged KV.

Selection (``select``) is two kernels: ``hsa_score`` gathers the request's candidate page reprs E_j
(through ``page_table``) and writes one sortable 32-bit key per (request, kv head, logical page)
(the fp32 score with its bits flipped so that unsigned order is score order; 0 marks a non-candidate).
``hsa_topk`` (one CTA per (request, kv head)) counts a row's keys in a shared-memory histogram of their top
12 bits, finds the bin of the k-th key, collects the keys in that bin and above in a second pass over the
row and ranks them by counting. The order is that of the 56-bit key (score key, 0xFFFFFF - logical page), so
ties go to the smaller logical page. If that bin is crowded (many equal scores) a radix select over the row
(8-bit digits, one shared-memory histogram per digit) finds the winners first.

Decode is split-K: the items of a (request, kv head) are its selected pages then the pages holding its
local tokens; split ``s`` of ``num_splits`` takes a contiguous range of items, so the grid is
num_splits x kv heads x B and fills the GPU even at small batch (the split count comes from the batch
size: whole waves of CTAs, ``_num_splits``). The G query heads of a kv head are the
M rows of one 16-row mma tile (warps split the N of each product, so the padding costs little); each
item is one physical page (K and V read as a page_size x head_dim box of k_buffer / v_buffer). Per item the page's own softmax is normalized and
merged into the split's running (o, lse) with a merge logit: the page's lse in ``token`` mode (plain
flash decoding), z_k = scale * q . E_k in ``softmax`` mode (HSA: the page is one chunk of weight
exp(z_k)); local pages always merge with their lse, so the window is one more chunk whose log-weight is
lse_loc. ``hsa_combine`` merges the splits' (o, lse) into o.
"""

import functools
import math

import torch

from ._runtime import check_choice, check_int, check_tensor, compile_kernel, resolve_config, sm_count

import tilelang.language as T  # noqa: E402  (after _runtime set the cache dir)

_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
_STRATEGIES = ("group", "head")
_COMBINES = ("softmax", "token")
_REPR_MODES = ("mean", "last")
_LOG2E = 1.4426950408889634
_RADIX = 256  # histogram bins of one radix-select digit (= threads of the top-k kernel)
_KEY_BATCH = 8  # keys each top-k thread loads at once
_IDX_BITS = 24  # logical page index bits of the selection key (max_pages < 2**24)
_RANK_MAX = 2 * _RADIX  # up to this many top-k candidates are ranked by counting, without radix passes
_HIST_BITS = 12  # the top-k counts a row's keys by their top bits: 1/8 of an octave of scores a bin
_HIST_BINS = 1 << _HIST_BITS
_RANK_UNROLL = 8
_VEC = 8  # 16-bit elements of one 16-byte load
_QROWS_DECODE = 16  # query rows of the decode products (one mma M tile; G <= 16)
_ZCOLS = 32  # reprs of a split's selected pages: the N of the z product (>= items per split)
_SM_SMEM = 228 * 1024  # shared memory of one SM (sm_90), of which 1 KiB per CTA is reserved
_DECODE_CTAS_PER_SM = 4  # register bound of a decode CTA (115 registers x 128 threads at the bench shape)


def _local_pages_max(page_size: int, window_size: int) -> int:
    """Most logical pages the local tokens [lo, L) can touch: at most max(window, page_size - 1) tokens,
    starting anywhere in a page."""
    return (max(window_size, page_size - 1) + page_size - 1) // page_size + 1


def _decode_smem(page_size: int, head_dim: int) -> int:
    """Bytes of shared memory of a decode CTA (16-bit K, V, q and repr tiles)."""
    return (2 * page_size + _QROWS_DECODE + _ZCOLS) * head_dim * 2


@functools.lru_cache(maxsize=None)
def _num_splits(rows: int, n_items: int, slots: int, overhead: int) -> int:
    """Decode split count for ``rows`` (request, kv head) pairs of at most ``n_items`` items each, when
    ``slots`` CTAs run at once: the one with the least (waves of CTAs) x (items per split + overhead),
    ``overhead`` pricing a split's fixed work (query, selected ids, reprs and z before its first page)
    in items; ties to fewer splits. A split holds at most _ZCOLS items (its reprs fill the z tile).
    At small batch this fills whole waves instead of leaving a short last one."""
    def cost(s):
        return -(-rows * s // slots) * (-(-n_items // s) + overhead)
    return min(range(-(-n_items // _ZCOLS), n_items + 1), key=lambda s: (cost(s), s))


def _first_local(L, page_size: int, window_size: int):
    """lo, the first local token of a request of L tokens (the issue's rule)."""
    return T.min(T.max(L - window_size, 0), (L // page_size) * page_size)


def _u32(v: int):
    return T.uint32(v)


# ----------------------------------------------------------------------------- page representations
def page_repr_kernel(num_kv_heads: int, head_dim: int, page_size: int, dtype: str, mode: str):
    """chunk_repr[page_ids[i], h] = mean (or last) of page page_ids[i]'s keys of kv head h."""
    num_ids, num_slots, num_pages = T.dynamic("num_ids, num_slots, num_pages")

    @T.prim_func
    def page_repr(k_buffer: T.Tensor((num_slots, num_kv_heads, head_dim), dtype),
                  page_ids: T.Tensor((num_ids,), "int32"),
                  chunk_repr: T.Tensor((num_pages, num_kv_heads, head_dim), dtype)):
        with T.Kernel(num_ids, num_kv_heads, threads=head_dim) as (i, h):
            acc = T.alloc_fragment((head_dim,), "float32")
            pid = page_ids[i]
            if mode == "mean":
                T.clear(acc)
                for t in T.serial(page_size):
                    for d in T.Parallel(head_dim):
                        acc[d] += T.cast(k_buffer[pid * page_size + t, h, d], "float32")
                for d in T.Parallel(head_dim):
                    chunk_repr[pid, h, d] = T.cast(acc[d] / page_size, dtype)
            else:
                for d in T.Parallel(head_dim):
                    chunk_repr[pid, h, d] = k_buffer[pid * page_size + page_size - 1, h, d]

    return page_repr


# ----------------------------------------------------------------------------- selection
def _score_layout(num_kv_heads: int, head_dim: int, max_threads: int = 256) -> tuple[int, int]:
    """(heads per CTA, pages per step) of the score kernel. A CTA reads whole rows: the reprs of its
    heads of one page, head_dim / 8 lanes of 16 bytes per head (all kv heads = one contiguous 2 KB row at
    the bench shape); most heads first, then as many rows per step as fit in max_threads whole warps."""
    lph = head_dim // _VEC
    for hc in range(num_kv_heads, 0, -1):
        vr = hc * lph
        if num_kv_heads % hc == 0 and vr <= max_threads:
            rows = [r for r in range(1, max_threads // vr + 1) if r * vr % 32 == 0]
            if rows:
                return hc, rows[-1]
    raise AssertionError("unreachable: one head (8..32 lanes) always fits")


def _score_to_key(score):
    """Sortable bits of an fp32 score: negative scores flip all bits, others set the sign bit, so unsigned
    order is float order and finite scores stay > 0 (0 marks a non-candidate)."""
    ib = T.reinterpret(score, "int32")
    return T.reinterpret(ib ^ ((ib >> 31) | T.int32(-(1 << 31))), "uint32")


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
    hc, rows = _score_layout(num_kv_heads, head_dim)
    lph = head_dim // _VEC
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
                for v in T.vectorized(_VEC):
                    e[buf, u, v] = chunk_repr[pid[buf, u], h, lane * _VEC + v]
                valid[buf, u] = repr_valid[pid[buf, u]]

    @T.macro
    def consume(e, valid, buf, it, qv, part, keys_s, hh, row, lane):
        for u in T.unroll(unroll):
            for g in T.unroll(NQ):
                part[g] = 0
                for v in T.unroll(_VEC):
                    part[g] += T.cast(e[buf, u, v], f32) * qv[g, v]
                # The head's lph lanes are aligned within the warp: xor offsets < lph stay in it.
                for k in T.unroll(lph.bit_length() - 1):
                    part[g] += T.shfl_xor(part[g], lph >> (k + 1))
            for g in T.unroll(1, NQ):  # head strategy: the best of the group's scores
                part[0] = T.max(part[0], part[g])
            if lane == 0:
                keys_s[hh, (it * unroll + u) * rows + row] = T.if_then_else(
                    valid[buf, u] != 0, _score_to_key(part[0] * scale), _u32(0))

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
            qv = T.alloc_local((NQ, _VEC), f32)
            # Two register buffers of one batch each: reprs, their valid bytes, and page ids (-1: none).
            e = T.alloc_local((2, unroll, _VEC), dtype)
            valid = T.alloc_local((2, unroll), "uint8")
            pid = T.alloc_local((2, unroll), "int32")
            part = T.alloc_local((NQ,), f32)
            L = seq_lens[b]
            lo = _first_local(L, page_size, window_size)
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
                for v in T.unroll(_VEC):
                    if selection_strategy == "group":
                        qv[0, v] = 0
                        for g in T.unroll(G):
                            qv[0, v] += T.cast(q[b, h * G + g, lane * _VEC + v], f32)
                    else:
                        for g in T.unroll(G):
                            qv[g, v] = T.cast(q[b, h * G + g, lane * _VEC + v], f32)
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


def _key_to_score(key):
    bits = T.if_then_else(key >= _u32(0x80000000), key ^ _u32(0x80000000), ~key)
    return T.reinterpret(bits, "float32")


def hsa_topk_kernel(num_kv_heads: int, page_size: int, topk: int, window_size: int):
    """Top-k of the key rows keys[b, h, :n_cand(b)] by (key, smaller logical page first), one CTA of 256
    threads per (request, kv head). A first pass over the row counts its keys by their top _HIST_BITS bits
    in shared memory; the bin of the k-th key bounds the candidates: the keys in it and above. When they are
    at most _RANK_MAX (the usual case: one bin is 1/8 of an octave of scores) a second pass collects them
    and each is ranked by counting. Otherwise (a crowded bin, e.g. many equal scores, or
    topk > _RANK_MAX) a radix select over the row finds the k winners first. Winners go to
    selected_page_ids / selected_scores best first, padded with -1 / -inf."""
    NT = _RADIX
    NW = NT // 32
    BPT = _HIST_BINS // NT  # histogram bins per thread
    n_comp = -(-max(topk, _RANK_MAX) // NT) * NT
    idx_top = (1 << _IDX_BITS) - 1
    batch, max_pages = T.dynamic("batch, max_pages")

    def composite(key, page):
        """(key, smaller page first) as one unsigned order; > 0 for every candidate (key != 0)."""
        return (T.cast(key, "uint64") << _IDX_BITS) | T.cast(idx_top - page, "uint64")

    def page_of(it, e, tx):
        """Logical page of key e of a thread's batch it: a batch's loads cover NT consecutive pages each."""
        return (it * _KEY_BATCH + e) * NT + tx

    def bin_of(key):
        return T.cast(key >> _u32(32 - _HIST_BITS), "int32")

    # What `scatter` collects, as wins(key, logical page): the keys in histogram bin thr and above, or (the radix
    # select's winners) the keys at or above the k-th key's settled digits, score digits (pu, mu) then page
    # digits (pr, mr).
    def from_bin(thr):
        return lambda key, page: bin_of(key) >= thr

    def at_or_above(pu, mu, pr, mr):
        def wins(key, page):
            r = T.cast(idx_top - page, "uint32")
            return T.Or((key & mu) > pu, T.And((key & mu) == pu, (r & mr) >= pr))
        return wins

    @T.macro
    def load_batch(keys, kbuf, b, h, n, it, tx):
        """kbuf[e] = key of logical page page_of(it, e, tx) of the row keys[b, h, :n] (0 past n). The loads are
        issued together, not one per round trip."""
        for e in T.unroll(_KEY_BATCH):
            kbuf[e] = T.if_then_else(page_of(it, e, tx) < n, keys[b, h, page_of(it, e, tx)], _u32(0))

    @T.macro
    def suffix_scan(value, suffix, warp_sum):
        """suffix[t] = sum of the threads' values over t..NT-1, suffix[NT] = 0: a shuffle scan inside each warp,
        then the warps' totals (two barriers, where a block-wide Hillis-Steele scan takes two per step)."""
        tx = T.get_thread_binding()
        acc = T.alloc_var("int32")
        acc = value
        for k in T.unroll(5):
            down = T.shfl_down(acc, 1 << k)
            acc += T.if_then_else(tx % 32 + (1 << k) < 32, down, 0)
        if tx % 32 == 0:
            warp_sum[tx // 32] = acc
        T.sync_threads()
        for w in T.unroll(1, NW):
            acc += T.if_then_else(tx // 32 + w < NW, warp_sum[T.min(tx // 32 + w, NW - 1)], 0)
        suffix[tx] = acc
        if tx == 0:
            suffix[NT] = 0
        T.sync_threads()

    @T.macro
    def scatter(keys, b, h, n, wins, counter, ci, limit, comp):
        """comp[slot] = composite of every key of the row keys[b, h, :n] for which wins(key, logical page) holds,
        in the order the threads claim slots (< limit) from the shared counter[ci]; a barrier follows."""
        tx = T.get_thread_binding()
        kbuf = T.alloc_local((_KEY_BATCH,), "uint32")
        for it in T.serial(T.ceildiv(n, NT * _KEY_BATCH)):
            load_batch(keys, kbuf, b, h, n, it, tx)
            for e in T.unroll(_KEY_BATCH):
                if kbuf[e] != _u32(0) and wins(kbuf[e], page_of(it, e, tx)):
                    slot = T.atomic_add(counter[ci], 1, return_prev=True)
                    # Stored as atomics: TileLang's sync planner then sees no hazard against the counter's
                    # atomic and puts no barrier here. It would keep one inside this branch (its condition
                    # reads only thread-local values, which it takes for block-uniform) and the CTA would
                    # hang there: the threads without a winner never reach it.
                    if slot < limit:
                        T.atomic_store(comp[slot], composite(kbuf[e], page_of(it, e, tx)), memory_order="relaxed")
        T.sync_threads()

    @T.macro
    def select(keys, b, h, n, k_eff, comp, suffix, warp_sum):
        """Radix select over the 56-bit key (score key, idx_top - logical page): 8-bit digits, one shared
        histogram per digit, stopping as soon as the k_eff-th key's digits are settled (the page digits only
        matter on exact score ties). The k_eff winners go to comp[:k_eff] as composites, unordered."""
        tx = T.get_thread_binding()
        hist = T.alloc_shared((NT,), "int32")
        # 0: chosen digit, 1: rank still to fill inside the chosen bin, 2: winners written
        state = T.alloc_shared((3,), "int32")
        kbuf = T.alloc_local((_KEY_BATCH,), "uint32")
        # Settled high digits of the k-th key: score key (pu, mu), then page key (pr, mr).
        pu = T.alloc_var("uint32", _u32(0))
        mu = T.alloc_var("uint32", _u32(0))
        pr = T.alloc_var("uint32", _u32(0))
        mr = T.alloc_var("uint32", _u32(0))
        need = T.alloc_var("int32")  # rank of the k-th key among keys matching the prefix
        need = k_eff
        done = T.alloc_var("int32", 0)
        n_batches = T.ceildiv(n, NT * _KEY_BATCH)

        for p in T.serial(4 + _IDX_BITS // 8):
            if done == 0:
                on_score = p < 4
                shift = T.if_then_else(on_score, 24 - 8 * p, _IDX_BITS - 8 - 8 * (p - 4))
                hist[tx] = 0
                T.sync_threads()
                for it in T.serial(n_batches):
                    load_batch(keys, kbuf, b, h, n, it, tx)
                    for e in T.unroll(_KEY_BATCH):
                        u = kbuf[e]
                        r = T.cast(idx_top - page_of(it, e, tx), "uint32")
                        if u != _u32(0) and (u & mu) == pu and (r & mr) == pr:
                            digit = T.if_then_else(on_score, u >> T.cast(shift, "uint32"),
                                                   r >> T.cast(shift, "uint32")) & _u32(0xFF)
                            T.atomic_add(hist[T.cast(digit, "int32")], 1)
                T.sync_threads()
                suffix_scan(hist[tx], suffix, warp_sum)
                if p == 0 and suffix[0] <= need:
                    done = 1  # every candidate wins: no digit to settle
                else:
                    if suffix[tx] >= need and suffix[tx + 1] < need:
                        state[0] = tx
                        state[1] = need - suffix[tx + 1]
                    T.sync_threads()
                    need = state[1]
                    digit_mask = _u32(0xFF) << T.cast(shift, "uint32")
                    chosen = T.cast(state[0], "uint32") << T.cast(shift, "uint32")
                    if on_score:
                        pu = pu | chosen
                        mu = mu | digit_mask
                    else:
                        pr = pr | chosen
                        mr = mr | digit_mask
                    # The bin holds exactly the keys still needed: all of them win.
                    if hist[state[0]] == need:
                        done = 1
                T.sync_threads()

        if tx == 0:
            state[2] = 0
        T.sync_threads()
        scatter(keys, b, h, n, at_or_above(pu, mu, pr, mr), state, 2, k_eff, comp)

    @T.macro
    def write_ranked(comp, n, k_eff, page_table, b, h, selected_page_ids, selected_scores):
        """comp[:n] holds candidates (zeros after them); the one of rank i < k_eff in their order goes to slot
        i, slots k_eff..topk-1 get -1 / -inf. A rank is the number of candidates before it, counted in one
        pass over shared memory."""
        tx = T.get_thread_binding()
        mine = T.alloc_var("uint64")
        rank = T.alloc_var("int32")
        for it in T.serial(T.ceildiv(topk, NT)):
            i = it * NT + tx
            if i >= k_eff and i < topk:
                selected_page_ids[b, h, i] = -1
                selected_scores[b, h, i] = -T.infinity("float32")
        for it in T.serial(T.ceildiv(n, NT)):
            if it * NT + tx < n:
                mine = comp[it * NT + tx]
                rank = 0
                # Zeros past n never outrank a candidate: no bound check in the unrolled loop.
                for m0 in T.serial(T.ceildiv(n, _RANK_UNROLL)):
                    for mm in T.unroll(_RANK_UNROLL):
                        rank += T.if_then_else(comp[m0 * _RANK_UNROLL + mm] > mine, 1, 0)
                if rank < k_eff:
                    page = idx_top - T.cast(mine & T.uint64(idx_top), "int32")
                    selected_page_ids[b, h, rank] = page_table[b, page]
                    selected_scores[b, h, rank] = _key_to_score(T.cast(mine >> _IDX_BITS, "uint32"))

    @T.prim_func
    def hsa_topk(keys: T.Tensor((batch, num_kv_heads, max_pages), "uint32"),
                 page_table: T.Tensor((batch, max_pages), "int32"),
                 seq_lens: T.Tensor((batch,), "int32"),
                 selected_page_ids: T.Tensor((batch, num_kv_heads, topk), "int32"),
                 selected_scores: T.Tensor((batch, num_kv_heads, topk), "float32")):
        with T.Kernel(num_kv_heads, batch, threads=NT) as (h, b):
            tx = T.get_thread_binding()
            comp = T.alloc_shared((n_comp,), "uint64")
            key_hist = T.alloc_shared((_HIST_BINS,), "int32")
            suffix = T.alloc_shared((NT + 1,), "int32")
            warp_sum = T.alloc_shared((NW,), "int32")
            cut = T.alloc_shared((2,), "int32")  # the bin of the k-th key, and the keys in it and above
            filled = T.alloc_shared((1,), "int32")  # candidates collected
            counts = T.alloc_local((BPT,), "int32")
            kbuf = T.alloc_local((_KEY_BATCH,), "uint32")
            acc = T.alloc_var("int32", 0)
            k_eff = T.alloc_var("int32")
            thr = T.alloc_var("int32")  # cut[0] in a register: reading the shared copy between the
            # collecting threads' atomics would make TileLang put a barrier before each key
            n = _first_local(seq_lens[b], page_size, window_size) // page_size
            for i in T.unroll(n_comp // NT):
                comp[i * NT + tx] = T.uint64(0)
            for i in T.unroll(BPT):
                key_hist[i * NT + tx] = 0
            T.sync_threads()
            for it in T.serial(T.ceildiv(n, NT * _KEY_BATCH)):
                load_batch(keys, kbuf, b, h, n, it, tx)
                for e in T.unroll(_KEY_BATCH):
                    if kbuf[e] != _u32(0):
                        T.atomic_add(key_hist[bin_of(kbuf[e])], 1)
            T.sync_threads()
            for v in T.vectorized(BPT):
                counts[v] = key_hist[tx * BPT + v]
            # TileLang lays the buffers below over the histogram (its last read is above): no write before
            # every thread has read its bins.
            T.sync_threads()
            for v in T.unroll(BPT):
                acc += counts[v]
            if tx == 0:
                cut[0] = _HIST_BINS  # no candidates: no bin qualifies
                cut[1] = 0
                filled[0] = 0
            suffix_scan(acc, suffix, warp_sum)
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
            if cut[1] <= _RANK_MAX:
                # The bound always holds (the histogram counted these keys); it keeps the stores in comp.
                scatter(keys, b, h, n, from_bin(thr), filled, 0, n_comp, comp)
                write_ranked(comp, cut[1], k_eff, page_table, b, h, selected_page_ids, selected_scores)
            else:
                select(keys, b, h, n, k_eff, comp, suffix, warp_sum)
                write_ranked(comp, k_eff, k_eff, page_table, b, h, selected_page_ids, selected_scores)

    return hsa_topk


# ----------------------------------------------------------------------------- decode
def hsa_decode_kernel(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, topk: int,
                      dtype: str, window_size: int, combine: str, scale: float):
    """Per (split, kv head, request): merge the split's items (pages) into partial (o, lse) per query
    head. The split count is the partials' split axis (the grid's x, chosen by the caller from the batch);
    a request's topk + n_local items are cut into that many contiguous ranges of equal length, which the
    caller keeps <= _ZCOLS (``_num_splits``)."""
    G = num_heads // num_kv_heads
    GM = _QROWS_DECODE
    # Warps split the N of every product (M is one 16-row tile): N = page_size needs >= 8 per warp.
    threads = 32 * min(4, page_size // 8)
    fuse_z = combine == "softmax"
    batch, max_pages, num_slots, num_pages, num_splits = T.dynamic(
        "batch, max_pages, num_slots, num_pages, num_splits")
    f32 = "float32"

    @T.prim_func
    def hsa_decode(q: T.Tensor((batch, num_heads, head_dim), dtype),
                   k_buffer: T.Tensor((num_slots, num_kv_heads, head_dim), dtype),
                   v_buffer: T.Tensor((num_slots, num_kv_heads, head_dim), dtype),
                   page_table: T.Tensor((batch, max_pages), "int32"),
                   seq_lens: T.Tensor((batch,), "int32"),
                   chunk_repr: T.Tensor((num_pages, num_kv_heads, head_dim), dtype),
                   selected_page_ids: T.Tensor((batch, num_kv_heads, topk), "int32"),
                   o_part: T.Tensor((batch, num_heads, num_splits, head_dim), f32),
                   lse_part: T.Tensor((batch, num_heads, num_splits), f32)):
        with T.Kernel(num_splits, num_kv_heads, batch, threads=threads) as (sp, h, b):
            q_s = T.alloc_shared((GM, head_dim), dtype)
            k_s = T.alloc_shared((page_size, head_dim), dtype)
            v_s = T.alloc_shared((page_size, head_dim), dtype)
            e_s = T.alloc_shared((_ZCOLS, head_dim), dtype)
            z_s = T.alloc_shared((GM, _ZCOLS), f32)
            z = T.alloc_fragment((GM, _ZCOLS), f32)
            acc_s = T.alloc_fragment((GM, page_size), f32)
            p_s = T.alloc_shared((GM, page_size), dtype)  # P via shared: every warp needs all of its rows
            acc_o = T.alloc_fragment((GM, head_dim), f32)
            m_run = T.alloc_fragment((GM,), f32)  # running max of merge logits
            l_run = T.alloc_fragment((GM,), f32)  # running sum of exp(merge logit - m_run)
            m_pg = T.alloc_fragment((GM,), f32)
            l_pg = T.alloc_fragment((GM,), f32)
            alpha = T.alloc_fragment((GM,), f32)
            weight = T.alloc_fragment((GM,), f32)
            L = seq_lens[b]
            lo = _first_local(L, page_size, window_size)
            p0 = lo // page_size
            n_local = T.ceildiv(L, page_size) - p0
            # Items of this split (vars: computed once); past the request's items a split is empty. The
            # min only matters for seq_lens past the page table (validate=False): z_s has _ZCOLS columns.
            per_split = T.alloc_var("int32", init=T.min(T.ceildiv(topk + n_local, num_splits), _ZCOLS))
            i0 = sp * per_split
            n_it = T.alloc_var("int32", init=T.clamp(topk + n_local - i0, 0, per_split))

            for g, d in T.Parallel(GM, head_dim):
                q_s[g, d] = T.if_then_else(g < G, q[b, h * G + T.min(g, G - 1), d], T.cast(0, dtype))
            T.clear(acc_o)
            T.fill(m_run, -T.infinity(f32))
            T.clear(l_run)
            if fuse_z:
                for r, d in T.Parallel(_ZCOLS, head_dim):
                    e_s[r, d] = T.cast(0, dtype)
                    if r < n_it and i0 + r < topk:
                        if selected_page_ids[b, h, i0 + r] >= 0:
                            e_s[r, d] = chunk_repr[selected_page_ids[b, h, i0 + r], h, d]
                T.gemm(q_s, e_s, z, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
                T.copy(z, z_s)

            # One stage (K/V of the next page still load during this one's math): the trip count is dynamic.
            for it in T.Pipelined(n_it, num_stages=1):
                # Item i -> physical page and its valid token range [tok_lo, tok_hi). Every iteration
                # loads a page (a hole, -1, reads page 0 with no valid token) so the loop pipelines.
                i = i0 + it
                is_sel = i < topk
                j_loc = p0 + i - topk  # logical page of a local item
                is_loc = not is_sel and i - topk < n_local
                sel_pid = selected_page_ids[b, h, T.min(i, topk - 1)]
                valid = (is_sel and sel_pid >= 0) or is_loc
                pid = T.if_then_else(is_sel, T.max(sel_pid, 0),
                                     T.if_then_else(is_loc, page_table[b, T.min(j_loc, max_pages - 1)], 0))
                tok_lo = T.if_then_else(is_loc, lo - j_loc * page_size, 0)
                tok_hi = T.if_then_else(valid, T.if_then_else(is_loc, L - j_loc * page_size, page_size), 0)
                T.copy(k_buffer[pid * page_size:(pid + 1) * page_size, h, :], k_s)
                T.copy(v_buffer[pid * page_size:(pid + 1) * page_size, h, :], v_s)
                T.gemm(q_s, k_s, acc_s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
                for g, n in T.Parallel(GM, page_size):
                    acc_s[g, n] = T.if_then_else(n >= tok_lo and n < tok_hi, acc_s[g, n] * (scale * _LOG2E),
                                                 -T.infinity(f32))
                T.reduce_max(acc_s, m_pg, dim=1)
                for g in T.Parallel(GM):
                    m_pg[g] = T.if_then_else(valid, m_pg[g], 0)  # keeps an empty item's exp2 at 0, not NaN
                for g, n in T.Parallel(GM, page_size):
                    acc_s[g, n] = T.exp2(acc_s[g, n] - m_pg[g])
                T.reduce_sum(acc_s, l_pg, dim=1)
                for g in T.Parallel(GM):
                    # Merge logit in log2 units: z_k for a selected page in softmax mode, else the lse.
                    logit = m_pg[g] + T.log2(l_pg[g])
                    if fuse_z:
                        logit = T.if_then_else(is_sel, z_s[g, it] * (scale * _LOG2E), logit)
                    m_new = T.if_then_else(valid, T.max(m_run[g], logit), m_run[g])
                    alpha[g] = T.if_then_else(valid, T.exp2(m_run[g] - m_new), 1)
                    weight[g] = T.if_then_else(valid, T.exp2(logit - m_new), 0)
                    l_run[g] = l_run[g] * alpha[g] + weight[g]
                    weight[g] = T.if_then_else(valid, weight[g] / l_pg[g], 0)
                    m_run[g] = m_new
                for g, d in T.Parallel(GM, head_dim):
                    acc_o[g, d] *= alpha[g]
                for g, n in T.Parallel(GM, page_size):
                    p_s[g, n] = T.cast(acc_s[g, n] * weight[g], dtype)
                T.gemm(p_s, v_s, acc_o, policy=T.GemmWarpPolicy.FullCol)

            for g, d in T.Parallel(GM, head_dim):
                if g < G:
                    o_part[b, h * G + g, sp, d] = T.if_then_else(l_run[g] > 0, acc_o[g, d] / l_run[g], 0)
            for g in T.Parallel(GM):
                if g < G:
                    lse_part[b, h * G + g, sp] = T.if_then_else(
                        l_run[g] > 0, (m_run[g] + T.log2(l_run[g])) / _LOG2E, -T.infinity(f32))

    return hsa_decode


def hsa_combine_kernel(num_heads: int, head_dim: int, dtype: str):
    """o[b, h] = sum over splits of exp(lse_s) o_s / sum of exp(lse_s); 0 when every split is empty."""
    batch, num_splits = T.dynamic("batch, num_splits")
    f32 = "float32"

    @T.prim_func
    def hsa_combine(o_part: T.Tensor((batch, num_heads, num_splits, head_dim), f32),
                    lse_part: T.Tensor((batch, num_heads, num_splits), f32),
                    o: T.Tensor((batch, num_heads, head_dim), dtype)):
        with T.Kernel(num_heads, batch, threads=head_dim) as (hq, b):
            acc = T.alloc_fragment((head_dim,), f32)
            m = T.alloc_var(f32)
            total = T.alloc_var(f32)
            w = T.alloc_var(f32)
            m = -T.infinity(f32)
            for s in T.serial(num_splits):
                m = T.max(m, lse_part[b, hq, s])
            total = 0
            T.clear(acc)
            if m > -T.infinity(f32):
                for s in T.serial(num_splits):
                    w = T.exp(lse_part[b, hq, s] - m)
                    total += w
                    for d in T.Parallel(head_dim):
                        acc[d] += w * o_part[b, hq, s, d]
            for d in T.Parallel(head_dim):
                o[b, hq, d] = T.cast(T.if_then_else(total > 0, acc[d] / total, 0), dtype)

    return hsa_combine


# ----------------------------------------------------------------------------- ops
def _dtype_name(dtype) -> str:
    if dtype not in _DTYPES:
        raise TypeError(f"dtype: expected one of {list(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _check_values(checks: list[tuple[str, torch.Tensor]]) -> None:
    """Raise ValueError for the first failed (message, bool tensor) check: one host sync for all."""
    if not checks:
        return
    ok = torch.stack([c.all() for _, c in checks]).tolist()
    for (msg, _), good in zip(checks, ok):
        if not good:
            raise ValueError(msg)


class HSAPageReprTileLang:
    """Fills chunk_repr rows of completed pages: ``mode="mean"`` (mean of the page's keys per kv head) or
    ``"last"`` (its last key). ``op(k_buffer, page_ids, chunk_repr)`` writes rows ``page_ids`` of
    chunk_repr in place (nothing else) and returns chunk_repr."""

    op_name = "hsa_page_repr"

    def __init__(self, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype, mode: str = "mean"):
        check_int("num_kv_heads", num_kv_heads, lo=1)
        check_choice("head_dim", head_dim, (64, 128, 256))
        check_choice("page_size", page_size, (16, 32, 64, 128))
        check_choice("mode", mode, _REPR_MODES)
        self.dtype = dtype
        self.spec = dict(num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                         dtype=_dtype_name(dtype), mode=mode)
        self.kernel = compile_kernel(page_repr_kernel(**self.spec))

    def __call__(self, k_buffer: torch.Tensor, page_ids: torch.Tensor, chunk_repr: torch.Tensor,
                 validate: bool = True) -> torch.Tensor:
        Hkv, D, ps = self.spec["num_kv_heads"], self.spec["head_dim"], self.spec["page_size"]
        check_tensor("k_buffer", k_buffer, self.dtype, (None, Hkv, D))
        check_tensor("page_ids", page_ids, torch.int32, (None,), device=k_buffer.device)
        check_tensor("chunk_repr", chunk_repr, self.dtype, (None, Hkv, D), device=k_buffer.device)
        num_pages = chunk_repr.shape[0]
        if k_buffer.shape[0] < num_pages * ps:
            raise ValueError(f"k_buffer: expected at least num_physical_pages * page_size = {num_pages * ps} "
                             f"slots, got {k_buffer.shape[0]}")
        if validate:
            _check_values([(f"page_ids: expected values in [0, {num_pages})",
                            (page_ids >= 0) & (page_ids < num_pages))])
        if page_ids.numel():
            self.kernel(k_buffer, page_ids, chunk_repr)
        return chunk_repr


class HSADecodeTileLang:
    """HSA decode: per request and kv head, top-k pages by repr score, then attention over those pages
    and the local tokens, combined per ``combine`` (see golden/hsa_decode.py for the semantics).

    ``op(q, k_buffer, v_buffer, page_table, seq_lens, chunk_repr, repr_valid=None, selected_page_ids=None,
    out=None, validate=True) -> o``; ``op.select(q, page_table, seq_lens, chunk_repr, repr_valid=None,
    validate=True) -> (selected_page_ids, selected_scores)``. ``validate=False`` skips the value checks
    that need a host sync (seq_lens range, page ids in range), so a call can be captured in a CUDA graph.
    """

    op_name = "hsa_decode"
    # split_overhead: the split count rule's price of a split's fixed work, in items (``_num_splits``).
    DEFAULT_CONFIG = {"split_overhead": 2}

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, topk: int,
                 dtype: torch.dtype, selection_strategy: str = "group", window_size: int = 0,
                 combine: str = "softmax", scale: float | None = None, config: dict | None = None,
                 score_config: dict | None = None):
        check_int("num_heads", num_heads, lo=1)
        check_int("num_kv_heads", num_kv_heads, lo=1)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads: expected a multiple of num_kv_heads ({num_kv_heads}) so that "
                             f"G = num_heads / num_kv_heads is an integer, got {num_heads}")
        check_int("G (num_heads / num_kv_heads)", num_heads // num_kv_heads, lo=1, hi=16)
        check_choice("head_dim", head_dim, (64, 128, 256))
        check_choice("page_size", page_size, (16, 32, 64, 128))
        check_int("topk", topk, lo=1, hi=2048)
        check_choice("selection_strategy", selection_strategy, _STRATEGIES)
        check_int("window_size", window_size, lo=0)
        check_choice("combine", combine, _COMBINES)
        if scale is None:
            scale = head_dim ** -0.5
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale: expected a positive finite float or None, got {scale!r}")
        self.dtype = dtype
        self.selection_strategy = selection_strategy
        self.spec = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         page_size=page_size, topk=topk, dtype=_dtype_name(dtype), window_size=window_size,
                         combine=combine, scale=float(scale))
        self.config = resolve_config(self.op_name, self.spec, config, self.DEFAULT_CONFIG)
        check_int("config['split_overhead']", self.config["split_overhead"], lo=0)
        self.decode_ctas_per_sm = max(1, min(_DECODE_CTAS_PER_SM, _SM_SMEM // (_decode_smem(page_size, head_dim) + 1024)))
        sp = self.spec
        score_config = score_config or {}
        self.score_kernel = compile_kernel(hsa_score_kernel(
            num_heads, num_kv_heads, head_dim, page_size, sp["dtype"], selection_strategy, window_size, sp["scale"],
            **score_config))
        self.topk_kernel = compile_kernel(hsa_topk_kernel(num_kv_heads, page_size, topk, window_size))
        # Without warp specialization: every warp computes (the products split N over all of them).
        self.decode_kernel = compile_kernel(hsa_decode_kernel(**sp),
                                            pass_configs={"tl.disable_warp_specialized": True})
        self.combine_kernel = compile_kernel(hsa_combine_kernel(num_heads, head_dim, sp["dtype"]))
        self._all_valid = {}  # device -> uint8 ones, the repr_valid of calls without one

    # -- validation
    def _check_common(self, q, page_table, seq_lens, chunk_repr, repr_valid):
        sp = self.spec
        Hq, Hkv, D = sp["num_heads"], sp["num_kv_heads"], sp["head_dim"]
        check_tensor("q", q, self.dtype, (None, Hq, D))
        B, dev = q.shape[0], q.device
        if B < 1:
            raise ValueError("q: expected a batch of at least 1 request, got 0")
        check_tensor("page_table", page_table, torch.int32, (B, None), device=dev)
        check_tensor("seq_lens", seq_lens, torch.int32, (B,), device=dev)
        check_tensor("chunk_repr", chunk_repr, self.dtype, (None, Hkv, D), device=dev)
        max_pages, num_pages = page_table.shape[1], chunk_repr.shape[0]
        if max_pages < 1 or num_pages < 1:
            raise ValueError(f"page_table / chunk_repr: expected at least one page, got max_pages={max_pages}, "
                             f"num_physical_pages={num_pages}")
        if max_pages >= 1 << _IDX_BITS or max_pages * sp["page_size"] >= 1 << 31:
            raise ValueError(f"page_table: expected max_pages * page_size < 2**31 and max_pages < 2**{_IDX_BITS}, "
                             f"got max_pages={max_pages}")
        if repr_valid is not None:
            check_tensor("repr_valid", repr_valid, torch.bool, (num_pages,), device=dev)

    def _value_checks(self, page_table, seq_lens, num_pages):
        ps = self.spec["page_size"]
        max_pages = page_table.shape[1]
        used = torch.arange(max_pages, device=page_table.device) < ((seq_lens + ps - 1) // ps)[:, None]
        return [
            (f"seq_lens: expected values in [1, max_pages * page_size = {max_pages * ps}] (seq_len 0 is an error)",
             (seq_lens >= 1) & (seq_lens <= max_pages * ps)),
            (f"page_table: expected the pages of each request (logical page < ceil(seq_len / page_size)) "
             f"to be physical page ids in [0, {num_pages})",
             ~used | ((page_table >= 0) & (page_table < num_pages))),
        ]

    # -- entry points
    def select(self, q, page_table, seq_lens, chunk_repr, repr_valid=None, validate: bool = True):
        """-> (selected_page_ids [B, Hkv, topk] int32 padded -1, selected_scores fp32 padded -inf), best first."""
        self._check_common(q, page_table, seq_lens, chunk_repr, repr_valid)
        if validate:
            _check_values(self._value_checks(page_table, seq_lens, chunk_repr.shape[0]))
        return self._select(q, page_table, seq_lens, chunk_repr, repr_valid)

    def _valid(self, repr_valid, num_pages: int, device):
        """repr_valid as bytes; without one, all pages valid: a buffer kept per device rather than a fill per
        call, except one made during a CUDA graph capture (its fill runs only when the graph does)."""
        if repr_valid is not None:
            return repr_valid.view(torch.uint8)
        ones = self._all_valid.get(device)
        if ones is None or ones.numel() < num_pages:
            ones = torch.ones(num_pages, dtype=torch.uint8, device=device)
            if not torch.cuda.is_current_stream_capturing():
                self._all_valid[device] = ones
        return ones[:num_pages]

    def _select(self, q, page_table, seq_lens, chunk_repr, repr_valid):
        B, Hkv, k = q.shape[0], self.spec["num_kv_heads"], self.spec["topk"]
        valid = self._valid(repr_valid, chunk_repr.shape[0], q.device)
        # Allocated as int32: torch has few uint32 kernels (fills included).
        keys = torch.empty(B, Hkv, page_table.shape[1], dtype=torch.int32, device=q.device).view(torch.uint32)
        ids = torch.empty(B, Hkv, k, dtype=torch.int32, device=q.device)
        scores = torch.empty(B, Hkv, k, dtype=torch.float32, device=q.device)
        self.score_kernel(q, page_table, seq_lens, chunk_repr, valid, keys)
        self.topk_kernel(keys, page_table, seq_lens, ids, scores)
        return ids, scores

    def _check_decode(self, q, k_buffer, v_buffer, page_table, seq_lens, chunk_repr, repr_valid,
                      selected_page_ids, out):
        self._check_common(q, page_table, seq_lens, chunk_repr, repr_valid)
        sp = self.spec
        Hkv, D, dev = sp["num_kv_heads"], sp["head_dim"], q.device
        check_tensor("k_buffer", k_buffer, self.dtype, (None, Hkv, D), device=dev)
        need = chunk_repr.shape[0] * sp["page_size"]
        if k_buffer.shape[0] < need:
            raise ValueError(f"k_buffer: expected at least num_physical_pages * page_size = {need} slots, "
                             f"got {k_buffer.shape[0]}")
        check_tensor("v_buffer", v_buffer, self.dtype, tuple(k_buffer.shape), device=dev)
        if selected_page_ids is not None:
            check_tensor("selected_page_ids", selected_page_ids, torch.int32, (q.shape[0], Hkv, sp["topk"]),
                         device=dev)
        if out is not None:
            check_tensor("out", out, self.dtype, tuple(q.shape), device=dev)

    def __call__(self, q, k_buffer, v_buffer, page_table, seq_lens, chunk_repr, repr_valid=None,
                 selected_page_ids=None, out=None, validate: bool = True):
        self._check_decode(q, k_buffer, v_buffer, page_table, seq_lens, chunk_repr, repr_valid,
                           selected_page_ids, out)
        num_pages = chunk_repr.shape[0]
        if validate:
            checks = self._value_checks(page_table, seq_lens, num_pages)
            if selected_page_ids is not None:
                checks.append((f"selected_page_ids: expected -1 or physical page ids in [0, {num_pages})",
                               (selected_page_ids >= -1) & (selected_page_ids < num_pages)))
            _check_values(checks)
        if selected_page_ids is None:
            selected_page_ids, _ = self._select(q, page_table, seq_lens, chunk_repr, repr_valid)
        o_part, lse_part = self._partials(q, self.num_splits(q.shape[0], q.device))
        self.decode_kernel(q, k_buffer, v_buffer, page_table, seq_lens, chunk_repr, selected_page_ids,
                           o_part, lse_part)
        if out is None:
            out = torch.empty_like(q)
        self.combine_kernel(o_part, lse_part, out)
        return out

    def num_splits(self, batch: int, device) -> int:
        """Decode splits for a batch (from shapes and the device only, so calls stay capturable)."""
        sp = self.spec
        n_items = sp["topk"] + _local_pages_max(sp["page_size"], sp["window_size"])
        slots = sm_count(torch.device(device)) * self.decode_ctas_per_sm
        return _num_splits(batch * sp["num_kv_heads"], n_items, slots, self.config["split_overhead"])

    @staticmethod
    def _partials(q, num_splits):
        B, Hq, D = q.shape
        return (torch.empty(B, Hq, num_splits, D, dtype=torch.float32, device=q.device),
                torch.empty(B, Hq, num_splits, dtype=torch.float32, device=q.device))
