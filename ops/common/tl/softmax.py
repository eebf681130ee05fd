"""Online-softmax pieces shared by the attention kernels; scores live in the log2 domain (exp2 is one
instruction; a natural-log score s is s * LOG2E there).

``online_softmax_step``  one KV tile of a flash-attention row block: running max, rescale factor, P and the
                         running denominator (paged prefill's two kernels)
``lse_update`` / ``lse_finish``  a log-sum-exp kept as per-element partial (max, sum) pairs, reduced per row
                         at the end (htree's top-layer and walk passes)

HSA keeps its own merge (`ops/hsa/kernels/common.page_merge`, the decode's and the extend's): it folds whole
pages' (max, sum) states with a validity mask and per-mode logits into the running state, a different operation
from both of these.
"""

import tilelang.language as T

# A finite "minus infinity": exp2(NEG - m) == 0 without inf - inf. A power of two, so that NEG * scale is exact
# and a row whose scores are all NEG gets exp2(fma(NEG, scale, -(NEG * scale))) = exp2(0) = 1: with 1e30 the
# fused multiply-add kept the product's rounding error, about 1e22, and exp2 of it was inf (NaN rows after the
# next rescale).
NEG = -(2.0 ** 100)


def online_softmax_step(scale_log2: float):
    """The step for raw (unscaled) scores, scaled by ``scale_log2`` = softmax scale * LOG2E: a closure, so that
    the scale stays a literal of the generated code."""

    @T.macro
    def step(acc_s, m_cur, m_prev, rescale, row_sum, denom):
        # P = exp2(scale_log2 * (s - m)): one FFMA + EX2 per score. The caller guarantees every valid row a
        # finite score in its first tile, so the running max is finite from then on.
        rows, cols = acc_s.shape
        T.copy(m_cur, m_prev)
        T.reduce_max(acc_s, m_cur, dim=1, clear=False)
        for i in T.Parallel(rows):
            rescale[i] = T.exp2((m_prev[i] - m_cur[i]) * scale_log2)
        for i, j in T.Parallel(rows, cols):
            acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - m_cur[i] * scale_log2)
        T.reduce_sum(acc_s, row_sum, dim=1)
        for i in T.Parallel(rows):
            denom[i] = denom[i] * rescale[i] + row_sum[i]

    return step


@T.macro
def lse_update(m_part, l_part, i, j, s):
    """Fold score s (log2 domain, <= NEG: none) into the per-element partial max / sum of exp2."""
    mx = T.max(m_part[i, j], s)
    l_part[i, j] = T.if_then_else(s <= NEG, l_part[i, j], l_part[i, j] * T.exp2(m_part[i, j] - mx) + T.exp2(s - mx))
    m_part[i, j] = mx


@T.macro
def lse_finish(m_part, l_part, m_row, lse):
    """lse[i] = log2 sum_j of the partials of row i (l_part is consumed)."""
    T.reduce_max(m_part, m_row, dim=1, clear=True)
    for i, j in T.Parallel(m_part.shape[0], m_part.shape[1]):
        l_part[i, j] *= T.exp2(m_part[i, j] - m_row[i])
    T.reduce_sum(l_part, lse, dim=1, clear=True)
    for i in T.Parallel(m_part.shape[0]):
        lse[i] = m_row[i] + T.log2(lse[i])
