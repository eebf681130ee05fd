"""htree forward (`HTreeForwardTileLang`): hierarchical tree sparse attention, see ``golden.htree``.

Kernels:
  - ``htree_pool_kernel`` builds one tree layer (mean of each node's existing children), once per layer;
  - ``htree_rope_kernel`` rotates the top layer's K once (its candidates are the same nodes at the same
    buffer positions for every query), so the top-layer kernels read them as contiguous rows;
  - the top layer (for L > 1) is done by GEMMs over blocks of queries, since all queries score the same
    rotated top-layer rows (only their own RoPE position differs): ``htree_top_lse_kernel`` computes every
    query head's log-sum-exp over it, ``htree_top_keys_kernel`` every query's packed importance keys,
    and, after the walk, ``htree_top_merge_kernel`` merges the top layer's non-winners and writes O (each
    streams the top layer in chunks staged by cp.async one chunk ahead, so a chunk's loads overlap the
    previous chunk's products; fp32 K and V are split into TF32 halves once per call, ``_split_tf32``, so
    the chunks land as the products' operand tiles);
  - ``htree_fwd_kernel`` walks the rest of one (b, t, kv head) row in one CTA: the top layer's top-k from
    its keys, then every lower layer, fused, so the selected parents of a layer live in shared memory;
  - ``htree_layer0_kernel`` (fp32 with K, V in {32, 64}): layer 0 of the walk's rows, from the parents the walk
    hands over; ``htree_layer16_kernel`` (fp16 / bf16 with r >= 16): the same for layer 0 and, one launch per
    layer, every middle layer 0 < l < L - 1 (the walk then stops after the top layer's selection). Without the
    walk's shared tiles they run more CTAs per SM, and their operands go from the gathers straight into
    mma.sync register fragments; the 16-bit one reads K pre-rotated at the child index, node % r
    (``htree_rope_kernel`` with a period), rotates the query once per 16-candidate tile instead of loading
    RoPE table rows per candidate, and keeps a middle layer's scores in a per-slab scratch between its
    passes, so each candidate's K and V are gathered once. Other cases stay in the walk.

Below the top the walk streams each layer's candidates in chunks of ``block_n``: gathers their K into
registers (all of a chunk's loads in flight at once, issued one chunk ahead so they overlap the previous
chunk's math), rotates it at the candidates' buffer positions into shared memory and scores the G query
heads with the tensor cores (M = G padded to 16). Layers l > 0 take three passes: (1) the per-head
log-sum-exp (per-element partial max/sum in registers, reduced once per layer), (2) the packed
importance keys (fp32 importance, low LOG_N bits = ~position) into shared memory, then (also for the top
layer's keys) the top-k threshold, the top_k-th largest key, by a radix select over them (8 bits per
pass; keys are distinct, so exactly top_k keys reach it) and an order-preserving compaction of the winners
into the next layer's parents (candidate buffers are in ascending node order, so the parents stay sorted);
(3) the non-winners
merged into the per-head online softmax with V, against one reference per layer (lse bounds every
score, so no per-chunk maximum). Layer 0 merges all with a running maximum. The walk's state (U, m, S
per head) goes to the top-merge kernel, which adds the top layer's non-winners (against their lse) and
normalizes. The walk's shared-memory chunks are bound by L1 traffic (gathers, operand stores and mma operand
loads); the layer kernels by their gathers (latency in fp32, L1 wavefronts in 16-bit); see docs/perf.md.

fp32 inputs use split-TF32 products (hi*hi + hi*lo + lo*hi), close to fp32 accuracy so selections match
an fp32 reference; fp16/bf16 inputs use one 16-bit product with fp32 accumulation. The top-layer kernels'
64-row tiles run them as warpgroup (wgmma) products; the walk's 16-row tiles as mma.sync. The layer kernels
gather their operands straight into the mma.sync register fragments, each warp merging its own share of the
candidates, with no shared memory in between.

Memory: the tree above layer 0, sum_{l>=1} N_l ~ T / (r - 1) nodes of K and V per (batch, kv head) in
the input dtype, the rotated top layer (<= max_top_nodes rows of K per (batch, kv head); fp32 also its K
and V in TF32 halves, 2 (K + V) x 4 bytes per node), RoPE tables of
max(max_top_nodes, top_k * r) x K/2 fp32 pairs and the top layer's lse [B, T, H] fp32. The queries go
through the top-layer kernels and the walk in slabs, sized so that a slab's packed keys
[B, slab, Hkv, N_top] int32 take at most 256 MiB; per slab also the walk's state [B, slab, H, V + 2]
fp32, and for the layer kernels the parents [B, slab, Hkv, top_k] int32; the 16-bit layer kernel also takes
rotated copies of k ([B, Hkv, T, K], k's size) and of the middle layers' K nodes, and with L > 2 a scratch of
scores [B, slab, Hkv, G, max(max_top_nodes, top_k * r)] fp32, at most 1 GiB (the slab shrinks to fit).
Nothing else scales with T x candidates; the output and, on request, the selections [L-1, B, T, Hkv, top_k]
int32.
"""

import math
import struct

import torch

from golden.htree import RIGHTMOST_IMPORTANCE, pack_bits, rope_tables
from ._runtime import check_choice, check_int, check_tensor, compile_kernel, resolve_config

import tilelang.language as T  # noqa: E402  (after _runtime set the cache dir)

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_MAX_LAYERS = 32  # r >= 2 and T < 2^31
_MAX_BUFFER = 16384  # candidate buffer (packed keys live in shared memory)
_NEG = -1.0e30  # finite "minus infinity": exp2(_NEG - m) == 0 without inf - inf
_LOG2E = 1.4426950408889634
_FLT_MIN = 1.1754943508222875e-38
_RIGHTMOST_KEY = struct.unpack("<i", struct.pack("<f", RIGHTMOST_IMPORTANCE))[0]  # its fp32 bits


def htree_pool_kernel(num_kv_heads: int, head_dim: int, v_head_dim: int, compression_rate: int,
                      dtype: str, block_i: int = 32, threads: int = 128):
    """Dst[b, dst_off + i] = mean of Src[b, src_off + i*r + c] over existing children c < r."""
    H, K, V, r = num_kv_heads, head_dim, v_head_dim, compression_rate
    B, NS, ND = T.dynamic("B"), T.dynamic("NS"), T.dynamic("ND")

    @T.prim_func
    def htree_pool(SrcK: T.Tensor((B, NS, H, K), dtype), SrcV: T.Tensor((B, NS, H, V), dtype),
                   DstK: T.Tensor((B, ND, H, K), dtype), DstV: T.Tensor((B, ND, H, V), dtype),
                   src_off: T.int32, src_len: T.int32, dst_off: T.int32, dst_len: T.int32):
        with T.Kernel(T.ceildiv(dst_len, block_i), H, B, threads=threads) as (bi, h, b):
            for i, d in T.Parallel(block_i, K + V):
                node = bi * block_i + i
                count = T.min(r, src_len - node * r)
                if node < dst_len:
                    if d < K:
                        total = sum(T.if_then_else(c < count, T.cast(SrcK[b, T.min(src_off + node * r + c, NS - 1), h,
                                                                           T.min(d, K - 1)], "float32"), 0.0)
                                    for c in range(r))
                        DstK[b, dst_off + node, h, d] = T.cast(total / T.cast(count, "float32"), dtype)
                    else:
                        total = sum(T.if_then_else(c < count, T.cast(SrcV[b, T.min(src_off + node * r + c, NS - 1), h,
                                                                           T.max(d - K, 0)], "float32"), 0.0)
                                    for c in range(r))
                        DstV[b, dst_off + node, h, d - K] = T.cast(total / T.cast(count, "float32"), dtype)

    return htree_pool


def _tf32_hi(x):
    """The TF32-exact high part of fp32 x (low 13 mantissa bits cleared); x minus it is exact in fp32."""
    return T.reinterpret(T.bitwise_and(T.reinterpret(x, "int32"), T.int32(-8192)), "float32")


@T.macro
def _split(v, hi, lo, i):
    """hi[i], lo[i] = the split-TF32 halves of fp32 v (local buffers)."""
    hi[i] = _tf32_hi(v)
    lo[i] = v - hi[i]


def _rope_pair(x, y, cos, sin):
    """Rotate-half RoPE of the pair (x, y) = (v[i], v[i + K/2]) at the angle of (cos, sin)."""
    return x * cos - y * sin, x * sin + y * cos


def _mma(a, ai, b, bi, c, ci, dtype: str = "float32"):
    """c[ci:ci+4] += a @ b for one tile held in registers, in the PTX fragment layouts: fp32 as an m16n8k8 TF32
    tile (a at ai, four values; b at bi, two), 16-bit as m16n8k16 (eight and four); c four fp32."""
    shape, ab = {"float32": ("m16n8k8", "tf32"), "float16": ("m16n8k16", "fp16"),
                 "bfloat16": ("m16n8k16", "bf16")}[dtype]
    return T.ptx_mma("float32", shape, "row", "col", ab, ab, "fp32", a.data, ai, b.data, bi, c.data, ci, False)


def _split_layer0(dtype: str, K: int, V: int, G: int, r: int) -> bool:
    """Whether layer 0 runs in its own kernel: htree_layer0_kernel (fp32, K and V in {32, 64}, G <= 16) or
    htree_layer16_kernel (16-bit, r >= 16: a 16-candidate tile never spans two parents; the middle layers too)."""
    if dtype == "float32":
        return K in (32, 64) and V in (32, 64) and G <= 16
    return r >= 16


def _child(parents, p, r: int, top_k: int):
    """Node of candidate p below the top: child p % r of parent p // r (parents in shared memory)."""
    return parents[T.min(p >> int(math.log2(r)), top_k - 1)] * r + T.bitwise_and(p, r - 1)


def _operand_stores(dtype: str, half: int):
    """Macros storing fp32 values as mma operands of ``dtype`` (fp32: split-TF32 halves in two tiles):
    put(x, dst, dst_lo, i, j), and put_rotated for a RoPE pair (i, i + half)."""
    split = dtype == "float32"

    @T.macro
    def put(x, dst, dst_lo, i, j):
        if split:  # the TF32-exact high part and the fp32 remainder
            hi = _tf32_hi(x)
            dst[i, j] = hi
            dst_lo[i, j] = x - hi
        else:
            dst[i, j] = T.cast(x, dtype)

    @T.macro
    def put_rotated(x, y, cos, sin, mul, ok, dst, dst_lo, row, i):
        """dst[row, i], dst[row, i + half] = mul * rotate-half RoPE of the pair (x, y); 0 unless ok."""
        lo, hi = _rope_pair(x, y, cos, sin)
        lo = T.if_then_else(ok, mul * lo, 0.0)
        hi = T.if_then_else(ok, mul * hi, 0.0)
        put(lo, dst, dst_lo, row, i)
        put(hi, dst, dst_lo, row, i + half)

    return put, put_rotated


@T.macro
def _split_product(a_s, a_lo, b_s, b_lo, acc):
    """acc += a @ b^T from split-TF32 halves (hi*hi + hi*lo + lo*hi)."""
    T.gemm(a_s, b_s, acc, transpose_B=True)
    T.gemm(a_s, b_lo, acc, transpose_B=True)
    T.gemm(a_lo, b_s, acc, transpose_B=True)


@T.macro
def _lse_update(m_part, l_part, i, j, s):
    """Fold score s (log2 domain, <= _NEG: none) into the per-element partial max / sum of exp2."""
    mx = T.max(m_part[i, j], s)
    l_part[i, j] = T.if_then_else(s <= _NEG, l_part[i, j], l_part[i, j] * T.exp2(m_part[i, j] - mx) + T.exp2(s - mx))
    m_part[i, j] = mx


@T.macro
def _lse_finish(m_part, l_part, m_row, lse):
    """lse[i] = log2 sum_j of the partials of row i (l_part is consumed)."""
    T.reduce_max(m_part, m_row, dim=1, clear=True)
    for i, j in T.Parallel(m_part.shape[0], m_part.shape[1]):
        l_part[i, j] *= T.exp2(m_part[i, j] - m_row[i])
    T.reduce_sum(l_part, lse, dim=1, clear=True)
    for i in T.Parallel(m_part.shape[0]):
        lse[i] = m_row[i] + T.log2(lse[i])


def _head_sum(buf, num_heads: int, row, j):
    """sum_g buf[row + g, j] over num_heads rows, in head order like the golden."""
    total = buf[row, j]
    for g in range(1, num_heads):
        total = total + buf[row + g, j]
    return total


def _packed_key(prob, num_heads: int, row, j, p, n, pos_mask: int):
    """Candidate p's packed importance key: the fp32 sum of its heads' probabilities (rows row .. row +
    num_heads - 1 of prob, column j; the rightmost candidate n - 1 gets 1e3) with its low LOG_N bits
    replaced by ~p, so keys are distinct and order ties by the smaller position."""
    bits = T.if_then_else(p == n - 1, _RIGHTMOST_KEY, T.reinterpret(_head_sum(prob, num_heads, row, j), "int32"))
    return T.bitwise_or(T.bitwise_and(bits, ~pos_mask), T.bitwise_and(T.bitwise_not(p), pos_mask))


@T.macro
def _select_top_k(keys, n, top_k: int, hist, pick, tmp, tx, threads: int):
    """pick[0] = the top_k-th largest of keys[0:n] (distinct and non-negative), 0 when n <= top_k: radix select,
    8 bits per pass from bit 30 down, on a shared histogram of the keys that match pick[0] above the digit, with
    pick[1] the wanted key's rank among those (tmp: four int32 per thread)."""
    if tx == 0:
        pick[0] = 0
        pick[1] = top_k
    T.sync_threads()
    if n > top_k:
        for d in T.serial(4):
            hi = 31 - 8 * d
            lo = T.max(hi - 8, 0)
            for i in T.Parallel(256):
                hist[i] = 0
            tmp[3] = T.shift_right(pick[0], hi)  # the threshold's bits found so far
            T.sync_threads()
            for i in T.serial(T.ceildiv(n, threads)):
                p = i * threads + tx
                if p < n:
                    if T.shift_right(keys[p], hi) == tmp[3]:
                        # (atomicAdd itself: T.atomic_add makes ThreadSync put a barrier in every iteration; the
                        # increments commute)
                        T.call_extern("int32", "atomicAdd", T.address_of(
                            hist[T.bitwise_and(T.shift_right(keys[p], lo), 255)]), 1)
            T.sync_threads()
            if tx < 32:  # warp 0 finds the digit: lane tx scans bins 8 tx .. 8 tx + 7
                tmp[2] = pick[1]
                tmp[0] = 0
                for i in T.unroll(8):
                    tmp[0] += hist[8 * tx + i]
                tmp[1] = tmp[0]  # -> keys in the bins of lanes >= tx
                for o in T.unroll(5):
                    nxt = T.shfl_down(tmp[1], T.shift_left(1, o))
                    tmp[1] = tmp[1] + T.if_then_else(tx + T.shift_left(1, o) < 32, nxt, 0)
                if tmp[1] >= tmp[2] and tmp[1] - tmp[0] < tmp[2]:
                    tmp[1] = tmp[1] - tmp[0]
                    for i in T.serial(8):
                        if tmp[1] < tmp[2]:
                            tmp[1] = tmp[1] + hist[8 * tx + 7 - i]
                            if tmp[1] >= tmp[2]:
                                pick[1] = tmp[2] - tmp[1] + hist[8 * tx + 7 - i]
                                pick[0] = T.bitwise_or(pick[0], T.shift_left(8 * tx + 7 - i, lo))
            T.sync_threads()


@T.macro
def _compact_winners(keys, n, thr, parents, n_par, chosen, counts, tx, threads: int, r: int, top_k: int):
    """chosen = the winners (keys[p] >= thr, p < n) in candidate order, -1 padded to top_k, as nodes: candidate p is
    node p of the top layer (n_par == 0), else child p % r of parent p / r."""
    seg = -(-int(keys.shape[0]) // threads)  # keys per thread
    pos = T.alloc_var("int32")  # (a var, not a buffer element: ThreadSync would fence every store at it)
    pos = 0
    for i in T.serial(seg):
        p = tx * seg + i
        if p < n:
            if keys[p] >= thr:
                pos += 1
    counts[tx] = pos
    T.sync_threads()
    pos = 0
    for i in T.serial(threads):
        if i < tx:
            pos += counts[i]
    for i in T.serial(seg):
        p = tx * seg + i
        if p < n:
            if keys[p] >= thr:
                chosen[pos] = T.if_then_else(n_par == 0, p, _child(parents, p, r, top_k))
                pos += 1
    T.sync_threads()
    for i in T.Parallel(top_k):
        if i >= T.min(n, top_k):
            chosen[i] = -1


def htree_rope_kernel(num_kv_heads: int, head_dim: int, dtype: str, period: int = 0, block_i: int = 32,
                      threads: int = 128):
    """Dst[b, h, i] = Src[b, src_off + i, h] rotated at position i (i % period with a period): the top layer's
    candidates are the same nodes at the same buffer positions for every query, so they are rotated once,
    not per query; the nodes below the top are rotated at their child index for htree_layer16_kernel."""
    H, K = num_kv_heads, head_dim
    half = K // 2
    B, NS, NT, NC = T.dynamic("B"), T.dynamic("NS"), T.dynamic("NT"), T.dynamic("NC")

    @T.prim_func
    def htree_rope(Src: T.Tensor((B, NS, H, K), dtype), Cos: T.Tensor((NC, half), "float32"),
                   Sin: T.Tensor((NC, half), "float32"), Dst: T.Tensor((B, H, NT, K), dtype), src_off: T.int32):
        with T.Kernel(T.ceildiv(NT, block_i), H, B, threads=threads) as (bi, h, b):
            for i, d in T.Parallel(block_i, half):
                node = bi * block_i + i
                if node < NT:
                    x = T.cast(Src[b, src_off + node, h, d], "float32")
                    y = T.cast(Src[b, src_off + node, h, d + half], "float32")
                    pos = T.bitwise_and(node, period - 1) if period else node
                    lo, hi = _rope_pair(x, y, Cos[pos, d], Sin[pos, d])
                    Dst[b, h, node, d] = T.cast(lo, dtype)
                    Dst[b, h, node, d + half] = T.cast(hi, dtype)

    return htree_rope


def _top_operand(B, Hkv, NT, K, dtype: str):
    """Shape and dtype of the top-layer kernels' K operand: the rotated rows [B, Hkv, NT, K], or for fp32 their
    TF32 halves [2, B, Hkv, NT, K] (``_split_tf32``), loaded straight into the products' operand tiles."""
    return ((2, B, Hkv, NT, K), T.tfloat32) if dtype == "float32" else ((B, Hkv, NT, K), dtype)


def _top_layer_macros(num_heads: int, num_kv_heads: int, head_dim: int, scale: float, dtype: str,
                      block_m: int, block_n: int):
    """What the top-layer kernels share. Every query's top-layer candidates are the same nodes at the
    same buffer positions (nodes 0 .. t >> top_shift, rotated once by ``htree_rope_kernel``); only the
    query's own RoPE position n - 1 differs. So a CTA takes block_m // G queries of one kv head (rows
    (t, g)) and scores each chunk of block_n nodes for all of them with one GEMM."""
    G = num_heads // num_kv_heads
    bt = block_m // G  # queries per CTA
    half = head_dim // 2
    split = dtype == "float32"
    put, put_rotated = _operand_stores(dtype, half)

    @T.macro
    def load_queries(Q, Cos, Sin, q_s, q_lo, b, h, t0, t_end, top_shift):
        """Row m: query t0 + m // G, head m % G, scaled and rotated at its position n - 1 (zero past t_end)."""
        for m, i in T.Parallel(block_m, half):
            tq = T.min(t0 + m // G, t_end - 1)
            ok = T.And(m < bt * G, t0 + m // G < t_end)
            x = T.if_then_else(ok, T.cast(Q[b, tq, h * G + m % G, i], "float32"), 0.0)
            y = T.if_then_else(ok, T.cast(Q[b, tq, h * G + m % G, i + half], "float32"), 0.0)
            put_rotated(x, y, Cos[tq >> top_shift, i], Sin[tq >> top_shift, i], scale * _LOG2E, True, q_s, q_lo,
                        m, i)

    @T.macro
    def load_slab_rows(Q, Cos, Sin, Lse, q_s, q_lo, lse, b, h, bx, t_start, TS, top_shift):
        """The CTA's rows of the slab [t_start, t_start + TS) (load_queries) and their lse; returns
        (first query t0, t_end, n_max: the top nodes its last query sees)."""
        t0 = t_start + bx * bt
        t_end = t_start + TS
        load_queries(Q, Cos, Sin, q_s, q_lo, b, h, t0, t_end, top_shift)
        for m in T.Parallel(block_m):
            lse[m] = Lse[b, T.min(t0 + m // G, t_end - 1), h * G + m % G]
        return t0, t_end, (T.min(t0 + bt, t_end) - 1 >> top_shift) + 1

    @T.macro
    def load_chunk(TopK, kt_s, b, h, c, TopV=None, vt_s=None, top_off=None):
        """Chunk c's rotated top-layer K (and V) into stage c % 2 by cp.async, rows past the buffers as
        zeros (the callers mask candidates past a query's n by position). fp32: both TF32 halves of K
        ([2, B, Hkv, NT, K]) and of V transposed ([2, B, Hkv, V, chunks * block_n]), split once per call
        (``_split_tf32``); 16-bit: K rows, and V rows of the tree's top layer (from row top_off)."""
        nodes = slice(c * block_n, (c + 1) * block_n)
        if split:
            for part in range(2):
                T.async_copy(TopK[part, b, h, nodes, :], kt_s[c % 2, part, :, :])
                if TopV is not None:
                    T.async_copy(TopV[part, b, h, :, nodes], vt_s[c % 2, part, :, :])
        else:
            T.async_copy(TopK[b, h, nodes, :], kt_s[c % 2, :, :])
            if TopV is not None:
                T.async_copy(TopV[b, top_off + c * block_n:top_off + (c + 1) * block_n, h, :], vt_s[c % 2, :, :])

    @T.macro
    def await_chunk(TopK, kt_s, b, h, c, nc, TopV=None, vt_s=None, top_off=None):
        """Chunk c's copies landed (for all threads), chunk c + 1's issued: its loads overlap chunk c's math."""
        if c + 1 < nc:
            load_chunk(TopK, kt_s, b, h, c + 1, TopV, vt_s, top_off)
            T.ptx_wait_group((1 if TopV is None else 2) * (2 if split else 1))
        else:
            T.ptx_wait_group(0)
        T.sync_threads()

    @T.macro
    def chunk_scores(kt_s, q_s, q_lo, acc_s, c):
        """acc_s[m, j] = log2-domain score of row m against top node c * block_n + j (its K in kt_s[c % 2])."""
        T.clear(acc_s)
        if split:
            _split_product(q_s, q_lo, kt_s[c % 2, 0, :, :], kt_s[c % 2, 1, :, :], acc_s)
        else:
            T.gemm(q_s, kt_s[c % 2, :, :], acc_s, transpose_B=True)

    @T.macro
    def alloc_operand(shape):
        """An mma operand's shared tile and the tile of its split-TF32 low halves (fp32; else a stub). fp32
        halves are typed TF32, which TileLang multiplies with wgmma (warpgroup products reading shared
        memory once per warpgroup; fp32 tiles get mma.sync, whose warps each load the whole B tile)."""
        cdt = T.tfloat32 if split else dtype
        return T.alloc_shared(shape, cdt), T.alloc_shared(shape if split else (1, 1), cdt)

    @T.macro
    def alloc_stages(shape):
        """Two cp.async stages of a chunk's operand tile (fp32: its TF32 halves side by side)."""
        return T.alloc_shared((2, 2) + shape, T.tfloat32) if split else T.alloc_shared((2,) + shape, dtype)

    @T.macro
    def alloc_scores():
        """chunk_scores' buffers (q_s, q_lo, kt_s, acc_s): the products read the staged K (fp32: its halves)."""
        q_s, q_lo = alloc_operand((block_m, head_dim))
        acc_s = T.alloc_fragment((block_m, block_n), "float32")
        return q_s, q_lo, alloc_stages((block_n, head_dim)), acc_s

    return (G, bt, put, alloc_operand, alloc_scores, alloc_stages, load_queries, load_slab_rows, load_chunk,
            await_chunk, chunk_scores)


def htree_top_lse_kernel(num_heads: int, num_kv_heads: int, head_dim: int, scale: float, dtype: str,
                         block_m: int = 64, block_n: int = 64, threads: int = 128):
    """Lse[b, t, h]: log2-domain log-sum-exp of query head h's scores over the top layer (for L > 1),
    the softmax reference of the top layer's importance and merge."""
    H, Hkv, K = num_heads, num_kv_heads, head_dim
    G, bt, _, _, alloc_scores, _, load_queries, _, load_chunk, await_chunk, chunk_scores = _top_layer_macros(
        H, Hkv, K, scale, dtype, block_m, block_n)
    B, Tn, NT, NC = T.dynamic("B"), T.dynamic("T"), T.dynamic("NT"), T.dynamic("NC")
    top_k_shape, top_dtype = _top_operand(B, Hkv, NT, K, dtype)

    @T.prim_func
    def htree_top_lse(Q: T.Tensor((B, Tn, H, K), dtype), TopK: T.Tensor(top_k_shape, top_dtype),
                      Cos: T.Tensor((NC, K // 2), "float32"), Sin: T.Tensor((NC, K // 2), "float32"),
                      Lse: T.Tensor((B, Tn, H), "float32"), top_shift: T.int32):
        with T.Kernel(T.ceildiv(Tn, bt), Hkv, B, threads=threads) as (bx, h, b):
            q_s, q_lo, kt_s, acc_s = alloc_scores()
            m_part = T.alloc_fragment((block_m, block_n), "float32")
            l_part = T.alloc_fragment((block_m, block_n), "float32")
            m_row = T.alloc_fragment((block_m,), "float32")
            lse = T.alloc_fragment((block_m,), "float32")
            t0 = bx * bt
            n_max = (T.min(t0 + bt, Tn) - 1 >> top_shift) + 1  # the CTA's last query sees the most nodes

            nc = T.ceildiv(n_max, block_n)
            load_chunk(TopK, kt_s, b, h, 0)
            load_queries(Q, Cos, Sin, q_s, q_lo, b, h, t0, Tn, top_shift)
            T.fill(m_part, _NEG)
            T.fill(l_part, 0.0)
            for c in T.serial(nc):
                await_chunk(TopK, kt_s, b, h, c, nc)
                chunk_scores(kt_s, q_s, q_lo, acc_s, c)
                for m, j in T.Parallel(block_m, block_n):
                    _lse_update(m_part, l_part, m, j,
                                T.if_then_else(c * block_n + j <= (T.min(t0 + m // G, Tn - 1) >> top_shift),
                                               acc_s[m, j], _NEG))
            _lse_finish(m_part, l_part, m_row, lse)
            for m in T.Parallel(block_m):
                if T.And(m < bt * G, t0 + m // G < Tn):
                    Lse[b, t0 + m // G, h * G + m % G] = lse[m]

    return htree_top_lse


def htree_top_keys_kernel(num_heads: int, num_kv_heads: int, head_dim: int, compression_rate: int, top_k: int,
                          max_top_nodes: int, scale: float, dtype: str, block_m: int = 64, block_n: int = 64,
                          threads: int = 128):
    """Keys[b, t - t_start, h, p]: the packed importance key of top node p (p < n) for query t of the slab
    [t_start, t_start + TS): fp32 importance sum_g exp2(s_gp - lse_g) (subnormal terms flushed, heads summed
    in order, the rightmost node's 1e3) with its low LOG_N bits replaced by ~p."""
    H, Hkv, K = num_heads, num_kv_heads, head_dim
    G, bt, _, _, alloc_scores, _, _, load_slab_rows, load_chunk, await_chunk, chunk_scores = _top_layer_macros(
        H, Hkv, K, scale, dtype, block_m, block_n)
    pos_mask = (1 << pack_bits(compression_rate, top_k, max_top_nodes)) - 1
    B, Tn, NT, NC = T.dynamic("B"), T.dynamic("T"), T.dynamic("NT"), T.dynamic("NC")
    TS, NK = T.dynamic("TS"), T.dynamic("NK")
    top_k_shape, top_dtype = _top_operand(B, Hkv, NT, K, dtype)

    @T.prim_func
    def htree_top_keys(Q: T.Tensor((B, Tn, H, K), dtype), TopK: T.Tensor(top_k_shape, top_dtype),
                       Cos: T.Tensor((NC, K // 2), "float32"), Sin: T.Tensor((NC, K // 2), "float32"),
                       Lse: T.Tensor((B, Tn, H), "float32"), Keys: T.Tensor((B, TS, Hkv, NK), "int32"),
                       top_shift: T.int32, t_start: T.int32):
        with T.Kernel(T.ceildiv(TS, bt), Hkv, B, threads=threads) as (bx, h, b):
            q_s, q_lo, kt_s, acc_s = alloc_scores()
            prob_s = T.alloc_shared((block_m, block_n), "float32")
            lse = T.alloc_fragment((block_m,), "float32")
            t0, t_end, n_max = load_slab_rows(Q, Cos, Sin, Lse, q_s, q_lo, lse, b, h, bx, t_start, TS, top_shift)
            nc = T.ceildiv(n_max, block_n)
            load_chunk(TopK, kt_s, b, h, 0)
            for c in T.serial(nc):
                await_chunk(TopK, kt_s, b, h, c, nc)
                chunk_scores(kt_s, q_s, q_lo, acc_s, c)
                for m, j in T.Parallel(block_m, block_n):
                    pr = T.exp2(acc_s[m, j] - lse[m])
                    prob_s[m, j] = T.if_then_else(pr < _FLT_MIN, 0.0, pr)
                for i, j in T.Parallel(bt, block_n):
                    p = c * block_n + j
                    n = ((t0 + i) >> top_shift) + 1
                    if T.And(t0 + i < t_end, p < n):
                        Keys[b, t0 + i - t_start, h, p] = _packed_key(prob_s, G, i * G, j, p, n, pos_mask)

    return htree_top_keys


def htree_top_merge_kernel(num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int, scale: float,
                           dtype: str, block_m: int = 64, block_n: int = 64, threads: int = 128):
    """O for the slab's queries: the top layer's non-winners (keys below the row's winning threshold Thr)
    merged against the lse reference, combined with the walk's state of the layers below (PartO
    unnormalized against PartML's maximum, PartML's sum)."""
    H, Hkv, K, V = num_heads, num_kv_heads, head_dim, v_head_dim
    G, bt, put, alloc_operand, alloc_scores, alloc_stages, _, load_slab_rows, load_chunk, await_chunk, \
        chunk_scores = _top_layer_macros(H, Hkv, K, scale, dtype, block_m, block_n)
    split = dtype == "float32"
    B, Tn, NT, NC, NN = T.dynamic("B"), T.dynamic("T"), T.dynamic("NT"), T.dynamic("NC"), T.dynamic("NN")
    TS, NK, NTC = T.dynamic("TS"), T.dynamic("NK"), T.dynamic("NTC")
    top_k_shape, top_dtype = _top_operand(B, Hkv, NT, K, dtype)
    # fp32: the top layer's V transposed in TF32 halves, padded to whole chunks; 16-bit: the tree's V rows
    top_v_shape = (2, B, Hkv, V, NTC * block_n) if split else (B, NN, Hkv, V)

    @T.prim_func
    def htree_top_merge(Q: T.Tensor((B, Tn, H, K), dtype), TopK: T.Tensor(top_k_shape, top_dtype),
                        TopV: T.Tensor(top_v_shape, top_dtype),
                        Cos: T.Tensor((NC, K // 2), "float32"), Sin: T.Tensor((NC, K // 2), "float32"),
                        Lse: T.Tensor((B, Tn, H), "float32"), Keys: T.Tensor((B, TS, Hkv, NK), "int32"),
                        Thr: T.Tensor((B, TS, Hkv), "int32"), PartO: T.Tensor((B, TS, H, V), "float32"),
                        PartML: T.Tensor((B, TS, H, 2), "float32"), O: T.Tensor((B, Tn, H, V), dtype),
                        top_shift: T.int32, t_start: T.int32, top_off: T.int32):
        with T.Kernel(T.ceildiv(TS, bt), Hkv, B, threads=threads) as (bx, h, b):
            q_s, q_lo, kt_s, acc_s = alloc_scores()
            p_s, p_lo = alloc_operand((block_m, block_n))
            vt_s = alloc_stages((V, block_n) if split else (block_n, V))  # a TF32 wgmma takes B K-major only
            s_part = T.alloc_fragment((block_m, block_n), "float32")
            acc_o = T.alloc_fragment((block_m, V), "float32")
            lse = T.alloc_fragment((block_m,), "float32")
            thr = T.alloc_fragment((block_m,), "int32")
            s_top = T.alloc_fragment((block_m,), "float32")
            t0, t_end, n_max = load_slab_rows(Q, Cos, Sin, Lse, q_s, q_lo, lse, b, h, bx, t_start, TS, top_shift)
            load_chunk(TopK, kt_s, b, h, 0, TopV, vt_s, top_off)
            for m in T.Parallel(block_m):
                thr[m] = Thr[b, T.min(t0 + m // G, t_end - 1) - t_start, h]
            T.fill(s_part, 0.0)
            T.fill(acc_o, 0.0)
            nc = T.ceildiv(n_max, block_n)
            for c in T.serial(nc):
                await_chunk(TopK, kt_s, b, h, c, nc, TopV, vt_s, top_off)
                chunk_scores(kt_s, q_s, q_lo, acc_s, c)
                for m, j in T.Parallel(block_m, block_n):
                    # a non-winner of its query (the candidates past n have no key: masked by position)
                    tq = T.min(t0 + m // G, t_end - 1)
                    keep = T.And(c * block_n + j <= (tq >> top_shift),
                                 Keys[b, tq - t_start, h, T.min(c * block_n + j, NK - 1)] < thr[m])
                    pr = T.if_then_else(keep, T.exp2(acc_s[m, j] - lse[m]), 0.0)
                    s_part[m, j] += pr
                    put(pr, p_s, p_lo, m, j)
                if split:
                    _split_product(p_s, p_lo, vt_s[c % 2, 0, :, :], vt_s[c % 2, 1, :, :], acc_o)
                else:
                    T.gemm(p_s, vt_s[c % 2, :, :], acc_o)
            T.reduce_sum(s_part, s_top, dim=1, clear=True)
            # both parts against their common maximum
            for m, d in T.Parallel(block_m, V):
                if T.And(m < bt * G, t0 + m // G < t_end):
                    tl = t0 + m // G - t_start
                    hq = h * G + m % G
                    mx = T.max(lse[m], PartML[b, tl, hq, 0])
                    w_top = T.exp2(lse[m] - mx)
                    w_low = T.exp2(PartML[b, tl, hq, 0] - mx)
                    O[b, t0 + m // G, hq, d] = T.cast(
                        (acc_o[m, d] * w_top + PartO[b, tl, hq, d] * w_low)
                        / (s_top[m] * w_top + PartML[b, tl, hq, 1] * w_low), dtype)

    return htree_top_merge


def htree_fwd_kernel(num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int,
                     compression_rate: int, top_k: int, max_top_nodes: int, scale: float, dtype: str,
                     block_n: int = 64, threads: int = 128, min_blocks: int = 3, chunk_rope: bool = False):
    H, Hkv, K, V, r = num_heads, num_kv_heads, head_dim, v_head_dim, compression_rate
    G = H // Hkv
    GP = max(16, G)  # tensor-core M
    half = K // 2
    log_r = int(math.log2(r))
    log_n = pack_bits(r, top_k, max_top_nodes)
    nbuf = 1 << log_n  # every candidate buffer position is below this
    pos_mask = nbuf - 1
    split = dtype == "float32"  # split-TF32 products
    # Layers l_lo and below left to the layer kernels: the walk hands over layer l_lo's parents and candidate count
    # (l_lo = 0: layer 0 to htree_layer0_kernel / htree_layer16_kernel; 16-bit with r >= 16: l_lo = L - 2, the
    # middle layers to htree_layer16_kernel too)
    split0 = _split_layer0(dtype, K, V, G, r)
    # chunk_rope (16-bit inputs): below the top, candidate p = c0 + j is rotated at j (table entries fixed
    # per thread, loaded once) and the query at n - 1 - c0 once per chunk, instead of loading the table
    # rows of every p. Exact in real arithmetic, but the composed angles round differently from the
    # golden's, which moves fp32 near-ties, so fp32 keeps the golden's own rows.
    chunk_rope = chunk_rope and not split
    cdt = dtype
    q_scale = scale * _LOG2E  # scores in the log2 domain
    B, Tn, NN, NT = T.dynamic("B"), T.dynamic("T"), T.dynamic("NN"), T.dynamic("NT")
    SL, SB, ST = T.dynamic("SL"), T.dynamic("SB"), T.dynamic("ST")
    # the slab's rows TS come from Thr; the L == 1 call passes one-row placeholders for the others
    TS, TK, NK, TP, TQ = T.dynamic("TS"), T.dynamic("TK"), T.dynamic("NK"), T.dynamic("TP"), T.dynamic("TQ")

    put, put_rotated = _operand_stores(dtype, half)

    def node_of(parents, p, n_par):
        """Layer node of candidate p (below the top: child p % r of parent p // r)."""
        return T.if_then_else(n_par == 0, p, _child(parents, p, r, top_k))

    # Chunk loads go in two loops: gathers into registers, then math and shared stores. In one loop the
    # compiler keeps every shared-memory read of a node index behind the previous row's shared store
    # (it cannot rule out aliasing), which serialized the chunk into one global round trip per row.
    @T.macro
    def gather_pairs(Src, rows, row_off, Cos, Sin, parents, kx, ky, kc, ks, b, h, c0, n, n_par):
        """Pairs (i, i + K/2) of the chunk's candidate rows Src[b, row_off + node] with their RoPE table
        entries (zero past the candidates); both halves are wide loads."""
        for j, i in T.Parallel(block_n, half):
            p = T.min(c0 + j, nbuf - 1)
            row = T.min(row_off + node_of(parents, p, n_par), rows - 1)
            ok = c0 + j < n
            kx[j, i] = T.if_then_else(ok, Src[b, row, h, i], T.cast(0.0, dtype))
            ky[j, i] = T.if_then_else(ok, Src[b, row, h, i + half], T.cast(0.0, dtype))
            if not chunk_rope:
                kc[j, i] = T.if_then_else(ok, Cos[p, i], 0.0)
                ks[j, i] = T.if_then_else(ok, Sin[p, i], 0.0)

    @T.macro
    def gather_k(Kt, NodesK, TopK, Cos, Sin, parents, kt, kx, ky, kc, ks, b, h, l, top, c0, off, n, n_par):
        """Raw K of the chunk's candidates into registers (zero past the candidates): the top layer's rows
        were rotated beforehand (contiguous, no tables), below it pairs with their RoPE entries."""
        if top:
            for j, d in T.Parallel(block_n, K):
                kt[j, d] = T.if_then_else(c0 + j < n, TopK[b, h, T.min(c0 + j, NT - 1), d], T.cast(0.0, dtype))
        elif l == 0:
            gather_pairs(Kt, Tn, 0, Cos, Sin, parents, kx, ky, kc, ks, b, h, c0, n, n_par)
        else:
            gather_pairs(NodesK, NN, off, Cos, Sin, parents, kx, ky, kc, ks, b, h, c0, n, n_par)

    @T.macro
    def store_k(kt, kx, ky, kc, ks, k_s, k_lo, top):
        """The gathered K as the mma operand, rotated at the candidates' buffer positions below the top."""
        if top:
            for j, d in T.Parallel(block_n, K):
                put(T.cast(kt[j, d], "float32"), k_s, k_lo, j, d)
        else:
            for j, i in T.Parallel(block_n, half):
                put_rotated(T.cast(kx[j, i], "float32"), T.cast(ky[j, i], "float32"), kc[j, i], ks[j, i], 1.0,
                            True, k_s, k_lo, j, i)

    @T.macro
    def gather_rows(Src, rows, row_off, parents, vx, b, h, c0, n, n_par):
        """Rows Src[b, row_off + node] of the chunk's candidates (zero past the candidates)."""
        for j, d in T.Parallel(block_n, V):
            row = T.min(row_off + node_of(parents, T.min(c0 + j, nbuf - 1), n_par), rows - 1)
            vx[j, d] = T.if_then_else(c0 + j < n, Src[b, row, h, d], T.cast(0.0, dtype))

    @T.macro
    def gather_v(Vt, NodesV, parents, vx, b, h, l, c0, off, n, n_par):
        """Raw V of the chunk's candidates into registers (zero past the candidates, where probabilities
        are zero too)."""
        if l == 0:
            gather_rows(Vt, Tn, 0, parents, vx, b, h, c0, n, n_par)
        else:
            gather_rows(NodesV, NN, off, parents, vx, b, h, c0, n, n_par)

    @T.macro
    def rotate_q(q_raw, q_s, q_lo, Cos, Sin, pos):
        """q_s = the G query heads, scaled and rotated at position pos."""
        for g, i in T.Parallel(GP, half):
            x = T.if_then_else(g < G, T.cast(q_raw[T.min(g, G - 1), i], "float32"), 0.0)
            y = T.if_then_else(g < G, T.cast(q_raw[T.min(g, G - 1), i + half], "float32"), 0.0)
            put_rotated(x, y, Cos[pos, i], Sin[pos, i], q_scale, True, q_s, q_lo, g, i)

    @T.macro
    def scores(q_raw, q_s, q_lo, k_s, k_lo, acc_s, Cos, Sin, below_top, c0, n):
        """acc_s = log2-domain scores of chunk c0; _NEG past the candidates."""
        if chunk_rope:
            if below_top:
                rotate_q(q_raw, q_s, q_lo, Cos, Sin, n - 1 - c0)
        T.clear(acc_s)
        T.gemm(q_s, k_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
        if split:
            T.gemm(q_s, k_lo, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
            T.gemm(q_lo, k_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
        for g, j in T.Parallel(GP, block_n):
            acc_s[g, j] = T.if_then_else(c0 + j < n, acc_s[g, j], _NEG)

    @T.macro
    def rescale(acc_o, s_part, m_run, m_new):
        """Move the online-softmax state (acc_o, s_part) from reference m_run to m_new >= m_run."""
        for g, d in T.Parallel(GP, V):
            acc_o[g, d] *= T.exp2(m_run[g] - m_new[g])
        for g, j in T.Parallel(GP, block_n):
            s_part[g, j] *= T.exp2(m_run[g] - m_new[g])
        for g in T.Parallel(GP):
            m_run[g] = m_new[g]

    @T.prim_func
    def htree_fwd(
        Q: T.Tensor((B, Tn, H, K), dtype),
        Kt: T.Tensor((B, Tn, Hkv, K), dtype),
        Vt: T.Tensor((B, Tn, Hkv, V), dtype),
        NodesK: T.Tensor((B, NN, Hkv, K), dtype),
        NodesV: T.Tensor((B, NN, Hkv, V), dtype),
        TopK: T.Tensor((B, Hkv, NT, K), dtype),
        TopKeys: T.Tensor((B, TK, Hkv, NK), "int32"),
        Cos: T.Tensor((nbuf, half), "float32"),
        Sin: T.Tensor((nbuf, half), "float32"),
        LayerOff: T.Tensor((_MAX_LAYERS,), "int32"),
        O: T.Tensor((B, Tn, H, V), dtype),
        Thr: T.Tensor((B, TS, Hkv), "int32"),
        PartO: T.Tensor((B, TP, H, V), "float32"),
        PartML: T.Tensor((B, TP, H, 2), "float32"),
        Sel: T.Tensor((SL, SB, ST, Hkv, top_k), "int32"),
        Par: T.Tensor((B, TQ, Hkv, top_k), "int32"),
        N0: T.Tensor((B, TQ, Hkv), "int32"),
        num_layers: T.int32,
        write_sel: T.int32,
        t_start: T.int32,
        l_lo: T.int32,
    ):
        # rows t_start + (0 .. TS) (one slab of queries when the top layer is done by the top kernels)
        with T.Kernel(TS, Hkv, B, threads=threads) as (ts, h, b):
            # The walk is latency-bound (dependent gathers, barriers): capping registers so that
            # min_blocks CTAs share an SM hides more of it than the extra registers would.
            T.annotate_min_blocks_per_sm(min_blocks)
            # Shared memory decides how many CTAs share an SM, so tiles are reused where lifetimes allow.
            q_raw = T.alloc_shared((G, K), dtype)
            q_s = T.alloc_shared((GP, K), cdt)
            k_s = T.alloc_shared((block_n, K), cdt)
            p_s = T.alloc_shared((GP, block_n), cdt)
            # low parts of the split-TF32 operands (unused placeholders otherwise)
            q_lo = T.alloc_shared((GP, K) if split else (1, 1), cdt)
            k_lo = T.alloc_shared((block_n, K) if split else (1, 1), cdt)
            p_lo = T.alloc_shared((GP, block_n) if split else (1, 1), cdt)
            # V's tile is loaded after the chunk's scores are computed: it can take K's place
            v_s = k_s if K == V else T.alloc_shared((block_n, V), cdt)
            v_lo = k_lo if K == V else T.alloc_shared((block_n, V) if split else (1, 1), cdt)
            prob_s = T.alloc_shared((GP, block_n), "float32")
            keys = T.alloc_shared((nbuf,), "int32")
            parents = T.alloc_shared((top_k,), "int32")
            chosen = T.alloc_shared((top_k,), "int32")
            counts = T.alloc_shared((threads,), "int32")
            hist = T.alloc_shared((256,), "int32")  # the top-k's radix histogram and its pick (threshold, rank)
            pick = T.alloc_shared((2,), "int32")

            acc_s = T.alloc_fragment((GP, block_n), "float32")
            # one chunk's gathered K (the top layer's rotated rows, or pairs with their RoPE entries), V
            kt = T.alloc_fragment((block_n, K), dtype)
            kx = T.alloc_fragment((block_n, half), dtype)
            ky = T.alloc_fragment((block_n, half), dtype)
            kc = T.alloc_fragment((block_n, half), "float32")
            ks = T.alloc_fragment((block_n, half), "float32")
            vx = T.alloc_fragment((block_n, V), dtype)
            acc_o = T.alloc_fragment((GP, V), "float32")
            # per-element partial statistics, reduced once per layer instead of once per chunk
            s_part = T.alloc_fragment((GP, block_n), "float32")  # softmax sum, reference m_run
            m_part = T.alloc_fragment((GP, block_n), "float32")
            l_part = T.alloc_fragment((GP, block_n), "float32")
            m_run = T.alloc_fragment((GP,), "float32")
            m_new = T.alloc_fragment((GP,), "float32")
            lse = T.alloc_fragment((GP,), "float32")

            n = T.alloc_var("int32")  # candidates of this layer
            n_par = T.alloc_var("int32")  # parents expanded into this layer
            thr = T.alloc_var("int32")  # smallest winning key
            tmp = T.alloc_local((4,), "int32")  # the top-k's per-thread scratch
            tx = T.get_thread_binding()
            t = t_start + ts

            for g, d in T.Parallel(G, K):
                q_raw[g, d] = Q[b, t, h * G + g, d]
            T.fill(acc_o, 0.0)
            T.fill(s_part, 0.0)
            T.fill(m_run, _NEG)
            n_par = 0
            if chunk_rope:  # this thread's table entries of in-chunk positions j
                for j, i in T.Parallel(block_n, half):  # (rows past the table are past every n)
                    kc[j, i] = Cos[T.min(j, nbuf - 1), i]
                    ks[j, i] = Sin[T.min(j, nbuf - 1), i]

            for li in T.serial(num_layers - l_lo):  # down to l_lo (see split0)
                l = num_layers - 1 - li
                T.sync_threads()  # the previous layer's readers of q_s / parents are done
                last = t >> (l * log_r)  # node holding t
                off = LayerOff[l]
                if n_par == 0:
                    n = last + 1
                else:
                    n = (n_par - 1) * r + T.bitwise_and(last, r - 1) + 1
                # The query sits at candidate-local position n - 1.
                if not chunk_rope or l == num_layers - 1:
                    rotate_q(q_raw, q_s, q_lo, Cos, Sin, n - 1)
                chunks = T.ceildiv(n, block_n)
                thr = 0
                if l == num_layers - 1 and l > 0:  # the top layer's keys: htree_top_keys_kernel
                    for i in T.serial(T.ceildiv(n, threads)):
                        if i * threads + tx < n:
                            keys[i * threads + tx] = TopKeys[b, ts, h, i * threads + tx]
                    T.sync_threads()
                elif l > l_lo:
                    # (1) per-head log-sum-exp over all candidates
                    T.fill(m_part, _NEG)
                    T.fill(l_part, 0.0)
                    gather_k(Kt, NodesK, TopK, Cos, Sin, parents, kt, kx, ky, kc, ks, b, h, l, l == num_layers - 1,
                             0, off, n, n_par)
                    for c in T.serial(chunks):
                        store_k(kt, kx, ky, kc, ks, k_s, k_lo, l == num_layers - 1)
                        # the next chunk's loads fly during this chunk's math (past the last: none)
                        gather_k(Kt, NodesK, TopK, Cos, Sin, parents, kt, kx, ky, kc, ks, b, h, l, l == num_layers - 1,
                                 (c + 1) * block_n, off, n, n_par)
                        scores(q_raw, q_s, q_lo, k_s, k_lo, acc_s, Cos, Sin, l < num_layers - 1, c * block_n, n)
                        for g, j in T.Parallel(GP, block_n):
                            _lse_update(m_part, l_part, g, j, acc_s[g, j])
                    _lse_finish(m_part, l_part, m_new, lse)
                    # (2) packed importance keys
                    gather_k(Kt, NodesK, TopK, Cos, Sin, parents, kt, kx, ky, kc, ks, b, h, l, l == num_layers - 1,
                             0, off, n, n_par)
                    for c in T.serial(chunks):
                        store_k(kt, kx, ky, kc, ks, k_s, k_lo, l == num_layers - 1)
                        # the next chunk's loads fly during this chunk's math (past the last: none)
                        gather_k(Kt, NodesK, TopK, Cos, Sin, parents, kt, kx, ky, kc, ks, b, h, l, l == num_layers - 1,
                                 (c + 1) * block_n, off, n, n_par)
                        scores(q_raw, q_s, q_lo, k_s, k_lo, acc_s, Cos, Sin, l < num_layers - 1, c * block_n, n)
                        for g, j in T.Parallel(GP, block_n):
                            pr = T.exp2(acc_s[g, j] - lse[g])
                            prob_s[g, j] = T.if_then_else(pr < _FLT_MIN, 0.0, pr)
                        for j in T.Parallel(block_n):
                            p = c * block_n + j
                            if p < n:
                                keys[p] = _packed_key(prob_s, G, 0, j, p, n, pos_mask)
                if l > l_lo:
                    _select_top_k(keys, n, top_k, hist, pick, tmp, tx, threads)
                    thr = pick[0]
                    _compact_winners(keys, n, thr, parents, n_par, chosen, counts, tx, threads, r, top_k)
                    if write_sel != 0:
                        for i in T.Parallel(top_k):
                            Sel[l - 1, b, t, h, i] = chosen[i]
                    if l == num_layers - 1:  # htree_top_merge_kernel merges the top layer's non-winners
                        if tx == 0:
                            Thr[b, ts, h] = thr
                    else:  # lse bounds every score of the layer: one reference for the whole merge below
                        for g in T.Parallel(GP):
                            m_new[g] = T.max(m_run[g], lse[g])
                        rescale(acc_o, s_part, m_run, m_new)
                # (3) merge the non-winners (layer 0: everything) into the online softmax
                if split0 and l == l_lo and num_layers > 1:  # htree_layer16_kernel / htree_layer0_kernel go on from here
                    if tx == 0:
                        N0[b, ts, h] = n
                    for i in T.Parallel(top_k):
                        Par[b, ts, h, i] = parents[i]
                elif l == 0 or (n > top_k and l < num_layers - 1):
                    gather_k(Kt, NodesK, TopK, Cos, Sin, parents, kt, kx, ky, kc, ks, b, h, l, l == num_layers - 1,
                             0, off, n, n_par)
                    for c in T.serial(chunks):
                        store_k(kt, kx, ky, kc, ks, k_s, k_lo, l == num_layers - 1)
                        # this chunk's V and the next chunk's K fly during the scores (past the last: none)
                        gather_v(Vt, NodesV, parents, vx, b, h, l, c * block_n, off, n, n_par)
                        gather_k(Kt, NodesK, TopK, Cos, Sin, parents, kt, kx, ky, kc, ks, b, h, l, l == num_layers - 1,
                                 (c + 1) * block_n, off, n, n_par)
                        scores(q_raw, q_s, q_lo, k_s, k_lo, acc_s, Cos, Sin, l < num_layers - 1, c * block_n, n)
                        if l > 0:
                            for g, j in T.Parallel(GP, block_n):
                                p = T.min(c * block_n + j, nbuf - 1)
                                acc_s[g, j] = T.if_then_else(keys[p] >= thr, _NEG, acc_s[g, j])
                        else:  # no bound known at layer 0: running maximum
                            T.reduce_max(acc_s, m_new, dim=1, clear=True)
                            for g in T.Parallel(GP):
                                m_new[g] = T.max(m_new[g], m_run[g])
                            rescale(acc_o, s_part, m_run, m_new)
                        for g, j in T.Parallel(GP, block_n):
                            acc_s[g, j] = T.if_then_else(acc_s[g, j] <= _NEG, 0.0, T.exp2(acc_s[g, j] - m_run[g]))
                            s_part[g, j] += acc_s[g, j]
                            put(acc_s[g, j], p_s, p_lo, g, j)
                        for j, d in T.Parallel(block_n, V):
                            put(T.cast(vx[j, d], "float32"), v_s, v_lo, j, d)
                        T.gemm(p_s, v_s, acc_o, policy=T.GemmWarpPolicy.FullCol)
                        if split:
                            T.gemm(p_s, v_lo, acc_o, policy=T.GemmWarpPolicy.FullCol)
                            T.gemm(p_lo, v_s, acc_o, policy=T.GemmWarpPolicy.FullCol)
                if l > 0:
                    T.sync_threads()
                    for i in T.Parallel(top_k):
                        parents[i] = chosen[i]
                    n_par = T.min(n, top_k)

            T.reduce_sum(s_part, lse, dim=1, clear=True)
            if num_layers > 1:  # the state of the layers below the top, for htree_top_merge_kernel
                for g, d in T.Parallel(GP, V):
                    if g < G:
                        PartO[b, ts, h * G + g, d] = acc_o[g, d]
                for g in T.Parallel(GP):
                    if g < G:
                        PartML[b, ts, h * G + g, 0] = m_run[g]
                        PartML[b, ts, h * G + g, 1] = lse[g]
            else:
                for g, d in T.Parallel(GP, V):
                    if g < G:
                        O[b, t, h * G + g, d] = T.cast(acc_o[g, d] / lse[g], dtype)

    return htree_fwd


@T.macro
def _layer0_state_in(PartML, m_w, l_w, b, ts, h, w, gr, tg, G: int):
    """Rows gr and gr + 8 (heads) of the layers above, for a layer kernel's warp: their maximum is every warp's
    reference, their sum warp 0's (lane tg == 0; the others start empty)."""
    for rr in T.unroll(2):
        g = gr + 8 * rr
        m_w[rr] = T.if_then_else(g < G, PartML[b, ts, h * G + T.min(g, G - 1), 0], 0.0)
        l_w[rr] = T.if_then_else(w == 0 and tg == 0 and g < G, PartML[b, ts, h * G + T.min(g, G - 1), 1], 0.0)


@T.macro
def _layer0_warp_scales(m_w, l_w, mx, al, red, w, gr, tg):
    """The four warps' softmax states on one reference: mx[rr] = row gr + 8 rr's maximum over the warps, al[rr] =
    this warp's rescale to it; red[w] = the warps' rescaled sums, red[4] the maxima (summed in a fixed order by
    _layer0_state_out)."""
    for rr in T.unroll(2):
        l_w[rr] += T.shfl_xor(l_w[rr], 1)
        l_w[rr] += T.shfl_xor(l_w[rr], 2)
    if tg == 0:
        for rr in T.unroll(2):
            red[w, gr + 8 * rr] = m_w[rr]
    T.sync_threads()
    for rr in T.unroll(2):
        mx[rr] = T.max(T.max(red[0, gr + 8 * rr], red[1, gr + 8 * rr]), T.max(red[2, gr + 8 * rr], red[3, gr + 8 * rr]))
        al[rr] = T.exp2(m_w[rr] - mx[rr])
    T.sync_threads()  # every warp has read the maxima: red's rows take the sums, rescaled to the common one
    if tg == 0:
        for rr in T.unroll(2):
            red[w, gr + 8 * rr] = l_w[rr] * al[rr]
            if w == 0:
                red[4, gr + 8 * rr] = mx[rr]


@T.macro
def _layer0_state_out(o_sh, red, PartO, PartML, b, ts, h, G: int):
    """The combined state (o_sh: the warps' rescaled U, red: _layer0_warp_scales') back to PartO / PartML."""
    for g, d in T.Parallel(G, o_sh.shape[1]):
        PartO[b, ts, h * G + g, d] = o_sh[g, d]
    for g in T.Parallel(G):
        PartML[b, ts, h * G + g, 0] = red[4, g]
        PartML[b, ts, h * G + g, 1] = (red[0, g] + red[1, g]) + (red[2, g] + red[3, g])


def htree_layer0_kernel(num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int, compression_rate: int,
                        top_k: int, max_top_nodes: int, scale: float, tiles0: int = 2, min_blocks: int = 4):
    """fp32 layer 0 (merge everything, running maximum) of the rows of one slab (K, V in {32, 64}, G <= 16),
    after the walk left each row's layer-0 parents in Par, its candidate count in N0 and the state of the
    layers above in PartO / PartML (updated in place). One CTA per row, as split-TF32 mma.sync products whose
    operands go from the gathers straight into the PTX register fragments: no shared memory between a
    candidate's load and the tensor cores (the walk is bound by the L1 data pipe, and staging operands through
    shared memory cost ~20 of its ~28 wavefronts per candidate).
    Each warp takes every fourth chunk of CH candidates with its own online-softmax state; the warps' states
    are combined once, in a fixed order. Per 8-candidate tile, lane (gr, tg) = (lane / 4, lane % 4):
      - scores S = Q K^T: B's column gr is candidate gr; dot products do not care about the order of the head
        dimension, so lane tg's k-steps cover the RoPE pairs (KE tg + ks, half + KE tg + ks): two contiguous
        loads per row and table, and each pair is rotated in the lane that loads it;
      - O += P V: the accumulator's columns (2 tg, 2 tg + 1) are taken as A's columns (tg, tg + 4), i.e.
        candidates 2 tg and 2 tg + 1, so P stays in the lane; B's column gr of V tile vt is V dim VE gr + vt:
        one contiguous load per candidate.
    The mma accumulators add in truncation, so each chunk's P V starts from zero and is added in fp32;
    independent accumulators (hi*hi apart from the two corrections) keep the mma chains short."""
    H, Hkv, K, V, r = num_heads, num_kv_heads, head_dim, v_head_dim, compression_rate
    G = H // Hkv
    GP = 16
    half = K // 2
    nbuf = 1 << pack_bits(r, top_k, max_top_nodes)
    KE, VE = K // 8, V // 8  # per lane: head dims of each half, V tiles
    NT0 = tiles0 if K + V <= 64 else max(1, tiles0 // 2)  # 8-candidate tiles per chunk
    CH = 8 * NT0
    q_scale = scale * _LOG2E
    dtype = "float32"
    B, Tn, TS = T.dynamic("B"), T.dynamic("T"), T.dynamic("TS")

    @T.prim_func
    def htree_layer0(
        Q: T.Tensor((B, Tn, H, K), dtype),
        Kt: T.Tensor((B, Tn, Hkv, K), dtype),
        Vt: T.Tensor((B, Tn, Hkv, V), dtype),
        Cos: T.Tensor((nbuf, half), "float32"),
        Sin: T.Tensor((nbuf, half), "float32"),
        Par: T.Tensor((B, TS, Hkv, top_k), "int32"),
        N0: T.Tensor((B, TS, Hkv), "int32"),
        PartO: T.Tensor((B, TS, H, V), "float32"),
        PartML: T.Tensor((B, TS, H, 2), "float32"),
        t_start: T.int32,
    ):
        with T.Kernel(TS, Hkv, B, threads=128) as (ts, h, b):
            T.annotate_min_blocks_per_sm(min_blocks)
            q_raw = T.alloc_shared((G, K), dtype)
            parents = T.alloc_shared((top_k,), "int32")
            o_sh = T.alloc_shared((GP, V), "float32")
            red = T.alloc_shared((5, GP), "float32")
            qh = T.alloc_local((KE * 4,), "float32")  # A fragments of the rotated, scaled query, per k-step
            ql = T.alloc_local((KE * 4,), "float32")
            fk_x = T.alloc_local((NT0 * KE,), dtype)  # a chunk's gathers: K pairs, their table entries, V
            fk_y = T.alloc_local((NT0 * KE,), dtype)
            fk_c = T.alloc_local((NT0 * KE,), "float32")
            fk_s = T.alloc_local((NT0 * KE,), "float32")
            fv = T.alloc_local((NT0 * 2 * VE,), dtype)
            kb_h = T.alloc_local((NT0 * KE * 2,), "float32")  # B fragments of the rotated K, per tile and k-step
            kb_l = T.alloc_local((NT0 * KE * 2,), "float32")
            sc = T.alloc_local((NT0 * 4,), "float32")  # scores (hi*hi), then probabilities
            sc2 = T.alloc_local((NT0 * 4,), "float32")  # the scores' corrections (hi*lo + lo*hi)
            pa_h = T.alloc_local((NT0 * 4,), "float32")
            pa_l = T.alloc_local((NT0 * 4,), "float32")
            vb_h = T.alloc_local((VE * 2,), "float32")
            vb_l = T.alloc_local((VE * 2,), "float32")
            o_acc = T.alloc_local((VE * 4,), "float32")
            o_tmp = T.alloc_local((VE * 4,), "float32")
            m_w = T.alloc_local((2,), "float32")  # rows gr and gr + 8: running maximum, partial sum
            l_w = T.alloc_local((2,), "float32")
            mx = T.alloc_local((2,), "float32")
            al = T.alloc_local((2,), "float32")

            tx = T.get_thread_binding()
            lane = tx % 32
            w = tx // 32
            gr = lane // 4
            tg = lane % 4
            t = t_start + ts
            n = N0[b, ts, h]

            for g, d in T.Parallel(G, K):
                q_raw[g, d] = Q[b, t, h * G + g, d]
            for i in T.Parallel(top_k):
                parents[i] = Par[b, ts, h, i]
            T.clear(o_sh)
            T.sync_threads()
            for ks in T.unroll(KE):
                for rr in T.unroll(2):
                    g = gr + 8 * rr
                    i = KE * tg + ks
                    x = T.if_then_else(g < G, q_raw[T.min(g, G - 1), i], 0.0)
                    y = T.if_then_else(g < G, q_raw[T.min(g, G - 1), i + half], 0.0)
                    lo_v, hi_v = _rope_pair(x, y, Cos[n - 1, i], Sin[n - 1, i])
                    _split(q_scale * lo_v, qh, ql, ks * 4 + rr)
                    _split(q_scale * hi_v, qh, ql, ks * 4 + 2 + rr)
            # the layers above: warp 0 carries their state, the others start empty (same reference)
            for vt in T.unroll(VE):
                for e in T.unroll(4):
                    g = gr + 8 * (e // 2)
                    o_acc[vt * 4 + e] = T.if_then_else(
                        w == 0, T.if_then_else(g < G, PartO[b, ts, h * G + T.min(g, G - 1), VE * (2 * tg + e % 2) + vt],
                                               0.0), 0.0)
            _layer0_state_in(PartML, m_w, l_w, b, ts, h, w, gr, tg, G)

            for it in T.serial(T.ceildiv(T.max(T.ceildiv(n, CH) - w, 0), 4)):
                c0 = (w + 4 * it) * CH
                # all of the chunk's gathers in flight at once (candidates past n, masked below, read clamped rows).
                # With r >= 8 a tile's 8 candidates are 8 consecutive children of one parent.
                for nt in T.unroll(NT0):
                    p0 = c0 + 8 * nt
                    if r >= 8:
                        row0 = _child(parents, p0, r, top_k)
                        row_k = T.max(T.min(row0 + gr, Tn - 1), 0)
                    else:
                        row_k = T.max(T.min(_child(parents, p0 + gr, r, top_k), Tn - 1), 0)
                    slot = T.min(p0 + gr, nbuf - 1)
                    for e in T.vectorized(KE):
                        fk_x[nt * KE + e] = Kt[b, row_k, h, KE * tg + e]
                    for e in T.vectorized(KE):
                        fk_y[nt * KE + e] = Kt[b, row_k, h, half + KE * tg + e]
                    for e in T.vectorized(KE):
                        fk_c[nt * KE + e] = Cos[slot, KE * tg + e]
                    for e in T.vectorized(KE):
                        fk_s[nt * KE + e] = Sin[slot, KE * tg + e]
                    for j2 in T.unroll(2):
                        if r >= 8:
                            row_v = T.max(T.min(row0 + 2 * tg + j2, Tn - 1), 0)
                        else:
                            row_v = T.max(T.min(_child(parents, p0 + 2 * tg + j2, r, top_k), Tn - 1), 0)
                        for e in T.vectorized(VE):
                            fv[(nt * 2 + j2) * VE + e] = Vt[b, row_v, h, VE * gr + e]
                for nt in T.unroll(NT0):
                    for ks in T.unroll(KE):
                        lo_v, hi_v = _rope_pair(fk_x[nt * KE + ks], fk_y[nt * KE + ks], fk_c[nt * KE + ks],
                                                fk_s[nt * KE + ks])
                        _split(lo_v, kb_h, kb_l, (nt * KE + ks) * 2)
                        _split(hi_v, kb_h, kb_l, (nt * KE + ks) * 2 + 1)
                    for e in T.unroll(4):
                        sc[nt * 4 + e] = 0.0
                        sc2[nt * 4 + e] = 0.0
                    for ks in T.unroll(KE):
                        _mma(qh, ks * 4, kb_h, (nt * KE + ks) * 2, sc, nt * 4)
                        _mma(qh, ks * 4, kb_l, (nt * KE + ks) * 2, sc2, nt * 4)
                        _mma(ql, ks * 4, kb_h, (nt * KE + ks) * 2, sc2, nt * 4)
                for rr in T.unroll(2):
                    mx[rr] = _NEG
                for nt in T.unroll(NT0):
                    for e in T.unroll(4):
                        sc[nt * 4 + e] = T.if_then_else(c0 + 8 * nt + 2 * tg + e % 2 < n,
                                                        sc[nt * 4 + e] + sc2[nt * 4 + e], _NEG)
                        mx[e // 2] = T.max(mx[e // 2], sc[nt * 4 + e])
                for rr in T.unroll(2):  # the row's maximum over its four lanes
                    mx[rr] = T.max(mx[rr], T.shfl_xor(mx[rr], 1))
                    mx[rr] = T.max(mx[rr], T.shfl_xor(mx[rr], 2))
                    mx[rr] = T.max(mx[rr], m_w[rr])
                    al[rr] = T.exp2(m_w[rr] - mx[rr])
                    m_w[rr] = mx[rr]
                    l_w[rr] *= al[rr]
                for nt in T.unroll(NT0):
                    for e in T.unroll(4):
                        sc[nt * 4 + e] = T.if_then_else(sc[nt * 4 + e] <= _NEG, 0.0,
                                                        T.exp2(sc[nt * 4 + e] - m_w[e // 2]))
                        l_w[e // 2] += sc[nt * 4 + e]
                    for e in T.unroll(4):  # A's (row, column) e <- accumulator element (e % 2) * 2 + e // 2
                        _split(sc[nt * 4 + (e % 2) * 2 + e // 2], pa_h, pa_l, nt * 4 + e)
                for e in T.unroll(VE * 4):
                    o_tmp[e] = 0.0
                for nt in T.unroll(NT0):
                    for vt in T.unroll(VE):
                        for j2 in T.unroll(2):
                            _split(fv[(nt * 2 + j2) * VE + vt], vb_h, vb_l, vt * 2 + j2)
                    for vt in T.unroll(VE):
                        _mma(pa_h, nt * 4, vb_h, vt * 2, o_tmp, vt * 4)
                    for vt in T.unroll(VE):
                        _mma(pa_h, nt * 4, vb_l, vt * 2, o_tmp, vt * 4)
                    for vt in T.unroll(VE):
                        _mma(pa_l, nt * 4, vb_h, vt * 2, o_tmp, vt * 4)
                for e in T.unroll(VE * 4):
                    o_acc[e] = o_acc[e] * al[e // 2 % 2] + o_tmp[e]


            # the warps' states, combined in a fixed order
            _layer0_warp_scales(m_w, l_w, mx, al, red, w, gr, tg)
            for ww in T.serial(4):
                if w == ww:
                    for vt in T.unroll(VE):
                        for e in T.unroll(4):
                            row = gr + 8 * (e // 2)
                            col = VE * (2 * tg + e % 2) + vt
                            o_sh[row, col] += o_acc[vt * 4 + e] * al[e // 2]
                T.sync_threads()
            _layer0_state_out(o_sh, red, PartO, PartML, b, ts, h, G)

    return htree_layer0


def htree_layer16_kernel(num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int, compression_rate: int,
                         top_k: int, max_top_nodes: int, scale: float, dtype: str, middle: bool = False,
                         min_blocks: int = 3):
    """16-bit layers below the walk, for r >= 16: layer 0 (``middle=False``: merge everything) or a middle layer
    0 < l < L - 1 (``middle=True``) of the rows of one slab. The walk (or the middle layer above) left each row's
    parents of the layer in Par, its candidate count in N0, and the state of the layers above in PartO / PartML
    (updated in place). One CTA per row; each warp takes every fourth tile of 16 candidates (one parent's children,
    r >= 16) with its own online softmax, combined once in a fixed order.
    A middle layer (1) scores every candidate into a per-slab scratch Scr and takes each head's log-sum-exp,
    (2) packs the importance keys from the scratch into shared memory, selects the top_k (radix select, as the walk)
    and hands the winners' children to the layer below through Par / N0 (in place), (3) merges the non-winners from
    the scratch scores with V: each candidate's K and V are gathered once.
    No RoPE table rows per candidate: candidate p = r pi + c (child c of parent slot pi) is rotated at p, and
    <R(q, n - 1), R(k, r pi + c)> = <R(q, n - 1 - r pi), R(k, c)>, so the nodes come pre-rotated at their
    child index (KRot, ``htree_rope_kernel`` with period r) and the query is rotated once per tile.
    The operands go from the gathers straight into m16n8k16 mma.sync fragments (lane (gr, tg) = (lane / 4,
    lane % 4)); dot products do not care about the order of the dimensions they sum, which is permuted so that
    every lane loads whole 16-byte pieces, side by side with its neighbours' (the kernel is bound by the L1
    wavefronts of its gathers, one per 128-byte line that an instruction touches):
      - scores S = Q K^T (M = 16 heads, two 8-candidate tiles): k-step ks's columns (2 tg, 2 tg + 1) are lane
        tg's pairs kdim(tg, 2 ks), kdim(tg, 2 ks + 1) and columns (2 tg + 8, + 9) the same dims + K/2, so a lane
        holds whole RoPE pairs of the query and K/8 dims of each half of its candidates gr and gr + 8;
      - O^T += V^T P^T (M = 16 V dims, N = 8 heads, K = the 16 candidates): the score accumulators are P^T's
        B fragments as they are (no transpose); rows gr and gr + 8 of m-tile mt are lane gr's V dims
        vdim(gr, 2 mt), vdim(gr, 2 mt + 1), so a lane loads V/8 dims of each of its candidates 2 tg, 2 tg + 1,
        2 tg + 8, 2 tg + 9."""
    H, Hkv, K, V, r = num_heads, num_kv_heads, head_dim, v_head_dim, compression_rate
    G = H // Hkv
    NH = 1 if G <= 8 else 2  # heads in tiles of 8: score rows gr (and gr + 8), O^T's N tiles
    half = K // 2
    log_r = int(math.log2(r))
    KP, VP = K // 8, V // 8  # per lane: RoPE pairs of the query, V dims of a candidate
    KC, VC = min(8, KP), min(8, VP)  # of them per 16-byte load

    def kdim(tg, i):  # lane tg's i-th pair (i, i + K/2): the four tg lanes' 16-byte loads lie side by side
        return KC * tg + 4 * KC * (i // KC) + i % KC

    def vdim(gr, i):  # lane gr's i-th V dim: the eight gr lanes' 16-byte loads cover 128 contiguous bytes
        return VC * gr + 8 * VC * (i // VC) + i % VC
    KS, VM = K // 16, V // 16  # the scores' k-steps, O^T's m-tiles
    nbuf = 1 << pack_bits(r, top_k, max_top_nodes)
    pos_mask = nbuf - 1
    q_scale = scale * _LOG2E
    B, Tn, TS, NR, NV = T.dynamic("B"), T.dynamic("T"), T.dynamic("TS"), T.dynamic("NR"), T.dynamic("NV")
    SL, SB, ST = T.dynamic("SL"), T.dynamic("SB"), T.dynamic("ST")
    XB, XT, XH, XG, XN = T.dynamic("XB"), T.dynamic("XT"), T.dynamic("XH"), T.dynamic("XG"), T.dynamic("XN")

    @T.macro
    def tile_scores(KRot, Cos, Sin, parents, qx, qy, fc, fs, fk_x, fk_y, qa, kb, sc, b, h, n, p0, gr, tg):
        """sc = the tile's log2-domain scores (_NEG past the candidates): sc[4 j + 2 rr + e] is head 8 rr + gr,
        candidate p0 + 8 j + 2 tg + e."""
        pi = p0 // r
        row0 = _child(parents, p0, r, top_k)
        # K and the angle's table rows in flight at once (candidates past n, masked below, read clamped rows)
        for j in T.unroll(2):
            row = T.max(T.min(row0 + gr + 8 * j, NR - 1), 0)
            for c in T.unroll(KP // KC):
                for e in T.vectorized(KC):
                    fk_x[j * KP + c * KC + e] = KRot[b, h, row, KC * tg + 4 * KC * c + e]
                for e in T.vectorized(KC):
                    fk_y[j * KP + c * KC + e] = KRot[b, h, row, half + KC * tg + 4 * KC * c + e]
        for c in T.unroll(KP // KC):
            for e in T.vectorized(KC):
                fc[c * KC + e] = Cos[n - 1 - pi * r, KC * tg + 4 * KC * c + e]
            for e in T.vectorized(KC):
                fs[c * KC + e] = Sin[n - 1 - pi * r, KC * tg + 4 * KC * c + e]
        # the query at the tile's relative position n - 1 - r pi
        for rr in T.unroll(NH):
            for e in T.unroll(KP):
                lo_v, hi_v = _rope_pair(T.cast(qx[rr * KP + e], "float32"), T.cast(qy[rr * KP + e], "float32"),
                                        fc[e], fs[e])
                qa[e // 2 * 8 + 2 * rr + e % 2] = T.cast(lo_v, dtype)
                qa[e // 2 * 8 + 4 + 2 * rr + e % 2] = T.cast(hi_v, dtype)
        for j in T.unroll(2):
            for e in T.unroll(4):
                sc[j * 4 + e] = 0.0
            for ks in T.unroll(KS):
                for e in T.unroll(2):
                    kb[e] = fk_x[j * KP + 2 * ks + e]
                    kb[2 + e] = fk_y[j * KP + 2 * ks + e]
                _mma(qa, ks * 8, kb, 0, sc, j * 4, dtype)
        for j in T.unroll(2):
            for e in T.unroll(4):
                sc[j * 4 + e] = T.if_then_else(p0 + 8 * j + 2 * tg + e % 2 < n, sc[j * 4 + e] * q_scale, _NEG)

    @T.macro
    def softmax_update(sc, m_w, l_w, mx, al):
        """Fold the tile's scores into the warp's running maximum m_w and sum l_w (al: the old state's rescale);
        sc becomes the probabilities against m_w."""
        for rr in T.unroll(NH):
            mx[rr] = m_w[rr]
            for j in T.unroll(2):
                for e in T.unroll(2):
                    mx[rr] = T.max(mx[rr], sc[j * 4 + 2 * rr + e])
            mx[rr] = T.max(mx[rr], T.shfl_xor(mx[rr], 1))
            mx[rr] = T.max(mx[rr], T.shfl_xor(mx[rr], 2))
            al[rr] = T.exp2(m_w[rr] - mx[rr])
            m_w[rr] = mx[rr]
            l_w[rr] *= al[rr]
            for j in T.unroll(2):
                for e in T.unroll(2):
                    i = j * 4 + 2 * rr + e
                    sc[i] = T.if_then_else(sc[i] <= _NEG, 0.0, T.exp2(sc[i] - m_w[rr]))
                    l_w[rr] += sc[i]

    @T.macro
    def tile_merge(Vt, parents, fv, va, pb, sc, o_acc, m_w, l_w, mx, al, b, h, p0, v_off, gr, tg):
        """Merge the tile (scores sc) into the warp's online softmax (m_w, l_w, o_acc) with the candidates' V."""
        row0 = v_off + _child(parents, p0, r, top_k)
        # V after the scores: fewer registers, so 3 CTAs per SM without spills
        for c in T.unroll(4):
            row = T.max(T.min(row0 + 2 * tg + c % 2 + 8 * (c // 2), NV - 1), 0)
            for vc in T.unroll(VP // VC):
                for e in T.vectorized(VC):
                    fv[c * VP + vc * VC + e] = Vt[b, row, h, VC * gr + 8 * VC * vc + e]
        softmax_update(sc, m_w, l_w, mx, al)
        for rr in T.unroll(NH):
            for j in T.unroll(2):
                for e in T.unroll(2):
                    pb[rr * 4 + 2 * j + e] = T.cast(sc[j * 4 + 2 * rr + e], dtype)
        # O^T's column 2 tg + e of head tile nh is head 8 nh + 2 tg + e, whose rescale lane 4 (2 tg + e) holds
        for nh in T.unroll(NH):
            for e in T.unroll(2):
                mx[0] = T.shfl_sync(al[nh], 4 * (2 * tg + e))
                for mt in T.unroll(VM):
                    for hi in T.unroll(2):
                        o_acc[(mt * NH + nh) * 4 + 2 * hi + e] *= mx[0]
        for mt in T.unroll(VM):
            for c2 in T.unroll(2):
                for hi in T.unroll(2):
                    for e in T.unroll(2):
                        va[4 * c2 + 2 * hi + e] = fv[(2 * c2 + e) * VP + 2 * mt + hi]
            for nh in T.unroll(NH):
                _mma(va, 0, pb, nh * 4, o_acc, (mt * NH + nh) * 4, dtype)

    @T.prim_func
    def htree_layer16(
        Q: T.Tensor((B, Tn, H, K), dtype),
        KRot: T.Tensor((B, Hkv, NR, K), dtype),
        Vt: T.Tensor((B, NV, Hkv, V), dtype),
        Cos: T.Tensor((nbuf, half), "float32"),
        Sin: T.Tensor((nbuf, half), "float32"),
        Par: T.Tensor((B, TS, Hkv, top_k), "int32"),
        N0: T.Tensor((B, TS, Hkv), "int32"),
        PartO: T.Tensor((B, TS, H, V), "float32"),
        PartML: T.Tensor((B, TS, H, 2), "float32"),
        Scr: T.Tensor((XB, XT, XH, XG, XN), "float32"),  # [B, TS, Hkv, G, nbuf] (a middle layer)
        Sel: T.Tensor((SL, SB, ST, Hkv, top_k), "int32"),
        t_start: T.int32,
        v_off: T.int32,
        layer: T.int32,
        write_sel: T.int32,
    ):
        with T.Kernel(TS, Hkv, B, threads=128) as (ts, h, b):
            T.annotate_min_blocks_per_sm(min_blocks)
            parents = T.alloc_shared((top_k,), "int32")
            o_sh = T.alloc_shared((16, V), "float32")
            red = T.alloc_shared((5, 16), "float32")
            # a middle layer's selection (placeholders at layer 0)
            keys = T.alloc_shared((nbuf,) if middle else (1,), "int32")
            chosen = T.alloc_shared((top_k,) if middle else (1,), "int32")
            counts = T.alloc_shared((128,) if middle else (1,), "int32")
            hist = T.alloc_shared((256,) if middle else (1,), "int32")
            pick = T.alloc_shared((2,), "int32")
            lse = T.alloc_shared((16,), "float32")
            qx = T.alloc_local((NH * KP,), dtype)  # the raw query pairs (i, i + K/2) of head rows gr (gr + 8)
            qy = T.alloc_local((NH * KP,), dtype)
            fc = T.alloc_local((KP,), "float32")  # a tile's gathers: its RoPE angle, K rows gr and gr + 8, V rows
            fs = T.alloc_local((KP,), "float32")
            fk_x = T.alloc_local((2 * KP,), dtype)
            fk_y = T.alloc_local((2 * KP,), dtype)
            fv = T.alloc_local((4 * VP,), dtype)
            qa = T.alloc_local((KS * 8,), dtype)  # A fragments of the rotated query, per k-step
            kb = T.alloc_local((4,), dtype)
            va = T.alloc_local((8,), dtype)
            pb = T.alloc_local((NH * 4,), dtype)  # B fragments of P^T, per head tile
            sc = T.alloc_local((8,), "float32")
            o_acc = T.alloc_local((VM * NH * 4,), "float32")
            m_w = T.alloc_local((2,), "float32")  # head rows gr and gr + 8: running maximum, partial sum
            l_w = T.alloc_local((2,), "float32")
            mx = T.alloc_local((2,), "float32")
            al = T.alloc_local((2,), "float32")
            prob = T.alloc_local((G, 1), "float32")
            tmp = T.alloc_local((4,), "int32")
            thr = T.alloc_var("int32")  # smallest winning key (middle layers)

            tx = T.get_thread_binding()
            lane = tx % 32
            w = tx // 32
            gr = lane // 4
            tg = lane % 4
            t = t_start + ts
            n = N0[b, ts, h]

            for i in T.Parallel(top_k):
                parents[i] = Par[b, ts, h, i]
            T.clear(o_sh)
            for rr in T.unroll(NH):
                g = gr + 8 * rr
                for e in T.unroll(KP):
                    qx[rr * KP + e] = T.if_then_else(g < G, Q[b, t, h * G + T.min(g, G - 1), kdim(tg, e)],
                                                     T.cast(0.0, dtype))
                    qy[rr * KP + e] = T.if_then_else(g < G, Q[b, t, h * G + T.min(g, G - 1), half + kdim(tg, e)],
                                                     T.cast(0.0, dtype))
            for i in T.unroll(KS * 8):  # rows gr + 8 stay zero with G <= 8
                qa[i] = T.cast(0.0, dtype)
            T.sync_threads()
            thr = 0
            if middle:
                # (1) every candidate's scores into the scratch, each head's log-sum-exp
                for rr in T.unroll(2):
                    m_w[rr] = _NEG
                    l_w[rr] = 0.0
                for it in T.serial(T.ceildiv(T.max(T.ceildiv(n, 16) - w, 0), 4)):
                    p0 = (w + 4 * it) * 16
                    tile_scores(KRot, Cos, Sin, parents, qx, qy, fc, fs, fk_x, fk_y, qa, kb, sc, b, h, n, p0, gr, tg)
                    for rr in T.unroll(NH):
                        for j in T.unroll(2):
                            for e in T.unroll(2):
                                p = p0 + 8 * j + 2 * tg + e
                                if gr + 8 * rr < G and p < n:
                                    Scr[b, ts, h, T.min(gr + 8 * rr, G - 1), p] = sc[j * 4 + 2 * rr + e]
                    softmax_update(sc, m_w, l_w, mx, al)
                _layer0_warp_scales(m_w, l_w, mx, al, red, w, gr, tg)
                for g in T.Parallel(16):
                    lse[g] = red[4, g] + T.log2((red[0, g] + red[1, g]) + (red[2, g] + red[3, g]))
                T.sync_threads()
                # (2) the packed importance keys, the top-k threshold and the winners' children for the layer below
                for i in T.serial(T.ceildiv(n, 128)):
                    p = i * 128 + tx
                    if p < n:
                        for g in T.unroll(G):
                            pr = T.exp2(Scr[b, ts, h, g, p] - lse[g])
                            prob[g, 0] = T.if_then_else(pr < _FLT_MIN, 0.0, pr)
                        keys[p] = _packed_key(prob, G, 0, 0, p, n, pos_mask)
                T.sync_threads()
                _select_top_k(keys, n, top_k, hist, pick, tmp, tx, 128)
                thr = pick[0]
                _compact_winners(keys, n, thr, parents, 1, chosen, counts, tx, 128, r, top_k)
                if write_sel != 0:
                    for i in T.Parallel(top_k):
                        Sel[layer - 1, b, t, h, i] = chosen[i]
                for i in T.Parallel(top_k):
                    Par[b, ts, h, i] = chosen[i]
                if tx == 0:
                    N0[b, ts, h] = (T.min(n, top_k) - 1) * r + T.bitwise_and(t >> ((layer - 1) * log_r), r - 1) + 1
            # (3) merge the non-winners (layer 0: everything) into the online softmax; the layers above: warp 0
            # carries their state, the others start empty (same reference)
            for mt in T.unroll(VM):
                for nh in T.unroll(NH):
                    for e in T.unroll(4):
                        g = 8 * nh + 2 * tg + e % 2
                        o_acc[(mt * NH + nh) * 4 + e] = T.if_then_else(
                            w == 0 and g < G, PartO[b, ts, h * G + T.min(g, G - 1), vdim(gr, 2 * mt + e // 2)], 0.0)
            _layer0_state_in(PartML, m_w, l_w, b, ts, h, w, gr, tg, G)
            for it in T.serial(T.ceildiv(T.max(T.ceildiv(n, 16) - w, 0), 4)):
                p0 = (w + 4 * it) * 16
                if middle:
                    for rr in T.unroll(NH):
                        for j in T.unroll(2):
                            for e in T.unroll(2):
                                p = p0 + 8 * j + 2 * tg + e
                                sc[j * 4 + 2 * rr + e] = T.if_then_else(
                                    p < n and keys[T.min(p, nbuf - 1)] < thr,
                                    Scr[b, ts, h, T.min(gr + 8 * rr, G - 1), T.min(p, nbuf - 1)], _NEG)
                else:
                    tile_scores(KRot, Cos, Sin, parents, qx, qy, fc, fs, fk_x, fk_y, qa, kb, sc, b, h, n, p0, gr, tg)
                tile_merge(Vt, parents, fv, va, pb, sc, o_acc, m_w, l_w, mx, al, b, h, p0, v_off, gr, tg)

            # the warps' states, combined in a fixed order
            _layer0_warp_scales(m_w, l_w, mx, al, red, w, gr, tg)
            for ww in T.serial(4):
                if w == ww:
                    for nh in T.unroll(NH):
                        for e in T.unroll(2):
                            mx[0] = T.shfl_sync(al[nh], 4 * (2 * tg + e))
                            for mt in T.unroll(VM):
                                for hi in T.unroll(2):
                                    o_sh[8 * nh + 2 * tg + e, vdim(gr, 2 * mt + hi)] += \
                                        o_acc[(mt * NH + nh) * 4 + 2 * hi + e] * mx[0]
                T.sync_threads()
            _layer0_state_out(o_sh, red, PartO, PartML, b, ts, h, G)

    return htree_layer16


def _split_tf32(x: torch.Tensor) -> torch.Tensor:
    """[2, *x.shape] fp32: x's TF32-exact high part and its remainder, as the bit patterns the kernels'
    TF32 operand stores write (CUTLASS's round_half_ulp_truncate adds half a TF32 ulp, 0x1000, to finite
    values and the tensor cores drop the low 13 bits), so products read them unchanged."""
    hi = (x.view(torch.int32) & -8192).view(torch.float32)
    halves = torch.stack([hi, x - hi])
    bits = halves.view(torch.int32)
    return torch.where(halves.isfinite(), bits + 0x1000, bits).view(torch.float32)


# Nodes per chunk of each top-layer kernel, for fp32 (True) and 16-bit inputs: smaller chunks let more CTAs
# share an SM (an fp32 chunk takes 4x the shared memory of a 16-bit one: TF32 halves), larger ones
# amortize the per-chunk work. Same-process H100 A/Bs of 64 vs 32 (ms): fp32 (a) lse 42.0 / 38.5, keys
# 44.9 / 51.2, merge 127.4 / 110.0 (3 CTAs per SM instead of 2); bf16 (b) 128K lse 21.4 / 18.7, keys
# 36.3 / 25.5, merge 51.3 / 61.9.
_TOP_CHUNK = {True: dict(lse=32, keys=64, merge=32), False: dict(lse=32, keys=32, merge=64)}


class HTreeForwardTileLang:
    """``op(q, k, v, return_selection=False)``: q [B,T,H,K], k [B,T,Hkv,K], v [B,T,Hkv,V] -> o [B,T,H,V]
    (q's dtype); with ``return_selection`` also the list of layer l >= 1 selections (entry l-1),
    [B,T,Hkv,top_k] int32 ascending, -1 padded. See the module docstring for the memory needed."""

    op_name = "htree"
    _KEYS_BYTES = 1 << 28  # the top layer's packed keys of one slab of queries
    _SCRATCH_BYTES = 1 << 30  # a middle layer's scores of one slab (16-bit, r >= 16)
    # A chunk's gathers sit in registers (96 per thread at K = 128, bf16, block_n = 64: 2 CTAs per SM and
    # spills), so K > 32 takes chunks of 32 and 3 CTAs per SM (H200, (b) T=32768: 434 vs 600 ms); at
    # K = 32 (fp32: ~32 registers, 72 KB of shared memory) chunks of 64 fit 3 CTAs per SM. chunk_rope
    # (16-bit only) measured 2-9% faster (H100, (b) T=32768 382 -> 349 ms, 131072 1816 -> 1781 ms).
    # tiles0, min_blocks0: the layer kernels' 8-candidate tiles per warp step (fp32 only) and CTAs per SM: fp32
    # measured at (a) (2 and 4: 127 registers, no spills), 16-bit at (b) (3: 166 registers, no spills; 4 spills);
    # docs/perf.md. Not in the autotuned space (config_space tunes the walk, tunable_kernel)
    DEFAULT_CONFIG = {"block_n": 32, "threads": 128, "min_blocks": 3, "chunk_rope": True, "tiles0": 2, "min_blocks0": 3}
    SMALL_HEAD_CONFIG = {"block_n": 64, "threads": 128, "min_blocks": 3, "chunk_rope": True, "tiles0": 2,
                         "min_blocks0": 4}  # head_dim <= 32
    tunable_kernel = staticmethod(htree_fwd_kernel)

    @staticmethod
    def config_space(**spec) -> list[dict]:
        return [{"block_n": bn, "threads": 128, "min_blocks": mb} for bn in (32, 64, 128) for mb in (2, 3, 4)]

    def __init__(self, num_heads, num_kv_heads, head_dim, v_head_dim=None, compression_rate=16,
                 top_k_per_layer=512, max_top_nodes=8192, rope_base=10000.0, dtype=torch.bfloat16,
                 scale=None, config=None):
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        check_int("num_heads", num_heads, lo=1)
        check_int("num_kv_heads", num_kv_heads, lo=1)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads: expected a multiple of num_kv_heads={num_kv_heads}, got {num_heads}")
        check_int("num_heads // num_kv_heads", num_heads // num_kv_heads, hi=16)
        check_int("head_dim", head_dim, multiple_of=2)
        check_choice("head_dim", head_dim, (32, 64, 128))
        check_int("v_head_dim", v_head_dim)
        check_choice("v_head_dim", v_head_dim, (32, 64, 128))
        check_int("compression_rate", compression_rate, lo=2, power_of_two=True)
        check_int("top_k_per_layer", top_k_per_layer, lo=1, power_of_two=True)
        check_int("max_top_nodes", max_top_nodes, lo=1, power_of_two=True)
        check_int("max(max_top_nodes, top_k_per_layer * compression_rate)",
                  max(max_top_nodes, top_k_per_layer * compression_rate), hi=_MAX_BUFFER)
        if isinstance(rope_base, bool) or not isinstance(rope_base, (int, float)) or not rope_base > 0:
            raise ValueError(f"rope_base: expected a positive number, got {rope_base!r}")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
            raise TypeError(f"scale: expected a float or None, got {type(scale).__name__}")
        if dtype not in _DTYPES:
            raise TypeError(f"dtype: expected one of {list(_DTYPES)}, got {dtype}")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.v_head_dim = head_dim, v_head_dim
        self.compression_rate, self.top_k, self.max_top_nodes = compression_rate, top_k_per_layer, max_top_nodes
        self.rope_base, self.dtype = float(rope_base), dtype
        self.scale = float(head_dim ** -0.5 if scale is None else scale)
        self.spec = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                     "v_head_dim": v_head_dim, "compression_rate": compression_rate, "top_k": top_k_per_layer,
                     "max_top_nodes": max_top_nodes, "scale": self.scale, "dtype": _DTYPES[dtype]}
        default = self.SMALL_HEAD_CONFIG if head_dim <= 32 else self.DEFAULT_CONFIG
        self.config = resolve_config(self.op_name, self.spec, config, default)
        self.pool = compile_kernel(htree_pool_kernel(num_kv_heads, head_dim, v_head_dim, compression_rate,
                                                     _DTYPES[dtype]))
        self.rope = compile_kernel(htree_rope_kernel(num_kv_heads, head_dim, _DTYPES[dtype]))
        chunk = _TOP_CHUNK[dtype == torch.float32]
        self.top_lse = compile_kernel(htree_top_lse_kernel(num_heads, num_kv_heads, head_dim, self.scale,
                                                           _DTYPES[dtype], block_n=chunk["lse"]))
        self.top_keys = compile_kernel(htree_top_keys_kernel(num_heads, num_kv_heads, head_dim, compression_rate,
                                                             top_k_per_layer, max_top_nodes, self.scale,
                                                             _DTYPES[dtype], block_n=chunk["keys"]))
        self.top_merge = compile_kernel(htree_top_merge_kernel(num_heads, num_kv_heads, head_dim, v_head_dim,
                                                               self.scale, _DTYPES[dtype], block_n=chunk["merge"]))
        walk = {k: v for k, v in self.config.items() if k not in ("tiles0", "min_blocks0")}
        self.kernel = compile_kernel(htree_fwd_kernel(**self.spec, **walk))
        self.layer0 = self.middle = self.rope0 = None
        if _split_layer0(_DTYPES[dtype], head_dim, v_head_dim, num_heads // num_kv_heads, compression_rate):
            shape = (num_heads, num_kv_heads, head_dim, v_head_dim, compression_rate, top_k_per_layer, max_top_nodes,
                     self.scale)
            if dtype == torch.float32:
                self.layer0 = compile_kernel(htree_layer0_kernel(*shape, tiles0=self.config["tiles0"],
                                                                 min_blocks=self.config["min_blocks0"]))
            else:  # the nodes below the top pre-rotated at their child index
                self.rope0 = compile_kernel(htree_rope_kernel(num_kv_heads, head_dim, _DTYPES[dtype],
                                                              period=compression_rate))
                self.layer0, self.middle = (compile_kernel(htree_layer16_kernel(
                    *shape, _DTYPES[dtype], middle=middle, min_blocks=self.config["min_blocks0"]))
                    for middle in (False, True))
        self._tables = {}

    def _rope(self, device):
        if device not in self._tables:
            nbuf = 1 << pack_bits(self.compression_rate, self.top_k, self.max_top_nodes)
            self._tables[device] = rope_tables(self.head_dim, nbuf, self.rope_base, torch.float32, device)
        return self._tables[device]

    def _check(self, q, k, v, out):
        if isinstance(q, torch.Tensor) and q.dim() == 4 and 0 in q.shape[:2]:
            raise ValueError(f"q: expected B >= 1 and T >= 1, got shape {list(q.shape)}")
        check_tensor("q", q, self.dtype, (None, None, self.num_heads, self.head_dim))
        B, T = q.shape[:2]
        check_tensor("k", k, self.dtype, (B, T, self.num_kv_heads, self.head_dim), q.device)
        check_tensor("v", v, self.dtype, (B, T, self.num_kv_heads, self.v_head_dim), q.device)
        if out is not None:
            check_tensor("out", out, self.dtype, (B, T, self.num_heads, self.v_head_dim), q.device)

    def _tree(self, k, v):
        """Layers 1..L-1 concatenated along the node axis; LayerOff[l] = first row of layer l."""
        B, T, Hkv = k.shape[:3]
        r = self.compression_rate
        sizes = [T]
        while sizes[-1] > self.max_top_nodes:
            sizes.append(-(-sizes[-1] // r))
        offs = [0, 0]
        for s in sizes[1:-1]:
            offs.append(offs[-1] + s)
        nn = max(1, sum(sizes[1:]))
        nodes_k = k.new_empty(B, nn, Hkv, self.head_dim)
        nodes_v = v.new_empty(B, nn, Hkv, self.v_head_dim)
        for l in range(1, len(sizes)):
            src_k, src_v = (k, v) if l == 1 else (nodes_k, nodes_v)
            self.pool(src_k, src_v, nodes_k, nodes_v, 0 if l == 1 else offs[l - 1], sizes[l - 1], offs[l], sizes[l])
        layer_off = torch.zeros(_MAX_LAYERS, dtype=torch.int32)
        layer_off[:len(sizes)] = torch.tensor(offs[:len(sizes)], dtype=torch.int32)
        # the top layer (layer 0 itself when T <= max_top_nodes), rotated at its buffer positions
        top = k.new_empty(B, Hkv, sizes[-1], self.head_dim)
        cos, sin = self._rope(k.device)
        self.rope(k if len(sizes) == 1 else nodes_k, cos, sin, top, 0 if len(sizes) == 1 else offs[-1])
        return nodes_k, nodes_v, top, layer_off.to(k.device), offs, sizes

    def __call__(self, q, k, v, return_selection=False, out=None):
        self._check(q, k, v, out)
        B, T = q.shape[:2]
        H, Hkv, V = self.num_heads, self.num_kv_heads, self.v_head_dim
        nodes_k, nodes_v, top, layer_off, offs, sizes = self._tree(k, v)
        top_off, L = offs[-1], len(sizes)
        cos, sin = self._rope(q.device)
        if out is None:
            out = torch.empty(B, T, H, V, dtype=q.dtype, device=q.device)
        write_sel = return_selection and L > 1
        sel = q.new_empty(((L - 1, B, T) if write_sel else (1, 1, 1)) + (Hkv, self.top_k), dtype=torch.int32)
        f32, i32 = dict(dtype=torch.float32, device=q.device), dict(dtype=torch.int32, device=q.device)
        if L == 1:  # one layer: the walk merges everything and writes O (no top-layer workspaces)
            self.kernel(q, k, v, nodes_k, nodes_v, top, torch.empty(B, 1, Hkv, 1, **i32), cos, sin, layer_off, out,
                        torch.empty(B, T, Hkv, **i32), torch.empty(B, 1, H, V, **f32), torch.empty(B, 1, H, 2, **f32),
                        sel, torch.empty(B, 1, Hkv, self.top_k, **i32), torch.empty(B, 1, Hkv, **i32), L, 0, 0, 0)
            return (out, []) if return_selection else out
        shift = (L - 1) * int(math.log2(self.compression_rate))
        lse = torch.empty(B, T, H, **f32)
        n_top = top.shape[2]
        top_k, top_v = top, nodes_v
        if q.dtype == torch.float32:  # the top kernels' operands in TF32 halves, split once per call
            chunk = _TOP_CHUNK[True]["merge"]
            top_v = torch.zeros(B, Hkv, V, -(-n_top // chunk) * chunk, **f32)
            top_v[..., :n_top] = nodes_v[:, top_off:top_off + n_top].permute(0, 2, 3, 1)
            top_k, top_v = _split_tf32(top), _split_tf32(top_v)
        self.top_lse(q, top_k, cos, sin, lse, shift)
        # htree_layer16_kernel takes the middle layers (16-bit, r >= 16), with their scores in a per-slab scratch
        l_lo = L - 2 if self.middle is not None and L > 2 else 0
        nbuf = 1 << pack_bits(self.compression_rate, self.top_k, self.max_top_nodes)
        scr_row = 4 * B * H * nbuf if l_lo else 0  # scratch bytes per query row
        slab = max(1, min(T, self._KEYS_BYTES // (4 * B * Hkv * n_top), self._SCRATCH_BYTES // max(scr_row, 1)))
        slab = slab - slab % 64 if slab >= 64 else slab  # whole CTAs of the top kernels
        scr_buf = torch.empty(slab * scr_row // 4 if l_lo else 1, **f32)
        keys_buf = torch.empty(B * slab * Hkv * n_top, **i32)
        thr_buf = torch.empty(B * slab * Hkv, **i32)
        part_o_buf, part_ml_buf = torch.empty(B * slab * H * V, **f32), torch.empty(B * slab * H * 2, **f32)
        # the parents and candidate counts the walk hands over to the layer kernels (else one-row placeholders)
        par_rows = slab if self.layer0 is not None else 1
        par_buf, n0_buf = torch.empty(B * par_rows * Hkv * self.top_k, **i32), torch.empty(B * par_rows * Hkv, **i32)

        def carve(buf, *shape):  # a contiguous view of the slab's part of a workspace
            return buf[:math.prod(shape)].view(shape)

        # htree_layer16_kernel's K: the tokens and the middle layers' nodes rotated at their child index
        rot = []
        if self.rope0 is not None:
            for l in range(l_lo + 1):
                rot.append(k.new_empty(B, Hkv, sizes[l], self.head_dim))
                self.rope0(k if l == 0 else nodes_k, cos, sin, rot[l], offs[l])

        for t0 in range(0, T, slab):
            ts = min(slab, T - t0)
            nk = ((t0 + ts - 1) >> shift) + 1  # the slab's last query has the most top-layer candidates
            keys, thr = carve(keys_buf, B, ts, Hkv, nk), carve(thr_buf, B, ts, Hkv)
            part_o, part_ml = carve(part_o_buf, B, ts, H, V), carve(part_ml_buf, B, ts, H, 2)
            par, n0 = carve(par_buf, B, min(ts, par_rows), Hkv, self.top_k), carve(n0_buf, B, min(ts, par_rows), Hkv)
            self.top_keys(q, top_k, cos, sin, lse, keys, shift, t0)
            self.kernel(q, k, v, nodes_k, nodes_v, top, keys, cos, sin, layer_off, out, thr, part_o, part_ml, sel, par,
                        n0, L, int(write_sel), t0, l_lo)
            scr = carve(scr_buf, B, ts, Hkv, H // Hkv, nbuf) if l_lo else scr_buf.view(1, 1, 1, 1, 1)
            for l in range(l_lo, 0, -1):
                self.middle(q, rot[l], nodes_v, cos, sin, par, n0, part_o, part_ml, scr, sel, t0, offs[l], l,
                            int(write_sel))
            if self.rope0 is not None:
                self.layer0(q, rot[0], v, cos, sin, par, n0, part_o, part_ml, scr, sel, t0, 0, 0, 0)
            elif self.layer0 is not None:
                self.layer0(q, k, v, cos, sin, par, n0, part_o, part_ml, t0)
            self.top_merge(q, top_k, top_v, cos, sin, lse, keys, thr, part_o, part_ml, out, shift, t0, top_off)
        return (out, list(sel.unbind(0)) if write_sel else []) if return_selection else out
