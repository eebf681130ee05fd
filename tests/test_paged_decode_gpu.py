"""PagedAttentionDecodeTileLang on the GPU: compiled vs golden over ragged batches on shuffled NaN-poisoned
paged caches, for every option and their combinations with ALiBi, both layouts, pages 1-256, FP8 caches,
1-8 query tokens; with many splits, the default split and no split; poisoned outputs; lse; window tiles
never read; CUDA-graph capture and replay of run (also after the lengths grow); bitwise determinism; the
custom ops under torch.compile."""

import pytest
import torch

from golden.paged_decode import paged_attention_decode
from ops.paged_decode import PagedAttentionDecodeTileLang
from ops.paged_decode import paged_attention_decode as paged_attention_decode_op
from test_paged_decode import make_decode_batch  # tests/ is on sys.path under pytest

FP8 = torch.float8_e4m3fn
TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}
# Split rules (config overrides; the kernels are the same builds): many short splits (combine), the
# default, one split per sequence (direct write, no combine).
SPLITS = {"many": dict(ctas_per_sm=100000, min_split_tiles=1), "default": {},
          "none": dict(ctas_per_sm=1, min_split_tiles=1 << 20)}

# spec, seq_lens, (k_scale, v_scale): seq_len 1 (or nq), exact page multiples, one past a page, long ones
GPU_CASES = [
    (dict(num_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16),
     [1, 16, 17, 1000, 4100], None),
    (dict(num_heads=8, num_kv_heads=2, head_dim=128, page_size=64, dtype=torch.float16, use_alibi=True,
          kv_layout="NHD"), [63, 64, 65, 3000], None),
    (dict(num_heads=4, num_kv_heads=4, head_dim=64, page_size=1, dtype=torch.bfloat16, use_alibi=True),
     [1, 2, 77, 300], None),
    (dict(num_heads=16, num_kv_heads=2, head_dim=256, page_size=256, dtype=torch.bfloat16, kv_layout="NHD",
          window_left=100, logits_soft_cap=30.0), [5, 256, 257, 2000], None),
    (dict(num_heads=8, num_kv_heads=1, head_dim=128, page_size=32, dtype=torch.float16, use_alibi=True,
          window_left=50, num_q_tokens=4), [4, 33, 500], None),
    (dict(num_heads=6, num_kv_heads=2, head_dim=128, page_size=8, dtype=torch.float16, window_left=0,
          num_q_tokens=8), [8, 9, 100], None),
    (dict(num_heads=32, num_kv_heads=8, head_dim=128, page_size=128, dtype=torch.bfloat16, logits_soft_cap=10.0,
          use_alibi=True, num_q_tokens=2), [2, 129, 9000], None),
    (dict(num_heads=32, num_kv_heads=8, head_dim=64, page_size=2, dtype=torch.bfloat16, kv_layout="NHD",
          window_left=7, use_alibi=True, logits_soft_cap=5.0, num_q_tokens=3), [3, 4, 555], None),
    (dict(num_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16, kv_dtype=FP8),
     [1, 17, 5000], (0.5, 2.0)),
    (dict(num_heads=8, num_kv_heads=2, head_dim=128, page_size=64, dtype=torch.float16, kv_dtype=FP8,
          kv_layout="NHD", use_alibi=True, window_left=300, logits_soft_cap=20.0, num_q_tokens=3),
     [3, 64, 65, 2500], (1.3, 0.7)),
    (dict(num_heads=4, num_kv_heads=2, head_dim=64, page_size=4, dtype=torch.bfloat16, kv_dtype=FP8),
     [1, 4, 5, 700], (None, None)),
    (dict(num_heads=8, num_kv_heads=4, head_dim=256, page_size=32, dtype=torch.bfloat16, kv_dtype=FP8,
          use_alibi=True, num_q_tokens=2), [2, 31, 1500], (0.8, 1.1)),
    # the warp-split kernel at its limits: 16 rows (8 heads x 2 tokens), 256-row pages and a window; 15 rows (3
    # heads x 5 tokens), head_dim 64, one-row pages, NHD, ALiBi and a soft cap
    (dict(num_heads=16, num_kv_heads=2, head_dim=128, page_size=256, dtype=torch.float16, kv_dtype=FP8,
          window_left=1000, num_q_tokens=2), [2, 255, 257, 7000], (0.9, 1.2)),
    (dict(num_heads=12, num_kv_heads=4, head_dim=64, page_size=1, dtype=torch.bfloat16, kv_dtype=FP8,
          kv_layout="NHD", use_alibi=True, logits_soft_cap=15.0, num_q_tokens=5), [5, 6, 1234], (1.1, 0.6)),
]
# GPU_CASES run by the warp-split kernel (<= 16 rows, head_dim <= 128; the rest by split_kv): its TMA pages at
# 0, 1, 6 (16-bit) and 9, 12 (FP8), its cp.async rows at 2, 7 (16-bit) and 8, 10, 13 (FP8)
WARP_CASES = [0, 1, 2, 6, 7, 8, 9, 10, 12, 13]


def _case(case, splits="default"):
    spec, seq_lens, scales = GPU_CASES[case]
    op = PagedAttentionDecodeTileLang(**spec, config=SPLITS[splits])
    batch = make_decode_batch(seq_lens, spec.get("num_q_tokens", 1), spec["num_heads"], spec["num_kv_heads"],
                              spec["head_dim"], spec["page_size"], spec["dtype"], device="cuda",
                              kv_layout=spec.get("kv_layout", "HND"), use_alibi=spec.get("use_alibi", False),
                              kv_dtype=spec.get("kv_dtype"), seed=case)
    k_scale, v_scale = scales or (None, None)
    return spec, op, batch, dict(k_scale=k_scale, v_scale=v_scale)


def _golden(spec, batch, scales):
    return paged_attention_decode(**batch, num_q_tokens=spec.get("num_q_tokens", 1),
                                  kv_layout=spec.get("kv_layout", "HND"), window_left=spec.get("window_left", -1),
                                  logits_soft_cap=spec.get("logits_soft_cap", 0.0), return_lse=True, **scales)


def _check(spec, got, lse, want, want_lse):
    assert torch.isfinite(got).all() and torch.isfinite(lse).all()
    tol = TOL[spec["dtype"]]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse, want_lse, rtol=1e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", list(SPLITS))
@pytest.mark.parametrize("case", range(len(GPU_CASES)))
def test_matches_golden(case, splits, poisoned):
    spec, op, batch, scales = _case(case, splits)
    assert ("paged_decode_warps" in op.split_kernel.get_kernel_source()) == (case in WARP_CASES)
    with poisoned():
        plan = op.plan(batch["block_tables"], batch["seq_lens"])
        got, lse = op.run(batch["q"], batch["k_cache"], batch["v_cache"], plan, batch["alibi_slopes"], **scales,
                          return_lse=True)
    if splits == "many":
        assert plan.num_splits > 1
    if splits == "none":
        assert plan.num_splits == 1
    _check(spec, got, lse, *_golden(spec, batch, scales))


@pytest.mark.gpu
@pytest.mark.parametrize("config", [dict(block_N=128, num_stages=3), dict(block_N=64, num_stages=2),
                                    dict(block_N=64, num_stages=6), dict(block_N=128, num_stages=2)])
@pytest.mark.parametrize("case", [0, 8, 12])
def test_warp_kernel_configs(case, config, poisoned):
    """The warp-split kernel's tile sizes (16 and 32 keys a warp) and ring depths, with many splits, on 16-bit and
    FP8 caches (TMA pages, or cp.async rows where a tile spans more than 4 pages)."""
    spec, _, batch, scales = _case(case)
    op = PagedAttentionDecodeTileLang(**spec, config=dict(config, **SPLITS["many"]))
    assert "paged_decode_warps" in op.split_kernel.get_kernel_source()
    with poisoned():
        got, lse = op(batch["q"], batch["k_cache"], batch["v_cache"], batch["block_tables"], batch["seq_lens"],
                      batch["alibi_slopes"], return_lse=True, **scales)
    _check(spec, got, lse, *_golden(spec, batch, scales))


@pytest.mark.gpu
@pytest.mark.parametrize("case", [0, 4, 8])
def test_one_call_out_and_scale_tensors(case, poisoned):
    """The one-call form with out= (NaN-filled), int64 tables, scales as fp32 tensors, validate=False."""
    spec, op, batch, scales = _case(case)
    out = torch.full_like(batch["q"], float("nan"))
    tensors = {k: None if v is None else torch.tensor([v], device="cuda") for k, v in scales.items()}
    got = op(batch["q"], batch["k_cache"], batch["v_cache"], batch["block_tables"].long(), batch["seq_lens"].long(),
             batch["alibi_slopes"], out=out, validate=False, **tensors)
    assert got is out
    want, _ = _golden(spec, batch, scales)
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[spec["dtype"]], atol=TOL[spec["dtype"]])


@pytest.mark.gpu
def test_random_ragged_batches(poisoned):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    spec = dict(num_heads=16, num_kv_heads=4, head_dim=128, page_size=16, dtype=torch.bfloat16, use_alibi=True,
                window_left=200, num_q_tokens=2)
    op = PagedAttentionDecodeTileLang(**spec)
    for _ in range(3):
        n = int(torch.randint(1, 9, (), generator=gen))
        seq_lens = torch.randint(2, 3000, (n,), generator=gen).tolist()
        batch = make_decode_batch(seq_lens, 2, 16, 4, 128, 16, torch.bfloat16, device="cuda", use_alibi=True,
                                  seed=int(torch.randint(0, 1000, (), generator=gen)))
        with poisoned():
            got, lse = op(batch["q"], batch["k_cache"], batch["v_cache"], batch["block_tables"], batch["seq_lens"],
                          batch["alibi_slopes"], return_lse=True)
        _check(spec, got, lse, *_golden(spec, batch, dict(k_scale=None, v_scale=None)))


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_window_tiles_never_read(page_size):
    """Positions in KV tiles wholly before every row's window hold NaN: a read of one would show."""
    spec = dict(num_heads=8, num_kv_heads=2, head_dim=128, page_size=page_size, dtype=torch.bfloat16,
                window_left=70, num_q_tokens=2)
    op = PagedAttentionDecodeTileLang(**spec, config=SPLITS["many"])
    seq_lens = [2, 300, 2000]
    batch = make_decode_batch(seq_lens, 2, 8, 2, 128, page_size, torch.bfloat16, device="cuda", poison=False)
    want = _golden(spec, batch, dict(k_scale=None, v_scale=None))[0]
    block_N = op.config["block_N"]
    for b, n in enumerate(seq_lens):
        first_tile_pos = (max(n - 2 - 70, 0) // block_N) * block_N
        for t in range(first_tile_pos):
            page, off = int(batch["block_tables"][b, t // page_size]), t % page_size
            batch["k_cache"][page, :, off] = float("nan")
            batch["v_cache"][page, :, off] = float("nan")
    got = op(batch["q"], batch["k_cache"], batch["v_cache"], batch["block_tables"], batch["seq_lens"])
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("case,splits", [(1, "many"), (1, "none"), (9, "many")])
def test_bitwise_deterministic(case, splits):
    spec, op, batch, scales = _case(case, splits)
    plan = op.plan(batch["block_tables"], batch["seq_lens"])
    args = (batch["q"], batch["k_cache"], batch["v_cache"], plan, batch["alibi_slopes"])
    first, first_lse = op.run(*args, return_lse=True, **scales)
    for _ in range(5):
        out, lse = op.run(*args, return_lse=True, **scales)
        assert out.equal(first) and lse.equal(first_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("case,splits", [(0, "default"), (0, "none"), (8, "many"), (4, "many")])
def test_cuda_graph_capture_and_replay(case, splits):
    """run captured once, replayed on new q / cache values and on sequences that grew (in place) since the
    plan: the graph holds no host-side value."""
    spec, op, batch, scales = _case(case, splits)
    nq = spec.get("num_q_tokens", 1)
    # the cache holds the grown lengths; the plan (and the first replay) sees them shorter by up to a page
    grown = batch["seq_lens"].clone()
    short = torch.clamp(grown - spec["page_size"] // 2 - 1, min=nq).to(torch.int32)
    seq_lens = short.clone()
    plan = op.plan(batch["block_tables"], seq_lens)
    out = torch.empty_like(batch["q"])
    lse = torch.empty(out.shape[:2], dtype=torch.float32, device="cuda")
    k_scale, v_scale = (torch.tensor([v if v is not None else 1.0], device="cuda") for v in scales.values())

    def step():
        o, l_ = op.run(batch["q"], batch["k_cache"], batch["v_cache"], plan, batch["alibi_slopes"], k_scale=k_scale,
                       v_scale=v_scale, out=out, return_lse=True)
        lse.copy_(l_)

    step()  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in (short, grown):
        batch["q"].copy_(torch.randn_like(batch["q"], dtype=torch.float32).to(batch["q"].dtype))
        out.fill_(float("nan"))
        seq_lens.copy_(lens)
        graph.replay()
        torch.cuda.synchronize()
        want, want_lse = _golden(spec, {**batch, "seq_lens": seq_lens}, scales)
        _check(spec, out, lse, want, want_lse)


@pytest.mark.gpu
def test_custom_ops_and_torch_compile():
    spec, _, batch, scales = _case(4)
    kw = dict(num_q_tokens=4, kv_layout="HND", window_left=50)
    want, want_lse = _golden(spec, batch, scales)
    args = (batch["q"], batch["k_cache"], batch["v_cache"], batch["block_tables"], batch["seq_lens"])
    out = paged_attention_decode_op(*args, alibi_slopes=batch["alibi_slopes"], **kw)
    torch.testing.assert_close(out.float(), want.float(), rtol=4e-3, atol=4e-3)

    def fn(q, k_cache, v_cache, block_tables, seq_lens, alibi_slopes):
        o, l_ = paged_attention_decode_op(q, k_cache, v_cache, block_tables, seq_lens, alibi_slopes=alibi_slopes,
                                          return_lse=True, validate=False, **kw)
        return o * 2, l_

    torch._dynamo.reset()
    o2, lse = torch.compile(fn, fullgraph=True)(*args, batch["alibi_slopes"])
    torch.testing.assert_close(o2.float(), 2 * want.float(), rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(lse, want_lse, rtol=1e-3, atol=2e-3)
