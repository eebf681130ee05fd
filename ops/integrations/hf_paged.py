"""HF transformers' continuous batching on our paged attention.

    from ops.integrations.hf_paged import ATTN_IMPLEMENTATION, register
    register()  # adds "paged|llm_tile_ops" to HF's AttentionInterface (idempotent)
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation=ATTN_IMPLEMENTATION)
    outputs = model.generate_batch(prompts, generation_config)  # continuous batching, HF's scheduler

HF keeps one cache tensor per layer, ``[num_blocks * block_size, num_kv_heads, head_dim]``: our "NHD" layout with
pages of ``block_size`` rows. Each call (one per layer and step) writes the step's new K/V into the cache at HF's
write positions and runs ``PagedAttentionPrefillTileLang`` over the cache (every request's history and new tokens,
causal, GQA packed), or for a decode step (one new token per request) ``PagedAttentionDecodeTileLang`` (split-KV
decode). The per-batch work (block tables from HF's read positions, a page's first position / block_size; lengths;
the ``plan`` of the prefill or the decode, with the prefill's tile schedule) is done once per step, at its first
layer, and shared by the others. All of it runs on the device with no host synchronization, so
HF's CUDA graphs capture the step. Padding rows of a graph-padded batch (no tokens) read page 0 and are never written. HF's own "decode fast
path" (a block table instead of read positions) is offered to flash-attention implementations only, so decode steps
come here through the read positions too.

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
from ..paged_decode import PagedAttentionDecodeTileLang
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


class _StepPlans:
    """The per-batch work of one step (block tables, lengths, the decode's plan), done at the first layer and shared by
    the others: HF builds each step's keyword arguments afresh, so the step's ``write_index`` list identifies it
    (the reference kept here keeps its id from being reused)."""

    def __init__(self):
        self.step, self.plans = None, {}

    def get(self, step, key, build):
        if self.step is not step:
            self.step, self.plans = step, {}
        if key not in self.plans:
            self.plans[key] = build()
        return self.plans[key]


_plans = _StepPlans()


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """HF's paged attention signature: query [1, H, T, D], key / value [1, Hkv, T, D] of the step's T new tokens;
    the cache and the batch layout in ``kwargs`` (cache, cu_seq_lens_q, cu_seq_lens_k, max_seqlen_q, max_seqlen_k,
    read_index, write_index). Returns ([T, H, D], None)."""
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
    spec = dict(num_heads=query.shape[1], num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=bs,
                dtype=query.dtype, kv_layout="NHD", scale=module.scaling if scaling is None else scaling)
    cu_q, cu_k, max_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"], kwargs["max_seqlen_k"]
    if isinstance(cu_k, dict):
        cu_k, max_k = cu_k["full_attention"], max_k["full_attention"]
    step, tokens = kwargs["write_index"], query.shape[2]
    # a decode step: one new token per request (max_seqlen_q is a host int: no sync to know it)
    decode = kwargs["max_seqlen_q"] == 1 and cu_q.numel() - 1 == tokens
    op = op_instance(PagedAttentionDecodeTileLang if decode else PagedAttentionPrefillTileLang, **spec)

    def build():
        q32, k32 = cu_q.to(torch.int32), cu_k.to(torch.int32)
        # at least the request's new tokens: graph-padding rows may carry a query token and no key
        seq_lens = torch.maximum(k32[1:] - k32[:-1], q32[1:] - q32[:-1])
        read_index = kwargs["read_index"][group]
        if read_index.numel():
            tables = block_tables_from_positions(read_index, k32, max_k, bs)
        else:  # no request has a history: its tokens are the ones written at this step
            tables = block_tables_from_positions(kwargs["write_index"][group], q32, kwargs["max_seqlen_q"], bs)
        return op.plan(tables, seq_lens, validate=False) if decode else \
            op.plan(tables, seq_lens, q32, validate=False, total_q=tokens)

    plan = _plans.get(step, (group, decode), build)
    write_index = kwargs["write_index"][group]
    k_cache.index_copy_(0, write_index, key[0].transpose(0, 1))
    v_cache.index_copy_(0, write_index, value[0].transpose(0, 1))
    q = query[0].transpose(0, 1)  # [T, H, D], a strided view: the prefill reads it as is
    k_pages, v_pages = (c.view(-1, bs, num_kv_heads, head_dim) for c in (k_cache, v_cache))
    if decode:  # every row is a request's token
        return op.run(q.contiguous(), k_pages, v_pages, plan), None
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)  # rows of graph padding stay zero
    return op.run(q, k_pages, v_pages, plan, out=out), None
