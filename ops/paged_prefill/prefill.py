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
zeroed in shared memory (P is 0 there, but the slots may hold NaN). Design and numbers:
docs/design/paged_prefill.md.
"""

import warnings

import torch

from ..common.protocol import Op
from ..common.runtime import compile_kernel, resolve_config, sm_count
from ..common.validate import (check_bool, check_choice, check_int, check_scale, check_tensor, dtype_name,
                               renamed)
from ..common.validate import check_values as check_all
from .kernels import paged_prefill_kernel, paged_prefill_schedule_kernel
from .tiling import HEAD_DIMS, WS_BLOCK_M, config_space, default_config, tile_tokens

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KV_LAYOUTS = ("HND", "NHD")
# Deprecated constructor keywords (old name -> new name), accepted with a FutureWarning for one release.
_RENAMED = {"head_size": "head_dim", "block_size": "page_size"}


def _as_int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)


class PagedAttentionPrefillTileLang(Op):
    """Causal paged attention prefill: ``op(q, k_cache, v_cache, block_tables, seq_lens, cum_seq_lens_q,
    alibi_slopes=None, out=None, validate=True) -> out``; semantics in ``golden.paged_prefill``.

    Built for one specialization: ``num_heads`` query heads over ``num_kv_heads`` kv heads (a divisor),
    ``head_dim`` in {64, 128, 256}, ``page_size`` rows per cache page (a power of two up to 256),
    ``dtype`` fp16 / bf16 / fp32, ALiBi or not, softmax ``scale`` (default head_dim ** -0.5) and cache
    layout ``kv_layout``: "HND" [num_pages, num_kv_heads, page_size, head_dim] or "NHD"
    [num_pages, page_size, num_kv_heads, head_dim]. ``config`` overrides the kernel's tunables.

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
        return default_config(spec["head_dim"], spec["dtype"], spec["page_size"])

    @classmethod
    def config_space(cls, spec: dict) -> list[dict]:
        return config_space(spec.get("head_dim", 128), spec.get("dtype", "bfloat16"), spec.get("page_size", 16))

    @classmethod
    def tunable_kernel(cls, spec: dict):
        return paged_prefill_kernel

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int | None = None, page_size: int | None = None,
                 dtype: torch.dtype | None = None, use_alibi: bool = False, scale: float | None = None,
                 kv_layout: str = "HND", config: dict | None = None, **deprecated):
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
        if config is not None and not isinstance(config, dict):
            raise TypeError(f"config: expected a dict or None, got {type(config).__name__}")
        self.num_heads, self.num_kv_heads, self.head_dim, self.page_size = num_heads, num_kv_heads, head_dim, page_size
        self.dtype, self.use_alibi, self.kv_layout, self.scale = dtype, use_alibi, kv_layout, scale
        self.spec = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                     "page_size": page_size, "dtype": tl_dtype, "use_alibi": use_alibi, "kv_layout": kv_layout,
                     "scale": scale, "num_ctas": sm_count()}
        self.config = resolve_config(self.op_name, self.spec, config, self.default_config(self.spec))
        self._no_alibi = {}
        # Fast math: exp2 and the final division as single approximate instructions (well inside
        # the error of the bf16/fp16 probabilities fed to the second product).
        self.kernel = compile_kernel(paged_prefill_kernel(**self.spec, **self.config),
                                     pass_configs={"tl.enable_fast_math": True})
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

    def check_inputs(self, q, k_cache, v_cache, block_tables, seq_lens, cum_seq_lens_q,
                     alibi_slopes=None, out=None) -> None:
        """Device, dtype, shape and contiguity of every tensor (no host synchronization)."""
        check_tensor("q", q, self.dtype, [None, self.num_heads, self.head_dim])
        dev = q.device
        check_tensor("k_cache", k_cache, self.dtype, self._kv_shape(None), dev)
        check_tensor("v_cache", v_cache, self.dtype, list(k_cache.shape), dev)
        check_tensor("block_tables", block_tables, (torch.int32, torch.int64), [None, None], dev)
        num_seqs = block_tables.shape[0]
        check_tensor("seq_lens", seq_lens, (torch.int32, torch.int64), [num_seqs], dev)
        check_tensor("cum_seq_lens_q", cum_seq_lens_q, (torch.int32, torch.int64), [num_seqs + 1], dev)
        if self.use_alibi:
            if alibi_slopes is None:
                raise ValueError("alibi_slopes: expected a [num_heads] fp32 tensor (use_alibi=True), got None")
            check_tensor("alibi_slopes", alibi_slopes, torch.float32, [self.num_heads], dev)
        elif alibi_slopes is not None:
            raise ValueError("alibi_slopes: given but the op was built with use_alibi=False")
        if out is not None:
            check_tensor("out", out, self.dtype, list(q.shape), dev)

    def check_values(self, q, k_cache, block_tables, seq_lens, cum_seq_lens_q) -> None:
        """Value checks on the device, then one host synchronization for all of them."""
        cum, lens = cum_seq_lens_q.long(), seq_lens.long()
        q_lens = cum[1:] - cum[:-1]
        needed = (lens + self.page_size - 1) // self.page_size
        cols = torch.arange(block_tables.shape[1], device=q.device)
        used = cols[None, :] < needed[:, None]
        ids = block_tables.long()
        bad_ids = used & ((ids < 0) | (ids >= k_cache.shape[0]))
        check_all([
            ("cum_seq_lens_q: expected to start at 0", cum[0] == 0),
            ("cum_seq_lens_q: expected non-decreasing values", q_lens >= 0),
            (f"cum_seq_lens_q: expected to end at total_q_tokens={q.shape[0]}", cum[-1] == q.shape[0]),
            ("seq_lens: expected seq_lens[s] >= q_len of sequence s (history + new tokens)", lens >= q_lens),
            (f"block_tables: a sequence needs more blocks than its row holds ({block_tables.shape[1]})",
             needed <= block_tables.shape[1]),
            (f"block_tables: a needed block id is out of range [0, {k_cache.shape[0]})", ~bad_ids),
        ])

    # ------------------------------------------------------------------ launch
    def schedule(self, total_q: int, seq_lens: torch.Tensor, cum_seq_lens_q: torch.Tensor):
        """Query tiles -> (sequence or -1, first query row), longest KV first; on the device (int32
        inputs). The tile count is an upper bound: spare tiles come last, with sequence -1."""
        num_seqs, tokens = seq_lens.shape[0], self.tile_tokens
        num_tiles = (total_q + num_seqs * (tokens - 1)) // tokens
        tile_seq = torch.empty(num_tiles, dtype=torch.int32, device=seq_lens.device)
        tile_q0 = torch.empty_like(tile_seq)
        self.schedule_kernel(seq_lens, cum_seq_lens_q, tile_seq, tile_q0)
        return tile_seq, tile_q0

    def tune_args(self, q, k_cache, v_cache, block_tables, seq_lens, cum_seq_lens_q, alibi_slopes=None):
        seq_lens, cum = _as_int32(seq_lens), _as_int32(cum_seq_lens_q)
        tile_seq, tile_q0 = self.schedule(q.shape[0], seq_lens, cum)
        if alibi_slopes is None:  # the kernel ignores it then; a cached buffer keeps calls allocation-free
            alibi_slopes = self._no_alibi.get(q.device)
            if alibi_slopes is None:
                alibi_slopes = self._no_alibi[q.device] = torch.zeros(self.num_heads, device=q.device)
        return (q, k_cache, v_cache, _as_int32(block_tables), seq_lens, cum, alibi_slopes, tile_seq, tile_q0,
                torch.empty_like(q))

    def __call__(self, q, k_cache, v_cache, block_tables, seq_lens, cum_seq_lens_q, alibi_slopes=None,
                 out=None, validate: bool | None = None):
        """``validate``: True (default, unless the deprecated constructor keyword said otherwise) checks
        the values with one host synchronization; False skips that (CUDA-graph capturable)."""
        validate = self.validate if validate is None else validate
        check_bool("validate", validate)
        self.check_inputs(q, k_cache, v_cache, block_tables, seq_lens, cum_seq_lens_q, alibi_slopes, out)
        if validate:
            self.check_values(q, k_cache, block_tables, seq_lens, cum_seq_lens_q)
        if out is None:
            out = torch.empty_like(q)
        if q.shape[0] == 0:
            return out
        args = self.tune_args(q, k_cache, v_cache, block_tables, seq_lens, cum_seq_lens_q, alibi_slopes)
        with torch.cuda.device(q.device):
            self.kernel(*args[:-1], out)
        return out
