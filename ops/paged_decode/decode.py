"""Dense paged decode (`PagedAttentionDecodeTileLang`): split-KV ("flash decoding") attention of a batch of
sequences, each with ``num_q_tokens`` new tokens at the end of its paged KV cache, with GQA packed into the
query tile and optional sliding window, logits soft-cap, ALiBi, FP8 cache and log-sum-exp output.

Each CTA takes (split, head group, sequence): the query heads of one kv head times the sequence's new
tokens are the rows of one tile, so each K / V tile is read once for all of them; the split streams its
range of KV tiles through a software pipeline (TMA page copies, or row gathers below 16-row pages) with an
online softmax. The split length is a fixed number of KV tiles chosen by ``plan`` from the batch (so the
grid makes several waves of CTAs: a GPU shared with another stream only runs more waves); a sequence of one
split writes its output directly, longer ones write partial (o, lse) that the combine kernel merges in
split order (deterministic). ``plan`` does the per-batch work once (value checks in one host sync, split
length, workspaces); ``run`` is the per-layer call: no host sync, CUDA-graph capturable. Design:
docs/design/paged_decode.md; semantics: golden/paged_decode.py.
"""

from __future__ import annotations

import torch

from ..common.protocol import Op
from ..common.runtime import OWN_BARRIERS, compile_kernels, resolve_config, sm_count
from ..common.validate import (check_bool, check_choice, check_float, check_int, check_scale, check_tensor,
                               dtype_name)
from . import schedule
from .kernels import paged_decode_combine_kernel, paged_decode_split_kernel, paged_decode_warps_kernel

DTYPES = (torch.float16, torch.bfloat16)
FP8 = torch.float8_e4m3fn
KV_LAYOUTS = ("HND", "NHD")
_TL_FP8 = "float8_e4m3fn"


def _int32(name: str, t: torch.Tensor) -> torch.Tensor:
    """int32 as given; int64 converted once (by the plan, not per layer)."""
    check_tensor(name, t, (torch.int32, torch.int64))
    return t if t.dtype == torch.int32 else t.to(torch.int32)


class DecodePlan:
    """Per-batch state of a decode (``PagedAttentionDecodeTileLang.plan``): the int32 tables, the split
    schedule (``tiles_per_split`` KV tiles a split, ``num_splits`` the grid's split axis) and the
    workspaces, all of fixed size, so that every ``run`` on it launches the same grids (graph replay)."""

    def __init__(self, key, block_tables, seq_lens, tiles_per_split, num_splits, max_page_id, num_heads, head_dim,
                 num_q_tokens):
        dev, batch = seq_lens.device, seq_lens.shape[0]
        self.key = key  # the tiling it was made for (op specialization and config)
        self.block_tables, self.seq_lens = block_tables, seq_lens
        self.batch, self.device = batch, dev
        self.tiles_per_split, self.num_splits = tiles_per_split, num_splits
        self.max_page_id = max_page_id  # the largest page id the batch reads (None: not checked)
        self.sched = torch.full((1,), tiles_per_split, dtype=torch.int32, device=dev)
        rows = batch if num_splits > 1 else 1  # one-split batches write no partials (a 1-row stand-in)
        self.o_part = torch.empty(rows, num_splits, num_q_tokens, num_heads, head_dim, dtype=torch.float32,
                                  device=dev)
        self.lse_part = torch.empty(rows, num_splits, num_q_tokens, num_heads, dtype=torch.float32, device=dev)
        self.lse = torch.empty(batch * num_q_tokens, num_heads, dtype=torch.float32, device=dev)  # unless asked for
        self.no_alibi = torch.zeros(num_heads, dtype=torch.float32, device=dev)
        self.unit_scale = torch.ones(1, dtype=torch.float32, device=dev)


class PagedAttentionDecodeTileLang(Op):
    """Paged decode: ``plan = op.plan(block_tables, seq_lens, validate=True)`` once per batch, then
    ``op.run(q, k_cache, v_cache, plan, alibi_slopes=None, k_scale=None, v_scale=None, out=None,
    return_lse=False)`` per layer (no host sync, CUDA-graph capturable), or the one call ``op(q, k_cache,
    v_cache, block_tables, seq_lens, ..., validate=True)``. Semantics: ``golden.paged_decode``.

    Built for ``num_heads`` query heads over ``num_kv_heads`` (a divisor), ``head_dim`` in {64, 128, 256},
    ``page_size`` a power of two up to 256, ``dtype`` fp16 / bf16 (q and out), ``kv_dtype`` the cache's
    (None: ``dtype``; or torch.float8_e4m3fn), ALiBi or not, ``window_left`` (-1: none; a query at
    position p sees keys p - window_left .. p), ``logits_soft_cap`` (0: none), softmax ``scale`` (default
    head_dim ** -0.5), ``kv_layout`` "HND" [num_pages, num_kv_heads, page_size, head_dim] or "NHD"
    [num_pages, page_size, num_kv_heads, head_dim], and ``num_q_tokens`` new tokens per sequence (1..8;
    q rows b * nq .. b * nq + nq - 1 at positions seq_len - nq + i, causal among themselves).

    q, out: [batch * num_q_tokens, num_heads, head_dim] contiguous; lse (``return_lse``) [batch *
    num_q_tokens, num_heads] fp32, natural log. ``block_tables`` [batch, max_pages] and ``seq_lens``
    [batch]: int32 (int64 is converted once by ``plan``). ``k_scale`` / ``v_scale`` (real value = stored x
    scale; any cache dtype, meant for FP8): a positive float or a 1-element fp32 tensor on q's device
    (its value is not checked: no host sync).
    """

    op_name = "paged_decode"
    # The bench's specializations (scripts/workloads/paged_decode.py).
    warm_specs = tuple(dict(num_heads=32, num_kv_heads=8, head_dim=128, page_size=ps, dtype=torch.bfloat16,
                            kv_dtype=kv) for ps in (16, 64) for kv in (None, FP8))

    @classmethod
    def default_config(cls, spec: dict) -> dict:
        if "num_heads" not in spec:  # a partial spec (config-space queries): the largest tile, FP8
            return schedule.default_config(spec["head_dim"], spec["page_size"])
        nq = spec.get("num_q_tokens", 1)
        rows = schedule.head_pack(spec["num_heads"], spec["num_kv_heads"], nq) * nq
        return schedule.default_config(spec["head_dim"], spec["page_size"], rows, spec.get("kv_dtype") == _TL_FP8)

    @staticmethod
    def _splits_keys_over_warps(spec: dict) -> bool:
        """Whether ``spec`` runs the warp-split kernel (a partial spec: no)."""
        if "num_heads" not in spec:
            return False
        nq = spec.get("num_q_tokens", 1)
        rows = schedule.head_pack(spec["num_heads"], spec["num_kv_heads"], nq) * nq
        return schedule.splits_keys_over_warps(rows, spec["head_dim"])

    @classmethod
    def config_space(cls, spec: dict) -> list[dict]:
        if cls._splits_keys_over_warps(spec):
            return schedule.warp_config_space(spec["head_dim"], spec.get("kv_dtype") == _TL_FP8)
        return schedule.config_space(spec.get("head_dim", 128), spec.get("page_size", 16))

    @classmethod
    def tunable_kernel(cls, spec: dict):
        return paged_decode_warps_kernel if cls._splits_keys_over_warps(spec) else paged_decode_split_kernel

    @classmethod
    def tunable_pass_configs(cls, spec: dict) -> dict | None:
        # the warp-split kernel places its own block barriers (one per tile)
        return OWN_BARRIERS if cls._splits_keys_over_warps(spec) else None

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
                 kv_dtype: torch.dtype | None = None, use_alibi: bool = False, window_left: int = -1,
                 logits_soft_cap: float = 0.0, scale: float | None = None, kv_layout: str = "HND",
                 num_q_tokens: int = 1, config: dict | None = None):
        check_int("num_heads", num_heads, lo=1)
        check_int("num_kv_heads", num_kv_heads, lo=1)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads: expected a multiple of num_kv_heads={num_kv_heads}, got {num_heads}")
        check_int("head_dim", head_dim)
        check_choice("head_dim", head_dim, schedule.HEAD_DIMS)
        check_int("page_size", page_size, lo=1, hi=256, power_of_two=True)
        tl_dtype = dtype_name(dtype, DTYPES)
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        if kv_dtype not in (dtype, FP8):
            raise TypeError(f"kv_dtype: expected None, {dtype} (= dtype) or {FP8}, got {kv_dtype!r}")
        check_bool("use_alibi", use_alibi)
        check_int("window_left", window_left, lo=-1)
        logits_soft_cap = check_float("logits_soft_cap", logits_soft_cap, lo=0.0)
        scale = check_scale(scale, head_dim)
        check_choice("kv_layout", kv_layout, KV_LAYOUTS)
        check_int("num_q_tokens", num_q_tokens, lo=1, hi=schedule.MAX_Q_TOKENS)
        if config is not None and not isinstance(config, dict):
            raise TypeError(f"config: expected a dict or None, got {type(config).__name__}")
        self.num_heads, self.num_kv_heads, self.head_dim, self.page_size = num_heads, num_kv_heads, head_dim, page_size
        self.dtype, self.kv_dtype, self.use_alibi, self.kv_layout = dtype, kv_dtype, use_alibi, kv_layout
        self.window_left, self.logits_soft_cap, self.scale, self.num_q_tokens = (window_left, logits_soft_cap,
                                                                                 scale, num_q_tokens)
        self.spec = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                     "page_size": page_size, "dtype": tl_dtype, "kv_dtype": _TL_FP8 if kv_dtype == FP8 else tl_dtype,
                     "use_alibi": use_alibi, "window_left": window_left, "logits_soft_cap": logits_soft_cap,
                     "scale": scale, "kv_layout": kv_layout, "num_q_tokens": num_q_tokens}
        self.config = resolve_config(self.op_name, self.spec, config, self.default_config(self.spec))
        cfg = self.config
        if self._splits_keys_over_warps(self.spec):  # 16 or 32 keys a warp
            check_choice("config['block_N']", cfg["block_N"], (64, 128))
            check_choice("config['num_stages']", cfg["num_stages"], schedule.WARP_STAGES)
            fits = schedule.warp_smem_bytes(cfg["block_N"], cfg["num_stages"], head_dim,
                                            kv_dtype == FP8) <= schedule.SMEM_LIMIT
        else:
            check_choice("config['block_N']", cfg["block_N"], (32, 64, 128))  # >= 8 columns per warp
            check_choice("config['num_stages']", cfg["num_stages"], schedule.pipeline_stages(page_size))
            rows = schedule.head_pack(num_heads, num_kv_heads, num_q_tokens) * num_q_tokens
            fits = schedule.smem_fits(rows, cfg["block_N"], cfg["num_stages"], head_dim, kv_dtype == FP8)
        if not fits:
            raise ValueError(f"config: block_N={cfg['block_N']} x num_stages={cfg['num_stages']} K/V tiles of "
                             f"head_dim {head_dim} exceed shared memory")
        check_int("config['min_blocks']", cfg["min_blocks"], lo=1, hi=schedule.MAX_CTAS_PER_SM)
        check_int("config['ctas_per_sm']", cfg["ctas_per_sm"], lo=1)
        check_int("config['min_split_tiles']", cfg["min_split_tiles"], lo=1)
        split = (self.tunable_kernel(self.spec)(**self.spec, **cfg), self.tunable_pass_configs(self.spec))
        combine = paged_decode_combine_kernel(num_heads, head_dim, tl_dtype, num_q_tokens, cfg["block_N"], window_left)
        self.split_kernel, self.combine_kernel = compile_kernels(split, combine)
        self._plan_key = (tuple(sorted(self.spec.items())), cfg["block_N"])

    def _kv_shape(self, num_pages: int | None) -> list:
        hkv, ps, d = self.num_kv_heads, self.page_size, self.head_dim
        return [num_pages, hkv, ps, d] if self.kv_layout == "HND" else [num_pages, ps, hkv, d]

    # ------------------------------------------------------------------ plan
    def plan(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, validate: bool = True) -> DecodePlan:
        """The per-batch work. ``validate=True`` checks the values (seq_lens in [num_q_tokens, max_pages *
        page_size], the needed block_tables entries >= 0; ``run`` then checks them against the cache's
        page count) in ONE host synchronization and sizes the splits for the longest sequence;
        ``validate=False`` makes no host sync and sizes them for the table's capacity. Lengths may grow
        between runs of one plan (graph replay) up to the table's capacity: the last split then takes the
        rest (correct, slower)."""
        check_bool("validate", validate)
        bt, lens = _int32("block_tables", block_tables), _int32("seq_lens", seq_lens)
        check_tensor("block_tables", bt, torch.int32, [None, None])
        batch, max_pages = bt.shape
        check_tensor("seq_lens", lens, torch.int32, [batch], bt.device)
        if batch < 1 or max_pages < 1:
            raise ValueError(f"block_tables: expected at least one sequence and one page, got shape {list(bt.shape)}")
        ps, nq = self.page_size, self.num_q_tokens
        capacity = max_pages * ps
        if capacity >= 1 << 31:
            raise ValueError(f"block_tables: expected max_pages * page_size < 2**31, got {capacity}")
        max_len, max_page_id = capacity, None
        if validate:
            lens64 = lens.long()
            used = torch.arange(max_pages, device=bt.device)[None, :] < ((lens64 + ps - 1) // ps)[:, None]
            ids = bt.long()
            vals = torch.stack([(lens64 >= nq).all().long(), (lens64 <= capacity).all().long(),
                                (~used | (ids >= 0)).all().long(), lens64.max(),
                                torch.where(used, ids, -1).max()]).tolist()  # the one host sync
            if not vals[0]:
                raise ValueError(f"seq_lens: expected values >= num_q_tokens ({nq}): a sequence holds its new tokens")
            if not vals[1]:
                raise ValueError(f"seq_lens: expected values <= max_pages * page_size = {capacity} (block_tables "
                                 f"has {max_pages} columns)")
            if not vals[2]:
                raise ValueError("block_tables: expected page ids >= 0 for the pages a sequence uses")
            max_len, max_page_id = vals[3], vals[4]
        cfg = self.config
        pack = schedule.head_pack(self.num_heads, self.num_kv_heads, nq)
        tiles = schedule.kv_tiles_bound(max_len, cfg["block_N"], self.window_left, nq)
        tiles_per_split, num_splits = schedule.split_tiles(
            batch * (self.num_heads // pack), tiles, cfg["ctas_per_sm"] * sm_count(bt.device), cfg["min_split_tiles"])
        return DecodePlan(self._plan_key, bt, lens, tiles_per_split, num_splits, max_page_id, self.num_heads,
                          self.head_dim, nq)

    # ------------------------------------------------------------------ run
    def _scale(self, name, value, plan):
        if value is None:
            return plan.unit_scale
        if isinstance(value, torch.Tensor):
            check_tensor(name, value, torch.float32, None, plan.device)
            if value.numel() != 1:
                raise ValueError(f"{name}: expected a 1-element fp32 tensor, got shape {list(value.shape)}")
            return value.reshape(1)
        value = check_float(name, value, positive=True)
        return torch.full((1,), value, dtype=torch.float32, device=plan.device)  # a fill kernel: capturable

    def check_inputs(self, q, k_cache, v_cache, plan, alibi_slopes=None, out=None) -> None:
        """Types, shapes and devices against the op and the plan (no host synchronization)."""
        if not isinstance(plan, DecodePlan):
            raise TypeError(f"plan: expected a DecodePlan (from op.plan), got {type(plan).__name__}")
        if plan.key != self._plan_key:
            raise ValueError("plan: made by an op of another specialization or config; use this op's plan()")
        check_tensor("q", q, self.dtype, [plan.batch * self.num_q_tokens, self.num_heads, self.head_dim],
                     plan.device)
        check_tensor("k_cache", k_cache, self.kv_dtype, self._kv_shape(None), plan.device)
        check_tensor("v_cache", v_cache, self.kv_dtype, list(k_cache.shape), plan.device)
        if plan.max_page_id is not None and plan.max_page_id >= k_cache.shape[0]:
            raise ValueError(f"k_cache: the plan's block_tables use page {plan.max_page_id}, the cache holds "
                             f"{k_cache.shape[0]} pages")
        if self.use_alibi:
            if alibi_slopes is None:
                raise ValueError("alibi_slopes: expected a [num_heads] fp32 tensor (use_alibi=True), got None")
            check_tensor("alibi_slopes", alibi_slopes, torch.float32, [self.num_heads], plan.device)
        elif alibi_slopes is not None:
            raise ValueError("alibi_slopes: given but the op was built with use_alibi=False")
        if out is not None:
            check_tensor("out", out, self.dtype, list(q.shape), plan.device)

    def tune_args(self, q, k_cache, v_cache, block_tables, seq_lens, alibi_slopes=None):
        plan = self.plan(block_tables, seq_lens)
        return self._split_args(q, k_cache, v_cache, plan, alibi_slopes, None, None, torch.empty_like(q), plan.lse)

    def _split_args(self, q, k_cache, v_cache, plan, alibi_slopes, k_scale, v_scale, out, lse):
        return (q, k_cache, v_cache, plan.block_tables, plan.seq_lens,
                plan.no_alibi if alibi_slopes is None else alibi_slopes,
                self._scale("k_scale", k_scale, plan), self._scale("v_scale", v_scale, plan), plan.sched,
                out, lse, plan.o_part, plan.lse_part)

    def run(self, q, k_cache, v_cache, plan: DecodePlan, alibi_slopes=None, k_scale=None, v_scale=None,
            out=None, return_lse: bool = False):
        """One decode step over ``plan``'s batch: out, or (out, lse) with ``return_lse``."""
        check_bool("return_lse", return_lse)
        self.check_inputs(q, k_cache, v_cache, plan, alibi_slopes, out)
        if out is None:
            out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else plan.lse
        args = self._split_args(q, k_cache, v_cache, plan, alibi_slopes, k_scale, v_scale, out, lse)
        with torch.cuda.device(q.device):
            self.split_kernel(*args)
            if plan.num_splits > 1:
                self.combine_kernel(plan.seq_lens, plan.sched, plan.o_part, plan.lse_part, out, lse)
        return (out, lse) if return_lse else out

    def __call__(self, q, k_cache, v_cache, block_tables, seq_lens, alibi_slopes=None, k_scale=None, v_scale=None,
                 out=None, return_lse: bool = False, validate: bool = True):
        """``plan`` then ``run`` (validate=False: no host sync, capturable, splits sized by the table)."""
        return self.run(q, k_cache, v_cache, self.plan(block_tables, seq_lens, validate), alibi_slopes, k_scale,
                        v_scale, out, return_lse)
