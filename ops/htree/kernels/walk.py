"""The walk (``htree_fwd_kernel``): one CTA per (b, t, kv head) row walks down the tree from the top layer, so
the selected parents of a layer live in shared memory.

Below the top the walk streams each layer's candidates in chunks of ``block_n``: gathers their K into
registers (all of a chunk's loads in flight at once, issued one chunk ahead so they overlap the previous
chunk's math), rotates it at the candidates' buffer positions into shared memory and scores the G query
heads with the tensor cores (mma.sync, M = G padded to 16). Layers l > 0 take three passes: (1) the
per-head log-sum-exp (per-element partial max/sum in registers, reduced once per layer), (2) the packed
importance keys (fp32 importance, low LOG_N bits = ~position) into shared memory, then (also for the top
layer's keys, from ``htree_top_keys_kernel``) the top-k threshold by a radix select and an order-preserving
compaction of the winners into the next layer's parents (``select``), (3) the non-winners merged into the
per-head online softmax with V, against one reference per layer (lse bounds every score, so no per-chunk
maximum). Layer 0 merges all with a running maximum. The walk's state (U, m, S per head) goes to
``htree_top_merge_kernel``, which adds the top layer's non-winners and normalizes; where the layer kernels
apply (``uses_layer_kernels``) the walk stops early and hands its parents over to them."""

import math

from ...common.hw import LOG2E
from ..tree import MAX_LAYERS, pack_bits
from ...common.tl.softmax import NEG, lse_finish, lse_update
from .fragments import FLT_MIN, child, operand_stores, packed_key, uses_layer_kernels
from .select import compact_winners, select_top_k

import tilelang.language as T  # noqa: E402


def htree_fwd_kernel(num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int,
                     compression_rate: int, top_k_per_layer: int, max_top_nodes: int, scale: float, dtype: str,
                     block_n: int = 64, threads: int = 128, min_blocks: int = 3, chunk_rope: bool = False,
                     for_backward: bool = False):
    """The walk (module docstring). ``for_backward`` builds the variant the differentiable forward runs: Sel holds
    the winners' candidate-buffer positions as int16 (the backward's saved selections), and with one layer the
    rows' softmax states (maximum, sum; log2 domain) also go to PartML, passed with T rows, for the final lse."""
    H, Hkv, K, V, r = num_heads, num_kv_heads, head_dim, v_head_dim, compression_rate
    top_k = top_k_per_layer
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
    split0 = uses_layer_kernels(dtype, K, V, G, r)
    # chunk_rope (16-bit inputs): below the top, candidate p = c0 + j is rotated at j (table entries fixed
    # per thread, loaded once) and the query at n - 1 - c0 once per chunk, instead of loading the table
    # rows of every p. Exact in real arithmetic, but the composed angles round differently from the
    # golden's, which moves fp32 near-ties, so fp32 keeps the golden's own rows.
    chunk_rope = chunk_rope and not split
    cdt = dtype
    q_scale = scale * LOG2E  # scores in the log2 domain
    B, Tn, NN, NT = T.dynamic("B"), T.dynamic("T"), T.dynamic("NN"), T.dynamic("NT")
    SL, SB, ST = T.dynamic("SL"), T.dynamic("SB"), T.dynamic("ST")
    # the slab's rows TS come from Thr; the L == 1 call passes one-row placeholders for the others
    TS, TK, NK, TP, TQ = T.dynamic("TS"), T.dynamic("TK"), T.dynamic("NK"), T.dynamic("TP"), T.dynamic("TQ")

    put, put_rotated = operand_stores(dtype, half)

    def node_of(parents, p, n_par):
        """Layer node of candidate p (below the top: child p % r of parent p // r)."""
        return T.if_then_else(n_par == 0, p, child(parents, p, r, top_k))

    # ------------------------------------------------------------------------- a chunk's operands
    # Chunk loads go in two loops: gathers into registers, then math and shared stores. In one loop the
    # compiler keeps every shared-memory read of a node index behind the previous row's shared store
    # (it cannot rule out aliasing), which serialized the chunk into one global round trip per row.
    # k_src = (Kt, NodesK, TopK, Cos, Sin): where K comes from; k_regs = (kt, kx, ky, kc, ks): one chunk's
    # gathered K (the top layer's rotated rows, or pairs with their RoPE entries).
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
    def gather_k(k_src, k_regs, parents, b, h, l, top, c0, off, n, n_par):
        """Raw K of the chunk's candidates into registers (zero past the candidates): the top layer's rows
        were rotated beforehand (contiguous, no tables), below it pairs with their RoPE entries."""
        Kt, NodesK, TopK, Cos, Sin = k_src
        kt, kx, ky, kc, ks = k_regs
        if top:
            for j, d in T.Parallel(block_n, K):
                kt[j, d] = T.if_then_else(c0 + j < n, TopK[b, h, T.min(c0 + j, NT - 1), d], T.cast(0.0, dtype))
        elif l == 0:
            gather_pairs(Kt, Tn, 0, Cos, Sin, parents, kx, ky, kc, ks, b, h, c0, n, n_par)
        else:
            gather_pairs(NodesK, NN, off, Cos, Sin, parents, kx, ky, kc, ks, b, h, c0, n, n_par)

    @T.macro
    def store_k(k_regs, k_s, k_lo, top):
        """The gathered K as the mma operand, rotated at the candidates' buffer positions below the top."""
        kt, kx, ky, kc, ks = k_regs
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
        """acc_s = log2-domain scores of chunk c0; NEG past the candidates."""
        if chunk_rope:
            if below_top:
                rotate_q(q_raw, q_s, q_lo, Cos, Sin, n - 1 - c0)
        T.clear(acc_s)
        T.gemm(q_s, k_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
        if split:
            T.gemm(q_s, k_lo, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
            T.gemm(q_lo, k_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
        for g, j in T.Parallel(GP, block_n):
            acc_s[g, j] = T.if_then_else(c0 + j < n, acc_s[g, j], NEG)

    @T.macro
    def score_chunk(k_src, k_regs, parents, tiles, b, h, l, num_layers, c, off, n: T.Ref, n_par: T.Ref,
                    v_src=None, vx=None):
        """acc_s = the scores of chunk c, whose K was gathered into k_regs; meanwhile (with v_src = (Vt, NodesV))
        this chunk's V and the next chunk's K fly (past the last: none). tiles = (q_raw, q_s, q_lo, k_s, k_lo,
        acc_s)."""
        # (k_s, k_lo are not bound to names here: with K == V they are also v_s, v_lo, and a buffer takes the
        # name it was last bound to)
        Kt, NodesK, TopK, Cos, Sin = k_src
        q_raw, q_s, q_lo, acc_s = tiles[0], tiles[1], tiles[2], tiles[5]
        store_k(k_regs, tiles[3], tiles[4], l == num_layers - 1)
        if v_src is not None:
            Vt, NodesV = v_src
            gather_v(Vt, NodesV, parents, vx, b, h, l, c * block_n, off, n, n_par)
        gather_k(k_src, k_regs, parents, b, h, l, l == num_layers - 1, (c + 1) * block_n, off, n, n_par)
        scores(q_raw, q_s, q_lo, tiles[3], tiles[4], acc_s, Cos, Sin, l < num_layers - 1, c * block_n, n)

    @T.macro
    def rescale(acc_o, s_part, m_run, m_new):
        """Move the online-softmax state (acc_o, s_part) from reference m_run to m_new >= m_run."""
        for g, d in T.Parallel(GP, V):
            acc_o[g, d] *= T.exp2(m_run[g] - m_new[g])
        for g, j in T.Parallel(GP, block_n):
            s_part[g, j] *= T.exp2(m_run[g] - m_new[g])
        for g in T.Parallel(GP):
            m_run[g] = m_new[g]

    # ------------------------------------------------------------------------- the walk's phases
    @T.macro
    def start_row(Q, Cos, Sin, q_raw, acc_o, s_part, m_run, kc, ks, b, t, h, n_par: T.Ref):
        """The row's G query heads, an empty online softmax, no parents yet, and (chunk_rope) this thread's
        table entries of in-chunk positions j."""
        for g, d in T.Parallel(G, K):
            q_raw[g, d] = Q[b, t, h * G + g, d]
        T.fill(acc_o, 0.0)
        T.fill(s_part, 0.0)
        T.fill(m_run, NEG)
        n_par = 0
        if chunk_rope:  # this thread's table entries of in-chunk positions j
            for j, i in T.Parallel(block_n, half):  # (rows past the table are past every n)
                kc[j, i] = Cos[T.min(j, nbuf - 1), i]
                ks[j, i] = Sin[T.min(j, nbuf - 1), i]

    @T.macro
    def load_top_keys(TopKeys, keys, b, ts, h, tx, n: T.Ref):
        """The top layer's packed keys, computed for the slab by htree_top_keys_kernel."""
        for i in T.serial(T.ceildiv(n, threads)):
            if i * threads + tx < n:
                keys[i * threads + tx] = TopKeys[b, ts, h, i * threads + tx]
        T.sync_threads()

    @T.macro
    def lse_pass(k_src, k_regs, parents, tiles, m_part, l_part, m_new, lse, b, h, l, num_layers, off, chunks,
                 n: T.Ref, n_par: T.Ref):
        """(1) lse = every head's log-sum-exp over all candidates of layer l."""
        acc_s = tiles[5]
        T.fill(m_part, NEG)
        T.fill(l_part, 0.0)
        gather_k(k_src, k_regs, parents, b, h, l, l == num_layers - 1, 0, off, n, n_par)
        for c in T.serial(chunks):
            score_chunk(k_src, k_regs, parents, tiles, b, h, l, num_layers, c, off, n, n_par)
            for g, j in T.Parallel(GP, block_n):
                lse_update(m_part, l_part, g, j, acc_s[g, j])
        lse_finish(m_part, l_part, m_new, lse)

    @T.macro
    def keys_pass(k_src, k_regs, parents, tiles, prob_s, keys, lse, b, h, l, num_layers, off, chunks,
                  n: T.Ref, n_par: T.Ref):
        """(2) keys = the packed importance keys of layer l's candidates (against lse)."""
        acc_s = tiles[5]
        gather_k(k_src, k_regs, parents, b, h, l, l == num_layers - 1, 0, off, n, n_par)
        for c in T.serial(chunks):
            score_chunk(k_src, k_regs, parents, tiles, b, h, l, num_layers, c, off, n, n_par)
            for g, j in T.Parallel(GP, block_n):
                pr = T.exp2(acc_s[g, j] - lse[g])
                prob_s[g, j] = T.if_then_else(pr < FLT_MIN, 0.0, pr)
            for j in T.Parallel(block_n):
                p = c * block_n + j
                if p < n:
                    keys[p] = packed_key(prob_s, G, 0, j, p, n, pos_mask)

    @T.macro
    def select_layer(keys, parents, chosen, chosen_pos, counts, hist, pick, tmp, Sel, b, t, h, l, tx, write_sel,
                     n: T.Ref, n_par: T.Ref, thr: T.Ref):
        """thr = the top-k threshold of layer l's keys; chosen = its winners as nodes (ascending, -1 padded),
        also into Sel on request."""
        select_top_k(keys, n, top_k, hist, pick, tmp, tx, threads)
        thr = pick[0]
        compact_winners(keys, n, thr, parents, n_par, chosen, counts, tx, threads, r, top_k, chosen_pos)
        if write_sel != 0:
            for i in T.Parallel(top_k):
                if for_backward:  # the positions, int16
                    Sel[l - 1, b, t, h, i] = T.cast(chosen_pos[i], "int16")
                else:
                    Sel[l - 1, b, t, h, i] = chosen[i]

    @T.macro
    def hand_over(Par, N0, parents, b, ts, h, tx, n: T.Ref):
        """Layer l_lo's parents and candidate count, for htree_layer16_kernel / htree_layer0_kernel."""
        if tx == 0:
            N0[b, ts, h] = n
        for i in T.Parallel(top_k):
            Par[b, ts, h, i] = parents[i]

    @T.macro
    def merge_chunk(acc_s, vx, p_s, p_lo, v_s, v_lo, acc_o, s_part, m_run):
        """The chunk's probabilities against m_run (scores <= NEG: none) into s_part and, times its V, acc_o."""
        for g, j in T.Parallel(GP, block_n):
            acc_s[g, j] = T.if_then_else(acc_s[g, j] <= NEG, 0.0, T.exp2(acc_s[g, j] - m_run[g]))
            s_part[g, j] += acc_s[g, j]
            put(acc_s[g, j], p_s, p_lo, g, j)
        for j, d in T.Parallel(block_n, V):
            put(T.cast(vx[j, d], "float32"), v_s, v_lo, j, d)
        T.gemm(p_s, v_s, acc_o, policy=T.GemmWarpPolicy.FullCol)
        if split:
            T.gemm(p_s, v_lo, acc_o, policy=T.GemmWarpPolicy.FullCol)
            T.gemm(p_lo, v_s, acc_o, policy=T.GemmWarpPolicy.FullCol)

    @T.macro
    def merge_pass(k_src, k_regs, v_src, vx, parents, tiles, keys, p_s, p_lo, v_s, v_lo, acc_o, s_part, m_run,
                   m_new, b, h, l, num_layers, off, chunks, n: T.Ref, n_par: T.Ref, thr: T.Ref):
        """(3) layer l's non-winners (layer 0: every candidate) merged into the online softmax."""
        acc_s = tiles[5]
        gather_k(k_src, k_regs, parents, b, h, l, l == num_layers - 1, 0, off, n, n_par)
        for c in T.serial(chunks):
            score_chunk(k_src, k_regs, parents, tiles, b, h, l, num_layers, c, off, n, n_par, v_src, vx)
            if l > 0:
                for g, j in T.Parallel(GP, block_n):
                    p = T.min(c * block_n + j, nbuf - 1)
                    acc_s[g, j] = T.if_then_else(keys[p] >= thr, NEG, acc_s[g, j])
            else:  # no bound known at layer 0: running maximum
                T.reduce_max(acc_s, m_new, dim=1, clear=True)
                for g in T.Parallel(GP):
                    m_new[g] = T.max(m_new[g], m_run[g])
                rescale(acc_o, s_part, m_run, m_new)
            merge_chunk(acc_s, vx, p_s, p_lo, v_s, v_lo, acc_o, s_part, m_run)

    @T.macro
    def descend(parents, chosen, n: T.Ref, n_par: T.Ref):
        """The winners become the parents of the layer below."""
        T.sync_threads()
        for i in T.Parallel(top_k):
            parents[i] = chosen[i]
        n_par = T.min(n, top_k)

    @T.macro
    def write_state(O, PartO, PartML, acc_o, s_part, m_run, lse, b, t, ts, h, num_layers):
        """With L > 1 the state of the layers below the top (unnormalized U, m, S), for htree_top_merge_kernel;
        else O (for_backward: and m, S into PartML)."""
        T.reduce_sum(s_part, lse, dim=1, clear=True)
        if num_layers > 1:
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
            if for_backward:  # the softmax state, for the final lse
                for g in T.Parallel(GP):
                    if g < G:
                        PartML[b, t, h * G + g, 0] = m_run[g]
                        PartML[b, t, h * G + g, 1] = lse[g]

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
        LayerOff: T.Tensor((MAX_LAYERS,), "int32"),
        O: T.Tensor((B, Tn, H, V), dtype),
        Thr: T.Tensor((B, TS, Hkv), "int32"),
        PartO: T.Tensor((B, TP, H, V), "float32"),
        PartML: T.Tensor((B, TP, H, 2), "float32"),
        Sel: T.Tensor((SL, SB, ST, Hkv, top_k), "int16" if for_backward else "int32"),
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
            chosen_pos = T.alloc_shared((top_k,), "int32") if for_backward else None  # the winners' positions
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
            k_src = (Kt, NodesK, TopK, Cos, Sin)
            k_regs = (kt, kx, ky, kc, ks)
            tiles = (q_raw, q_s, q_lo, k_s, k_lo, acc_s)

            start_row(Q, Cos, Sin, q_raw, acc_o, s_part, m_run, kc, ks, b, t, h, n_par)
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
                    load_top_keys(TopKeys, keys, b, ts, h, tx, n)
                elif l > l_lo:
                    lse_pass(k_src, k_regs, parents, tiles, m_part, l_part, m_new, lse, b, h, l, num_layers, off,
                             chunks, n, n_par)
                    keys_pass(k_src, k_regs, parents, tiles, prob_s, keys, lse, b, h, l, num_layers, off, chunks,
                              n, n_par)
                if l > l_lo:
                    select_layer(keys, parents, chosen, chosen_pos, counts, hist, pick, tmp, Sel, b, t, h, l, tx,
                                 write_sel, n, n_par, thr)
                    if l == num_layers - 1:  # htree_top_merge_kernel merges the top layer's non-winners
                        if tx == 0:
                            Thr[b, ts, h] = thr
                    else:  # lse bounds every score of the layer: one reference for the whole merge below
                        for g in T.Parallel(GP):
                            m_new[g] = T.max(m_run[g], lse[g])
                        rescale(acc_o, s_part, m_run, m_new)
                if split0 and l == l_lo and num_layers > 1:  # htree_layer16_kernel / htree_layer0_kernel go on
                    hand_over(Par, N0, parents, b, ts, h, tx, n)
                elif l == 0 or (n > top_k and l < num_layers - 1):
                    merge_pass(k_src, k_regs, (Vt, NodesV), vx, parents, tiles, keys, p_s, p_lo, v_s, v_lo, acc_o,
                               s_part, m_run, m_new, b, h, l, num_layers, off, chunks, n, n_par, thr)
                if l > 0:
                    descend(parents, chosen, n, n_par)
            write_state(O, PartO, PartML, acc_o, s_part, m_run, lse, b, t, ts, h, num_layers)

    return htree_fwd
