"""The top layer's backward (for L > 1 the top layer, for L = 1 the whole causal attention): every query's
top-layer candidates are the nodes 0 .. t >> top_shift at buffer positions equal to their index (rotated once,
``htree_rope_kernel``), so both sides are GEMMs over blocks, as in the forward's top kernels.

``htree_bwd_top_rows_kernel`` lays the slab's query rows out once as both products take them: row r = (t - t_start) G
+ g of kv head h holds query head h G + g, q scaled by scale log2(e) and rotated at t >> top_shift, rounded to the
operand dtype (fp32 at "highest": the TF32 high part and its remainder, parts 0 and 1; at "high": rounded to
TF32), dO likewise, lse log2(e) and D. The rows
of a kv head are then contiguous, so the products' kernels stream them by TMA in a software pipeline.
``htree_bwd_top_dq_kernel``: one CTA per block of rows streams the top layer in chunks and accumulates
dq_rot = sum dS k_rot, rotated back at the query's position t >> top_shift into a per-slab fp32 partial DQ (the
lower layers add theirs in the rows kernel).
``htree_bwd_top_dkv_kernel``: one CTA per block of top nodes streams the slab's rows that see it and adds dK (still
in the node's rotated frame and the log2 domain: ``top_dk_finish`` turns it back once, after the last slab) and dV
into the fp32 accumulators: each node's rows belong to one CTA per launch, and the row blocks go in a fixed order, so
the sums are deterministic.

Scores are recomputed in the log2 domain; P = exp2(s - lse log2(e)) for the merged candidates (on the causal side,
not winners: the winner flags of the slab, ``has_sel``), zero otherwise; dS = P (dO . v - D) with D = rowsum(dO * O).
"""

from ...common.hw import LOG2E
from .bwd_common import rotate, tiles, unrotate
from .fragments import split_operands, tf32_hi, tf32_round

import tilelang.language as T  # noqa: E402


def operand_parts(dtype: str, fp32_precision: str = "highest") -> int:
    """Planes of a staged operand tensor: split fp32 keeps its TF32 high part and the remainder, else one plane."""
    return 2 if split_operands(dtype, fp32_precision) else 1


def _store(dtype: str, fp32_precision: str):
    """The macro storing fp32 x as element [.., i] of an operand tensor's planes ([P, ...])."""
    split = split_operands(dtype, fp32_precision)

    @T.macro
    def store(x, dst, b, h, row, i):
        if split:
            hi = tf32_hi(x)
            dst[0, b, h, row, i] = hi
            dst[1, b, h, row, i] = x - hi
        elif dtype == "float32":
            dst[0, b, h, row, i] = tf32_round(x)
        else:
            dst[0, b, h, row, i] = T.cast(x, dtype)

    return store


def _load(dtype: str, fp32_precision: str, transposed: bool = False):
    """The macro copying rows [r0, r0 + n) of an operand tensor's planes ([P, B, Hkv, rows, dims]) into a tile and its
    low halves; `transposed`: columns [r0, r0 + n) of a transposed one ([P, B, Hkv, dims, rows]) into a tile [dims, n]."""
    split = split_operands(dtype, fp32_precision)

    def plane(src, p, b, h, r0, n):
        return src[p, b, h, :, r0:r0 + n] if transposed else src[p, b, h, r0:r0 + n, :]

    @T.macro
    def load(src, b, h, r0, n, dst, dst_lo):
        T.copy(plane(src, 0, b, h, r0, n), dst)
        if split:
            T.copy(plane(src, 1, b, h, r0, n), dst_lo)

    return load


def htree_bwd_top_rows_kernel(num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int, scale: float,
                              dtype: str, block_r: int = 64, threads: int = 128, fp32_precision: str = "highest"):
    """Qr, dOr [P, B, Hkv, R, .] (R = the slab's queries x G) and Ls, Ds [B, Hkv, RP] fp32 (RP >= R: rows padded to
    16-byte strides for TMA; the pad is not written) from the slab's queries t_start .. t_start + R / G - 1 (see the
    module's docstring)."""
    H, Hkv, K, V = num_heads, num_kv_heads, head_dim, v_head_dim
    G, half, P = H // Hkv, K // 2, operand_parts(dtype, fp32_precision)
    q_scale = scale * LOG2E
    store = _store(dtype, fp32_precision)
    B, Tn, NC, R, RP = T.dynamic("B"), T.dynamic("T"), T.dynamic("NC"), T.dynamic("R"), T.dynamic("RP")

    @T.prim_func
    def htree_bwd_top_rows(Q: T.Tensor((B, Tn, H, K), dtype), dO: T.Tensor((B, Tn, H, V), dtype),
                           Lse: T.Tensor((B, Tn, H), "float32"), Dl: T.Tensor((B, Tn, H), "float32"),
                           Cos: T.Tensor((NC, half), "float32"), Sin: T.Tensor((NC, half), "float32"),
                           Qr: T.Tensor((P, B, Hkv, R, K), dtype), dOr: T.Tensor((P, B, Hkv, R, V), dtype),
                           Ls: T.Tensor((B, Hkv, RP), "float32"), Ds: T.Tensor((B, Hkv, RP), "float32"),
                           top_shift: T.int32, t_start: T.int32):
        with T.Kernel(T.ceildiv(R, block_r), Hkv, B, threads=threads) as (bx, h, b):
            for m, i in T.Parallel(block_r, half):
                row = bx * block_r + m
                if row < R:
                    t, g = t_start + row // G, h * G + row % G
                    lo, hi = rotate(T.cast(Q[b, t, g, i], "float32"), T.cast(Q[b, t, g, i + half], "float32"),
                                    Cos[t >> top_shift, i], Sin[t >> top_shift, i])
                    store(q_scale * lo, Qr, b, h, row, i)
                    store(q_scale * hi, Qr, b, h, row, i + half)
            for m, d in T.Parallel(block_r, V):
                row = bx * block_r + m
                if row < R:
                    store(T.cast(dO[b, t_start + row // G, h * G + row % G, d], "float32"), dOr, b, h, row, d)
            for m in T.Parallel(block_r):
                row = bx * block_r + m
                if row < R:
                    Ls[b, h, row] = Lse[b, t_start + row // G, h * G + row % G] * LOG2E
                    Ds[b, h, row] = Dl[b, t_start + row // G, h * G + row % G]

    return htree_bwd_top_rows


def _flag_rows(G: int, block_m: int) -> int:
    """Queries a block of block_m rows spans (it starts at a multiple of G when G divides block_m)."""
    return block_m // G if block_m % G == 0 else (block_m - 1) // G + 2


def _flags(G: int, block_m: int, block_n: int):
    """The macro copying a block's winner flags (queries q0 .. q0 + _flag_rows - 1 of the slab, nodes n0 .. n0 +
    block_n - 1) into shared memory by TMA (rows of nbuf + FLAG_PAD bytes); without selections (one layer) the flags
    are a [1, 1, Hkv, FLAG_PAD] zero placeholder, read past its bounds as zeros, and ``has_sel`` = 0 ignores them."""
    @T.macro
    def load(Flags, b, h, q0, n0, FB, f_s):
        T.copy(Flags[T.min(b, FB - 1), q0:q0 + _flag_rows(G, block_m), h, n0:n0 + block_n], f_s)

    return load


def _merged(G: int, has_sel, f_s, q0, row, j, node, R, NT, t_start, top_shift):
    """Whether row's query merges top node ``node`` (column j of the flags tile): a real row, a real node on its
    causal side, not a winner."""
    win = T.if_then_else(has_sel != 0, T.cast(f_s[row // G - q0, j], "int32"), 0)
    return T.And(T.And(row < R, node < NT), T.And(node <= ((t_start + row // G) >> top_shift), win == 0))


def htree_bwd_top_dq_kernel(num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int, scale: float,
                            dtype: str, block_m: int = 64, block_n: int = 64, num_stages: int = 2,
                            threads: int = 128, fp32_precision: str = "highest"):
    """DQ[b, t - t_start, h] (fp32): the top layer's part of dq for the slab's queries, rotated back and scaled.
    fp32: the products on TF32 warpgroup MMAs (wgmma), whose B operand is K-major only: dq = dS K takes the top
    layer's K transposed (TopKT [P, B, Hkv, K, NT'], ``backward._transposed``); other dtypes take a placeholder."""
    H, Hkv, K, V = num_heads, num_kv_heads, head_dim, v_head_dim
    G, half, P = H // Hkv, K // 2, operand_parts(dtype, fp32_precision)
    wg = dtype == "float32"
    odt = T.tfloat32 if wg else dtype  # operands typed TF32: TileLang multiplies them with wgmma
    alloc, put, product, product_nn = tiles(dtype, T.GemmWarpPolicy.FullRow, fp32_precision, tf32_typed=wg)
    load, load_flags, FQ = _load(dtype, fp32_precision), _flags(G, block_m, block_n), _flag_rows(G, block_m)
    load_t = _load(dtype, fp32_precision, transposed=True)
    B, NT, NC, R, RP, TS = (T.dynamic("B"), T.dynamic("NT"), T.dynamic("NC"), T.dynamic("R"), T.dynamic("RP"),
                            T.dynamic("TS"))
    FB, FT, FN = T.dynamic("FB"), T.dynamic("FT"), T.dynamic("FN")
    TKT = [T.dynamic(f"TKT{i}") for i in range(5)]

    @T.prim_func
    def htree_bwd_top_dq(Qr: T.Tensor((P, B, Hkv, R, K), odt), dOr: T.Tensor((P, B, Hkv, R, V), odt),
                         Ls: T.Tensor((B, Hkv, RP), "float32"), Ds: T.Tensor((B, Hkv, RP), "float32"),
                         TopK: T.Tensor((P, B, Hkv, NT, K), odt), TopV: T.Tensor((P, B, Hkv, NT, V), odt),
                         TopKT: T.Tensor(TKT, odt),
                         Cos: T.Tensor((NC, half), "float32"), Sin: T.Tensor((NC, half), "float32"),
                         Flags: T.Tensor((FB, FT, Hkv, FN), "int8"), DQ: T.Tensor((B, TS, H, K), "float32"),
                         top_shift: T.int32, t_start: T.int32, has_sel: T.int32):
        with T.Kernel(T.ceildiv(R, block_m), Hkv, B, threads=threads) as (bx, h, b):
            q_s, q_lo = alloc((block_m, K))
            do_s, do_lo = alloc((block_m, V))
            k_s, k_lo = alloc((block_n, K))
            v_s, v_lo = alloc((block_n, V))
            ds_s, ds_lo = alloc((block_m, block_n))
            kt_s, kt_lo = alloc((K, block_n) if wg else (1, 1))
            lse_s = T.alloc_shared((block_m,), "float32")
            dl_s = T.alloc_shared((block_m,), "float32")
            f_s = T.alloc_shared((FQ, block_n), "int8")
            dq_sh = T.alloc_shared((block_m, K), "float32")
            acc_s = T.alloc_fragment((block_m, block_n), "float32")
            acc_dp = T.alloc_fragment((block_m, block_n), "float32")
            acc_dq = T.alloc_fragment((block_m, K), "float32")
            r0 = bx * block_m
            q0 = r0 // G
            load(Qr, b, h, r0, block_m, q_s, q_lo)
            load(dOr, b, h, r0, block_m, do_s, do_lo)
            T.copy(Ls[b, h, r0:r0 + block_m], lse_s)
            T.copy(Ds[b, h, r0:r0 + block_m], dl_s)
            T.clear(acc_dq)
            # the block's last query sees the most nodes
            n_max = T.min(((t_start + (T.min(r0 + block_m, R) - 1) // G) >> top_shift) + 1, NT)
            for c in T.Pipelined(T.ceildiv(n_max, block_n), num_stages=num_stages):
                load(TopK, b, h, c * block_n, block_n, k_s, k_lo)
                load(TopV, b, h, c * block_n, block_n, v_s, v_lo)
                if wg:
                    load_t(TopKT, b, h, c * block_n, block_n, kt_s, kt_lo)
                load_flags(Flags, b, h, q0, c * block_n, FB, f_s)
                T.clear(acc_s)
                T.clear(acc_dp)
                product(q_s, q_lo, k_s, k_lo, acc_s)
                product(do_s, do_lo, v_s, v_lo, acc_dp)
                for m, j in T.Parallel(block_m, block_n):
                    keep = _merged(G, has_sel, f_s, q0, r0 + m, j, c * block_n + j, R, NT, t_start, top_shift)
                    # a select, not a product: the rows past R hold no lse or D
                    put(T.if_then_else(keep, T.exp2(acc_s[m, j] - lse_s[m]) * (acc_dp[m, j] - dl_s[m]), 0.0), ds_s,
                        ds_lo, m, j)
                if wg:
                    product(ds_s, ds_lo, kt_s, kt_lo, acc_dq)
                else:
                    product_nn(ds_s, ds_lo, k_s, k_lo, acc_dq)
            T.copy(acc_dq, dq_sh)
            for m, i in T.Parallel(block_m, half):
                row = r0 + m
                if row < R:
                    t = t_start + row // G
                    lo, hi = unrotate(dq_sh[m, i], dq_sh[m, i + half], Cos[t >> top_shift, i], Sin[t >> top_shift, i])
                    DQ[b, row // G, h * G + row % G, i] = scale * lo
                    DQ[b, row // G, h * G + row % G, i + half] = scale * hi

    return htree_bwd_top_dq


def htree_bwd_top_dkv_kernel(num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int, dtype: str,
                             block_m: int = 64, block_n: int = 64, num_stages: int = 2, threads: int = 128,
                             fp32_precision: str = "highest"):
    """AccK / AccV rows acc_off + node (fp32) += the top layer's dK (the node's rotated frame, log2 domain) and dV
    from the slab's rows."""
    H, Hkv, K, V = num_heads, num_kv_heads, head_dim, v_head_dim
    G, P = H // Hkv, operand_parts(dtype, fp32_precision)
    alloc, put, product, product_nn = tiles(dtype, T.GemmWarpPolicy.FullRow, fp32_precision)
    load, load_flags, FQ = _load(dtype, fp32_precision), _flags(G, block_m, block_n), _flag_rows(G, block_m)
    B, NT, R, RP, NA = T.dynamic("B"), T.dynamic("NT"), T.dynamic("R"), T.dynamic("RP"), T.dynamic("NA")
    FB, FT, FN = T.dynamic("FB"), T.dynamic("FT"), T.dynamic("FN")

    @T.prim_func
    def htree_bwd_top_dkv(Qr: T.Tensor((P, B, Hkv, R, K), dtype), dOr: T.Tensor((P, B, Hkv, R, V), dtype),
                          Ls: T.Tensor((B, Hkv, RP), "float32"), Ds: T.Tensor((B, Hkv, RP), "float32"),
                          TopK: T.Tensor((P, B, Hkv, NT, K), dtype), TopV: T.Tensor((P, B, Hkv, NT, V), dtype),
                          Flags: T.Tensor((FB, FT, Hkv, FN), "int8"), AccK: T.Tensor((B, NA, Hkv, K), "float32"),
                          AccV: T.Tensor((B, NA, Hkv, V), "float32"), top_shift: T.int32, acc_off: T.int32,
                          t_start: T.int32, has_sel: T.int32):
        with T.Kernel(T.ceildiv(NT, block_n), Hkv, B, threads=threads) as (bx, h, b):
            k_s, k_lo = alloc((block_n, K))
            v_s, v_lo = alloc((block_n, V))
            q_s, q_lo = alloc((block_m, K))
            do_s, do_lo = alloc((block_m, V))
            p_s, p_lo = alloc((block_n, block_m))
            ds_s, ds_lo = alloc((block_n, block_m))
            lse_s = T.alloc_shared((block_m,), "float32")
            dl_s = T.alloc_shared((block_m,), "float32")
            f_s = T.alloc_shared((FQ, block_n), "int8")
            acc_s = T.alloc_fragment((block_n, block_m), "float32")  # scores, transposed (node, row)
            acc_dp = T.alloc_fragment((block_n, block_m), "float32")
            acc_dk = T.alloc_fragment((block_n, K), "float32")
            acc_dv = T.alloc_fragment((block_n, V), "float32")
            j0 = bx * block_n
            r_first = T.max((j0 << top_shift) - t_start, 0) * G  # the first row whose query sees node j0
            load(TopK, b, h, j0, block_n, k_s, k_lo)
            load(TopV, b, h, j0, block_n, v_s, v_lo)
            T.clear(acc_dk)
            T.clear(acc_dv)
            for qb in T.Pipelined(T.ceildiv(T.max(R - r_first, 0), block_m), num_stages=num_stages):
                r0 = r_first + qb * block_m
                q0 = r0 // G
                load(Qr, b, h, r0, block_m, q_s, q_lo)
                load(dOr, b, h, r0, block_m, do_s, do_lo)
                T.copy(Ls[b, h, r0:r0 + block_m], lse_s)
                T.copy(Ds[b, h, r0:r0 + block_m], dl_s)
                load_flags(Flags, b, h, q0, j0, FB, f_s)
                T.clear(acc_s)
                T.clear(acc_dp)
                product(k_s, k_lo, q_s, q_lo, acc_s)
                product(v_s, v_lo, do_s, do_lo, acc_dp)
                for j, m in T.Parallel(block_n, block_m):
                    keep = _merged(G, has_sel, f_s, q0, r0 + m, j, j0 + j, R, NT, t_start, top_shift)
                    p = T.if_then_else(keep, T.exp2(acc_s[j, m] - lse_s[m]), 0.0)
                    put(p, p_s, p_lo, j, m)
                    put(T.if_then_else(keep, p * (acc_dp[j, m] - dl_s[m]), 0.0), ds_s, ds_lo, j, m)
                product_nn(p_s, p_lo, do_s, do_lo, acc_dv)
                product_nn(ds_s, ds_lo, q_s, q_lo, acc_dk)
            for j, d in T.Parallel(block_n, K):
                if j0 + j < NT:
                    AccK[b, acc_off + j0 + j, h, d] += acc_dk[j, d]
            for j, d in T.Parallel(block_n, V):
                if j0 + j < NT:
                    AccV[b, acc_off + j0 + j, h, d] += acc_dv[j, d]

    return htree_bwd_top_dkv
