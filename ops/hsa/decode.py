"""HSA decode (``HSADecodeTileLang``): top-k page selection plus sparse paged decode on SGLang's paged KV.

Selection (``select``) is two kernels: ``hsa_score`` gathers the request's candidate page reprs E_j
(through ``page_table``) and writes one sortable 32-bit key per (request, kv head, logical page)
(the fp32 score with its bits flipped so that unsigned order is score order; 0 marks a non-candidate).
``hsa_topk`` (one CTA per (request, kv head)) counts a row's keys in a shared-memory histogram of their top
12 bits, finds the bin of the k-th key, collects the keys in that bin and above in a second pass over the
row and ranks them by counting. The order is that of the 56-bit key (score key, 0xFFFFFF - logical page), so
ties go to the smaller logical page. If that bin is crowded (many equal scores) a radix select over the row
(8-bit digits, one shared-memory histogram per digit) finds the winners first.

Decode is split-K: the items of a (request, kv head) are its selected pages then the pages holding its
local tokens; split ``s`` of ``num_splits`` takes a contiguous range of items, so the grid is
num_splits x kv heads x B and fills the GPU even at small batch (the split count comes from the batch
size, suited to the whole GPU and to one shared with another stream: ``schedule.num_splits``). The G query heads of a kv head are the M rows of one
16-row mma tile (warps split the N of each product, so the padding costs little); each item is one
physical page (K and V read as a page_size x head_dim box of k_buffer / v_buffer). Per item the page's own
softmax is normalized and merged into the split's running (o, lse) with a merge logit: the page's lse in
``token`` mode (plain flash decoding), z_k = scale * q . E_k in ``softmax`` mode (HSA: the page is one chunk
of weight exp(z_k)); local pages always merge with their lse, so the window is one more chunk whose
log-weight is lse_loc. ``hsa_combine`` merges the splits' (o, lse) into o. Design and numbers:
docs/design/hsa.md.
"""

from __future__ import annotations

import torch

from ..common.protocol import Op
from ..common.runtime import NO_WARP_SPECIALIZATION, compile_kernel, resolve_config, sm_count
from ..common.validate import (check_bool, check_choice, check_int, check_scale, check_tensor, check_values,
                               dtype_name)
from . import schedule
from .kernels.decode import hsa_combine_kernel, hsa_decode_kernel
from .kernels.score import hsa_score_kernel
from .kernels.topk import hsa_topk_kernel
from .page_repr import DTYPES, HEAD_DIMS, PAGE_SIZES

STRATEGIES = ("group", "head")
COMBINES = ("softmax", "token")

# The bench / demo specialization (scripts/workloads/hsa_decode.py): bf16, 32 query heads, 8 kv heads.
BENCH_SPEC = dict(num_heads=32, num_kv_heads=8, head_dim=128, page_size=64, topk=64, dtype=torch.bfloat16,
                  selection_strategy="group", window_size=512)


class HSADecodeTileLang(Op):
    """HSA decode: per request and kv head, top-k pages by repr score, then attention over those pages
    and the local tokens, combined per ``combine`` (see golden/hsa_decode.py for the semantics).

    ``op(q, k_buffer, v_buffer, page_table, seq_lens, chunk_repr, repr_valid=None, selected_page_ids=None,
    out=None, validate=True) -> o``; ``op.select(q, page_table, seq_lens, chunk_repr, repr_valid=None,
    validate=True) -> (selected_page_ids, selected_scores)``. Shapes: q ``[B, num_heads, head_dim]``;
    k_buffer, v_buffer ``[num_slots, num_kv_heads, head_dim]`` (page p holds slots p * page_size ..);
    page_table ``[B, max_pages]`` int32; seq_lens ``[B]`` int32; chunk_repr
    ``[num_physical_pages, num_kv_heads, head_dim]``; repr_valid ``[num_physical_pages]`` bool;
    selected_page_ids ``[B, num_kv_heads, topk]`` int32 (-1: none). ``validate=False`` skips the value checks
    that need a host sync (seq_lens range, page ids in range), so a call can be captured in a CUDA graph.

    Config: ``split_overhead``, the split-count rule's price of a split's fixed work, in items
    (``schedule.num_splits``); ``score_config`` passes tunables to the score kernel's builder
    (``pages_per_thread``, ``unroll``, ``blocks_per_sm``).
    """

    op_name = "hsa_decode"
    warm_specs = tuple(dict(BENCH_SPEC, combine=c) for c in COMBINES)

    @classmethod
    def default_config(cls, spec: dict) -> dict:
        return {"split_overhead": 2}

    @classmethod
    def config_space(cls, spec: dict) -> list[dict]:
        """Nothing for the autotuner: split_overhead sets a host-side split count (no kernel to time)."""
        return []

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, topk: int,
                 dtype: torch.dtype, selection_strategy: str = "group", window_size: int = 0,
                 combine: str = "softmax", scale: float | None = None, config: dict | None = None,
                 score_config: dict | None = None):
        check_int("num_heads", num_heads, lo=1)
        check_int("num_kv_heads", num_kv_heads, lo=1)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads: expected a multiple of num_kv_heads ({num_kv_heads}) so that "
                             f"G = num_heads / num_kv_heads is an integer, got {num_heads}")
        check_int("G (num_heads / num_kv_heads)", num_heads // num_kv_heads, lo=1, hi=16)
        check_choice("head_dim", head_dim, HEAD_DIMS)
        check_choice("page_size", page_size, PAGE_SIZES)
        check_int("topk", topk, lo=1, hi=2048)
        check_choice("selection_strategy", selection_strategy, STRATEGIES)
        check_int("window_size", window_size, lo=0)
        check_choice("combine", combine, COMBINES)
        scale = check_scale(scale, head_dim)
        self.dtype = dtype
        self.spec = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         page_size=page_size, topk=topk, dtype=dtype_name(dtype, DTYPES),
                         selection_strategy=selection_strategy, window_size=window_size,
                         combine=combine, scale=scale)
        self.config = resolve_config(self.op_name, self.spec, config, self.default_config(self.spec))
        check_int("config['split_overhead']", self.config["split_overhead"], lo=0)
        self.decode_ctas_per_sm = schedule.decode_ctas_per_sm(page_size, head_dim)
        sp = self.spec
        self.score_kernel = compile_kernel(hsa_score_kernel(
            num_heads, num_kv_heads, head_dim, page_size, sp["dtype"], selection_strategy, window_size, scale,
            **(score_config or {})))
        self.topk_kernel = compile_kernel(hsa_topk_kernel(num_kv_heads, page_size, topk, window_size))
        # Without warp specialization: every warp computes (the products split N over all of them).
        self.decode_kernel = compile_kernel(
            hsa_decode_kernel(num_heads, num_kv_heads, head_dim, page_size, topk, sp["dtype"], window_size,
                              combine, scale),
            pass_configs=NO_WARP_SPECIALIZATION)
        self.combine_kernel = compile_kernel(hsa_combine_kernel(num_heads, head_dim, sp["dtype"]))
        self._all_valid = {}  # device -> uint8 ones, the repr_valid of calls without one

    # -- validation
    def _check_common(self, q, page_table, seq_lens, chunk_repr, repr_valid, validate):
        sp = self.spec
        Hq, Hkv, D = sp["num_heads"], sp["num_kv_heads"], sp["head_dim"]
        check_bool("validate", validate)
        check_tensor("q", q, self.dtype, (None, Hq, D))
        B, dev = q.shape[0], q.device
        if B < 1:
            raise ValueError("q: expected a batch of at least 1 request, got 0")
        check_tensor("page_table", page_table, torch.int32, (B, None), device=dev)
        check_tensor("seq_lens", seq_lens, torch.int32, (B,), device=dev)
        check_tensor("chunk_repr", chunk_repr, self.dtype, (None, Hkv, D), device=dev)
        max_pages, num_pages = page_table.shape[1], chunk_repr.shape[0]
        if max_pages < 1 or num_pages < 1:
            raise ValueError(f"page_table / chunk_repr: expected at least one page, got max_pages={max_pages}, "
                             f"num_physical_pages={num_pages}")
        if max_pages >= 1 << schedule.IDX_BITS or max_pages * sp["page_size"] >= 1 << 31:
            raise ValueError(f"page_table: expected max_pages * page_size < 2**31 and "
                             f"max_pages < 2**{schedule.IDX_BITS}, got max_pages={max_pages}")
        if repr_valid is not None:
            check_tensor("repr_valid", repr_valid, torch.bool, (num_pages,), device=dev)

    def _value_checks(self, page_table, seq_lens, num_pages):
        ps = self.spec["page_size"]
        max_pages = page_table.shape[1]
        used = torch.arange(max_pages, device=page_table.device) < ((seq_lens + ps - 1) // ps)[:, None]
        return [
            (f"seq_lens: expected values in [1, max_pages * page_size = {max_pages * ps}] (seq_len 0 is an error)",
             (seq_lens >= 1) & (seq_lens <= max_pages * ps)),
            (f"page_table: expected the pages of each request (logical page < ceil(seq_len / page_size)) "
             f"to be physical page ids in [0, {num_pages})",
             ~used | ((page_table >= 0) & (page_table < num_pages))),
        ]

    # -- entry points
    def select(self, q, page_table, seq_lens, chunk_repr, repr_valid=None, validate: bool = True):
        """-> (selected_page_ids [B, Hkv, topk] int32 padded -1, selected_scores fp32 padded -inf), best first."""
        self._check_common(q, page_table, seq_lens, chunk_repr, repr_valid, validate)
        if validate:
            check_values(self._value_checks(page_table, seq_lens, chunk_repr.shape[0]))
        return self._select(q, page_table, seq_lens, chunk_repr, repr_valid)

    def valid_bytes(self, repr_valid, num_pages: int, device):
        """repr_valid as bytes; without one, all pages valid: a buffer kept per device rather than a fill per
        call, except one made during a CUDA graph capture (its fill runs only when the graph does)."""
        if repr_valid is not None:
            return repr_valid.view(torch.uint8)
        ones = self._all_valid.get(device)
        if ones is None or ones.numel() < num_pages:
            ones = torch.ones(num_pages, dtype=torch.uint8, device=device)
            if not torch.cuda.is_current_stream_capturing():
                self._all_valid[device] = ones
        return ones[:num_pages]

    def empty_keys(self, rows: int, max_pages: int, device) -> torch.Tensor:
        """The selection keys [rows, Hkv, max_pages] a score kernel writes and ``top_pages`` reads."""
        # Allocated as int32: torch has few uint32 kernels (fills included).
        keys = torch.empty(rows, self.spec["num_kv_heads"], max_pages, dtype=torch.int32, device=device)
        return keys.view(torch.uint32)

    def top_pages(self, keys, page_table, seq_lens, topk_kernel=None):
        """(selected_page_ids, selected_scores) of the scored rows: the top-k of each (row, kv head), by the
        decode's top-k kernel or another build of it (``topk_kernel``: HSA extend's)."""
        B, Hkv, k = keys.shape[0], self.spec["num_kv_heads"], self.spec["topk"]
        ids = torch.empty(B, Hkv, k, dtype=torch.int32, device=keys.device)
        scores = torch.empty(B, Hkv, k, dtype=torch.float32, device=keys.device)
        (topk_kernel or self.topk_kernel)(keys, page_table, seq_lens, ids, scores)
        return ids, scores

    def _select(self, q, page_table, seq_lens, chunk_repr, repr_valid):
        valid = self.valid_bytes(repr_valid, chunk_repr.shape[0], q.device)
        keys = self.empty_keys(q.shape[0], page_table.shape[1], q.device)
        self.score_kernel(q, page_table, seq_lens, chunk_repr, valid, keys)
        return self.top_pages(keys, page_table, seq_lens)

    def _check_decode(self, q, k_buffer, v_buffer, page_table, seq_lens, chunk_repr, repr_valid,
                      selected_page_ids, out, validate):
        self._check_common(q, page_table, seq_lens, chunk_repr, repr_valid, validate)
        sp = self.spec
        Hkv, D, dev = sp["num_kv_heads"], sp["head_dim"], q.device
        check_tensor("k_buffer", k_buffer, self.dtype, (None, Hkv, D), device=dev)
        need = chunk_repr.shape[0] * sp["page_size"]
        if k_buffer.shape[0] < need:
            raise ValueError(f"k_buffer: expected at least num_physical_pages * page_size = {need} slots, "
                             f"got {k_buffer.shape[0]}")
        check_tensor("v_buffer", v_buffer, self.dtype, tuple(k_buffer.shape), device=dev)
        if selected_page_ids is not None:
            check_tensor("selected_page_ids", selected_page_ids, torch.int32, (q.shape[0], Hkv, sp["topk"]),
                         device=dev)
        if out is not None:
            check_tensor("out", out, self.dtype, tuple(q.shape), device=dev)

    def __call__(self, q, k_buffer, v_buffer, page_table, seq_lens, chunk_repr, repr_valid=None,
                 selected_page_ids=None, out=None, validate: bool = True):
        self._check_decode(q, k_buffer, v_buffer, page_table, seq_lens, chunk_repr, repr_valid,
                           selected_page_ids, out, validate)
        num_pages = chunk_repr.shape[0]
        if validate:
            checks = self._value_checks(page_table, seq_lens, num_pages)
            if selected_page_ids is not None:
                checks.append((f"selected_page_ids: expected -1 or physical page ids in [0, {num_pages})",
                               (selected_page_ids >= -1) & (selected_page_ids < num_pages)))
            check_values(checks)
        if selected_page_ids is None:
            selected_page_ids, _ = self._select(q, page_table, seq_lens, chunk_repr, repr_valid)
        o_part, lse_part = self._partials(q, self.num_splits(q.shape[0], q.device))
        self.decode_kernel(q, k_buffer, v_buffer, page_table, seq_lens, chunk_repr, selected_page_ids,
                           o_part, lse_part)
        if out is None:
            out = torch.empty_like(q)
        self.combine_kernel(o_part, lse_part, out)
        return out

    def num_splits(self, batch: int, device) -> int:
        """Decode splits for a batch (from shapes and the device only, so calls stay capturable)."""
        sp = self.spec
        n_items = sp["topk"] + schedule.local_pages_max(sp["page_size"], sp["window_size"])
        slots = sm_count(torch.device(device)) * self.decode_ctas_per_sm
        return schedule.num_splits(batch * sp["num_kv_heads"], n_items, slots, self.config["split_overhead"])

    @staticmethod
    def _partials(q, num_splits):
        B, Hq, D = q.shape
        return (torch.empty(B, Hq, num_splits, D, dtype=torch.float32, device=q.device),
                torch.empty(B, Hq, num_splits, dtype=torch.float32, device=q.device))
