"""``torch.library`` custom ops of HSA decode (namespace ``llm_tile_ops``), so that a function calling them
compiles under ``torch.compile(fullgraph=True)``: each has a fake (meta) implementation giving its
outputs' shapes and dtypes, and its implementation runs the op class built for the specialization the
arguments describe (``op_instance``: once per process). None is differentiable.

  hsa_decode(q, k_buffer, v_buffer, page_table, seq_lens, chunk_repr, repr_valid=None,
             selected_page_ids=None, *, page_size, topk, selection_strategy="group", window_size=0,
             combine="softmax", scale=None, validate=True) -> o
  hsa_select(q, page_table, seq_lens, chunk_repr, repr_valid=None, *, page_size, topk,
             selection_strategy="group", window_size=0, scale=None, validate=True)
      -> (selected_page_ids, selected_scores)
  hsa_page_repr(k_buffer, page_ids, chunk_repr, *, page_size, repr_mode="mean", validate=True) -> None,
      writing rows page_ids of chunk_repr (the public function returns chunk_repr)

Inside a compiled graph pass ``validate=False``: the value checks synchronize with the host.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..common.library import NAMESPACE, op_instance
from .decode import HSADecodeTileLang
from .page_repr import HSAPageReprTileLang


def _decode_op(q, chunk_repr, page_size, topk, selection_strategy, window_size, combine, scale):
    return op_instance(HSADecodeTileLang, num_heads=q.shape[1], num_kv_heads=chunk_repr.shape[1],
                       head_dim=q.shape[2], page_size=page_size, topk=topk, dtype=q.dtype,
                       selection_strategy=selection_strategy, window_size=window_size, combine=combine,
                       scale=scale)


@torch.library.custom_op(f"{NAMESPACE}::hsa_decode", mutates_args=(), device_types="cuda")
def _hsa_decode(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, page_table: torch.Tensor,
                seq_lens: torch.Tensor, chunk_repr: torch.Tensor, repr_valid: Optional[torch.Tensor] = None,
                selected_page_ids: Optional[torch.Tensor] = None, *, page_size: int, topk: int,
                selection_strategy: str = "group", window_size: int = 0, combine: str = "softmax",
                scale: Optional[float] = None, validate: bool = True) -> torch.Tensor:
    op = _decode_op(q, chunk_repr, page_size, topk, selection_strategy, window_size, combine, scale)
    return op(q, k_buffer, v_buffer, page_table, seq_lens, chunk_repr, repr_valid=repr_valid,
              selected_page_ids=selected_page_ids, validate=validate)


@_hsa_decode.register_fake
def _(q, k_buffer, v_buffer, page_table, seq_lens, chunk_repr, repr_valid=None, selected_page_ids=None, *,
      page_size, topk, selection_strategy="group", window_size=0, combine="softmax", scale=None, validate=True):
    return q.new_empty(q.shape)


@torch.library.custom_op(f"{NAMESPACE}::hsa_select", mutates_args=(), device_types="cuda")
def _hsa_select(q: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor, chunk_repr: torch.Tensor,
                repr_valid: Optional[torch.Tensor] = None, *, page_size: int, topk: int,
                selection_strategy: str = "group", window_size: int = 0, scale: Optional[float] = None,
                validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    # The combine mode only shapes the decode kernel: selections share the default one's op.
    op = _decode_op(q, chunk_repr, page_size, topk, selection_strategy, window_size, "softmax", scale)
    return op.select(q, page_table, seq_lens, chunk_repr, repr_valid=repr_valid, validate=validate)


@_hsa_select.register_fake
def _(q, page_table, seq_lens, chunk_repr, repr_valid=None, *, page_size, topk, selection_strategy="group",
      window_size=0, scale=None, validate=True):
    shape = (q.shape[0], chunk_repr.shape[1], topk)
    return q.new_empty(shape, dtype=torch.int32), q.new_empty(shape, dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::hsa_page_repr", mutates_args=("chunk_repr",), device_types="cuda")
def _hsa_page_repr(k_buffer: torch.Tensor, page_ids: torch.Tensor, chunk_repr: torch.Tensor, *, page_size: int,
                   repr_mode: str = "mean", validate: bool = True) -> None:
    # (not `mode`: torch's functionalization of a mutating op takes a parameter of that name, which the
    # op's own keyword would collide with under torch.compile)
    op = op_instance(HSAPageReprTileLang, num_kv_heads=k_buffer.shape[1], head_dim=k_buffer.shape[2],
                     page_size=page_size, dtype=k_buffer.dtype, mode=repr_mode)
    op(k_buffer, page_ids, chunk_repr, validate=validate)


@_hsa_page_repr.register_fake
def _(k_buffer, page_ids, chunk_repr, *, page_size, repr_mode="mean", validate=True):
    return None


# ----------------------------------------------------------------------------- public functions
def hsa_decode(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, page_table: torch.Tensor,
               seq_lens: torch.Tensor, chunk_repr: torch.Tensor, repr_valid: torch.Tensor | None = None,
               selected_page_ids: torch.Tensor | None = None, *, page_size: int, topk: int,
               selection_strategy: str = "group", window_size: int = 0, combine: str = "softmax",
               scale: float | None = None, validate: bool = True) -> torch.Tensor:
    """HSA decode as a function: ``HSADecodeTileLang(num_heads, num_kv_heads, head_dim, page_size, topk,
    q.dtype, selection_strategy, window_size, combine, scale)(q, k_buffer, ...)``, with num_heads and
    head_dim from q and num_kv_heads from chunk_repr. Returns o, shaped and typed as q; the custom op
    ``torch.ops.llm_tile_ops.hsa_decode``."""
    return _hsa_decode(q, k_buffer, v_buffer, page_table, seq_lens, chunk_repr, repr_valid, selected_page_ids,
                       page_size=page_size, topk=topk, selection_strategy=selection_strategy,
                       window_size=window_size, combine=combine, scale=scale, validate=validate)


def hsa_select(q: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor, chunk_repr: torch.Tensor,
               repr_valid: torch.Tensor | None = None, *, page_size: int, topk: int,
               selection_strategy: str = "group", window_size: int = 0, scale: float | None = None,
               validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """HSA's top-k page selection as a function (``HSADecodeTileLang.select``): -> (selected_page_ids
    [B, num_kv_heads, topk] int32 padded with -1, selected_scores fp32 padded with -inf), best first; the
    custom op ``torch.ops.llm_tile_ops.hsa_select``."""
    return _hsa_select(q, page_table, seq_lens, chunk_repr, repr_valid, page_size=page_size, topk=topk,
                       selection_strategy=selection_strategy, window_size=window_size, scale=scale,
                       validate=validate)


def hsa_page_repr(k_buffer: torch.Tensor, page_ids: torch.Tensor, chunk_repr: torch.Tensor, *, page_size: int,
                  mode: str = "mean", validate: bool = True) -> torch.Tensor:
    """Write the reprs of pages ``page_ids`` into chunk_repr in place (``HSAPageReprTileLang``) and return
    chunk_repr; the custom op ``torch.ops.llm_tile_ops.hsa_page_repr``."""
    _hsa_page_repr(k_buffer, page_ids, chunk_repr, page_size=page_size, repr_mode=mode, validate=validate)
    return chunk_repr
