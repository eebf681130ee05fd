"""``torch.library`` custom op of the paged prefill: ``llm_tile_ops::paged_attention_prefill``, so that
``torch.compile`` keeps it in one graph. The specialization comes from the tensors' shapes and the scalar
arguments; the op object of each specialization is built once per process (``op_instance``)."""

from typing import Optional

import torch

from ..common.library import NAMESPACE, op_instance
from ..common.validate import check_choice
from .prefill import KV_LAYOUTS, PagedAttentionPrefillTileLang


def _spec(q: torch.Tensor, k_cache: torch.Tensor, alibi_slopes: Optional[torch.Tensor], scale: Optional[float],
          kv_layout: str, window_left: int = -1, logits_soft_cap: float = 0.0, fp8_compute: bool = False) -> dict:
    """Constructor keywords of the op that serves these inputs (the op checks them)."""
    check_choice("kv_layout", kv_layout, KV_LAYOUTS)
    if q.dim() != 3:
        raise ValueError(f"q: expected shape [total_q_tokens, num_heads, head_dim], got {list(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache: expected a 4-d {kv_layout} cache, got shape {list(k_cache.shape)}")
    heads_axis, page_axis = (1, 2) if kv_layout == "HND" else (2, 1)
    return dict(num_heads=q.shape[1], num_kv_heads=k_cache.shape[heads_axis], head_dim=q.shape[2],
                page_size=k_cache.shape[page_axis], dtype=q.dtype, use_alibi=alibi_slopes is not None,
                scale=scale, kv_layout=kv_layout, window_left=window_left, logits_soft_cap=logits_soft_cap,
                kv_dtype=k_cache.dtype, fp8_compute=fp8_compute)


@torch.library.custom_op(f"{NAMESPACE}::paged_attention_prefill", mutates_args=(), device_types="cuda")
def _paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, seq_lens: torch.Tensor, cum_seq_lens_q: torch.Tensor,
                             alibi_slopes: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                             kv_layout: str = "HND", validate: bool = True, window_left: int = -1,
                             logits_soft_cap: float = 0.0, k_scale: Optional[torch.Tensor] = None,
                             v_scale: Optional[torch.Tensor] = None, fp8_compute: bool = False) -> torch.Tensor:
    op = op_instance(PagedAttentionPrefillTileLang, **_spec(q, k_cache, alibi_slopes, scale, kv_layout, window_left,
                                                            logits_soft_cap, fp8_compute))
    return op(q, k_cache, v_cache, block_tables, seq_lens, cum_seq_lens_q, alibi_slopes, validate=validate,
              k_scale=k_scale, v_scale=v_scale)


@_paged_attention_prefill.register_fake
def _(q, k_cache, v_cache, block_tables, seq_lens, cum_seq_lens_q, alibi_slopes=None, scale=None,
      kv_layout="HND", validate=True, window_left=-1, logits_soft_cap=0.0, k_scale=None, v_scale=None,
      fp8_compute=False):
    return torch.empty_like(q)


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, cum_seq_lens_q: torch.Tensor,
                            alibi_slopes: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                            kv_layout: str = "HND", validate: bool = True, window_left: int = -1,
                            logits_soft_cap: float = 0.0, k_scale: Optional[torch.Tensor] = None,
                            v_scale: Optional[torch.Tensor] = None, fp8_compute: bool = False) -> torch.Tensor:
    """Causal paged attention prefill (``torch.ops.llm_tile_ops.paged_attention_prefill``): q
    [total_q_tokens, num_heads, head_dim] -> out of the same shape and dtype. The specialization comes from
    the inputs: num_heads and head_dim from q, num_kv_heads and page_size from k_cache in ``kv_layout``
    ("HND" [num_pages, num_kv_heads, page_size, head_dim] or "NHD" [num_pages, page_size, num_kv_heads,
    head_dim]), the dtype from q, ALiBi when ``alibi_slopes`` ([num_heads] fp32) is given. ``scale``
    defaults to head_dim ** -0.5; ``validate``, ``window_left`` and ``logits_soft_cap`` as in
    ``PagedAttentionPrefillTileLang``; an FP8 (float8_e4m3fn) cache takes its scales as 1-element fp32 tensors
    ``k_scale`` / ``v_scale`` (None: 1), and ``fp8_compute`` as the class's. Semantics:
    ``golden.paged_prefill.paged_attention_prefill`` (``return_lse``: use the class)."""
    return torch.ops.llm_tile_ops.paged_attention_prefill(q, k_cache, v_cache, block_tables, seq_lens,
                                                          cum_seq_lens_q, alibi_slopes, scale, kv_layout, validate,
                                                          window_left, logits_soft_cap, k_scale, v_scale,
                                                          fp8_compute)
