"""Golden dense paged decode: every sequence has ``num_q_tokens`` new query tokens at the end of its cache.

Sequence b of a decode batch holds seq_lens[b] tokens in the paged cache, the last ``num_q_tokens`` (nq)
of which are its new tokens: q rows b * nq .. b * nq + nq - 1, at KV positions seq_lens[b] - nq + i, each
causal over the cache (a speculative-decoding step verifies nq draft tokens at once; nq = 1 is plain
decode). That is paged prefill with q_len = nq for every sequence, so the semantics (window, soft-cap,
ALiBi, FP8 scales, lse) are those of ``golden.paged_prefill.paged_attention_prefill``.
"""

from __future__ import annotations

import torch

from .paged_prefill import paged_attention_prefill


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, num_q_tokens: int = 1,
                           alibi_slopes: torch.Tensor | None = None, scale: float | None = None,
                           kv_layout: str = "HND", window_left: int = -1, logits_soft_cap: float = 0.0,
                           k_scale=None, v_scale=None, return_lse: bool = False):
    """q [batch * num_q_tokens, num_heads, head_dim] -> out (same shape and dtype), with ``return_lse``
    also lse [batch * num_q_tokens, num_heads] fp32 (natural log). Needs seq_lens[b] >= num_q_tokens."""
    batch = seq_lens.shape[0]
    if q.shape[0] != batch * num_q_tokens:
        raise ValueError(f"q: expected {batch} * {num_q_tokens} rows, got {q.shape[0]}")
    if bool((seq_lens < num_q_tokens).any()):
        raise ValueError(f"seq_lens: expected values >= num_q_tokens ({num_q_tokens})")
    cum_seq_lens_q = torch.arange(batch + 1, device=seq_lens.device) * num_q_tokens
    return paged_attention_prefill(q, k_cache, v_cache, block_tables, seq_lens, cum_seq_lens_q, alibi_slopes,
                                   scale, kv_layout, window_left, logits_soft_cap, k_scale, v_scale, return_lse)
