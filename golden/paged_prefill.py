"""Golden paged attention prefill (causal, over a paged KV cache, with GQA/MQA and optional ALiBi).

For sequence s with q_len = cum_seq_lens_q[s+1] - cum_seq_lens_q[s] new tokens and
history = seq_lens[s] - q_len cached tokens before them, query token i (0-based within s) of head h
attends over KV positions t = 0 .. history + i of kv head h // (num_heads // num_kv_heads):
    score(t) = scale * q . k_t  (+ alibi_slopes[h] * (t - (history + i)) with ALiBi)
    out      = softmax(score) @ v          (softmax in fp32, output in q's dtype)
KV position t lives in physical block block_tables[s, t // page_size] at offset t % page_size.
The cache layout is "HND" [num_blocks, num_kv_heads, page_size, head_dim] or
"NHD" [num_blocks, page_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

import torch


def gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor, kv_len: int,
              kv_layout: str = "HND") -> torch.Tensor:
    """The first ``kv_len`` positions of one sequence as [kv_len, num_kv_heads, head_dim];
    reads only the blocks those positions need."""
    if kv_layout not in ("HND", "NHD"):
        raise ValueError(f"kv_layout: expected 'HND' or 'NHD', got {kv_layout!r}")
    page_size = cache.shape[2] if kv_layout == "HND" else cache.shape[1]
    needed = -(-kv_len // page_size)
    blocks = cache[block_table_row[:needed].long()]
    if kv_layout == "HND":
        blocks = blocks.transpose(1, 2)
    return blocks.reshape(needed * page_size, *blocks.shape[2:])[:kv_len]


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            cum_seq_lens_q: torch.Tensor, alibi_slopes: torch.Tensor | None = None,
                            scale: float | None = None, kv_layout: str = "HND") -> torch.Tensor:
    """q [total_q_tokens, num_heads, head_dim] -> out of the same shape and dtype.
    Computes in fp32 (fp64 when q is fp64)."""
    total_q, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1] if kv_layout == "HND" else k_cache.shape[2]
    groups = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.empty_like(q)
    cum = cum_seq_lens_q.tolist()
    for s, kv_len in enumerate(seq_lens.tolist()):
        q_begin, q_end = cum[s], cum[s + 1]
        q_len = q_end - q_begin
        if q_len == 0:
            continue
        history = kv_len - q_len
        k = gather_kv(k_cache, block_tables[s], kv_len, kv_layout).to(acc).repeat_interleave(groups, dim=1)
        v = gather_kv(v_cache, block_tables[s], kv_len, kv_layout).to(acc).repeat_interleave(groups, dim=1)
        qs = q[q_begin:q_end].to(acc)
        scores = scale * torch.einsum("ihd,thd->hit", qs, k)
        q_pos = history + torch.arange(q_len, device=q.device)[:, None]  # kv position of each query
        rel = torch.arange(kv_len, device=q.device)[None, :] - q_pos      # t - (history + i)
        if alibi_slopes is not None:
            scores = scores + alibi_slopes.to(acc)[:, None, None] * rel.to(acc)
        scores = scores.masked_fill(rel > 0, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_begin:q_end] = torch.einsum("hit,thd->ihd", probs, v).to(q.dtype)
    return out
