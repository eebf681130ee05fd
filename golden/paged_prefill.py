"""Golden paged attention prefill (causal, over a paged KV cache, with GQA/MQA and optional ALiBi,
sliding window, logits soft-cap, FP8 caches and the log-sum-exp).

For sequence s with q_len = cum_seq_lens_q[s+1] - cum_seq_lens_q[s] new tokens and
history = seq_lens[s] - q_len cached tokens before them, query token i (0-based within s) of head h
sits at KV position p = history + i and attends over KV positions t of kv head
h // (num_heads // num_kv_heads) with t <= p and, when window_left >= 0, t >= p - window_left
(FlashInfer's convention):
    s(t)  = scale * q . k_t
    s(t)  = cap * tanh(s(t) / cap)                 when logits_soft_cap = cap > 0
    s(t) += alibi_slopes[h] * (t - p)              with ALiBi
    out   = softmax(s) @ v                          (softmax in fp32, output in q's dtype)
    lse   = log(sum_t exp(s(t)))                    (natural log, fp32, with return_lse)
KV position t lives in physical block block_tables[s, t // page_size] at offset t % page_size.
The cache layout is "HND" [num_blocks, num_kv_heads, page_size, head_dim] or
"NHD" [num_blocks, page_size, num_kv_heads, head_dim]. A cache may be stored in float8_e4m3fn (or any
dtype) with a per-tensor scale: the real value is stored * k_scale (v_scale); None means 1.
"""

from __future__ import annotations

import torch


def gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor, kv_len: int,
              kv_layout: str = "HND") -> torch.Tensor:
    """The first ``kv_len`` positions of one sequence as [kv_len, num_kv_heads, head_dim] (stored
    dtype); reads only the blocks those positions need."""
    if kv_layout not in ("HND", "NHD"):
        raise ValueError(f"kv_layout: expected 'HND' or 'NHD', got {kv_layout!r}")
    page_size = cache.shape[2] if kv_layout == "HND" else cache.shape[1]
    needed = -(-kv_len // page_size)
    blocks = cache[block_table_row[:needed].long()]
    if kv_layout == "HND":
        blocks = blocks.transpose(1, 2)
    return blocks.reshape(needed * page_size, *blocks.shape[2:])[:kv_len]


def _scale_value(name: str, value) -> float:
    if value is None:
        return 1.0
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name}: expected a python float or a 1-element tensor, got shape {tuple(value.shape)}")
        return float(value.reshape(()).item())
    return float(value)


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            cum_seq_lens_q: torch.Tensor, alibi_slopes: torch.Tensor | None = None,
                            scale: float | None = None, kv_layout: str = "HND", window_left: int = -1,
                            logits_soft_cap: float = 0.0, k_scale=None, v_scale=None,
                            return_lse: bool = False):
    """q [total_q_tokens, num_heads, head_dim] -> out of the same shape and dtype, and with
    ``return_lse`` also lse [total_q_tokens, num_heads] fp32. Computes in fp32 (fp64 when q is fp64).
    A query row with no visible key (impossible: t = p is always visible) would give NaN."""
    total_q, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1] if kv_layout == "HND" else k_cache.shape[2]
    groups = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    k_mult, v_mult = _scale_value("k_scale", k_scale), _scale_value("v_scale", v_scale)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.empty_like(q)
    lse = torch.empty(total_q, num_heads, dtype=torch.float32, device=q.device)
    cum = cum_seq_lens_q.tolist()
    for s, kv_len in enumerate(seq_lens.tolist()):
        q_begin, q_end = cum[s], cum[s + 1]
        q_len = q_end - q_begin
        if q_len == 0:
            continue
        history = kv_len - q_len

        def load(cache, mult):
            rows = gather_kv(cache, block_tables[s], kv_len, kv_layout).to(acc) * mult
            return rows.repeat_interleave(groups, dim=1)

        k, v = load(k_cache, k_mult), load(v_cache, v_mult)
        qs = q[q_begin:q_end].to(acc)
        scores = scale * torch.einsum("ihd,thd->hit", qs, k)
        if logits_soft_cap > 0:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        q_pos = history + torch.arange(q_len, device=q.device)[:, None]  # kv position of each query
        rel = torch.arange(kv_len, device=q.device)[None, :] - q_pos      # t - p
        if alibi_slopes is not None:
            scores = scores + alibi_slopes.to(acc)[:, None, None] * rel.to(acc)
        hidden = rel > 0
        if window_left >= 0:
            hidden = hidden | (rel < -window_left)
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_begin:q_end] = torch.einsum("hit,thd->ihd", probs, v).to(q.dtype)
        lse[q_begin:q_end] = torch.logsumexp(scores, dim=-1).transpose(0, 1).float()
    return (out, lse) if return_lse else out
