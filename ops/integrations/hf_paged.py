"""HF transformers' continuous batching on our paged attention.

    from ops.integrations.hf_paged import ATTN_IMPLEMENTATION, register
    register()  # adds "paged|llm_tile_ops" to HF's AttentionInterface (idempotent)
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation=ATTN_IMPLEMENTATION)
    outputs = model.generate_batch(prompts, generation_config)  # continuous batching, HF's scheduler

HF keeps one cache tensor per layer, ``[num_blocks * block_size, num_kv_heads, head_dim]``: our "NHD" layout with
pages of ``block_size`` rows. Each call (one per layer and step) writes the step's new K/V into the cache at HF's
write positions and runs ``PagedAttentionPrefillTileLang`` over the cache: every request's history and new tokens,
causal, GQA packed; a decode step (HF's "decode fast path", one new token per request, given a block table) is the
same call with one query token per request. The block tables of a varlen step come from HF's read positions (a
page's first position / block_size), computed on the device: no host synchronization, so HF's CUDA graphs capture
the call. Padding rows of a graph-padded batch (tables -1, no tokens) read page 0 and are never written.

Supported: full-attention layers (a model with sliding-window layers is refused at the first call), fp16 / bf16,
head_dim 64 / 128 / 256, block sizes that are powers of two from 16 to 256. The ops are built once per process and
specialization (``op_instance``), on the first step.
"""

from __future__ import annotations

import torch

try:
    from transformers import AttentionInterface
except ImportError as exc:  # transformers absent
    raise ImportError("ops.integrations.hf_paged needs HF transformers >= 5.17: pip install 'transformers>=5.17'") \
        from exc

from ..common.library import op_instance
from ..paged_prefill import PagedAttentionPrefillTileLang

__all__ = ["ATTN_IMPLEMENTATION", "register", "paged_attention_forward", "block_tables_from_positions"]

ATTN_IMPLEMENTATION = "paged|llm_tile_ops"


def register() -> str:
    """Register ``paged_attention_forward`` as ``ATTN_IMPLEMENTATION`` with HF's attention interface."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION


def block_tables_from_positions(positions: torch.Tensor, cum_lens: torch.Tensor, max_len: int,
                                block_size: int) -> torch.Tensor:
    """[B, ceil(max_len / block_size)] int32 page ids from the cache positions of each request's tokens (request b's
    in ``positions[cum_lens[b]:cum_lens[b + 1]]``, in order, whole blocks as HF allocates them); 0 past a request's
    pages. Device-only work, no host synchronization."""
    pages = -(-max(int(max_len), 1) // block_size)
    first = cum_lens[:-1, None] + torch.arange(pages, device=positions.device)[None] * block_size
    valid = first < cum_lens[1:, None]
    first = torch.where(valid, first, torch.zeros_like(first)).clamp_(max=max(positions.numel() - 1, 0))
    page = positions[first] // block_size if positions.numel() else torch.zeros_like(first)
    return torch.where(valid, page, torch.zeros_like(page)).to(torch.int32)


def _write_decode_tokens(cache, k_cache, v_cache, key, value, tables, seq_lens, block_size):
    """The decode fast path: each request's one new token goes at position seq_len - 1 of its table (padding rows,
    seq_len 0, write to HF's trash slot)."""
    pos = (seq_lens - 1).clamp(min=0).long()
    page = tables.gather(1, (pos // block_size)[:, None])[:, 0].long()
    where = torch.where(seq_lens > 0, page * block_size + pos % block_size,
                        torch.full_like(pos, cache.write_trash_index))
    k_cache.index_copy_(0, where, key[0].transpose(0, 1)[:where.numel()])
    v_cache.index_copy_(0, where, value[0].transpose(0, 1)[:where.numel()])


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """HF's paged attention signature: query [1, H, T, D], key / value [1, Hkv, T, D] of the step's T new tokens;
    the cache and the batch layout in ``kwargs`` (cache, cu_seq_lens_q, cu_seq_lens_k, max_seqlen_k, read_index,
    write_index, block_table). Returns ([T, H, D], None)."""
    cache = kwargs.get("cache")
    if cache is None:
        raise ValueError(f"{ATTN_IMPLEMENTATION} runs only inside HF continuous batching (no paged cache given)")
    if dropout:
        raise ValueError(f"{ATTN_IMPLEMENTATION}: dropout is not supported, got {dropout}")
    if cache.sliding_windows[module.layer_idx] != 1:
        raise NotImplementedError(f"{ATTN_IMPLEMENTATION}: sliding-window layers are not supported "
                                  f"(layer {module.layer_idx})")
    group, layer_in_group = cache.layer_index_to_group_indices[module.layer_idx]
    k_cache, v_cache = cache.key_cache[layer_in_group], cache.value_cache[layer_in_group]
    bs, num_kv_heads, head_dim = cache.block_size, cache.num_key_value_heads, cache.head_dim
    cu_q, cu_k, max_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"], kwargs["max_seqlen_k"]
    if isinstance(cu_k, dict):
        cu_k, max_k = cu_k["full_attention"], max_k["full_attention"]
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    # at least the request's new tokens: graph-padding rows may carry a query token and no key
    seq_lens = torch.maximum(cu_k[1:] - cu_k[:-1], cu_q[1:] - cu_q[:-1])
    block_table = kwargs.get("block_table")
    if block_table is not None:  # decode fast path: one new token per request
        tables = block_table[group].clamp(min=0)
        _write_decode_tokens(cache, k_cache, v_cache, key, value, tables, seq_lens, bs)
    else:
        write_index = kwargs["write_index"][group]
        k_cache.index_copy_(0, write_index, key[0].transpose(0, 1))
        v_cache.index_copy_(0, write_index, value[0].transpose(0, 1))
        read_index = kwargs["read_index"][group]
        if read_index.numel():
            tables = block_tables_from_positions(read_index, cu_k, max_k, bs)
        else:  # no request has a history: its tokens are the ones just written
            tables = block_tables_from_positions(write_index, cu_q, kwargs["max_seqlen_q"], bs)
    op = op_instance(PagedAttentionPrefillTileLang, num_heads=query.shape[1], num_kv_heads=num_kv_heads,
                     head_dim=head_dim, page_size=bs, dtype=query.dtype, kv_layout="NHD",
                     scale=module.scaling if scaling is None else scaling)
    q = query[0].transpose(0, 1).contiguous()
    out = torch.zeros_like(q)  # rows of graph padding belong to no request and stay zero
    op(q, k_cache.view(-1, bs, num_kv_heads, head_dim), v_cache.view(-1, bs, num_kv_heads, head_dim), tables,
       seq_lens, cu_q, out=out, validate=False)
    return out, None
