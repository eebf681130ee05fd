"""Causal paged attention prefill over a paged KV cache (ragged batches with history, GQA/MQA, ALiBi,
sliding window, soft cap, FP8 cache, lse): the op class ``PagedAttentionPrefillTileLang`` (one call, or
``plan`` -> ``PrefillPlan`` once per batch and ``run`` per layer) and its functional form
``paged_attention_prefill`` (the custom op ``torch.ops.llm_tile_ops.paged_attention_prefill``)."""

from .custom_ops import paged_attention_prefill
from .prefill import PagedAttentionPrefillTileLang, PrefillPlan

__all__ = ["PagedAttentionPrefillTileLang", "PrefillPlan", "paged_attention_prefill"]
