"""What the HSA kernels share: the local window's first token, the selection key's encoding of an fp32 score (a
sortable unsigned 32-bit key; 0 marks a non-candidate) and the extend's keys by score tile, and the merge of one
page into rows' running attention state (the decode's and the extend's local kernel's)."""

from types import SimpleNamespace

import tilelang.language as T
from tvm.tirx import Buffer

from ..schedule import KEY_PAGES


def first_local(L, page_size: int, window_size: int):
    """lo, the first local token of a request of L tokens: the window, and always the incomplete last page
    (see golden/hsa_decode.py)."""
    return T.min(T.max(L - window_size, 0), (L // page_size) * page_size)


def u32(v: int):
    return T.uint32(v)


def score_to_key(score):
    """Sortable bits of an fp32 score: negative scores flip all bits, others set the sign bit, so unsigned
    order is float order and finite scores stay > 0 (0 marks a non-candidate)."""
    ib = T.reinterpret(score, "int32")
    return T.reinterpret(ib ^ ((ib >> 31) | T.int32(-(1 << 31))), "uint32")


def key_to_score(key):
    """The fp32 score of a key of ``score_to_key``."""
    bits = T.if_then_else(key >= u32(0x80000000), key ^ u32(0x80000000), ~key)
    return T.reinterpret(bits, "float32")


class KeyTiles:
    """keys[row, h, page] of the selection keys by score tiles of `tile_rows` rows (``schedule.key_tiles_shape``) for
    a kernel that reads one row: `key_row` its tile x tile_rows + its row in the tile."""

    def __init__(self, buf: Buffer, key_row, tile_rows: int):
        self.buf, self.key_row, self.tile_rows = buf, key_row, tile_rows

    def __getitem__(self, idx):
        _, h, page = idx
        t, i = self.key_row // self.tile_rows, self.key_row % self.tile_rows
        return self.buf[h, t, page // KEY_PAGES, i, page % KEY_PAGES]


def _at(x, g):
    """Row g's value of x: a per-row fragment, or one value that every row shares."""
    return x[g] if isinstance(x, Buffer) else x


@T.macro
def alloc_merge_state(rows: int, page_size: int, head_dim: int, dtype: str):
    """The buffers of `page_merge` for ``rows`` query rows, allocated in the calling kernel: the page's scores and
    P (acc_s; p_s in shared memory, every warp needs all rows), the running output, max and sum of merge logits
    (acc_o, m_run, l_run), the page's max and sum (m_pg, l_pg), and the rescale and weight per row."""
    acc_s = T.alloc_fragment((rows, page_size), "float32")
    p_s = T.alloc_shared((rows, page_size), dtype)
    acc_o = T.alloc_fragment((rows, head_dim), "float32")
    m_run = T.alloc_fragment((rows,), "float32")
    l_run = T.alloc_fragment((rows,), "float32")
    m_pg = T.alloc_fragment((rows,), "float32")
    l_pg = T.alloc_fragment((rows,), "float32")
    alpha = T.alloc_fragment((rows,), "float32")
    weight = T.alloc_fragment((rows,), "float32")
    return SimpleNamespace(acc_s=acc_s, p_s=p_s, acc_o=acc_o, m_run=m_run, l_run=l_run, m_pg=m_pg, l_pg=l_pg,
                           alpha=alpha, weight=weight)


def page_merge(unit: float, fuse_z: bool):
    """``merge(q_s, k_s, v_s, st, lo, hi, valid, z_s, it, is_sel)``: the page in k_s / v_s merged into each row's
    running state (st: acc_s, p_s, acc_o, m_run, l_run, m_pg, l_pg, alpha, weight). A row sees the page's keys
    [lo, hi) and takes the page only if ``valid`` (each one value for all rows, or per-row fragments; valid None:
    hi > lo). The page's softmax of the scaled scores (log2 units, ``unit`` = scale * LOG2E: a literal) and its merge
    logit (with ``fuse_z``, z_s[:, it] * unit for a selected page, ``is_sel``; else the page's log-sum-exp) fold into
    the running (o, max, sum): P V weighted by exp2(logit - max) / the page's sum."""

    @T.macro
    def merge(q_s, k_s, v_s, st, lo, hi, valid, z_s, it, is_sel):
        rows, cols = st.acc_s.shape
        T.gemm(q_s, k_s, st.acc_s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
        for g, n in T.Parallel(rows, cols):
            st.acc_s[g, n] = T.if_then_else(T.And(n >= _at(lo, g), n < _at(hi, g)), st.acc_s[g, n] * unit,
                                            -T.infinity("float32"))
        T.reduce_max(st.acc_s, st.m_pg, dim=1)
        for g in T.Parallel(rows):
            # keeps a row without keys here at exp2(-inf - 0) = 0, not NaN
            st.m_pg[g] = T.if_then_else(_valid(valid, lo, hi, g), st.m_pg[g], 0)
        for g, n in T.Parallel(rows, cols):
            st.acc_s[g, n] = T.exp2(st.acc_s[g, n] - st.m_pg[g])
        T.reduce_sum(st.acc_s, st.l_pg, dim=1)
        for g in T.Parallel(rows):
            logit = st.m_pg[g] + T.log2(st.l_pg[g])  # log2 units
            if fuse_z:
                logit = T.if_then_else(is_sel, z_s[g, it] * unit, logit)
            m_new = T.if_then_else(_valid(valid, lo, hi, g), T.max(st.m_run[g], logit), st.m_run[g])
            st.alpha[g] = T.if_then_else(_valid(valid, lo, hi, g), T.exp2(st.m_run[g] - m_new), 1)
            st.weight[g] = T.if_then_else(_valid(valid, lo, hi, g), T.exp2(logit - m_new), 0)
            st.l_run[g] = st.l_run[g] * st.alpha[g] + st.weight[g]
            st.weight[g] = T.if_then_else(_valid(valid, lo, hi, g), st.weight[g] / st.l_pg[g], 0)
            st.m_run[g] = m_new
        for g, d in T.Parallel(rows, st.acc_o.shape[1]):
            st.acc_o[g, d] *= st.alpha[g]
        for g, n in T.Parallel(rows, cols):
            st.p_s[g, n] = T.cast(st.acc_s[g, n] * st.weight[g], st.p_s.dtype)
        T.gemm(st.p_s, v_s, st.acc_o, policy=T.GemmWarpPolicy.FullCol)

    return merge


def _valid(valid, lo, hi, g):
    return _at(hi, g) > _at(lo, g) if valid is None else _at(valid, g)
