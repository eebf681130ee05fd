"""Dense paged decode (split-KV flash decoding over a paged KV cache, GQA packed, 1-8 new tokens per
sequence, window / soft-cap / ALiBi / FP8 cache / lse): the op class ``PagedAttentionDecodeTileLang``
(plan / run) and its functional form ``paged_attention_decode`` (the custom ops
``torch.ops.llm_tile_ops.paged_attention_decode`` / ``paged_attention_decode_lse``)."""

from .custom_ops import paged_attention_decode
from .decode import DecodePlan, PagedAttentionDecodeTileLang

__all__ = ["PagedAttentionDecodeTileLang", "DecodePlan", "paged_attention_decode"]
