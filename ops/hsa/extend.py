"""HSA extend (`HSAExtendTileLang`): sparse attention for chunks of new tokens over SGLang's paged cache (a prompt
or a chunked prefill on top of each request's cached history), ragged batches packed as in paged prefill. Every new
token is answered exactly as a decode of its request at its position (``golden.hsa_decode.hsa_extend``).

``plan`` turns the batch into decode rows (each new token's request's page-table row and its decode length p + 1)
and query tiles (a few consecutive new tokens of one request), on the device with no host sync. ``run`` scores each
tile's tokens against its request's candidate reprs in one GEMM per (tile, kv head) (``extend_score``), runs the
decode's top-k over the rows, then attends page-major: the (token, slot) entries grouped by selected page
(``page_entries``: a counting sort on the device), each page read once for all the tokens that chose it
(``extend_pages``), the local tokens per tile (``extend_local``), and a combine of each token's slots
(docs/design/hsa.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.protocol import Op
from ..common.validate import check_bool, check_tensor, check_values
from ..common.runtime import NO_WARP_SPECIALIZATION, compile_kernel
from .decode import BENCH_SPEC, HSADecodeTileLang
from .kernels.extend_entries import hsa_extend_count_kernel, hsa_extend_place_kernel
from .kernels.extend_local import hsa_extend_local_kernel
from .kernels.extend_pages import hsa_extend_combine_kernel, hsa_extend_pages_kernel
from .kernels.extend_score import hsa_extend_score_kernel
from .kernels.topk import hsa_topk_kernel
from .schedule import (EXTEND_HIST_BITS, EXTEND_REPRS_BYTES, EXTEND_TOPK_THREADS, extend_tile_tokens, key_tiles_shape,
                       score_tile_tokens)


@dataclass(frozen=True)
class ExtendPlan:
    """An extend batch (``HSAExtendTileLang.plan``) as decode rows: per new token its request's page-table row
    [total_q, max_pages] and its decode length [total_q]; and as query tiles for the scores and the attention: per
    tile its request (-1: a spare tile) and first row, with the batch's page table and cum_seq_lens_q (all int32); the
    score kernel's tiles (``schedule.score_tile_tokens`` tokens each) the same way, and per new token its row of their
    keys (tile x tokens + its row in the tile)."""
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    total_q: int
    request_page_table: torch.Tensor
    cum_seq_lens_q: torch.Tensor
    tile_req: torch.Tensor
    tile_row0: torch.Tensor
    score_tile_req: torch.Tensor
    score_tile_row0: torch.Tensor
    score_key_rows: torch.Tensor


class HSAExtendTileLang(Op):
    """``op(q, k_buffer, v_buffer, page_table, seq_lens, cum_seq_lens_q, chunk_repr, repr_valid=None, out=None,
    return_selection=False, validate=True) -> o`` (with ``return_selection``: ``(o, selected_page_ids)``), the same as
    ``op.run(q, k_buffer, v_buffer, chunk_repr, op.plan(page_table, seq_lens, cum_seq_lens_q, q.shape[0],
    chunk_repr.shape[0]), ...)``.

    q ``[total_q, num_heads, head_dim]``: the new tokens of all requests, request b's in rows
    ``cum_seq_lens_q[b] .. cum_seq_lens_q[b + 1]``; ``seq_lens [B]`` each request's length including its new tokens
    (its K/V and the reprs of the pages they completed written before the call); the cache tensors as HSA decode's.
    selected_page_ids ``[total_q, num_kv_heads, topk]`` int32 (-1: none). ``validate=True`` checks the values (the
    decode's, and cum_seq_lens_q: starts at 0, non-decreasing, ends at total_q, q_len <= seq_len) in one host sync;
    ``validate=False`` skips them (CUDA-graph capturable). The constructor is HSA decode's.

    Workspace per call: the partial slots, total_q x (topk + 1) x num_heads x (2 x head_dim + 4) bytes (16-bit
    outputs and fp32 logits; 8.7 GB for 16384 new tokens at H = 32, D = 128, topk = 64), the selection keys (by
    score tile: score tiles x their tokens x num_kv_heads x max_pages rounded up to 64, x 4 bytes), the requests'
    reprs in page-table order (B x max_pages x num_kv_heads x head_dim x 2 bytes, at most
    ``schedule.EXTEND_REPRS_BYTES`` of requests at a time) and the entry lists (total_q x num_kv_heads x topk x 8
    bytes)."""

    op_name = "hsa_extend"
    warm_specs = (BENCH_SPEC,)

    @classmethod
    def default_config(cls, spec: dict) -> dict:
        """The decode's (its top-k's)."""
        return HSADecodeTileLang.default_config(spec)

    @classmethod
    def config_space(cls, spec: dict) -> list[dict]:
        """Nothing for the autotuner (the decode's split count is host-side)."""
        return []

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, topk: int,
                 dtype: torch.dtype, selection_strategy: str = "group", window_size: int = 0,
                 combine: str = "softmax", scale: float | None = None, config: dict | None = None):
        self.decode = HSADecodeTileLang(num_heads, num_kv_heads, head_dim, page_size, topk, dtype,
                                        selection_strategy, window_size, combine, scale, config)
        self.dtype, self.spec = dtype, self.decode.spec
        self.config = self.decode.config
        sp = self.spec
        self.tile_tokens = extend_tile_tokens(num_heads, num_kv_heads)
        # The scores' tiles: a GEMM row per token (its G heads accumulated), as many tokens as shared memory holds.
        self.score_tokens = score_tile_tokens(num_heads // num_kv_heads, head_dim)
        self.score_kernel = compile_kernel(hsa_extend_score_kernel(
            num_heads, num_kv_heads, head_dim, page_size, sp["dtype"], selection_strategy, window_size, sp["scale"],
            self.score_tokens))
        # As the decode's: without warp specialization, every warp computes, splitting the N of every product
        # (N = page_size needs >= 8 per warp). The local tokens go to the partial slot after the topk pages'.
        self.local_kernel = compile_kernel(
            hsa_extend_local_kernel(num_heads, num_kv_heads, head_dim, page_size, sp["dtype"], window_size,
                                    sp["scale"], self.tile_tokens, part=topk, threads=32 * min(4, page_size // 8)),
            pass_configs=NO_WARP_SPECIALIZATION)
        self.topk_kernel = compile_kernel(hsa_topk_kernel(num_kv_heads, page_size, topk, window_size,
                                                          EXTEND_TOPK_THREADS, EXTEND_HIST_BITS, self.score_tokens))
        self.count_kernel = compile_kernel(hsa_extend_count_kernel(num_kv_heads, topk))
        self.place_kernel = compile_kernel(hsa_extend_place_kernel(num_kv_heads, topk))
        self.pages_kernel = compile_kernel(hsa_extend_pages_kernel(
            num_heads, num_kv_heads, head_dim, page_size, topk, sp["dtype"], combine, sp["scale"]))
        # a plain cp.async pipeline: warp specialization would hold one CTA per SM (240 registers)
        self.combine_kernel = compile_kernel(hsa_extend_combine_kernel(num_heads, head_dim, topk + 1, sp["dtype"]),
                                             pass_configs=NO_WARP_SPECIALIZATION)

    def plan(self, page_table: torch.Tensor, seq_lens: torch.Tensor, cum_seq_lens_q: torch.Tensor, total_q: int,
             num_pages: int | None = None, validate: bool = True) -> ExtendPlan:
        """The batch as decode rows (device ops). With ``validate``, the value checks in one host sync: the batch
        layout, and with ``num_pages`` (chunk_repr's rows) also the decode's (seq_lens and page ids in range)."""
        check_bool("validate", validate)
        check_tensor("page_table", page_table, torch.int32, (None, None))
        B, dev = page_table.shape[0], page_table.device
        check_tensor("seq_lens", seq_lens, torch.int32, (B,), device=dev)
        check_tensor("cum_seq_lens_q", cum_seq_lens_q, torch.int32, (B + 1,), device=dev)
        if not isinstance(total_q, int) or total_q < 0:
            raise ValueError(f"total_q: expected a non-negative int (q.shape[0]), got {total_q!r}")
        q_lens = cum_seq_lens_q[1:] - cum_seq_lens_q[:-1]
        if validate:
            checks = [(f"cum_seq_lens_q: expected to start at 0, never decrease and end at total_q = {total_q}",
                       torch.cat([cum_seq_lens_q[:1] == 0, q_lens >= 0, cum_seq_lens_q[-1:] == total_q])),
                      ("cum_seq_lens_q / seq_lens: expected each request's new tokens (q_len) <= its seq_len",
                       q_lens <= seq_lens)]
            if num_pages is not None:
                checks += self.decode._value_checks(page_table, seq_lens, num_pages)
            check_values(checks)
        rows = torch.arange(total_q, device=dev, dtype=torch.int32)
        req = torch.searchsorted(cum_seq_lens_q[1:], rows, right=True).clamp_(max=max(B - 1, 0))
        pos = seq_lens[req] - q_lens[req] + rows - cum_seq_lens_q[req]
        # each token's score tile: its request's first tile, plus its offset in the request / score_tokens
        off = rows - cum_seq_lens_q[req]
        key_rows = self.first_tiles(cum_seq_lens_q, self.score_tokens)[0][req] * self.score_tokens + off
        return ExtendPlan(page_table[req], (pos + 1).to(torch.int32), total_q, page_table, cum_seq_lens_q,
                          *self.tiles(cum_seq_lens_q, total_q, self.tile_tokens),
                          *self.tiles(cum_seq_lens_q, total_q, self.score_tokens), key_rows.to(torch.int32))

    @staticmethod
    def first_tiles(cum_seq_lens_q: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(each request's first tile, its tile count) of the query tiles of ``tokens`` new tokens (``tiles``)."""
        q_lens = (cum_seq_lens_q[1:] - cum_seq_lens_q[:-1]).long()
        per_req = (q_lens + tokens - 1) // tokens
        return per_req.cumsum(0) - per_req, per_req

    @staticmethod
    def tiles(cum_seq_lens_q: torch.Tensor, total_q: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Query tiles on the device: (request or -1, first row) per tile, request by request, ``tokens`` new tokens
        each (fewer at a request's end). Their count is a bound known on the host (no sync): spare tiles come last,
        with request -1."""
        B = cum_seq_lens_q.shape[0] - 1
        bound = (total_q + B * (tokens - 1)) // tokens
        first, per_req = HSAExtendTileLang.first_tiles(cum_seq_lens_q, tokens)
        t = torch.arange(bound, device=cum_seq_lens_q.device)
        req = torch.searchsorted(first + per_req, t, right=True)
        real = req < B
        req = req.clamp(max=max(B - 1, 0))
        row0 = cum_seq_lens_q[req].long() + (t - first[req]) * tokens
        return (torch.where(real, req, -1).to(torch.int32), torch.where(real, row0, 0).to(torch.int32))

    def run(self, q, k_buffer, v_buffer, chunk_repr, plan: ExtendPlan, repr_valid=None, out=None,
            return_selection: bool = False):
        """The planned batch (no host sync): the selection, then the attention (`attend`)."""
        check_bool("return_selection", return_selection)
        if not isinstance(plan, ExtendPlan):
            raise TypeError(f"plan: expected an ExtendPlan (from op.plan), got {type(plan).__name__}")
        check_tensor("q", q, self.dtype, (plan.total_q, self.spec["num_heads"], self.spec["head_dim"]))
        if plan.total_q == 0:
            out = torch.empty_like(q) if out is None else out
            ids = torch.empty(0, self.spec["num_kv_heads"], self.spec["topk"], dtype=torch.int32, device=q.device)
            return (out, ids) if return_selection else out
        self.decode._check_decode(q, k_buffer, v_buffer, plan.page_table, plan.seq_lens, chunk_repr, repr_valid, None,
                                  out, validate=False)
        ids = self.select(q, chunk_repr, plan, repr_valid)
        out = torch.empty_like(q) if out is None else out
        self.attend(q, k_buffer, v_buffer, chunk_repr, plan, ids, out)
        return (out, ids) if return_selection else out

    def attend(self, q, k_buffer, v_buffer, chunk_repr, plan: ExtendPlan, ids, out):
        """out of the planned batch given its selections, page-major (no host sync): each selected page read once
        for every token that chose it (`page_entries`, ``hsa_extend_pages``) into the tokens' partial slots, the
        local tokens per tile into the last slot (``hsa_extend_local``), then the combine."""
        topk, dev = self.spec["topk"], q.device
        o_part = torch.empty(plan.total_q, topk + 1, *q.shape[1:], dtype=q.dtype, device=dev)
        logit_part = torch.full((plan.total_q, topk + 1, q.shape[1]), float("-inf"), device=dev)
        self.pages_kernel(q, k_buffer, v_buffer, chunk_repr, *self.page_entries(ids, chunk_repr.shape[0]), o_part,
                          logit_part)
        self.local_kernel(q, k_buffer, v_buffer, plan.request_page_table, plan.cum_seq_lens_q, plan.seq_lens,
                          plan.tile_req, plan.tile_row0, o_part, logit_part)
        self.combine_kernel(o_part, logit_part, out)

    def page_entries(self, ids: torch.Tensor, num_pages: int):
        """The page-major kernel's lists, on the device with no host sync: the (row, slot) entries of ids [total_q,
        Hkv, topk] (-1: none) grouped by (kv head, physical page): (group_start [Hkv * num_pages + 1], entry_row,
        entry_slot [total_q * Hkv * topk], all int32); group h * num_pages + p holds entries group_start[g] ..
        [g + 1], in no particular order (`kernels/extend_entries.py`); the entries past the last group are unused. ids
        must not be empty (`run` returns before)."""
        flat, groups = ids.reshape(-1), ids.shape[1] * num_pages
        counts = torch.zeros(groups + 1, dtype=torch.int32, device=ids.device)
        entry_row, entry_slot = torch.empty_like(flat), torch.empty_like(flat)
        self.count_kernel(flat, counts)
        group_start = counts.cumsum(0, dtype=torch.int32)
        self.place_kernel(flat, group_start[:-1].clone(), entry_row, entry_slot)
        return group_start, entry_row, entry_slot

    def select(self, q, chunk_repr, plan: ExtendPlan, repr_valid=None) -> torch.Tensor:
        """selected_page_ids [total_q, Hkv, topk] of the planned batch: the tiles' scores, then the decode's top-k
        (built for short rows: ``EXTEND_TOPK_THREADS``, ``EXTEND_HIST_BITS``) over each row."""
        # by score tile (schedule.key_tiles_shape): the score kernel stores them as fp32 bits, the top-k reads uint32
        keys = torch.empty(key_tiles_shape(plan.score_tile_req.numel(), self.spec["num_kv_heads"],
                                           plan.page_table.shape[1], self.score_tokens), dtype=torch.float32,
                           device=q.device)
        if plan.score_tile_req.numel():
            # The requests' reprs in page-table order, so that the score kernel reads a step's pages as one box, an
            # invalid one as NaN; entries past a request's pages may hold any id (their keys are never read).
            # EXTEND_REPRS_BYTES of them at a time, the kernel scoring those requests' tiles.
            table = plan.request_page_table
            row_bytes = table.shape[1] * chunk_repr[0].numel() * chunk_repr.element_size()
            chunk = max(1, EXTEND_REPRS_BYTES // max(1, row_bytes))
            for b0 in range(0, table.shape[0], chunk):
                ids = table[b0:b0 + chunk].clamp(0, chunk_repr.shape[0] - 1).reshape(-1)
                reprs = chunk_repr.index_select(0, ids).view(-1, table.shape[1], *chunk_repr.shape[1:])
                if repr_valid is not None:
                    invalid = repr_valid.index_select(0, ids).logical_not_().view(*reprs.shape[:2], 1, 1)
                    reprs.masked_fill_(invalid, float("nan"))
                self.score_kernel(q, plan.cum_seq_lens_q, plan.seq_lens, plan.score_tile_req, plan.score_tile_row0,
                                  reprs, keys, b0)
        Hkv, k = self.spec["num_kv_heads"], self.spec["topk"]
        ids = torch.empty(plan.total_q, Hkv, k, dtype=torch.int32, device=q.device)
        scores = torch.empty(plan.total_q, Hkv, k, dtype=torch.float32, device=q.device)
        self.topk_kernel(keys.view(torch.int32).view(torch.uint32), plan.score_key_rows, plan.page_table,
                         plan.seq_lens, ids, scores)
        return ids

    def __call__(self, q, k_buffer, v_buffer, page_table, seq_lens, cum_seq_lens_q, chunk_repr, repr_valid=None,
                 out=None, return_selection: bool = False, validate: bool = True):
        check_tensor("q", q, self.dtype, (None, self.spec["num_heads"], self.spec["head_dim"]))
        check_tensor("chunk_repr", chunk_repr, self.dtype, (None, self.spec["num_kv_heads"], self.spec["head_dim"]),
                     device=q.device)
        plan = self.plan(page_table, seq_lens, cum_seq_lens_q, q.shape[0], chunk_repr.shape[0], validate)
        return self.run(q, k_buffer, v_buffer, chunk_repr, plan, repr_valid, out, return_selection)
