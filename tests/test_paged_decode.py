"""PagedAttentionDecodeTileLang: golden vs a float64 per-token loop (window, soft-cap, ALiBi, lse, FP8,
1-8 query tokens), validation of the constructor, plan and run, the split schedule, the custom ops' fakes,
and compile-only builds for sm_90a (GPU checks live in test_paged_decode_gpu.py)."""

import math

import pytest
import torch

import ops.paged_decode.decode as decode_module
from golden.paged_decode import paged_attention_decode
from ops.common.protocol import op_class
from ops.paged_decode import DecodePlan, PagedAttentionDecodeTileLang
from ops.paged_decode import paged_attention_decode as paged_attention_decode_op
from ops.paged_decode import schedule
from ops.paged_decode.custom_ops import _spec as custom_op_spec
from ops.paged_decode.kernels import paged_decode_split_kernel, paged_decode_warps_kernel
from test_paged_prefill import paged_cache  # tests/ is on sys.path under pytest

FP8 = torch.float8_e4m3fn


# ----------------------------------------------------------------------------- inputs
def make_decode_batch(seq_lens, num_q_tokens, num_heads, num_kv_heads, head_dim, page_size, dtype, device="cpu",
                      kv_layout="HND", use_alibi=False, kv_dtype=None, spare_pages=3, poison=True, seed=0):
    """Random decode batch over a shuffled paged cache (``paged_cache``; stored in ``kv_dtype``, default q's
    dtype), from the generator of ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = paged_cache(seq_lens, num_kv_heads, head_dim, page_size,
                                           dtype if kv_dtype is None else kv_dtype, kv_layout, spare_pages,
                                           poison=poison, generator=gen)
    q = torch.randn(len(seq_lens) * num_q_tokens, num_heads, head_dim, generator=gen).to(dtype)
    alibi = torch.rand(num_heads, generator=gen) * 0.5 if use_alibi else None
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return dict(q=to(q), k_cache=to(k_cache), v_cache=to(v_cache), block_tables=to(tables),
                seq_lens=to(torch.tensor(seq_lens, dtype=torch.int32)), alibi_slopes=to(alibi))


def reference_float64(q, k_cache, v_cache, block_tables, seq_lens, num_q_tokens=1, alibi_slopes=None, scale=None,
                      kv_layout="HND", window_left=-1, logits_soft_cap=0.0, k_scale=None, v_scale=None):
    """One query row and head at a time, in float64: row i of sequence b sits at p = seq_len - nq + i and
    sees keys max(0, p - window_left) .. p (read through the block table, stored x scale); max pass, sum
    pass, weighted-sum pass. -> (out, lse)."""
    total_q, num_heads, head_dim = q.shape
    hkv_axis, slot_axis = (1, 2) if kv_layout == "HND" else (2, 1)
    page_size, num_kv_heads = k_cache.shape[slot_axis], k_cache.shape[hkv_axis]
    scale = head_dim ** -0.5 if scale is None else scale
    ks, vs = (1.0 if s is None else float(s) for s in (k_scale, v_scale))
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.zeros(total_q, num_heads, dtype=torch.float64)

    def row(cache, b, t, kvh, mult):
        page = int(block_tables[b, t // page_size])
        off = t % page_size
        r = cache[page, kvh, off] if kv_layout == "HND" else cache[page, off, kvh]
        return r.double() * mult

    for b, n in enumerate(seq_lens.tolist()):
        for i in range(num_q_tokens):
            p = n - num_q_tokens + i
            keys = range(max(0, p - window_left) if window_left >= 0 else 0, p + 1)
            for h in range(num_heads):
                kvh = h // (num_heads // num_kv_heads)
                qv = q[b * num_q_tokens + i, h].double()
                slope = 0.0 if alibi_slopes is None else float(alibi_slopes[h])

                def score(t):
                    s = scale * float(qv @ row(k_cache, b, t, kvh, ks))
                    if logits_soft_cap > 0:
                        s = logits_soft_cap * math.tanh(s / logits_soft_cap)
                    return s + slope * (t - p)

                m = max(score(t) for t in keys)
                denom = sum(math.exp(score(t) - m) for t in keys)
                out[b * num_q_tokens + i, h] = sum(math.exp(score(t) - m) / denom * row(v_cache, b, t, kvh, vs)
                                                   for t in keys)
                lse[b * num_q_tokens + i, h] = m + math.log(denom)
    return out, lse


# ----------------------------------------------------------------------------- golden
# (seq_lens, nq, heads, kv heads, page_size, layout, alibi, window_left, cap, k_scale, v_scale)
GOLDEN_CASES = [
    ([1, 9, 16, 17], 1, 4, 2, 4, "HND", False, -1, 0.0, None, None),  # seq_len 1, page multiples, one past
    ([5, 12], 3, 4, 1, 1, "NHD", True, -1, 0.0, None, None),          # MQA, page_size 1, ALiBi
    ([8, 20, 3], 3, 2, 2, 8, "HND", True, 4, 0.0, None, None),        # window shorter than the tokens' span
    ([11, 30], 8, 4, 2, 4, "NHD", False, 0, 0.0, None, None),         # window 0: only t = p; seq_len == nq + 3
    ([8, 25], 8, 2, 1, 16, "HND", False, -1, 1.7, None, None),        # nq 8 (seq_len == nq), soft-cap
    ([6, 19], 2, 4, 2, 4, "NHD", True, 7, 2.5, 0.4, 1.9),             # all options together
    ([7, 13], 5, 6, 3, 2, "HND", True, -1, 0.0, 2.0, 0.5),            # scales on a 16-bit cache
]


@pytest.mark.parametrize("seq_lens,nq,heads,kv_heads,page_size,layout,alibi,window_left,cap,k_scale,v_scale",
                         GOLDEN_CASES)
def test_golden_matches_float64_loop(seq_lens, nq, heads, kv_heads, page_size, layout, alibi, window_left, cap,
                                     k_scale, v_scale):
    batch = make_decode_batch(seq_lens, nq, heads, kv_heads, 8, page_size, torch.float64, kv_layout=layout,
                              use_alibi=alibi)
    opts = dict(num_q_tokens=nq, scale=0.4, kv_layout=layout, window_left=window_left, logits_soft_cap=cap,
                k_scale=k_scale, v_scale=v_scale)
    got, lse = paged_attention_decode(**batch, **opts, return_lse=True)
    want, want_lse = reference_float64(**batch, **opts)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)
    assert paged_attention_decode(**batch, **opts).equal(got)


@pytest.mark.parametrize("layout,nq,window_left,cap", [("HND", 1, -1, 0.0), ("NHD", 4, 6, 1.5)])
def test_golden_fp8_cache_dequantizes(layout, nq, window_left, cap):
    """An FP8 (e4m3) cache with scales equals the float64 loop over the dequantized values."""
    batch = make_decode_batch([9, 21], nq, 4, 2, 16, 8, torch.bfloat16, kv_layout=layout, use_alibi=True,
                              kv_dtype=FP8)
    opts = dict(num_q_tokens=nq, kv_layout=layout, window_left=window_left, logits_soft_cap=cap, k_scale=0.45,
                v_scale=1.7)
    out, lse = paged_attention_decode(**batch, **opts, return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want, want_lse = reference_float64(**batch, **opts)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


def test_golden_rejects_short_sequences_and_bad_rows():
    batch = make_decode_batch([3, 9], 2, 2, 1, 8, 4, torch.float64)
    with pytest.raises(ValueError, match="seq_lens: expected values >= num_q_tokens"):
        paged_attention_decode(**{**batch, "q": batch["q"].repeat(2, 1, 1)}, num_q_tokens=4)
    with pytest.raises(ValueError, match="q: expected 2 \\* 3 rows"):
        paged_attention_decode(**batch, num_q_tokens=3)


# ----------------------------------------------------------------------------- schedule (host arithmetic)
def test_head_pack_and_rows():
    assert schedule.head_pack(32, 8, 1) == 4 and schedule.head_pack(32, 8, 8) == 4
    assert schedule.head_pack(64, 1, 1) == 32 and schedule.head_pack(64, 1, 8) == 4
    assert schedule.head_pack(6, 2, 8) == 3 and schedule.head_pack(4, 4, 8) == 1
    assert [schedule.block_m(r) for r in (1, 16, 17, 32)] == [16, 16, 32, 32]


def test_split_rule():
    # B=64 x 8K, 8 head groups, 128 tiles of 64: several waves of CTAs, even splits
    per, splits = schedule.split_tiles(512, 128, 8 * 132, 4)
    assert splits > 1 and per * splits >= 128 and per * (splits - 1) < 128 and 512 * splits >= 132 * 8
    # short sequences: one split (no combine); min_split_tiles bounds the split length from below
    assert schedule.split_tiles(512, 3, 1056, 4) == (3, 1)
    assert schedule.split_tiles(1, 1024, 1056, 4)[0] >= 4
    # the split length is fixed by the batch, not by a one-wave share of the SMs
    assert schedule.split_tiles(64, 1024, 1056, 4) == schedule.split_tiles(64, 1024, 1056, 4)
    assert schedule.kv_tiles_bound(100000, 64, 100, 1) == 3 and schedule.kv_tiles_bound(10, 64, -1, 1) == 1
    assert schedule.kv_tiles_bound(130, 64, 200, 8) == 3


# ----------------------------------------------------------------------------- validation
SPEC = dict(num_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype=torch.bfloat16)


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(num_heads=6, num_kv_heads=4), ValueError, "num_heads"),
    (dict(head_dim=96), ValueError, "head_dim"),
    (dict(page_size=24), ValueError, "page_size"),
    (dict(page_size=512), ValueError, "page_size"),
    (dict(dtype=torch.float32), TypeError, "dtype"),
    (dict(kv_dtype=torch.float32), TypeError, "kv_dtype"),
    (dict(kv_dtype=torch.float8_e5m2), TypeError, "kv_dtype"),
    (dict(kv_layout="HDN"), ValueError, "kv_layout"),
    (dict(use_alibi=1), TypeError, "use_alibi"),
    (dict(window_left=-2), ValueError, "window_left: expected >= -1"),
    (dict(window_left=2.0), TypeError, "window_left"),
    (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap=float("inf")), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap="1"), TypeError, "logits_soft_cap"),
    (dict(scale=-0.1), ValueError, "scale"),
    (dict(num_q_tokens=0), ValueError, "num_q_tokens: expected >= 1"),
    (dict(num_q_tokens=9), ValueError, "num_q_tokens: expected <= 8"),
    (dict(config=[1]), TypeError, "config"),
    (dict(config={"block_M": 64}), ValueError, "config: unknown keys"),
    (dict(config={"block_N": 16}), ValueError, "block_N"),
    (dict(head_dim=256, config={"block_N": 128}), ValueError, "exceed shared memory"),
    (dict(head_dim=256, page_size=8, config={"num_stages": 2}), ValueError, "num_stages"),  # split_kv's row gathers
    (dict(config={"num_stages": 5}), ValueError, "num_stages"),  # the warp-split kernel's rings
])
def test_constructor_rejects(kwargs, err, match):
    with pytest.raises(err, match=match):
        PagedAttentionDecodeTileLang(**{**SPEC, **kwargs})


# The op of the validation checks; its kernels are built once (disk cache).
VALIDATION_SPEC = dict(num_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype=torch.bfloat16,
                       use_alibi=True, kv_layout="NHD", num_q_tokens=2)


@pytest.fixture(scope="module")
def op():
    return PagedAttentionDecodeTileLang(**VALIDATION_SPEC)


@pytest.fixture
def cpu_tensors_ok(allow_cpu_tensors):
    """Lets plan and the run checks take CPU tensors: only the CUDA-device error is waived."""
    allow_cpu_tensors(decode_module)


def _batch(**kw):
    return make_decode_batch([5, 40], 2, 8, 2, 128, 16, torch.bfloat16, kv_layout="NHD", use_alibi=True,
                             poison=False, **kw)


@pytest.mark.compile
def test_plan_schedule_and_workspaces(op, cpu_tensors_ok):
    batch = _batch()
    plan = op.plan(batch["block_tables"], batch["seq_lens"])
    assert isinstance(plan, DecodePlan) and plan.batch == 2 and plan.max_page_id == int(batch["block_tables"].max())
    assert plan.num_splits == 1 and plan.o_part.shape[0] == 1  # short batch: no partials
    assert plan.block_tables is batch["block_tables"] and plan.seq_lens is batch["seq_lens"]  # int32: no copies
    assert plan.lse.shape == (4, 8) and int(plan.sched[0]) == plan.tiles_per_split
    # long sequences split; validate=False sizes the splits by the table's capacity, without a host sync
    long = make_decode_batch([3000] * 4, 2, 8, 2, 128, 16, torch.bfloat16, kv_layout="NHD", poison=False)
    plan = op.plan(long["block_tables"], long["seq_lens"])
    assert plan.num_splits > 1 and plan.o_part.shape == (4, plan.num_splits, 2, 8, 128)
    assert plan.tiles_per_split * plan.num_splits >= -(-3000 // op.config["block_N"])
    unchecked = op.plan(long["block_tables"], long["seq_lens"], validate=False)
    assert unchecked.max_page_id is None and unchecked.num_splits >= plan.num_splits
    # int64 tables are converted once, by the plan
    plan = op.plan(long["block_tables"].long(), long["seq_lens"].long())
    assert plan.block_tables.dtype == torch.int32 and plan.seq_lens.dtype == torch.int32


@pytest.mark.compile
@pytest.mark.parametrize("mutate,err,match", [
    (lambda b: b.update(seq_lens=torch.tensor([1, 40], dtype=torch.int32)), ValueError,
     "seq_lens: expected values >= num_q_tokens"),
    (lambda b: b.update(seq_lens=torch.tensor([5, 99], dtype=torch.int32)), ValueError,
     "seq_lens: expected values <= max_pages"),
    (lambda b: b["block_tables"].__setitem__((1, 2), -1), ValueError, "block_tables: expected page ids >= 0"),
    (lambda b: b.update(block_tables=b["block_tables"].float()), TypeError, "block_tables: expected dtype"),
    (lambda b: b.update(block_tables=b["block_tables"][0]), ValueError, "block_tables: expected shape"),
    (lambda b: b.update(seq_lens=b["seq_lens"][:1]), ValueError, "seq_lens: expected shape"),
    (lambda b: b.update(seq_lens=b["seq_lens"].float()), TypeError, "seq_lens: expected dtype"),
    (lambda b: b.update(block_tables=b["block_tables"][:, :0]), ValueError, "at least one sequence and one page"),
])
def test_plan_rejects(op, cpu_tensors_ok, mutate, err, match):
    batch = _batch()
    mutate(batch)
    with pytest.raises(err, match=match):
        op.plan(batch["block_tables"], batch["seq_lens"])


def _run_args(batch, plan):
    return dict(q=batch["q"], k_cache=batch["k_cache"], v_cache=batch["v_cache"], plan=plan,
                alibi_slopes=batch["alibi_slopes"])


@pytest.mark.compile
@pytest.mark.parametrize("change,err,match", [
    (dict(q=lambda t: t[:-2]), ValueError, "q: expected shape \\[4, 8, 128\\]"),  # plan mismatched with the batch
    (dict(q=lambda t: t.half()), TypeError, "q: expected dtype"),
    (dict(k_cache=lambda t: t[:, :, :1]), ValueError, "k_cache: expected shape"),
    (dict(k_cache=lambda t: t[:3], v_cache=lambda t: t[:3]), ValueError, "k_cache: the plan's block_tables use page"),
    (dict(k_cache=lambda t: t.to(torch.float8_e4m3fn)), TypeError, "k_cache: expected dtype"),
    (dict(v_cache=lambda t: t[:-1]), ValueError, "v_cache: expected shape"),
    (dict(alibi_slopes=lambda t: None), ValueError, "alibi_slopes: expected"),
    (dict(alibi_slopes=lambda t: t[:3]), ValueError, "alibi_slopes: expected shape"),
    (dict(plan=lambda p: "plan"), TypeError, "plan: expected a DecodePlan"),
])
def test_run_rejects(op, cpu_tensors_ok, change, err, match):
    batch = _batch()
    args = _run_args(batch, op.plan(batch["block_tables"], batch["seq_lens"]))
    for name, fn in change.items():
        args[name] = fn(args[name])
    with pytest.raises(err, match=match):
        op.run(**args)


@pytest.mark.compile
def test_run_rejects_scales_out_lse_and_foreign_plans(op, cpu_tensors_ok):
    batch = _batch()
    plan = op.plan(batch["block_tables"], batch["seq_lens"])
    args = _run_args(batch, plan)
    for bad, err, match in [(-1.0, ValueError, "k_scale: expected a positive value"),
                            (float("nan"), ValueError, "k_scale: expected a finite value"),
                            ("1", TypeError, "k_scale: expected a float"),
                            (torch.ones(2), ValueError, "k_scale: expected a 1-element"),
                            (torch.ones(1, dtype=torch.float16), TypeError, "k_scale: expected dtype")]:
        with pytest.raises(err, match=match):
            op.run(**args, k_scale=bad)
    with pytest.raises(ValueError, match="v_scale: expected a positive value"):
        op.run(**args, v_scale=0.0)
    with pytest.raises(ValueError, match="out: expected shape"):
        op.run(**args, out=batch["q"][:-1])
    with pytest.raises(TypeError, match="return_lse: expected a bool"):
        op.run(**args, return_lse=1)
    other = PagedAttentionDecodeTileLang(**{**VALIDATION_SPEC, "num_q_tokens": 1, "use_alibi": False})
    with pytest.raises(ValueError, match="plan: made by an op of another specialization"):
        op.run(**_run_args(batch, other.plan(batch["block_tables"], batch["seq_lens"])))
    with pytest.raises(ValueError, match="alibi_slopes: given but"):
        other.run(**{**_run_args(batch, other.plan(batch["block_tables"], batch["seq_lens"])),
                     "q": batch["q"][:2]})
    with pytest.raises(TypeError, match="validate: expected a bool"):
        op(batch["q"], batch["k_cache"], batch["v_cache"], batch["block_tables"], batch["seq_lens"],
           batch["alibi_slopes"], validate=1)


@pytest.mark.compile
def test_call_rejects_cpu_tensors(op):
    batch = _batch()
    with pytest.raises(ValueError, match="expected a CUDA tensor"):
        op(batch["q"], batch["k_cache"], batch["v_cache"], batch["block_tables"], batch["seq_lens"],
           batch["alibi_slopes"])


# ----------------------------------------------------------------------------- compile-only
# Both load paths (page copies by TMA from 16 rows, row gathers below), both layouts, FP8, head_dim
# 64/128/256, nq 1/2/8, with and without window / soft-cap / ALiBi; kept few (each build takes ~10 s).
COMPILE_SPECS = [
    VALIDATION_SPEC,
    dict(num_heads=32, num_kv_heads=8, head_dim=128, page_size=64, dtype=torch.bfloat16, kv_dtype=FP8,
         window_left=100, logits_soft_cap=30.0),
    dict(num_heads=4, num_kv_heads=4, head_dim=64, page_size=1, dtype=torch.float16, use_alibi=True,
         kv_layout="HND", num_q_tokens=8),
    dict(num_heads=16, num_kv_heads=2, head_dim=256, page_size=256, dtype=torch.bfloat16, kv_layout="NHD",
         kv_dtype=FP8, window_left=7),
    dict(num_heads=12, num_kv_heads=4, head_dim=64, page_size=1, dtype=torch.float16, kv_layout="NHD",
         kv_dtype=FP8, use_alibi=True, num_q_tokens=5),
]


@pytest.mark.compile
@pytest.mark.parametrize("spec", COMPILE_SPECS,
                         ids=lambda s: f"d{s['head_dim']}-p{s['page_size']}-nq{s.get('num_q_tokens', 1)}")
def test_compiles_for_sm90a(spec):
    op = PagedAttentionDecodeTileLang(**spec)
    split = op.split_kernel.get_kernel_source()
    assert "paged_decode_combine" in op.combine_kernel.get_kernel_source()
    if op._splits_keys_over_warps(op.spec):  # mma.sync on fragments placed by hand; TMA pages or cp.async rows
        tma = schedule.loads_by_tma(spec["page_size"], op.config["block_N"])
        assert "paged_decode_warps" in split and "mma_sync" in split
        assert ("tma_load" in split) == tma and ("cp_async" in split) == (not tma)
        assert ("__tl_cvt_fp8x2_to_half2" in split) == (spec.get("kv_dtype") == FP8)
        return
    assert "paged_decode_split" in split
    # pages of >= 16 rows: TMA page copies; smaller: cp.async row gathers
    assert ("tma_load" in split) == (spec["page_size"] >= schedule.PAGE_COPIES_FROM)
    assert ("cp_async" in split) == (spec["page_size"] < schedule.PAGE_COPIES_FROM)


def test_protocol():
    cls = op_class("paged_decode")
    assert cls is PagedAttentionDecodeTileLang and cls.tunable_kernel({}) is paged_decode_split_kernel
    for spec in cls.warm_specs:
        assert {"num_heads", "num_kv_heads", "head_dim", "page_size", "dtype"} <= set(spec)
    for page_size, d in [(16, 128), (64, 256), (1, 64)]:
        spec = dict(head_dim=d, page_size=page_size)
        default, space = cls.default_config(spec), cls.config_space(spec)
        assert space and all(set(c) <= set(default) for c in space)
        assert default["num_stages"] in schedule.pipeline_stages(page_size)
    for kv_dtype in ("bfloat16", "float8_e4m3fn"):  # 4 rows, head_dim 128: the warp-split kernel
        spec = dict(cls.warm_specs[1], dtype="bfloat16", kv_dtype=kv_dtype)
        assert cls.tunable_kernel(spec) is paged_decode_warps_kernel
        # the autotuner builds it as the op does: with the kernel's own barriers only
        assert cls.tunable_pass_configs(spec) == {"tl.disable_thread_storage_sync": True}
        default, space = cls.default_config(spec), cls.config_space(spec)
        assert default["block_N"] == (128 if kv_dtype == "float8_e4m3fn" else 64) and default["min_blocks"] == 3
        assert default["num_stages"] in schedule.WARP_STAGES and space
        assert all(c["block_N"] in (64, 128) and c["num_stages"] in schedule.WARP_STAGES for c in space)
        wide = dict(spec, head_dim=256)  # head_dim 256: split_kv, TileLang's barriers
        assert cls.tunable_kernel(wide) is paged_decode_split_kernel and cls.tunable_pass_configs(wide) is None


# ----------------------------------------------------------------------------- custom ops (fake / meta)
def _meta_inputs(num_heads, num_kv_heads, head_dim, page_size, dtype, kv_layout, nq=1, device="meta", alibi=False,
                 kv_dtype=None):
    cache = ((40, num_kv_heads, page_size, head_dim) if kv_layout == "HND" else (40, page_size, num_kv_heads, head_dim))
    ints = lambda *shape: torch.empty(shape, dtype=torch.int32, device=device)  # noqa: E731
    return dict(q=torch.empty(3 * nq, num_heads, head_dim, dtype=dtype, device=device),
                k_cache=torch.empty(cache, dtype=kv_dtype or dtype, device=device),
                v_cache=torch.empty(cache, dtype=kv_dtype or dtype, device=device),
                block_tables=ints(3, 9), seq_lens=ints(3),
                alibi_slopes=torch.empty(num_heads, device=device) if alibi else None)


@pytest.mark.parametrize("dtype,kv_layout,alibi,kv_dtype", [(torch.bfloat16, "HND", False, None),
                                                            (torch.float16, "NHD", True, FP8)])
def test_custom_op_fake_shapes(dtype, kv_layout, alibi, kv_dtype):
    inputs = _meta_inputs(8, 2, 128, 16, dtype, kv_layout, nq=2, alibi=alibi, kv_dtype=kv_dtype)
    out = paged_attention_decode_op(**inputs, num_q_tokens=2, kv_layout=kv_layout, window_left=5,
                                    logits_soft_cap=2.0, k_scale=0.5, v_scale=2.0)
    assert out.shape == inputs["q"].shape and out.dtype == dtype and out.device.type == "meta"
    out, lse = paged_attention_decode_op(**inputs, num_q_tokens=2, kv_layout=kv_layout, return_lse=True,
                                         validate=False)
    assert out.shape == inputs["q"].shape and lse.shape == (6, 8) and lse.dtype == torch.float32


def test_custom_op_spec_from_shapes():
    inputs = _meta_inputs(12, 4, 64, 32, torch.float16, "NHD", alibi=True, kv_dtype=FP8)
    assert custom_op_spec(inputs["q"], inputs["k_cache"], inputs["alibi_slopes"], None, "NHD", 3, 1.5, 2) == dict(
        num_heads=12, num_kv_heads=4, head_dim=64, page_size=32, dtype=torch.float16, kv_dtype=FP8, use_alibi=True,
        window_left=3, logits_soft_cap=1.5, scale=None, kv_layout="NHD", num_q_tokens=2)
    with pytest.raises(ValueError, match="kv_layout"):
        custom_op_spec(inputs["q"], inputs["k_cache"], None, None, "NDH", -1, 0.0, 1)
    with pytest.raises(ValueError, match="q: expected shape"):
        custom_op_spec(inputs["q"][0], inputs["k_cache"], None, None, "HND", -1, 0.0, 1)
    with pytest.raises(ValueError, match="k_cache: expected a 4-d"):
        custom_op_spec(inputs["q"], inputs["k_cache"][0], None, None, "HND", -1, 0.0, 1)


def test_custom_op_traces_in_one_graph():
    """torch.compile(fullgraph=True) traces the custom ops with no graph break (meta tensors run the fakes)."""
    def fn(q, k_cache, v_cache, block_tables, seq_lens, alibi_slopes):
        out, lse = paged_attention_decode_op(q, k_cache, v_cache, block_tables, seq_lens, 1, alibi_slopes,
                                             window_left=16, return_lse=True)
        return out * 2, lse

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    inputs = _meta_inputs(8, 2, 128, 16, torch.bfloat16, "HND", alibi=True)
    out, lse = compiled(**inputs)
    assert out.shape == inputs["q"].shape and lse.shape == (3, 8)


def test_fp8_shared_memory_model():
    """An FP8 cache widened in shared memory (``split_kv``: head_dim 256, or more than 16 rows) holds 8-bit stages and
    one 16-bit K / V tile they are widened into (the kernel's allocations), not a 16-bit copy per stage; the
    warp-split kernel holds only its ring as stored, which its merge reuses. Both budget registers for 3 CTAs per SM
    at the bench specializations, 16-bit and FP8."""
    tile = 2 * 64 * 128  # K and V elements of a 64-row stage at head_dim 128
    qp = 2 * 16 * (128 + 64)  # the Q and P tiles of 4 rows (one 16-row mma tile)
    assert schedule.smem_bytes(4, 64, 2, 128, fp8=True) == qp + 2 * tile + 2 * tile
    assert schedule.smem_bytes(4, 64, 3, 128, fp8=True) == qp + 3 * tile + 2 * tile
    assert schedule.smem_bytes(4, 64, 2, 128, fp8=False) == qp + 2 * 2 * tile
    for fp8 in (False, True):
        assert schedule.default_config(128, 64, rows=4, fp8=fp8)["min_blocks"] == 3
    assert schedule.splits_keys_over_warps(16, 128) and schedule.splits_keys_over_warps(4, 64)
    assert not schedule.splits_keys_over_warps(17, 128) and not schedule.splits_keys_over_warps(4, 256)
    assert schedule.warp_smem_bytes(64, 4, 128, fp8=True) == 4 * 2 * 64 * 128
    assert schedule.warp_smem_bytes(64, 2, 128, fp8=False) == 2 * 2 * 64 * 128 * 2
    assert schedule.warp_smem_bytes(64, 2, 64, fp8=True) == 4 * 32 * 36 * 4 + 4 * 16 * 2 * 4  # the merge is larger
    # TMA for tiles of at most 4 pages (one thread reads a table entry per page), else cp.async rows
    assert schedule.loads_by_tma(16, 64) and schedule.loads_by_tma(256, 128)
    assert not schedule.loads_by_tma(16, 128) and not schedule.loads_by_tma(8, 64)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("size", [1, 2])
def test_warp_kernel_fragment_dims(head_dim, size):
    """The warp-split kernel's rotated fragment order (kernels/split_kv_warps.py `k_dim`, `v_dim`): a lane's K / q
    elements and a column's V elements are each a permutation of its own dims, in 16-byte runs; and on a 16-bit
    head_dim-128 tile in TMA's 128-byte swizzle (two 64-column bands, the 16-byte unit XOR the row mod 8) each quarter
    warp's 16-byte K loads (lane (g, t): row 8 j + g) and V loads (rows 2 t + e + 8 h, B column g) cover the 8
    distinct bank groups."""
    from ops.paged_decode.kernels.split_kv_warps import k_dim, v_dim
    unit = 16 // size
    td, nb = head_dim // 4, head_dim // 8
    for t in range(4):
        assert sorted(k_dim(t, k, head_dim, unit) for k in range(td)) == list(range(t * td, (t + 1) * td))
        assert all(k_dim(t, k + 1, head_dim, unit) == k_dim(t, k, head_dim, unit) + 1
                   for k in range(td) if (k + 1) % min(unit, td))
    for n in range(8):
        assert sorted(v_dim(n, x, head_dim, unit) for x in range(nb)) == list(range(n * nb, (n + 1) * nb))
    if (head_dim, size) != (128, 2):
        return

    def group(row, col):  # TMA's 128-byte swizzle of a [rows, 128] 16-bit tile in two bands
        return ((col % 64) // 8) ^ (row % 8)

    for q in range(4):
        lanes = range(8 * q, 8 * q + 8)
        for j in range(2):
            for c in range(4):
                assert len({group(8 * j + lane // 4, k_dim(lane % 4, 8 * c, 128, 8)) for lane in lanes}) == 8
        for h in range(2):
            for e in range(2):
                for c in range(2):
                    assert len({group(8 * h + 2 * (lane % 4) + e, v_dim(lane // 4, 8 * c, 128, 8))
                                for lane in lanes}) == 8


@pytest.mark.parametrize("head_dim", [64, 128])
def test_warp_kernel_swizzle(head_dim):
    """The warp-split kernel's shared rows when it gathers them by cp.async (kernels/split_kv_warps.py `swizzled`):
    every 16-byte unit of a 128-key tile has its own slot, 8- and 16-bit; and at head_dim 128 an FP8 warp's fragment
    loads are free of bank conflicts: each quarter warp's 16-byte K loads (lane (g, t): row 8 j + g, bytes 32 t +
    16 c) and V loads (rows 2 t + e + 8 h, bytes 16 g) cover the 8 distinct 16-byte bank groups."""
    from ops.paged_decode.kernels.split_kv_warps import swizzled

    for size in (1, 2):  # bytes an element
        unit = 16 // size
        units = [int(swizzled(r, unit * u, head_dim, unit)) for r in range(128) for u in range(head_dim // unit)]
        assert sorted(units) == list(range(0, 128 * head_dim, unit))
    if head_dim != 128:
        return

    def slot(row, byte):
        return int(swizzled(row, byte, head_dim, 16))

    def conflict_free(addrs):  # 8 lanes' 16-byte loads: one 128-byte wavefront
        return len({a % 128 // 16 for a in addrs}) == 8

    for j in range(2):  # K: lanes 8q .. 8q + 7 of a quarter warp q
        for c in range(2):
            for q in range(4):
                assert conflict_free([slot(16 + 8 * j + lane // 4, 32 * (lane % 4) + 16 * c)
                                      for lane in range(8 * q, 8 * q + 8)])
    for h in range(2):  # V
        for e in range(2):
            for q in range(4):
                assert conflict_free([slot(16 + 8 * h + 2 * (lane % 4) + e, 16 * (lane // 4))
                                      for lane in range(8 * q, 8 * q + 8)])
