"""Paged attention prefill (`PagedAttentionPrefillTileLang`): causal FlashAttention over a paged KV cache,
for ragged batches whose sequences have a history in the cache, with GQA/MQA and optional ALiBi.

Each CTA owns one *query tile* (a few new tokens of one sequence, for the `pack` query heads of one kv
head, stacked into the rows of the tile) and streams that sequence's KV positions in tiles of `block_N`
through shared memory with an online softmax, so the KV cache is read once per (query tile, kv head) and
packing the heads of a GQA group divides the K/V traffic by `pack`. Both products run on the tensor cores
(fp32 inputs run as TF32).

A query tile must know its sequence: rather than a host-side loop (a sync), a small kernel builds the
schedule on the device from `cum_seq_lens_q` (tile -> sequence, first query token), longest KV first for
load balance over ragged batches. The attention kernel is one of two families (`tiling.warp_specialized`):
the warp-specialized persistent kernel (`kernels/ws.py`, fp16/bf16 with pages of >= 16 rows) or the
gather kernel (`kernels/gather.py`, fp32 and smaller pages). Pages past a sequence's last one repeat it
(the table entries there may be invalid); positions past the sequence end are masked, and their V rows
zeroed in shared memory (P is 0 there, but the slots may hold NaN). Options: a sliding window (KV tiles left of
a query tile's window are never read), a logits soft-cap and the log-sum-exp of each row. As FlashInfer's
wrappers, ``plan`` does a batch's work once (the schedule, the value checks) and ``run`` launches one layer
with no host synchronization. Design and numbers: docs/design/paged_prefill.md.
"""

import warnings
from dataclasses import dataclass

import torch

from ..common.protocol import Op
from ..common.runtime import compile_kernel, resolve_config, sm_count
from ..common.validate import (check_bool, check_choice, check_float, check_int, check_scale, check_tensor,
                               dtype_name, renamed)
from ..common.validate import check_values as check_all
from .kernels import paged_prefill_kernel, paged_prefill_schedule_kernel
from .tiling import HEAD_DIMS, WS_BLOCK_M, WS_PAGES_FROM, config_space, default_config, tile_tokens, warp_specialized

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8 = torch.float8_e4m3fn  # the 8-bit cache dtype (with 16-bit q)
_TL_FP8 = "float8_e4m3fn"
KV_LAYOUTS = ("HND", "NHD")
# Deprecated constructor keywords (old name -> new name), accepted with a FutureWarning for one release.
_RENAMED = {"head_size": "head_dim", "block_size": "page_size"}


def _as_int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def _check_rows(name: str, t: torch.Tensor) -> None:
    """q / out may be views (q sliced from a fused QKV projection): any token and head strides, with a
    contiguous last dimension and 16-byte aligned rows (the kernels copy Q / O rows by TMA)."""
    align = 16 // t.element_size()
    if t.stride(2) != 1 or t.stride(0) % align or t.stride(1) % align or t.data_ptr() % 16:
        raise ValueError(f"{name}: expected a contiguous last dimension and strides and start aligned to 16 bytes, "
                         f"got strides {list(t.stride())} (start {t.data_ptr() % 16} bytes past alignment)")


@dataclass(frozen=True)
class PrefillPlan:
    """A batch's per-call work, done once by ``PagedAttentionPrefillTileLang.plan`` and reused by ``run``
    for every layer: the index tensors in int32, the device schedule of query tiles and the sizes the plan
    was made for (``run`` checks its tensors against them)."""
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cum_seq_lens_q: torch.Tensor
    tile_seq: torch.Tensor
    tile_q0: torch.Tensor
    total_q: int
    num_pages: int | None  # the cache size the block ids were checked against (None: not checked)
    tile_tokens: int  # the query tile of the op that made it


class PagedAttentionPrefillTileLang(Op):
    """Causal paged attention prefill: ``op(q, k_cache, v_cache, block_tables, seq_lens, cum_seq_lens_q,
    alibi_slopes=None, out=None, validate=True, return_lse=False) -> out`` (or ``(out, lse)``), the same as
    ``op.run(q, k_cache, v_cache, op.plan(block_tables, seq_lens, cum_seq_lens_q), ...)``; semantics in
    ``golden.paged_prefill``.

    Built for one specialization: ``num_heads`` query heads over ``num_kv_heads`` kv heads (a divisor),
    ``head_dim`` in {64, 128, 256}, ``page_size`` rows per cache page (a power of two up to 256),
    ``dtype`` fp16 / bf16 / fp32, ALiBi or not, softmax ``scale`` (default head_dim ** -0.5) and cache
    layout ``kv_layout``: "HND" [num_pages, num_kv_heads, page_size, head_dim] or "NHD"
    [num_pages, page_size, num_kv_heads, head_dim], a sliding window ``window_left`` (-1: none; a query at
    KV position p attends keys p - window_left .. p), a logits soft-cap ``logits_soft_cap`` (0: none) and
    the cache dtype ``kv_dtype`` (None: ``dtype``; or torch.float8_e4m3fn with fp16/bf16 q, whose real
    values are stored x the call's ``k_scale`` / ``v_scale``: python floats or 1-element fp32 tensors on
    q's device, default 1; the kernel's products keep every bit of q, K and V). ``fp8_compute=True`` (an FP8 cache,
    pages of >= 16 rows) runs both products on FP8 tensor cores instead, as FlashAttention-3's FP8 mode (vLLM's
    FP8 attention): q rounded to e4m3 (per row, under a power-of-two scale) and the softmax's P to e4m3; faster,
    at e4m3's 4 significant bits for q and P.
    ``config`` overrides the kernel's tunables. ``return_lse=True`` also returns the log-sum-exp of each
    (token, head)'s final scores, [total_q, num_heads] fp32, natural log (the kernel always writes it).

    fp16/bf16 run on the tensor cores with fp32 accumulation; fp32 inputs run as TF32 products
    (10-bit mantissa operands, fp32 accumulation and softmax).

    The call's ``validate=True`` (default) checks the values of ``cum_seq_lens_q``, ``seq_lens`` and the
    needed ``block_tables`` entries: a few small device reductions and ONE host synchronization per call.
    ``validate=False`` skips them (shapes, dtypes and devices are still checked): the call then makes no
    host synchronization and can be captured in a CUDA graph, and the caller guarantees the values are
    valid (invalid values give undefined results; TileLang's bounds guards still keep every access inside
    the tensors).

    Deprecated, for one release (FutureWarning): the constructor keywords ``head_size`` (now ``head_dim``),
    ``block_size`` (now ``page_size``) and ``validate`` (now a call keyword; the constructor's value
    becomes the call's default).
    """

    op_name = "paged_prefill"
    # The demo's and the bench's specializations (scripts/workloads/paged_prefill.py).
    warm_specs = tuple(dict(num_heads=32, num_kv_heads=8, head_dim=128, page_size=page_size, dtype=torch.bfloat16)
                       for page_size in (16, 64))

    @classmethod
    def default_config(cls, spec: dict) -> dict:
        return default_config(spec["head_dim"], spec["dtype"], spec["page_size"], 8 if "kv_dtype" in spec else 16,
                              spec.get("fp8_compute", False))

    @classmethod
    def config_space(cls, spec: dict) -> list[dict]:
        return config_space(spec.get("head_dim", 128), spec.get("dtype", "bfloat16"), spec.get("page_size", 16),
                            8 if "kv_dtype" in spec else 16, spec.get("fp8_compute", False))

    @classmethod
    def tunable_kernel(cls, spec: dict):
        return paged_prefill_kernel

    @classmethod
    def tunable_pass_configs(cls, spec: dict) -> dict:
        # Fast math: exp2 and the final division as single approximate instructions (well inside
        # the error of the bf16/fp16 probabilities fed to the second product).
        pass_configs = {"tl.enable_fast_math": True}
        if warp_specialized(spec["dtype"], spec["page_size"]):
            # TileLang's buffer-init check flags `acc_p`, which a KV step's P @ V reads and the previous
            # step writes (a loop-carried value): step 0 issues no P @ V and the last one runs only after a
            # step, so no path reads it unwritten. The check's only finding there; it is off for this kernel.
            pass_configs["tl.disable_buffer_init_check"] = True
            if "kv_dtype" in spec:
                # Its converter warps' loops read the 8-bit V ring and write the widened one: TileLang cannot
                # tell the two apart in the merged shared memory and puts a warp barrier before every 16-byte
                # store (the conversion then fell behind the consumers). Every cross-warp hand-off of this kernel
                # is an mbarrier or an explicit named barrier, so its inferred barriers are all off.
                pass_configs["tl.disable_thread_storage_sync"] = True
        return pass_configs

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int | None = None, page_size: int | None = None,
                 dtype: torch.dtype | None = None, use_alibi: bool = False, scale: float | None = None,
                 kv_layout: str = "HND", window_left: int = -1, logits_soft_cap: float = 0.0,
                 kv_dtype: torch.dtype | None = None, fp8_compute: bool = False, config: dict | None = None,
                 **deprecated):
        where = type(self).__name__
        self.validate = True  # the call's default
        if "validate" in deprecated:
            self.validate = deprecated.pop("validate")
            warnings.warn(f"{where}: the constructor's 'validate' is deprecated, pass validate= to the call",
                          FutureWarning, stacklevel=2)
            check_bool("validate", self.validate)
        named = {k: v for k, v in (("head_dim", head_dim), ("page_size", page_size)) if v is not None}
        args = renamed({**deprecated, **named}, _RENAMED, where)
        unknown = sorted(set(args) - {"head_dim", "page_size"})
        if unknown:
            raise TypeError(f"{where}: unexpected keyword argument {unknown[0]!r}")
        missing = [k for k in ("head_dim", "page_size") if k not in args] + (["dtype"] if dtype is None else [])
        if missing:
            raise TypeError(f"{where}: missing required argument(s) {missing}")
        head_dim, page_size = args["head_dim"], args["page_size"]

        check_int("num_heads", num_heads, lo=1)
        check_int("num_kv_heads", num_kv_heads, lo=1)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads: expected a multiple of num_kv_heads={num_kv_heads}, got {num_heads}")
        check_int("head_dim", head_dim)
        check_choice("head_dim", head_dim, HEAD_DIMS)
        check_int("page_size", page_size, lo=1, hi=256, power_of_two=True)
        tl_dtype = dtype_name(dtype, DTYPES)
        check_bool("use_alibi", use_alibi)
        check_choice("kv_layout", kv_layout, KV_LAYOUTS)
        scale = check_scale(scale, head_dim)  # > 0: the softmax takes its running max on unscaled scores
        check_int("window_left", window_left, lo=-1)
        logits_soft_cap = check_float("logits_soft_cap", logits_soft_cap, lo=0.0)
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        if kv_dtype != dtype and (kv_dtype != FP8 or dtype == torch.float32):
            raise TypeError(f"kv_dtype: expected None, dtype ({dtype}) or {FP8} with a 16-bit dtype, got {kv_dtype}")
        check_bool("fp8_compute", fp8_compute)
        if fp8_compute and (kv_dtype != FP8 or not warp_specialized(tl_dtype, page_size)):
            raise ValueError(f"fp8_compute: expected False unless kv_dtype={FP8} and page_size >= {WS_PAGES_FROM}, "
                             f"got True with kv_dtype={kv_dtype}, page_size={page_size}")
        if config is not None and not isinstance(config, dict):
            raise TypeError(f"config: expected a dict or None, got {type(config).__name__}")
        self.num_heads, self.num_kv_heads, self.head_dim, self.page_size = num_heads, num_kv_heads, head_dim, page_size
        self.dtype, self.use_alibi, self.kv_layout, self.scale = dtype, use_alibi, kv_layout, scale
        self.window_left, self.logits_soft_cap, self.kv_dtype = window_left, logits_soft_cap, kv_dtype
        self.fp8_compute = fp8_compute
        self.spec = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                     "page_size": page_size, "dtype": tl_dtype, "use_alibi": use_alibi, "kv_layout": kv_layout,
                     "scale": scale, "num_ctas": sm_count()}
        # Options in the spec only when set: the specializations without them keep their tuned configs.
        if window_left >= 0:
            self.spec["window_left"] = window_left
        if logits_soft_cap > 0:
            self.spec["soft_cap"] = logits_soft_cap
        if kv_dtype == FP8:
            self.spec["kv_dtype"] = _TL_FP8
        if fp8_compute:
            self.spec["fp8_compute"] = True
        self.config = resolve_config(self.op_name, self.spec, config, self.default_config(self.spec))
        self._no_alibi, self._unit_scales = {}, {}
        self.kernel = compile_kernel(paged_prefill_kernel(**self.spec, **self.config),
                                     pass_configs=self.tunable_pass_configs(self.spec))
        # The persistent kernel's work counter and cluster mailboxes: zeros, one per grid cluster and more.
        self.sched_len = self.spec["num_ctas"] + 2 if warp_specialized(tl_dtype, page_size) else 0
        tile_m = self.config.get("block_M", WS_BLOCK_M)
        # A schedule tile is the query tiles of all CTAs of a cluster (they share its KV tiles).
        self.tile_tokens = tile_tokens(num_heads, num_kv_heads, tile_m) * self.config.get("cluster", 1)
        self.schedule_kernel = compile_kernel(paged_prefill_schedule_kernel(self.tile_tokens))

    @property
    def head_size(self) -> int:
        warnings.warn("PagedAttentionPrefillTileLang.head_size is deprecated, use head_dim", FutureWarning,
                      stacklevel=2)
        return self.head_dim

    @property
    def block_size(self) -> int:
        warnings.warn("PagedAttentionPrefillTileLang.block_size is deprecated, use page_size", FutureWarning,
                      stacklevel=2)
        return self.page_size

    # ------------------------------------------------------------------ checks
    def _kv_shape(self, num_pages: int | None) -> list:
        hkv, ps, d = self.num_kv_heads, self.page_size, self.head_dim
        return [num_pages, hkv, ps, d] if self.kv_layout == "HND" else [num_pages, ps, hkv, d]

    def _check_run_inputs(self, q, k_cache, v_cache, alibi_slopes, out) -> None:
        check_tensor("q", q, self.dtype, [None, self.num_heads, self.head_dim], contiguous=False)
        _check_rows("q", q)
        dev = q.device
        check_tensor("k_cache", k_cache, self.kv_dtype, self._kv_shape(None), dev)
        check_tensor("v_cache", v_cache, self.kv_dtype, list(k_cache.shape), dev)
        if self.use_alibi:
            if alibi_slopes is None:
                raise ValueError("alibi_slopes: expected a [num_heads] fp32 tensor (use_alibi=True), got None")
            check_tensor("alibi_slopes", alibi_slopes, torch.float32, [self.num_heads], dev)
        elif alibi_slopes is not None:
            raise ValueError("alibi_slopes: given but the op was built with use_alibi=False")
        if out is not None:
            check_tensor("out", out, self.dtype, list(q.shape), dev, contiguous=False)
            _check_rows("out", out)

    @staticmethod
    def _check_index_tensors(block_tables, seq_lens, cum_seq_lens_q, dev) -> None:
        check_tensor("block_tables", block_tables, (torch.int32, torch.int64), [None, None], dev)
        num_seqs = block_tables.shape[0]
        check_tensor("seq_lens", seq_lens, (torch.int32, torch.int64), [num_seqs], dev)
        check_tensor("cum_seq_lens_q", cum_seq_lens_q, (torch.int32, torch.int64), [num_seqs + 1], dev)

    def check_inputs(self, q, k_cache, v_cache, block_tables, seq_lens, cum_seq_lens_q,
                     alibi_slopes=None, out=None) -> None:
        """Device, dtype, shape and contiguity of every tensor (no host synchronization)."""
        self._check_run_inputs(q, k_cache, v_cache, alibi_slopes, out)
        self._check_index_tensors(block_tables, seq_lens, cum_seq_lens_q, q.device)

    def check_values(self, q, k_cache, block_tables, seq_lens, cum_seq_lens_q) -> None:
        """Value checks on the device, then one host synchronization for all of them."""
        self._check_values(q.shape[0], k_cache.shape[0], block_tables, seq_lens, cum_seq_lens_q)

    def _check_values(self, total_q, num_pages, block_tables, seq_lens, cum_seq_lens_q) -> None:
        cum, lens = cum_seq_lens_q.long(), seq_lens.long()
        q_lens = cum[1:] - cum[:-1]
        needed = (lens + self.page_size - 1) // self.page_size
        checks = [
            ("cum_seq_lens_q: expected to start at 0", cum[0] == 0),
            ("cum_seq_lens_q: expected non-decreasing values", q_lens >= 0),
            (f"cum_seq_lens_q: expected to end at total_q_tokens={total_q}", cum[-1] == total_q),
            ("seq_lens: expected seq_lens[s] >= q_len of sequence s (history + new tokens)", lens >= q_lens),
            (f"block_tables: a sequence needs more blocks than its row holds ({block_tables.shape[1]})",
             needed <= block_tables.shape[1]),
        ]
        if num_pages is not None:
            cols = torch.arange(block_tables.shape[1], device=block_tables.device)
            used = cols[None, :] < needed[:, None]
            if self.window_left >= 0:  # pages before every query's window are never read (may be freed)
                first = (lens - q_lens - self.window_left).clamp(min=0) // self.page_size
                used &= cols[None, :] >= first[:, None]
            ids = block_tables.long()
            bad_ids = used & ((ids < 0) | (ids >= num_pages))
            checks.append((f"block_tables: a needed block id is out of range [0, {num_pages})", ~bad_ids))
        check_all(checks)

    # ------------------------------------------------------------------ plan / run
    def schedule(self, total_q: int, seq_lens: torch.Tensor, cum_seq_lens_q: torch.Tensor):
        """Query tiles -> (sequence or -1, first query row), longest KV first; on the device (int32
        inputs). The tile count is an upper bound: spare tiles come last, with sequence -1."""
        num_seqs, tokens = seq_lens.shape[0], self.tile_tokens
        num_tiles = (total_q + num_seqs * (tokens - 1)) // tokens if total_q else 0
        tile_seq = torch.empty(num_tiles, dtype=torch.int32, device=seq_lens.device)
        tile_q0 = torch.empty_like(tile_seq)
        if num_tiles:
            self.schedule_kernel(seq_lens, cum_seq_lens_q, tile_seq, tile_q0)
        return tile_seq, tile_q0

    def plan(self, block_tables, seq_lens, cum_seq_lens_q, validate: bool = True, total_q: int | None = None,
             num_pages: int | None = None) -> PrefillPlan:
        """A batch's work done once for all layers (``run``): index tensors to int32 (a no-op for int32),
        the device tile schedule and, with ``validate``, the value checks (block ids against ``num_pages``
        when given). One host synchronization: the checks', or reading ``total_q`` (the new tokens,
        cum_seq_lens_q[-1]) when not given; none with ``validate=False`` and ``total_q`` given."""
        check_bool("validate", validate)
        self._check_index_tensors(block_tables, seq_lens, cum_seq_lens_q, block_tables.device)
        if num_pages is not None:
            check_int("num_pages", num_pages, lo=1)
        if total_q is None:
            total_q = int(cum_seq_lens_q[-1])
            if total_q < 0:
                raise ValueError(f"cum_seq_lens_q: expected a non-negative last value, got {total_q}")
        check_int("total_q", total_q, lo=0)
        if validate:
            self._check_values(total_q, num_pages, block_tables, seq_lens, cum_seq_lens_q)
        seq_lens, cum = _as_int32(seq_lens), _as_int32(cum_seq_lens_q)
        tile_seq, tile_q0 = self.schedule(total_q, seq_lens, cum)
        return PrefillPlan(_as_int32(block_tables), seq_lens, cum, tile_seq, tile_q0, total_q, num_pages,
                           self.tile_tokens)

    def _check_plan(self, plan, q, k_cache) -> None:
        if not isinstance(plan, PrefillPlan):
            raise TypeError(f"plan: expected a PrefillPlan (from op.plan), got {type(plan).__name__}")
        if plan.tile_tokens != self.tile_tokens:
            raise ValueError(f"plan: made by an op with {plan.tile_tokens}-token query tiles, this op has "
                             f"{self.tile_tokens}")
        if q.shape[0] != plan.total_q:
            raise ValueError(f"q: expected {plan.total_q} tokens (the plan's batch), got {q.shape[0]}")
        if plan.num_pages is not None and k_cache.shape[0] != plan.num_pages:
            raise ValueError(f"k_cache: expected {plan.num_pages} pages (the plan's block ids were checked "
                             f"against them), got {k_cache.shape[0]}")
        if plan.block_tables.device != q.device:
            raise ValueError(f"plan: made on {plan.block_tables.device}, q is on {q.device}")

    def _no_alibi_buffer(self, device):
        # The kernel ignores the slopes then; a cached buffer keeps calls allocation-free.
        slopes = self._no_alibi.get(device)
        if slopes is None:
            slopes = self._no_alibi[device] = torch.zeros(self.num_heads, device=device)
        return slopes

    def _kv_scales(self, k_scale, v_scale, device) -> torch.Tensor:
        """The [k_scale, v_scale] fp32 device tensor of the kernel, with no host synchronization (a
        16-bit cache takes none: a cached [1, 1])."""
        if self.kv_dtype != FP8:
            for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
                if value is not None:
                    raise ValueError(f"{name}: only for an FP8 cache (kv_dtype={FP8}), got {value!r} with kv_dtype="
                                     f"{self.kv_dtype}")
            scales = self._unit_scales.get(device)
            if scales is None:
                scales = self._unit_scales[device] = torch.ones(2, device=device)
            return scales
        scales = torch.empty(2, dtype=torch.float32, device=device)
        for i, (name, value) in enumerate((("k_scale", k_scale), ("v_scale", v_scale))):
            if isinstance(value, torch.Tensor):
                check_tensor(name, value, torch.float32, None, device)
                if value.numel() != 1:
                    raise ValueError(f"{name}: expected 1 element, got shape {list(value.shape)}")
                scales[i].copy_(value.reshape(()))
            else:
                scales[i].fill_(1.0 if value is None else check_float(name, value, positive=True))
        return scales

    def _kernel_args(self, q, k_cache, v_cache, plan, alibi_slopes, kv_scales, out, lse) -> tuple:
        if alibi_slopes is None:
            alibi_slopes = self._no_alibi_buffer(q.device)
        args = (q, k_cache, v_cache, plan.block_tables, plan.seq_lens, plan.cum_seq_lens_q, alibi_slopes,
                kv_scales, plan.tile_seq, plan.tile_q0, out, lse)
        if self.sched_len:  # fresh zeros per launch: runs on concurrent streams never share a counter
            args += (torch.zeros(self.sched_len, dtype=torch.int32, device=q.device),)
        return args

    def tune_args(self, q, k_cache, v_cache, block_tables, seq_lens, cum_seq_lens_q, alibi_slopes=None):
        plan = self.plan(block_tables, seq_lens, cum_seq_lens_q, validate=False, total_q=q.shape[0])
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        scales = self._kv_scales(None, None, q.device)  # (the kernel leaves its counter zeroed: reusable)
        return self._kernel_args(q, k_cache, v_cache, plan, alibi_slopes, scales, torch.empty_like(q), lse)

    def run(self, q, k_cache, v_cache, plan: PrefillPlan, alibi_slopes=None, k_scale=None, v_scale=None,
            out=None, return_lse: bool = False):
        """One layer of the planned batch: no host synchronization (CUDA-graph capturable). Checks
        dtypes, shapes and devices, and that ``plan`` was made for this batch and op (ValueError)."""
        check_bool("return_lse", return_lse)
        self._check_run_inputs(q, k_cache, v_cache, alibi_slopes, out)
        self._check_plan(plan, q, k_cache)
        scales = self._kv_scales(k_scale, v_scale, q.device)
        if out is None:
            out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        if q.shape[0]:
            with torch.cuda.device(q.device):
                self.kernel(*self._kernel_args(q, k_cache, v_cache, plan, alibi_slopes, scales, out, lse))
        return (out, lse) if return_lse else out

    def __call__(self, q, k_cache, v_cache, block_tables, seq_lens, cum_seq_lens_q, alibi_slopes=None,
                 out=None, validate: bool | None = None, return_lse: bool = False, k_scale=None, v_scale=None):
        """``plan`` + ``run`` in one call. ``validate``: True (default, unless the deprecated constructor
        keyword said otherwise) checks the values with one host synchronization; False skips that
        (CUDA-graph capturable)."""
        validate = self.validate if validate is None else validate
        check_bool("validate", validate)
        self.check_inputs(q, k_cache, v_cache, block_tables, seq_lens, cum_seq_lens_q, alibi_slopes, out)
        plan = self.plan(block_tables, seq_lens, cum_seq_lens_q, validate, total_q=q.shape[0],
                         num_pages=k_cache.shape[0])
        return self.run(q, k_cache, v_cache, plan, alibi_slopes, k_scale, v_scale, out, return_lse)
