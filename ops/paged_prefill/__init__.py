"""Causal paged attention prefill over a paged KV cache (ragged batches with history, GQA/MQA, ALiBi):
the op class ``PagedAttentionPrefillTileLang`` and its functional form ``paged_attention_prefill``
(the custom op ``torch.ops.llm_tile_ops.paged_attention_prefill``)."""

from .custom_ops import paged_attention_prefill
from .prefill import PagedAttentionPrefillTileLang

__all__ = ["PagedAttentionPrefillTileLang", "paged_attention_prefill"]
