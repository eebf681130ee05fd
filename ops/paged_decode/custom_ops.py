"""``torch.library`` custom ops of the paged decode: ``llm_tile_ops::paged_attention_decode`` (out) and
``llm_tile_ops::paged_attention_decode_lse`` (out, lse), so that ``torch.compile`` keeps them in one graph.
The specialization comes from the tensors' shapes and the scalar arguments; the op object of each
specialization is built once per process (``op_instance``)."""

from typing import Optional

import torch

from ..common.library import NAMESPACE, op_instance
from ..common.validate import check_choice, check_int
from .decode import KV_LAYOUTS, PagedAttentionDecodeTileLang


def _spec(q: torch.Tensor, k_cache: torch.Tensor, alibi_slopes: Optional[torch.Tensor], scale: Optional[float],
          kv_layout: str, window_left: int, logits_soft_cap: float, num_q_tokens: int) -> dict:
    """Constructor keywords of the op that serves these inputs (the op checks them)."""
    check_choice("kv_layout", kv_layout, KV_LAYOUTS)
    if q.dim() != 3:
        raise ValueError(f"q: expected shape [batch * num_q_tokens, num_heads, head_dim], got {list(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache: expected a 4-d {kv_layout} cache, got shape {list(k_cache.shape)}")
    check_int("num_q_tokens", num_q_tokens, lo=1)
    heads_axis, page_axis = (1, 2) if kv_layout == "HND" else (2, 1)
    return dict(num_heads=q.shape[1], num_kv_heads=k_cache.shape[heads_axis], head_dim=q.shape[2],
                page_size=k_cache.shape[page_axis], dtype=q.dtype, kv_dtype=k_cache.dtype,
                use_alibi=alibi_slopes is not None, window_left=window_left, logits_soft_cap=logits_soft_cap,
                scale=scale, kv_layout=kv_layout, num_q_tokens=num_q_tokens)


def _call(q, k_cache, v_cache, block_tables, seq_lens, num_q_tokens, alibi_slopes, scale, kv_layout, window_left,
          logits_soft_cap, k_scale, v_scale, validate, return_lse):
    op = op_instance(PagedAttentionDecodeTileLang,
                     **_spec(q, k_cache, alibi_slopes, scale, kv_layout, window_left, logits_soft_cap, num_q_tokens))
    return op(q, k_cache, v_cache, block_tables, seq_lens, alibi_slopes, k_scale, v_scale, return_lse=return_lse,
              validate=validate)


@torch.library.custom_op(f"{NAMESPACE}::paged_attention_decode", mutates_args=(), device_types="cuda")
def _paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, num_q_tokens: int = 1, alibi_slopes: Optional[torch.Tensor] = None,
                            scale: Optional[float] = None, kv_layout: str = "HND", window_left: int = -1,
                            logits_soft_cap: float = 0.0, k_scale: Optional[float] = None,
                            v_scale: Optional[float] = None, validate: bool = True) -> torch.Tensor:
    return _call(q, k_cache, v_cache, block_tables, seq_lens, num_q_tokens, alibi_slopes, scale, kv_layout,
                 window_left, logits_soft_cap, k_scale, v_scale, validate, False)


@_paged_attention_decode.register_fake
def _(q, k_cache, v_cache, block_tables, seq_lens, num_q_tokens=1, alibi_slopes=None, scale=None, kv_layout="HND",
      window_left=-1, logits_soft_cap=0.0, k_scale=None, v_scale=None, validate=True):
    return torch.empty_like(q)


@torch.library.custom_op(f"{NAMESPACE}::paged_attention_decode_lse", mutates_args=(), device_types="cuda")
def _paged_attention_decode_lse(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, seq_lens: torch.Tensor, num_q_tokens: int = 1,
                                alibi_slopes: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                                kv_layout: str = "HND", window_left: int = -1, logits_soft_cap: float = 0.0,
                                k_scale: Optional[float] = None, v_scale: Optional[float] = None,
                                validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    return _call(q, k_cache, v_cache, block_tables, seq_lens, num_q_tokens, alibi_slopes, scale, kv_layout,
                 window_left, logits_soft_cap, k_scale, v_scale, validate, True)


@_paged_attention_decode_lse.register_fake
def _(q, k_cache, v_cache, block_tables, seq_lens, num_q_tokens=1, alibi_slopes=None, scale=None, kv_layout="HND",
      window_left=-1, logits_soft_cap=0.0, k_scale=None, v_scale=None, validate=True):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, num_q_tokens: int = 1, alibi_slopes: Optional[torch.Tensor] = None,
                           scale: Optional[float] = None, kv_layout: str = "HND", window_left: int = -1,
                           logits_soft_cap: float = 0.0, k_scale: Optional[float] = None,
                           v_scale: Optional[float] = None, return_lse: bool = False, validate: bool = True):
    """Dense paged decode (``torch.ops.llm_tile_ops.paged_attention_decode``, or ``..._decode_lse`` with
    ``return_lse``): q [batch * num_q_tokens, num_heads, head_dim] -> out of the same shape and dtype (and
    lse [batch * num_q_tokens, num_heads] fp32). The specialization comes from the inputs: num_heads and
    head_dim from q, num_kv_heads, page_size and the cache dtype (q's, or float8_e4m3fn with the float
    scales ``k_scale`` / ``v_scale``) from k_cache in ``kv_layout``, ALiBi when ``alibi_slopes`` is given.
    Semantics: ``golden.paged_decode.paged_attention_decode``; options as in
    ``PagedAttentionDecodeTileLang`` (each call plans: for plan once / run per layer, use the class)."""
    args = (q, k_cache, v_cache, block_tables, seq_lens, num_q_tokens, alibi_slopes, scale, kv_layout, window_left,
            logits_soft_cap, k_scale, v_scale, validate)
    if return_lse:
        return torch.ops.llm_tile_ops.paged_attention_decode_lse(*args)
    return torch.ops.llm_tile_ops.paged_attention_decode(*args)
