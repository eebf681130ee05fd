"""PagedAttentionPrefillTileLang: golden vs a float64 per-token loop, validation, compile-only builds
(CPU), and compiled vs golden on the GPU."""

import copy
import math
import random

import pytest
import torch

from golden.paged_prefill import paged_attention_prefill
import ops.paged_prefill.prefill as prefill_module
from ops.common.hw import TL_DTYPES
from ops.common.protocol import op_class
from ops.common.runtime import compile_kernels
from ops.paged_prefill import PagedAttentionPrefillTileLang
from ops.paged_prefill import paged_attention_prefill as paged_attention_prefill_op
from ops.paged_prefill.custom_ops import _spec as custom_op_spec
from ops.paged_prefill.kernels import paged_prefill_kernel
from ops.paged_prefill.kernels.tile_plan import PAIR_BYTES, ROW_BYTES, transpose_block
from ops.paged_prefill.prefill import PrefillPlan
from ops.paged_prefill.tiling import warp_specialized


# ----------------------------------------------------------------------------- inputs
def paged_cache(seq_lens, num_kv_heads, head_dim, page_size, kv_dtype, kv_layout="HND", spare_pages=3,
                table_dtype=torch.int32, poison=True, generator=None):
    """(k_cache, v_cache, block_tables): each sequence's positions on shuffled pages of a cache stored in
    ``kv_dtype``, its table [num_seqs, most pages + 2]. With ``poison``, slots past each sequence's end and the spare
    pages hold NaN and table entries past the needed pages hold -1, so any read of them shows up in the output."""
    needed = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(needed) + spare_pages
    perm = torch.randperm(num_pages, generator=generator).tolist()
    tables = torch.full((len(seq_lens), max(needed + [1]) + 2), -1, dtype=table_dtype)
    shape = ((num_pages, num_kv_heads, page_size, head_dim) if kv_layout == "HND"
             else (num_pages, page_size, num_kv_heads, head_dim))
    caches = [torch.full(shape, float("nan")) if poison else torch.randn(shape, generator=generator)
              for _ in range(2)]
    nxt = 0
    for s, (n, nb) in enumerate(zip(seq_lens, needed)):
        for j in range(nb):
            page = perm[nxt]
            nxt += 1
            tables[s, j] = page
            valid = min(page_size, n - j * page_size)
            for cache in caches:
                rows = torch.randn(num_kv_heads, valid, head_dim, generator=generator)
                if kv_layout == "HND":
                    cache[page, :, :valid] = rows
                else:
                    cache[page, :valid] = rows.transpose(0, 1)
    return caches[0].to(kv_dtype), caches[1].to(kv_dtype), tables


def make_batch(q_lens, histories, num_heads, num_kv_heads, head_dim, page_size, dtype, device="cpu",
               kv_layout="HND", use_alibi=False, spare_blocks=3, table_dtype=torch.int32, poison=True,
               kv_dtype=None):
    """Random ragged batch over a shuffled paged cache (``paged_cache``; stored in ``kv_dtype``, default q's
    dtype)."""
    seq_lens = [q + h for q, h in zip(q_lens, histories)]
    k_cache, v_cache, tables = paged_cache(seq_lens, num_kv_heads, head_dim, page_size,
                                           dtype if kv_dtype is None else kv_dtype, kv_layout, spare_blocks,
                                           table_dtype, poison)
    cum = torch.tensor([0] + q_lens).cumsum(0)
    q = torch.randn(int(cum[-1]), num_heads, head_dim).to(dtype)
    alibi = torch.rand(num_heads) * 0.5 if use_alibi else None
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return dict(q=to(q), k_cache=to(k_cache), v_cache=to(v_cache), block_tables=to(tables),
                seq_lens=to(torch.tensor(seq_lens, dtype=torch.int64)), cum_seq_lens_q=to(cum),
                alibi_slopes=to(alibi))


def reference_float64(q, k_cache, v_cache, block_tables, seq_lens, cum_seq_lens_q, alibi_slopes=None,
                      scale=None, kv_layout="HND", window_left=-1, logits_soft_cap=0.0, k_scale=None,
                      v_scale=None):
    """The seed's algorithm, one query token and head at a time, in float64: max pass, sum pass,
    weighted-sum pass, each reading KV position t through the block table. Returns (out, lse)."""
    total_q, num_heads, head_dim = q.shape
    hkv_axis, slot_axis = (1, 2) if kv_layout == "HND" else (2, 1)
    page_size, num_kv_heads = k_cache.shape[slot_axis], k_cache.shape[hkv_axis]
    scale = head_dim ** -0.5 if scale is None else scale
    k_mult = 1.0 if k_scale is None else float(k_scale)
    v_mult = 1.0 if v_scale is None else float(v_scale)
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.zeros(q.shape[:2], dtype=torch.float64)
    cum = cum_seq_lens_q.tolist()

    def row(cache, s, t, kvh):
        blk = int(block_tables[s, t // page_size])
        off = t % page_size
        r = cache[blk, kvh, off] if kv_layout == "HND" else cache[blk, off, kvh]
        return r.double()

    for s in range(len(cum) - 1):
        q_len = cum[s + 1] - cum[s]
        history = int(seq_lens[s]) - q_len
        for i in range(q_len):
            limit = history + i
            first = 0 if window_left < 0 else max(0, limit - window_left)
            keys = range(first, limit + 1)
            for h in range(num_heads):
                kvh = h // (num_heads // num_kv_heads)
                qv = q[cum[s] + i, h].double()
                slope = 0.0 if alibi_slopes is None else float(alibi_slopes[h])

                def score(t):
                    x = scale * float(qv @ (row(k_cache, s, t, kvh) * k_mult))
                    if logits_soft_cap > 0:
                        x = logits_soft_cap * math.tanh(x / logits_soft_cap)
                    return x + slope * (t - limit)

                m = max(score(t) for t in keys)
                denom = sum(math.exp(score(t) - m) for t in keys)
                acc = sum(math.exp(score(t) - m) / denom * row(v_cache, s, t, kvh) * v_mult for t in keys)
                out[cum[s] + i, h] = acc
                lse[cum[s] + i, h] = m + math.log(denom)
    return out, lse


CPU_CASES = [
    # q_lens, histories, heads, kv heads, page_size, layout, alibi
    ([5, 0, 1, 7], [3, 4, 0, 9], 4, 2, 16, "HND", False),   # GQA, q_len 0 and 1, history 0
    ([3, 6], [10, 0], 4, 1, 1, "NHD", True),                 # MQA, page_size 1, ALiBi
    ([9, 2, 4], [0, 17, 5], 2, 2, 4, "HND", True),          # MHA, ALiBi
    ([4, 5], [33, 2], 6, 3, 16, "NHD", False),
]


@pytest.mark.parametrize("q_lens,histories,heads,kv_heads,page_size,layout,alibi", CPU_CASES)
def test_golden_matches_float64_loop(q_lens, histories, heads, kv_heads, page_size, layout, alibi):
    batch = make_batch(q_lens, histories, heads, kv_heads, 8, page_size, torch.float64, kv_layout=layout,
                       use_alibi=alibi, table_dtype=random.choice([torch.int32, torch.int64]))
    got, lse = paged_attention_prefill(**batch, scale=0.3, kv_layout=layout, return_lse=True)
    want, want_lse = reference_float64(**batch, scale=0.3, kv_layout=layout)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert torch.isfinite(got).all() and lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)
    assert paged_attention_prefill(**batch, scale=0.3, kv_layout=layout).equal(got)  # return_lse=False: out only


# Each option alone and combined with ALiBi and the others, both layouts: (window_left, soft cap,
# k_scale, v_scale, alibi, layout). The window sizes 0 (only t = p), shorter and longer than histories.
OPTION_CASES = [
    (0, 0.0, None, None, False, "HND"),
    (3, 0.0, None, None, True, "NHD"),
    (7, 0.0, None, None, False, "HND"),
    (-1, 2.5, None, None, False, "NHD"),
    (-1, 0.7, None, None, True, "HND"),
    (-1, 0.0, 0.37, 1.9, False, "HND"),
    (-1, 0.0, 2.0, 0.5, True, "NHD"),
    (5, 1.3, 0.6, 1.4, True, "HND"),
    (2, 3.0, None, 0.8, True, "NHD"),
    (40, 1.0, 1.5, None, False, "HND"),
]


@pytest.mark.parametrize("window_left,cap,k_scale,v_scale,alibi,layout", OPTION_CASES)
def test_golden_options_match_float64_loop(window_left, cap, k_scale, v_scale, alibi, layout):
    batch = make_batch([5, 0, 1, 9], [3, 4, 0, 12], 4, 2, 8, 4, torch.float64, kv_layout=layout, use_alibi=alibi)
    opts = dict(scale=0.4, kv_layout=layout, window_left=window_left, logits_soft_cap=cap)
    got, lse = paged_attention_prefill(**batch, **opts, k_scale=k_scale, v_scale=v_scale, return_lse=True)
    want, want_lse = reference_float64(**batch, **opts, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)
    # the scales also as 0-dim and 1-element fp32 tensors
    tensors = dict(k_scale=None if k_scale is None else torch.tensor(k_scale),
                   v_scale=None if v_scale is None else torch.tensor([v_scale]))
    torch.testing.assert_close(paged_attention_prefill(**batch, **opts, **tensors), got, rtol=1e-6, atol=1e-6)


def test_golden_window_hides_old_keys():
    """A window of w keeps exactly the last w + 1 keys: changing an older key leaves the output alone."""
    batch = make_batch([2], [10], 2, 1, 8, 4, torch.float64, poison=False)
    before = paged_attention_prefill(**batch, window_left=3)
    k_cache = batch["k_cache"].clone()
    first_block = int(batch["block_tables"][0, 0])
    k_cache[first_block] += 5.0  # positions 0..3: outside [p - 3, p] for p = 10, 11
    after = paged_attention_prefill(**{**batch, "k_cache": k_cache}, window_left=3)
    assert after.equal(before)
    assert not paged_attention_prefill(**{**batch, "k_cache": k_cache}).equal(paged_attention_prefill(**batch))


@pytest.mark.parametrize("layout,alibi,window_left,cap", [("HND", False, -1, 0.0), ("NHD", True, 6, 1.5)])
def test_golden_fp8_cache_dequantizes(layout, alibi, window_left, cap):
    """An FP8 (e4m3) cache with scales equals the float64 loop over the dequantized values, and the
    golden on a 16-bit cache holding the same values."""
    batch = make_batch([4, 3], [9, 0], 4, 2, 16, 8, torch.bfloat16, kv_layout=layout, use_alibi=alibi,
                       kv_dtype=torch.float8_e4m3fn)
    assert batch["k_cache"].dtype == torch.float8_e4m3fn
    opts = dict(kv_layout=layout, window_left=window_left, logits_soft_cap=cap, k_scale=0.45, v_scale=torch.tensor(1.7))
    out, lse = paged_attention_prefill(**batch, **opts, return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want, want_lse = reference_float64(**batch, **{**opts, "v_scale": 1.7})
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    # stored fp8 -> the same real values in bf16 (exact: e4m3 values fit in bf16) with the scales applied
    real = {**batch, "k_cache": batch["k_cache"].to(torch.bfloat16), "v_cache": batch["v_cache"].to(torch.bfloat16)}
    torch.testing.assert_close(paged_attention_prefill(**real, **opts), out, rtol=0, atol=0)


def test_golden_keeps_dtype():
    batch = make_batch([3, 2], [1, 4], 2, 1, 8, 4, torch.bfloat16)
    out = paged_attention_prefill(**batch)
    assert out.dtype == torch.bfloat16 and out.shape == batch["q"].shape
    ref, _ = reference_float64(**batch)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("kwargs,err,match", [
    (dict(num_heads=6, num_kv_heads=4), ValueError, "num_heads"),
    (dict(head_dim=96), ValueError, "head_dim"),
    (dict(page_size=24), ValueError, "page_size"),
    (dict(page_size=512), ValueError, "page_size"),
    (dict(page_size=0), ValueError, "page_size"),
    (dict(dtype=torch.int8), TypeError, "dtype"),
    (dict(kv_layout="HDN"), ValueError, "kv_layout"),
    (dict(num_kv_heads=0), ValueError, "num_kv_heads"),
    (dict(use_alibi=1), TypeError, "use_alibi"),
    (dict(scale=float("inf")), ValueError, "scale"),
    (dict(scale=-0.1), ValueError, "scale: expected a positive value"),
    (dict(window_left=-2), ValueError, "window_left"),
    (dict(window_left=2.0), TypeError, "window_left"),
    (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap=float("nan")), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap="30"), TypeError, "logits_soft_cap"),
    (dict(kv_dtype=torch.float16), TypeError, "kv_dtype"),
    (dict(kv_dtype=torch.float8_e5m2), TypeError, "kv_dtype"),
    (dict(dtype=torch.float32, kv_dtype=torch.float8_e4m3fn), TypeError, "kv_dtype"),
    (dict(fp8_compute=True), ValueError, "fp8_compute: expected False unless kv_dtype"),
    (dict(kv_dtype=torch.float8_e4m3fn, page_size=8, fp8_compute=True), ValueError, "fp8_compute.*page_size=8"),
    (dict(kv_dtype=torch.float8_e4m3fn, fp8_compute=1), TypeError, "fp8_compute"),
])
def test_constructor_rejects(kwargs, err, match):
    args = dict(num_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype=torch.bfloat16)
    with pytest.raises(err, match=match):
        PagedAttentionPrefillTileLang(**{**args, **kwargs})


# The op of the bf16 compile-only case; its kernel is built once (disk cache) for the checks below.
VALIDATION_SPEC = dict(num_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype=torch.bfloat16,
                       use_alibi=True, kv_layout="NHD")


@pytest.fixture(scope="module")
def op():
    return PagedAttentionPrefillTileLang(**VALIDATION_SPEC)


def _valid_batch():
    return make_batch([5, 3], [2, 20], 8, 2, 128, 16, torch.bfloat16, kv_layout="NHD", use_alibi=True,
                      poison=False)


def _bad(name, fn):
    def apply(batch):
        batch[name] = fn(batch[name])
        return batch
    return apply


@pytest.fixture
def cpu_tensors_ok(allow_cpu_tensors):
    """Lets the dtype/shape checks run on CPU tensors: only the CUDA-device error is waived."""
    allow_cpu_tensors(prefill_module)


@pytest.mark.compile
@pytest.mark.parametrize("mutate,err,match", [
    (_bad("q", lambda t: t.half()), TypeError, "q: expected dtype"),
    (_bad("q", lambda t: t[:, :4]), ValueError, "q: expected shape"),
    (_bad("q", lambda t: t[None]), ValueError, "q: expected shape"),
    (_bad("k_cache", lambda t: t.float()), TypeError, "k_cache: expected dtype"),
    (_bad("k_cache", lambda t: t.transpose(1, 2).contiguous()), ValueError, "k_cache: expected shape"),
    (_bad("k_cache", lambda t: t[:, :, :, :64]), ValueError, "k_cache: expected shape"),
    (_bad("v_cache", lambda t: t[:-1]), ValueError, "v_cache: expected shape"),
    (_bad("v_cache", lambda t: t.half()), TypeError, "v_cache: expected dtype"),
    (_bad("block_tables", lambda t: t.float()), TypeError, "block_tables: expected dtype"),
    (_bad("block_tables", lambda t: t[0]), ValueError, "block_tables: expected shape"),
    (_bad("seq_lens", lambda t: t[:1]), ValueError, "seq_lens: expected shape"),
    (_bad("seq_lens", lambda t: t.float()), TypeError, "seq_lens: expected dtype"),
    (_bad("cum_seq_lens_q", lambda t: t[:-1]), ValueError, "cum_seq_lens_q: expected shape"),
    (_bad("alibi_slopes", lambda t: None), ValueError, "alibi_slopes: expected"),
    (_bad("alibi_slopes", lambda t: t.half()), TypeError, "alibi_slopes: expected dtype"),
    (_bad("alibi_slopes", lambda t: t[:3]), ValueError, "alibi_slopes: expected shape"),
])
def test_call_rejects_tensors(op, cpu_tensors_ok, mutate, err, match):
    batch = mutate(_valid_batch())
    with pytest.raises(err, match=match):
        op(**batch)


@pytest.mark.compile
def test_call_rejects_out_cpu_and_unexpected_alibi(op, cpu_tensors_ok):
    batch = _valid_batch()
    with pytest.raises(ValueError, match="out: expected shape"):
        op(**batch, out=batch["q"][:-1])
    with pytest.raises(TypeError, match="out: expected dtype"):
        op(**batch, out=batch["q"].float())
    no_alibi = copy.copy(op)
    no_alibi.use_alibi = False  # validation only: same checks as an op built with use_alibi=False
    with pytest.raises(ValueError, match="use_alibi=False"):
        no_alibi(**batch)


def _plan_for(batch, op, **overrides):
    """A plan for `batch` as op.plan makes it, built on the CPU (no schedule launch) for the run checks."""
    tiles = torch.zeros(4, dtype=torch.int32)
    fields = dict(block_tables=batch["block_tables"].int(), seq_lens=batch["seq_lens"].int(),
                  cum_seq_lens_q=batch["cum_seq_lens_q"].int(), tile_seq=tiles, tile_q0=tiles,
                  total_q=batch["q"].shape[0], num_pages=batch["k_cache"].shape[0], tile_tokens=op.tile_tokens)
    return PrefillPlan(**{**fields, **overrides})


@pytest.mark.compile
@pytest.mark.parametrize("overrides,err,match", [
    (dict(total_q=3), ValueError, "q: expected 3 tokens"),
    (dict(num_pages=2), ValueError, "k_cache: expected 2 pages"),
    (dict(tile_tokens=7), ValueError, "plan: made by an op with 7-token"),
])
def test_run_rejects_a_plan_of_another_batch(op, cpu_tensors_ok, overrides, err, match):
    batch = _valid_batch()
    with pytest.raises(err, match=match):
        op.run(batch["q"], batch["k_cache"], batch["v_cache"], _plan_for(batch, op, **overrides),
               batch["alibi_slopes"])
    with pytest.raises(TypeError, match="plan: expected a PrefillPlan"):
        op.run(batch["q"], batch["k_cache"], batch["v_cache"], (batch["block_tables"],), batch["alibi_slopes"])
    with pytest.raises(TypeError, match="return_lse: expected a bool"):
        op.run(batch["q"], batch["k_cache"], batch["v_cache"], _plan_for(batch, op), batch["alibi_slopes"],
               return_lse=1)


@pytest.mark.compile
def test_scales_only_for_fp8_caches(op, cpu_tensors_ok):
    batch = _valid_batch()
    for name in ("k_scale", "v_scale"):
        with pytest.raises(ValueError, match=f"{name}: only for an FP8 cache"):
            op.run(batch["q"], batch["k_cache"], batch["v_cache"], _plan_for(batch, op), batch["alibi_slopes"],
                   **{name: 0.5})


@pytest.mark.compile
def test_fp8_op_rejects_bad_scales_and_caches(cpu_tensors_ok):
    fp8_op = PagedAttentionPrefillTileLang(**OPTION_SPECS[2])  # bf16 q over an FP8 cache, HND, ALiBi
    batch = make_batch([5, 3], [2, 20], 8, 2, 128, 16, torch.bfloat16, use_alibi=True, poison=False,
                       kv_dtype=torch.float8_e4m3fn)
    plan = _plan_for(batch, fp8_op)
    args = (batch["q"], batch["k_cache"], batch["v_cache"], plan, batch["alibi_slopes"])
    for kwargs, err, match in [
        (dict(k_scale=-1.0), ValueError, "k_scale: expected a positive"),
        (dict(v_scale=float("inf")), ValueError, "v_scale: expected a finite"),
        (dict(k_scale="1"), TypeError, "k_scale: expected a float"),
        (dict(v_scale=torch.ones(2)), ValueError, "v_scale: expected 1 element"),
        (dict(k_scale=torch.ones(1, dtype=torch.float64)), TypeError, "k_scale: expected dtype"),
    ]:
        with pytest.raises(err, match=match):
            fp8_op.run(*args, **kwargs)
    with pytest.raises(TypeError, match="k_cache: expected dtype"):
        fp8_op.run(batch["q"], batch["k_cache"].to(torch.bfloat16), batch["v_cache"], plan, batch["alibi_slopes"])


@pytest.mark.compile
def test_strided_q_and_out(op, cpu_tensors_ok):
    """q and out may be views with any token / head strides (q sliced from a fused QKV projection), but
    need a contiguous last dimension and 16-byte aligned strides."""
    batch = _valid_batch()
    fused = torch.randn(batch["q"].shape[0], 8 + 2 * 2, 128).to(torch.bfloat16)
    q = fused[:, :8]
    assert not q.is_contiguous()
    out = torch.empty(batch["q"].shape[0], 8, 2, 128, dtype=torch.bfloat16)[:, :, 0]
    op.check_inputs(**{**batch, "q": q}, out=out)  # accepted
    for bad in (batch["q"].transpose(1, 2).contiguous().transpose(1, 2),  # last dimension strided
                torch.randn(batch["q"].shape[0], 8, 129).to(torch.bfloat16)[:, :, 1:]):  # 2-byte misaligned
        with pytest.raises(ValueError, match="q: expected a contiguous last dimension"):
            op.check_inputs(**{**batch, "q": bad})
        with pytest.raises(ValueError, match="out: expected a contiguous last dimension"):
            op.check_inputs(**batch, out=bad)


@pytest.mark.compile
def test_call_rejects_cpu_tensors(op):
    with pytest.raises(ValueError, match="q: expected a CUDA tensor"):
        op(**_valid_batch())


def _set(name, fn):
    def apply(b):
        t = b[name].clone()
        fn(t)
        b[name] = t
        return b
    return apply


@pytest.mark.compile
@pytest.mark.parametrize("mutate,match", [
    (_set("cum_seq_lens_q", lambda t: t.add_(1)), "start at 0"),
    (_set("cum_seq_lens_q", lambda t: t.__setitem__(1, 9)), "non-decreasing"),
    (_set("cum_seq_lens_q", lambda t: t.__setitem__(2, 7)), "end at total_q_tokens"),
    (_set("seq_lens", lambda t: t.__setitem__(0, 4)), "seq_lens"),
    (_set("seq_lens", lambda t: t.__setitem__(1, 16 * 4 + 1)), "more blocks than its row"),
    (_set("block_tables", lambda t: t.__setitem__((1, 1), 10 ** 6)), "out of range"),
    (_set("block_tables", lambda t: t.__setitem__((0, 0), -1)), "out of range"),
])
def test_value_checks(op, mutate, match):
    batch = _valid_batch()
    op.check_values(batch["q"], batch["k_cache"], batch["block_tables"], batch["seq_lens"],
                    batch["cum_seq_lens_q"])  # the valid batch passes
    batch = mutate(batch)
    with pytest.raises(ValueError, match=match):
        op.check_values(batch["q"], batch["k_cache"], batch["block_tables"], batch["seq_lens"],
                        batch["cum_seq_lens_q"])


# ----------------------------------------------------------------------------- compile-only
# Every dtype, head_dim 64/128/256, page_size 1/16/64, both layouts and ALiBi on/off, once each, and
# both kernel families (warp-specialized: 16-bit with pages >= 16 rows; gather: fp32 or small pages).
COMPILE_SPECS = [
    dict(num_heads=4, num_kv_heads=4, head_dim=64, page_size=1, dtype=torch.float16, use_alibi=False,
         kv_layout="HND"),
    VALIDATION_SPEC,
    dict(num_heads=4, num_kv_heads=1, head_dim=256, page_size=64, dtype=torch.float32, use_alibi=False,
         kv_layout="HND"),
    dict(num_heads=8, num_kv_heads=1, head_dim=256, page_size=64, dtype=torch.float16, use_alibi=False,
         kv_layout="HND"),
    dict(num_heads=2, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16, use_alibi=False,
         kv_layout="HND"),
]
# The options on both families, each with ALiBi at least once: window, soft cap, FP8 cache, combined; CTA
# pairs (32-row pages) with a window; the 8-bit gather (pages under 16 rows) and the one-Q-buffer head_dim 256.
OPTION_SPECS = [
    dict(num_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype=torch.bfloat16, use_alibi=True,
         kv_layout="NHD", window_left=100, logits_soft_cap=30.0),
    dict(num_heads=8, num_kv_heads=2, head_dim=64, page_size=32, dtype=torch.bfloat16, use_alibi=False,
         kv_layout="HND", window_left=70),
    dict(num_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype=torch.bfloat16, use_alibi=True,
         kv_layout="HND", kv_dtype=torch.float8_e4m3fn),
    dict(num_heads=4, num_kv_heads=1, head_dim=256, page_size=64, dtype=torch.float16, use_alibi=True,
         kv_layout="NHD", kv_dtype=torch.float8_e4m3fn, window_left=300, logits_soft_cap=5.0),
    dict(num_heads=4, num_kv_heads=4, head_dim=64, page_size=1, dtype=torch.float16, use_alibi=True,
         kv_layout="NHD", window_left=5, logits_soft_cap=2.0),
    dict(num_heads=4, num_kv_heads=2, head_dim=128, page_size=4, dtype=torch.bfloat16, use_alibi=True,
         kv_layout="HND", kv_dtype=torch.float8_e4m3fn, logits_soft_cap=20.0),
    dict(num_heads=4, num_kv_heads=1, head_dim=64, page_size=64, dtype=torch.float32, use_alibi=True,
         kv_layout="HND", window_left=0, logits_soft_cap=1.0),
]


@pytest.mark.compile
@pytest.mark.parametrize("spec", COMPILE_SPECS, ids=lambda s: f"{s['dtype']}-d{s['head_dim']}-b{s['page_size']}")
def test_compiles_for_sm90a(spec):
    op = PagedAttentionPrefillTileLang(**spec)
    source = op.kernel.get_kernel_source()
    assert "paged_prefill" in source
    ws = warp_specialized(TL_DTYPES[spec["dtype"]], spec["page_size"])
    assert ("k_full" in source) == ws  # the warp-specialized kernel's mbarrier ring
    assert ("AtomicAddRet" in source) == ws  # its dynamic schedule: items pulled from a counter
    assert (op.sched_len > 0) == ws


@pytest.mark.compile
@pytest.mark.parametrize("spec", OPTION_SPECS, ids=lambda s: "-".join(
    [str(s["dtype"])[6:], f"b{s['page_size']}"] + [f"{k}={s[k]}" for k in ("window_left", "logits_soft_cap")
                                                      if k in s] + (["fp8"] if "kv_dtype" in s else [])))
def test_options_compile_for_sm90a(spec):
    """Every option lowers and builds on the family that serves it: tanh for the soft cap, the 8-bit
    cache's conversion, the window's loop start."""
    op = PagedAttentionPrefillTileLang(**spec)
    source = op.kernel.get_kernel_source()
    ws = warp_specialized(TL_DTYPES[spec["dtype"]], spec["page_size"])
    assert ("k_full" in source) == ws
    assert ("tanh" in source) == ("logits_soft_cap" in spec)
    if "kv_dtype" in spec:
        assert "fp8_e4" in source and op.spec["kv_dtype"] == "float8_e4m3fn"
    assert op.spec.get("window_left", -1) == spec.get("window_left", -1)


@pytest.mark.compile
def test_ws_config_space_builds():
    """Every warp-specialized config offered to the autotuner fits shared memory and builds."""
    spec = dict(num_heads=8, num_kv_heads=2, head_dim=64, page_size=32, dtype=torch.bfloat16)
    space = PagedAttentionPrefillTileLang.config_space(dict(spec, dtype="bfloat16"))
    assert {c["num_stages"] for c in space} == {2, 3} and {c["block_N"] for c in space} == {64, 128}
    assert {c["cluster"] for c in space} == {1, 2}
    for config in space:
        source = PagedAttentionPrefillTileLang(**spec, config=config).kernel.get_kernel_source()
        assert ("tma_load_multicast" in source) == (config["cluster"] > 1)  # K/V shared by the cluster pair
        # a cluster launch allows programmatic dependent launch: the schedule kernel must be waited for
        assert ("cudaGridDependencySynchronize" in source) == (config["cluster"] > 1)


def _build_fp8_config_space(op_spec):
    """The kernels of every config the autotuner may pick for an 8-bit cache's specialization `op_spec` (ring depths
    of the 8-bit stages and of the converted V, CTA pairs or not), built."""
    space = PagedAttentionPrefillTileLang.config_space(op_spec)
    assert {(c["num_stages"], c["v_widen"]) for c in space} >= {(1, 1), (2, 2), (3, 3)}
    assert {c["cluster"] for c in space} == {1, 2}
    return compile_kernels(*(paged_prefill_kernel(**op_spec, **c) for c in space),
                           pass_configs=PagedAttentionPrefillTileLang.tunable_pass_configs(op_spec))


@pytest.mark.compile
def test_fp8_ws_config_space_builds():
    """An 8-bit cache on the warp-specialized kernel: every config offered to the autotuner (ring depths of the
    8-bit stages and of the widened V) fits shared memory and builds, with the FP8 scores (two e4m3 products) and
    the converter warps' fp16 V, with and without CTA pairs."""
    spec = dict(num_heads=8, num_kv_heads=1, head_dim=64, page_size=32, dtype=torch.bfloat16,
                kv_dtype=torch.float8_e4m3fn)
    op_spec = PagedAttentionPrefillTileLang(**spec).spec
    for kernel in _build_fp8_config_space(op_spec):
        source = kernel.get_kernel_source()
        assert "__tl_cvt_fp8x2_to_half2" in source and source.count("kFloat8_e4m3, tl::DataType::kFloat8_e4m3") == 2
    fp16 = dict(op_spec, dtype="float16")
    source = paged_prefill_kernel(**fp16, **PagedAttentionPrefillTileLang.default_config(fp16))
    kernel, = compile_kernels(source, pass_configs=PagedAttentionPrefillTileLang.tunable_pass_configs(fp16))
    assert kernel.get_kernel_source().count("kFloat8_e4m3, tl::DataType::kFloat8_e4m3") == 3  # three terms of q


def _byte_perm(x: int, y: int, selector: int) -> int:
    """CUDA's __byte_perm: result byte i is byte (selector nibble i) of the 8 bytes y:x (x low)."""
    both = x | y << 32
    return sum((both >> 8 * (selector >> 4 * i & 7) & 0xFF) << 8 * i for i in range(4))


def test_fp8_compute_transpose_plan():
    """fp8_compute's V transpose (TilePlan.transpose_v), emulated: the converter lanes' rounds take every 8 x 8 byte
    block of a V stage exactly once at each (block_N, head_dim) a config builds; at 128-byte rows each 16 lanes load
    16 different 8-byte columns; and the byte permutes turn four keys' words into four dims' words."""
    for block_N, head_dim in [(128, 64), (128, 128), (64, 256), (64, 64), (64, 128)]:
        rounds = block_N * head_dim // (64 * 64)
        blocks = [transpose_block(lane, b, block_N, head_dim) for b in range(rounds) for lane in range(64)]
        assert sorted(blocks) == [(j, d) for j in range(0, block_N, 8) for d in range(0, head_dim, 8)]
    for b in range(2):
        for group in range(4):
            cols = {transpose_block(lane, b, 128, 128)[1] for lane in range(16 * group, 16 * group + 16)}
            assert len(cols) == 16
    rng = random.Random(5)
    rows = [[rng.randrange(256) for _ in range(4)] for _ in range(4)]  # rows[key][dim]
    words = [sum(v << 8 * i for i, v in enumerate(r)) for r in rows]
    out = {}
    for k, pair in enumerate(PAIR_BYTES):
        ab, cd = _byte_perm(words[0], words[1], pair), _byte_perm(words[2], words[3], pair)
        for i, row in enumerate(ROW_BYTES):
            out[2 * k + i] = _byte_perm(ab, cd, row)
    assert [[out[d] >> 8 * key & 0xFF for key in range(4)] for d in range(4)] == [list(c) for c in zip(*rows)]


@pytest.mark.compile
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_compute_builds(head_dim):
    """fp8_compute: q as one e4m3 term, P through shared memory and V transposed by the converter warps, both
    products FP8 wgmma (no fp16 widening left), within shared memory at every head_dim."""
    spec = dict(num_heads=8, num_kv_heads=2, head_dim=head_dim, page_size=64, dtype=torch.bfloat16,
                kv_dtype=torch.float8_e4m3fn, fp8_compute=True)
    op = PagedAttentionPrefillTileLang(**spec)
    source = op.kernel.get_kernel_source()
    assert "__tl_cvt_fp8x2_to_half2" not in source
    # the scores (one term), P @ V in the KV loop and after it
    assert source.count("kFloat8_e4m3, tl::DataType::kFloat8_e4m3") == 3
    if head_dim == 64:
        _build_fp8_config_space(op.spec)


# ----------------------------------------------------------------------------- API: deprecated names, protocol
@pytest.mark.compile
def test_deprecated_keywords_warn_and_work(op):
    """head_size / block_size (now head_dim / page_size) and the constructor's validate (now a call
    keyword) still work for one release, with a FutureWarning; the op is the same specialization."""
    old = dict(VALIDATION_SPEC)
    old["head_size"], old["block_size"] = old.pop("head_dim"), old.pop("page_size")
    with pytest.warns(FutureWarning) as record:
        renamed_op = PagedAttentionPrefillTileLang(**old)
    messages = {str(w.message) for w in record}
    assert any("'head_size' is deprecated, use 'head_dim'" in m for m in messages)
    assert any("'block_size' is deprecated, use 'page_size'" in m for m in messages)
    assert (renamed_op.head_dim, renamed_op.page_size) == (128, 16)
    assert renamed_op.spec == op.spec and renamed_op.config == op.config and renamed_op.validate is True
    with pytest.warns(FutureWarning, match="head_dim"):
        assert renamed_op.head_size == 128
    with pytest.warns(FutureWarning, match="page_size"):
        assert renamed_op.block_size == 16
    with pytest.warns(FutureWarning, match="'validate' is deprecated"):
        no_checks = PagedAttentionPrefillTileLang(**VALIDATION_SPEC, validate=False)
    assert no_checks.validate is False and no_checks.spec == op.spec  # the call's default
    with pytest.raises(TypeError, match="both 'head_size' and its new name 'head_dim'"):
        PagedAttentionPrefillTileLang(**VALIDATION_SPEC, head_size=128)
    with pytest.raises(TypeError, match="unexpected keyword argument 'head_dimm'"):
        PagedAttentionPrefillTileLang(**VALIDATION_SPEC, head_dimm=128)
    with pytest.raises(TypeError, match="missing"):
        PagedAttentionPrefillTileLang(num_heads=8, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16)


@pytest.mark.compile
def test_call_validate_keyword_type(op, cpu_tensors_ok):
    with pytest.raises(TypeError, match="validate: expected a bool"):
        op(**_valid_batch(), validate=1)


def test_protocol():
    cls = op_class("paged_prefill")
    assert cls is PagedAttentionPrefillTileLang and cls.tunable_kernel({}) is paged_prefill_kernel
    assert not hasattr(cls, "DEFAULT_CONFIG")
    for spec in cls.warm_specs:  # constructor keywords in the new vocabulary
        assert {"num_heads", "num_kv_heads", "head_dim", "page_size", "dtype"} <= set(spec)
    for page_size, dtype, d in [(16, "bfloat16", 128), (64, "float16", 256), (1, "float16", 64), (64, "float32", 256)]:
        spec = dict(head_dim=d, dtype=dtype, page_size=page_size)
        default, space = cls.default_config(spec), cls.config_space(spec)
        assert space and all(set(c) == set(default) for c in space)
        # the autotuner builds the kernel with the op's pass configs: fast math, and the warp-specialized kernel's
        # buffer-init check off
        configs = cls.tunable_pass_configs(spec)
        assert configs["tl.enable_fast_math"] is True
        assert configs.get("tl.disable_buffer_init_check", False) == (dtype != "float32" and page_size >= 16)


# ----------------------------------------------------------------------------- custom op (fake / meta)
def _meta_inputs(num_heads, num_kv_heads, head_dim, page_size, dtype, kv_layout, device="meta", alibi=False):
    cache = ((40, num_kv_heads, page_size, head_dim) if kv_layout == "HND" else (40, page_size, num_kv_heads, head_dim))
    ints = lambda *shape: torch.empty(shape, dtype=torch.int32, device=device)  # noqa: E731
    return dict(q=torch.empty(37, num_heads, head_dim, dtype=dtype, device=device),
                k_cache=torch.empty(cache, dtype=dtype, device=device),
                v_cache=torch.empty(cache, dtype=dtype, device=device),
                block_tables=ints(3, 9), seq_lens=ints(3), cum_seq_lens_q=ints(4),
                alibi_slopes=torch.empty(num_heads, device=device) if alibi else None)


@pytest.mark.parametrize("dtype,kv_layout,alibi", [(torch.bfloat16, "HND", False), (torch.float16, "NHD", True),
                                                   (torch.float32, "HND", True)])
def test_custom_op_fake_shapes(dtype, kv_layout, alibi):
    inputs = _meta_inputs(8, 2, 128, 16, dtype, kv_layout, alibi=alibi)
    out = torch.ops.llm_tile_ops.paged_attention_prefill(**inputs, kv_layout=kv_layout)
    assert out.shape == inputs["q"].shape and out.dtype == dtype and out.device.type == "meta"
    out = paged_attention_prefill_op(**inputs, scale=0.1, kv_layout=kv_layout, validate=False)
    assert out.shape == inputs["q"].shape and out.dtype == dtype
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = _meta_inputs(8, 2, 128, 16, dtype, kv_layout, device="cuda", alibi=alibi)
        out = paged_attention_prefill_op(**fake, kv_layout=kv_layout)
        assert out.shape == fake["q"].shape and out.dtype == dtype and out.device.type == "cuda"


def test_custom_op_spec_from_shapes():
    inputs = _meta_inputs(12, 4, 64, 32, torch.float16, "NHD", alibi=True)
    assert custom_op_spec(inputs["q"], inputs["k_cache"], inputs["alibi_slopes"], None, "NHD") == dict(
        num_heads=12, num_kv_heads=4, head_dim=64, page_size=32, dtype=torch.float16, use_alibi=True, scale=None,
        kv_layout="NHD", window_left=-1, logits_soft_cap=0.0, kv_dtype=torch.float16, fp8_compute=False)
    inputs = _meta_inputs(8, 1, 256, 64, torch.bfloat16, "HND")
    fp8 = inputs["k_cache"].to(torch.float8_e4m3fn)
    assert custom_op_spec(inputs["q"], fp8, None, 0.5, "HND", 100, 30.0, True) == dict(
        num_heads=8, num_kv_heads=1, head_dim=256, page_size=64, dtype=torch.bfloat16, use_alibi=False, scale=0.5,
        kv_layout="HND", window_left=100, logits_soft_cap=30.0, kv_dtype=torch.float8_e4m3fn, fp8_compute=True)
    with pytest.raises(ValueError, match="kv_layout"):
        custom_op_spec(inputs["q"], inputs["k_cache"], None, None, "NDH")
    with pytest.raises(ValueError, match="q: expected shape"):
        custom_op_spec(inputs["q"][0], inputs["k_cache"], None, None, "HND")
    with pytest.raises(ValueError, match="k_cache: expected a 4-d"):
        custom_op_spec(inputs["q"], inputs["k_cache"][0], None, None, "HND")


@pytest.mark.parametrize("validate", [False, True])
def test_custom_op_traces_in_one_graph(validate):
    """torch.compile(fullgraph=True) traces a function calling the custom op with no graph break (meta
    tensors run the fake: no kernel, no GPU), also for a second, larger batch (dynamic shapes)."""
    def fn(q, k_cache, v_cache, block_tables, seq_lens, cum_seq_lens_q, alibi_slopes):
        return paged_attention_prefill_op(q, k_cache, v_cache, block_tables, seq_lens, cum_seq_lens_q, alibi_slopes,
                                          kv_layout="NHD", validate=validate) * 2

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for alibi in (True, False):
        inputs = _meta_inputs(8, 2, 128, 16, torch.bfloat16, "NHD", alibi=alibi)
        out = compiled(**inputs)
        assert out.shape == inputs["q"].shape and out.dtype == torch.bfloat16
    inputs["q"] = torch.empty(91, 8, 128, dtype=torch.bfloat16, device="meta")
    assert compiled(**inputs).shape == (91, 8, 128)
