"""PagedAttentionPrefillTileLang on the GPU: compiled vs golden on random ragged batches over
shuffled, NaN-poisoned paged caches; poisoned outputs; CUDA-graph capture and replay; the custom op
under torch.compile."""

import pytest
import torch

from golden.paged_prefill import paged_attention_prefill
from ops.paged_prefill import PagedAttentionPrefillTileLang
from ops.paged_prefill import paged_attention_prefill as paged_attention_prefill_op
from test_paged_prefill import make_batch  # tests/ is on sys.path under pytest

TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2, torch.float32: 4e-3}  # fp32 runs as TF32

# spec, q_lens, histories (q_len 0 and 1, history 0, lengths not multiples of any tile)
GPU_CASES = [
    (dict(num_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype=torch.bfloat16, kv_layout="HND"),
     [0, 1, 130, 257, 77], [5, 0, 300, 0, 1000]),
    (dict(num_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype=torch.bfloat16, use_alibi=True,
          kv_layout="NHD"), [33, 0, 200], [500, 7, 0]),
    (dict(num_heads=4, num_kv_heads=4, head_dim=64, page_size=1, dtype=torch.float16, use_alibi=True,
          kv_layout="NHD"), [3, 70, 0, 1], [0, 40, 9, 63]),
    (dict(num_heads=4, num_kv_heads=1, head_dim=256, page_size=64, dtype=torch.float32, kv_layout="HND"),
     [65, 1, 200], [0, 129, 31]),
    (dict(num_heads=6, num_kv_heads=2, head_dim=256, page_size=256, dtype=torch.bfloat16, use_alibi=True,
          kv_layout="HND"), [300, 2, 129], [0, 600, 1]),
    (dict(num_heads=4, num_kv_heads=2, head_dim=64, page_size=64, dtype=torch.float16, kv_layout="HND"),
     [1, 1, 1, 250], [100, 0, 63, 64]),
    (dict(num_heads=8, num_kv_heads=2, head_dim=128, page_size=32, dtype=torch.bfloat16, use_alibi=True,
          kv_layout="NHD"), [33, 0, 200, 1], [500, 7, 0, 95]),  # whole-page loads from the NHD layout
    (dict(num_heads=3, num_kv_heads=3, head_dim=128, page_size=16, dtype=torch.float16, kv_layout="NHD"),
     [130, 1, 300], [0, 77, 20]),  # one query head per tile row: Q tiles by one copy of all tokens
    (dict(num_heads=8, num_kv_heads=2, head_dim=256, page_size=64, dtype=torch.float16, kv_layout="NHD"),
     [64, 1, 200], [0, 129, 31]),  # one Q buffer (head_dim 256) with O stored by TMA for full tiles
]


def _run(spec, q_lens, histories, use_out, poisoned, table_dtype=torch.int32):
    op = PagedAttentionPrefillTileLang(**spec)
    batch = make_batch(q_lens, histories, spec["num_heads"], spec["num_kv_heads"], spec["head_dim"],
                       spec["page_size"], spec["dtype"], device="cuda", kv_layout=spec["kv_layout"],
                       use_alibi=spec.get("use_alibi", False), table_dtype=table_dtype)
    if use_out:
        out = torch.full_like(batch["q"], float("nan"))
        got = op(**batch, out=out)
        assert got is out
    else:
        with poisoned():
            got = op(**batch)
    want = paged_attention_prefill(**batch, kv_layout=spec["kv_layout"])
    assert torch.isfinite(got).all()
    tol = TOL[spec["dtype"]]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(GPU_CASES)))
def test_matches_golden(case, poisoned):
    spec, q_lens, histories = GPU_CASES[case]
    _run(spec, q_lens, histories, use_out=case % 2 == 0, poisoned=poisoned,
         table_dtype=torch.int64 if case % 3 == 0 else torch.int32)


@pytest.mark.gpu
def test_matches_golden_random_ragged(poisoned):
    spec = GPU_CASES[0][0]
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    for _ in range(3):
        n = int(torch.randint(1, 7, (), generator=gen))
        q_lens = torch.randint(0, 300, (n,), generator=gen).tolist()
        histories = torch.randint(0, 700, (n,), generator=gen).tolist()
        _run(spec, q_lens, histories, use_out=False, poisoned=poisoned)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])  # one CTA per work item; CTA pairs (cluster launch)
def test_cuda_graph_capture_and_replay(page_size):
    spec = dict(GPU_CASES[0][0], page_size=page_size)
    op = PagedAttentionPrefillTileLang(**spec)
    assert op.config["cluster"] == (1 if page_size == 16 else 2)
    batch = make_batch([40, 0, 129], [7, 3, 200], 8, 2, 128, page_size, torch.bfloat16, device="cuda")
    out = torch.full_like(batch["q"], float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        op(**batch, out=out, validate=False)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op(**batch, out=out, validate=False)
    batch["q"].copy_(torch.randn_like(batch["q"]))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = paged_attention_prefill(**batch)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_value_checks_on_gpu():
    op = PagedAttentionPrefillTileLang(**GPU_CASES[0][0])
    batch = make_batch([4, 5], [0, 3], 8, 2, 128, 16, torch.bfloat16, device="cuda")
    batch["seq_lens"][1] = 2
    with pytest.raises(ValueError, match="seq_lens"):
        op(**batch)


@pytest.mark.gpu
@pytest.mark.parametrize("config",
                         PagedAttentionPrefillTileLang.config_space(dict(head_dim=64, page_size=32, dtype="bfloat16")),
                         ids=lambda c: f"N{c['block_N']}-s{c['num_stages']}-c{c['cluster']}")
def test_warp_specialized_configs(config, poisoned):
    """Every config the autotuner may pick, on MQA (8 query heads packed per tile) with long
    histories (the stage ring wraps many times)."""
    spec = dict(num_heads=8, num_kv_heads=1, head_dim=64, page_size=32, dtype=torch.bfloat16, kv_layout="HND",
                config=config)
    _run(spec, [200, 1, 0, 77, 16], [700, 0, 5, 1300, 2000], use_out=False, poisoned=poisoned)


_FP8_WS_SPEC = dict(num_heads=8, num_kv_heads=1, head_dim=64, page_size=32, dtype=torch.bfloat16, kv_layout="HND",
                    kv_dtype=torch.float8_e4m3fn)


@pytest.mark.gpu
@pytest.mark.parametrize("config", PagedAttentionPrefillTileLang.config_space(
    dict(head_dim=64, page_size=32, dtype="bfloat16", kv_dtype="float8_e4m3fn")),
    ids=lambda c: f"s{c['num_stages']}-v{c['v_widen']}-c{c['cluster']}")
def test_fp8_warp_specialized_configs(config, poisoned):
    """Every ring depth the autotuner may pick for an 8-bit cache (its converter warps widen V into a ring of
    v_widen tiles), on MQA with long histories (every ring wraps many times), against the golden."""
    spec, q_lens, histories = _FP8_WS_SPEC, [200, 1, 0, 77, 16], [700, 0, 5, 1300, 2000]
    op = PagedAttentionPrefillTileLang(**spec, config=config)
    batch, scales = _option_batch(spec, q_lens, histories)
    want, _ = _golden(spec, batch, scales)
    with poisoned():
        got = op(**batch, **scales)
    tol = TOL[spec["dtype"]] * 2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_scores_split_q_exactly(dtype, poisoned):
    """The FP8 scores split each Q row into e4m3 terms (two for bf16, three for fp16) under a power-of-two scale
    from the row's largest |q| (exact), against the golden: q x 100 with the softmax scale / 100, and among its
    rows one of zeros, one x 1e-6, one of exact powers of two (on the scale's boundaries), one whose other entries
    are 2^-20 of its largest. (The logits stay moderate: the FP8 products sum in the tensor cores' narrower
    accumulator, ~2^-13 of the running sum, which at logits of ~100 moves a softmax by percents.)"""
    spec = dict(_FP8_WS_SPEC, dtype=dtype)
    op = PagedAttentionPrefillTileLang(**spec, scale=spec["head_dim"] ** -0.5 / 100)
    batch, scales = _option_batch(spec, [130, 7], [300, 40])
    q = batch["q"].float() * 100
    gen = torch.Generator(device="cpu").manual_seed(7)
    q[0] = 0
    q[1] *= 1e-6
    q[2] = 2.0 ** torch.randint(-6, 9, q[2].shape, generator=gen).float().to(q.device)
    q[3] = q[3].sign() * 2.0 ** -20
    q[3, :, 0] = 300.0
    q[131] = 0
    batch["q"] = q.to(dtype)
    want = paged_attention_prefill(**batch, kv_layout=spec["kv_layout"], scale=op.scale, **scales)
    with poisoned():
        got = op(**batch, **scales)
    tol = TOL[dtype] * 2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.gpu
def test_schedule_orders_tiles_by_work():
    """Every query tile exactly once, by non-increasing KV work (history + first row), spare tiles last."""
    gen = torch.Generator().manual_seed(3)
    for spec, q_lens, histories in GPU_CASES[:1] + GPU_CASES[4:5] + GPU_CASES[7:]:
        op = PagedAttentionPrefillTileLang(**spec)
        for _ in range(4):
            seq_lens = [q + h for q, h in zip(q_lens, histories)]
            cum = torch.tensor([0] + q_lens).cumsum(0)
            tile_seq, tile_q0 = op.schedule(int(cum[-1]), torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
                                            cum.to("cuda", torch.int32))
            tile_seq, tile_q0 = tile_seq.tolist(), tile_q0.tolist()
            tokens = op.tile_tokens
            want = sorted((s, j) for s, q in enumerate(q_lens) for j in range(0, q, tokens))
            real = [(s, q0) for s, q0 in zip(tile_seq, tile_q0) if s >= 0]
            assert sorted(real) == want
            assert tile_seq[len(real):] == [-1] * (len(tile_seq) - len(real))  # spare tiles last
            work = [seq_lens[s] - q_lens[s] + q0 for s, q0 in real]
            assert work == sorted(work, reverse=True)
            n = int(torch.randint(1, 9, (), generator=gen))
            q_lens = torch.randint(0, 400, (n,), generator=gen).tolist()
            histories = torch.randint(0, 900, (n,), generator=gen).tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("validate", [False, True])  # True: one host sync inside the op, still one graph
@pytest.mark.parametrize("case", [1, 4, 6])  # ALiBi, all: one CTA per item (NHD); CTA pairs (HND d256; NHD)
def test_torch_compile_fullgraph(case, validate):
    """torch.compile(fullgraph=True) over a function calling the custom op: no graph break, and the same
    output as eager (the same kernel) and as the golden, over two batch shapes (the second one dynamic)."""
    spec, q_lens, histories = GPU_CASES[case]
    layout, use_alibi = spec["kv_layout"], spec.get("use_alibi", False)

    def fn(q, k_cache, v_cache, block_tables, seq_lens, cum_seq_lens_q, alibi_slopes):
        out = paged_attention_prefill_op(q, k_cache, v_cache, block_tables, seq_lens, cum_seq_lens_q,
                                         alibi_slopes, kv_layout=layout, validate=validate)
        return out * 2

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    for lens, hist in ((q_lens, histories), ([q + 3 for q in q_lens], histories[::-1])):
        batch = make_batch(lens, hist, spec["num_heads"], spec["num_kv_heads"], spec["head_dim"], spec["page_size"],
                           spec["dtype"], device="cuda", kv_layout=layout, use_alibi=use_alibi)
        got = compiled(**batch)
        torch.testing.assert_close(got, fn(**batch), rtol=0, atol=0)
        want = paged_attention_prefill(**batch, kv_layout=layout)
        tol = 2 * TOL[spec["dtype"]]  # the doubled output
        torch.testing.assert_close(got.float(), 2 * want.float(), rtol=tol, atol=tol)


@pytest.mark.gpu
def test_custom_op_matches_class():
    spec, q_lens, histories = GPU_CASES[0]
    batch = make_batch(q_lens, histories, 8, 2, 128, 16, torch.bfloat16, device="cuda")
    op = PagedAttentionPrefillTileLang(**spec, scale=0.07)
    got = torch.ops.llm_tile_ops.paged_attention_prefill(**batch, scale=0.07)
    torch.testing.assert_close(got, op(**batch), rtol=0, atol=0)
    batch["seq_lens"][1] = 0  # shorter than its new tokens: the value checks run inside the custom op
    with pytest.raises(ValueError, match="seq_lens"):
        paged_attention_prefill_op(**batch, scale=0.07)


# ----------------------------------------------------------------------------- options (issue 38)
FP8 = torch.float8_e4m3fn
# lse: fp32 math on the same inputs (an FP8 cache is converted exactly, its k_scale multiplies the scores:
# a little more room for the larger scores of k_scale > 1).
LSE_TOL = {False: 1e-3, True: 3e-3}

# spec, q_lens, histories: every option alone and with ALiBi, both layouts, both kernel families, pages 1-256
# (window sizes under, across and over block_N and the histories; window 0: only the diagonal).
OPTION_CASES = [
    (dict(num_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype=torch.bfloat16, window_left=200),
     [0, 1, 130, 257, 77], [5, 0, 300, 0, 1000]),
    (dict(num_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype=torch.bfloat16, use_alibi=True,
          kv_layout="NHD", window_left=37), [33, 0, 200, 1], [500, 7, 0, 95]),
    (dict(num_heads=8, num_kv_heads=2, head_dim=128, page_size=32, dtype=torch.bfloat16, use_alibi=True,
          kv_layout="NHD", window_left=300, logits_soft_cap=2.0), [33, 0, 300, 1], [500, 7, 0, 95]),  # CTA pairs
    (dict(num_heads=6, num_kv_heads=2, head_dim=256, page_size=256, dtype=torch.bfloat16, use_alibi=True,
          window_left=0), [300, 2, 129], [0, 600, 1]),
    (dict(num_heads=4, num_kv_heads=4, head_dim=64, page_size=1, dtype=torch.float16, use_alibi=True,
          kv_layout="NHD", window_left=9, logits_soft_cap=1.5), [3, 70, 0, 1], [0, 40, 9, 63]),
    (dict(num_heads=4, num_kv_heads=1, head_dim=256, page_size=64, dtype=torch.float32, logits_soft_cap=3.0),
     [65, 1, 200], [0, 129, 31]),
    (dict(num_heads=8, num_kv_heads=1, head_dim=64, page_size=64, dtype=torch.float16, use_alibi=True,
          logits_soft_cap=0.5), [64, 1, 200], [0, 129, 31]),
    (dict(num_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype=torch.bfloat16, kv_dtype=FP8),
     [0, 1, 130, 257, 77], [5, 0, 300, 0, 1000]),
    (dict(num_heads=8, num_kv_heads=2, head_dim=128, page_size=64, dtype=torch.float16, use_alibi=True,
          kv_layout="NHD", kv_dtype=FP8, window_left=150, logits_soft_cap=4.0), [33, 0, 300, 1], [500, 7, 0, 95]),
    (dict(num_heads=4, num_kv_heads=2, head_dim=64, page_size=4, dtype=torch.bfloat16, use_alibi=True,
          kv_dtype=FP8, window_left=20), [3, 70, 1], [0, 40, 63]),  # FP8 row gathers
    (dict(num_heads=8, num_kv_heads=8, head_dim=256, page_size=128, dtype=torch.bfloat16, kv_dtype=FP8,
          logits_soft_cap=10.0), [129, 1], [300, 0]),
]


def _option_batch(spec, q_lens, histories, table_dtype=torch.int32):
    batch = make_batch(q_lens, histories, spec["num_heads"], spec["num_kv_heads"], spec["head_dim"],
                       spec["page_size"], spec["dtype"], device="cuda", kv_layout=spec.get("kv_layout", "HND"),
                       use_alibi=spec.get("use_alibi", False), table_dtype=table_dtype, kv_dtype=spec.get("kv_dtype"))
    scales = {}
    if spec.get("kv_dtype") == FP8:
        scales = dict(k_scale=0.37, v_scale=torch.tensor([1.9], device="cuda"))
    return batch, scales


def _golden(spec, batch, scales):
    return paged_attention_prefill(**batch, kv_layout=spec.get("kv_layout", "HND"),
                                   window_left=spec.get("window_left", -1),
                                   logits_soft_cap=spec.get("logits_soft_cap", 0.0), return_lse=True, **scales)


def _free_pages_outside_windows(spec, batch):
    """Poison (NaN) every page wholly before each sequence's first query's window and set its table entry to
    -1, as an engine that frees them would: the op must neither read them nor check them."""
    w, ps = spec.get("window_left", -1), spec["page_size"]
    if w < 0:
        return
    cum = batch["cum_seq_lens_q"].tolist()
    for s, kv_len in enumerate(batch["seq_lens"].tolist()):
        first = max(0, kv_len - (cum[s + 1] - cum[s]) - w)
        for b in range(first // ps):
            blk = int(batch["block_tables"][s, b])
            batch["k_cache"][blk] = float("nan")
            batch["v_cache"][blk] = float("nan")
            batch["block_tables"][s, b] = -1


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(OPTION_CASES)))
def test_options_match_golden(case, poisoned):
    """Output and log-sum-exp against the golden, for both the one-call form (validate=True, int64 tables on
    odd cases) and plan + run; pages outside every window freed (NaN, table -1)."""
    spec, q_lens, histories = OPTION_CASES[case]
    op = PagedAttentionPrefillTileLang(**spec)
    batch, scales = _option_batch(spec, q_lens, histories, torch.int64 if case % 2 else torch.int32)
    want, want_lse = _golden(spec, batch, scales)
    _free_pages_outside_windows(spec, batch)
    with poisoned():
        got, lse = op(**batch, return_lse=True, **scales)
    assert torch.isfinite(got).all() and torch.isfinite(lse).all()
    fp8 = spec.get("kv_dtype") == FP8
    tol = TOL[spec["dtype"]] * (2 if fp8 else 1)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse, want_lse, rtol=LSE_TOL[fp8], atol=LSE_TOL[fp8])
    plan = op.plan(batch["block_tables"], batch["seq_lens"], batch["cum_seq_lens_q"],
                   num_pages=batch["k_cache"].shape[0])
    again = op.run(batch["q"], batch["k_cache"], batch["v_cache"], plan, batch["alibi_slopes"], **scales)
    torch.testing.assert_close(again, got, rtol=0, atol=0)  # deterministic, and the same as the one call


# fp8_compute: both products on FP8 (q and P rounded to e4m3); heads packed or not, both layouts, pages 16-256
FP8_COMPUTE_CASES = [
    (dict(num_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype=torch.bfloat16), [0, 1, 130, 257, 77],
     [5, 0, 300, 0, 1000]),
    (dict(num_heads=8, num_kv_heads=2, head_dim=128, page_size=64, dtype=torch.float16, use_alibi=True,
          kv_layout="NHD", window_left=150, logits_soft_cap=4.0), [33, 0, 300, 1], [500, 7, 0, 95]),
    (dict(num_heads=8, num_kv_heads=1, head_dim=64, page_size=32, dtype=torch.bfloat16, use_alibi=True),
     [200, 1, 0, 77, 16], [700, 0, 5, 1300, 2000]),
    (dict(num_heads=8, num_kv_heads=8, head_dim=256, page_size=256, dtype=torch.bfloat16, kv_layout="NHD",
          logits_soft_cap=10.0), [129, 1, 64], [300, 0, 31]),
]


def _round_q_like_fp8_compute(q):
    """q as the fp8_compute kernel rounds it: each (token, head) row scaled by the power of two s that puts its
    largest |q| in [128, 256), rounded to e4m3, times s."""
    q = q.float()
    big = q.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -120)
    s = torch.exp2(torch.floor(torch.log2(big)) - 7)
    return (q / s).to(FP8).float() * s


def _check_fp8_compute(spec, q_lens, histories, poisoned, config=None):
    """fp8_compute against the golden run on the kernel's rounding of q: what remains is P rounded to e4m3 (4
    significant bits: each product p v off by at most 2^-4 of it, while the softmax's sum takes the unrounded p),
    so |out - golden| <= 2^-4 max |v_scale v| of the head (e4m3's subnormal p below 2^-6 aside); the
    log-sum-exp sees no rounding of P. Returns the batch, its scales and the output."""
    spec = dict(spec, kv_dtype=FP8)
    op = PagedAttentionPrefillTileLang(**spec, fp8_compute=True, config=config)
    batch, scales = _option_batch(spec, q_lens, histories)
    exact = dict(batch, q=_round_q_like_fp8_compute(batch["q"]).to(spec["dtype"]))
    want, want_lse = _golden(spec, exact, scales)
    _free_pages_outside_windows(spec, batch)
    with poisoned():
        got, lse = op(**batch, return_lse=True, **scales)
    assert torch.isfinite(got).all() and torch.isfinite(lse).all()
    err = (got.float() - want.float()).abs()
    v = batch["v_cache"].float().nan_to_num().abs().amax() * float(scales["v_scale"])
    assert err.max() <= v / 16 + TOL[spec["dtype"]]
    torch.testing.assert_close(lse, want_lse, rtol=LSE_TOL[True], atol=LSE_TOL[True])
    return batch, scales, got


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(FP8_COMPUTE_CASES)))
def test_fp8_compute_matches_golden(case, poisoned):
    """fp8_compute within its bound (`_check_fp8_compute`); the custom op gives the same bits."""
    spec, q_lens, histories = FP8_COMPUTE_CASES[case]
    batch, scales, got = _check_fp8_compute(spec, q_lens, histories, poisoned)
    tensors = {k: torch.as_tensor(v, dtype=torch.float32, device="cuda").reshape(1) for k, v in scales.items()}
    again = paged_attention_prefill_op(**batch, kv_layout=spec.get("kv_layout", "HND"),
                                       window_left=spec.get("window_left", -1),
                                       logits_soft_cap=spec.get("logits_soft_cap", 0.0), fp8_compute=True, **tensors)
    torch.testing.assert_close(again, got, rtol=0, atol=0)  # the custom op serves the same kernel


@pytest.mark.gpu
@pytest.mark.parametrize("config", PagedAttentionPrefillTileLang.config_space(
    dict(head_dim=64, page_size=32, dtype="bfloat16", kv_dtype="float8_e4m3fn", fp8_compute=True)),
    ids=lambda c: f"s{c['num_stages']}-v{c['v_widen']}-c{c['cluster']}")
def test_fp8_compute_configs(config, poisoned):
    """Every ring depth the autotuner may pick for fp8_compute (8-bit stages, transposed V), on MQA with long
    histories (every ring wraps many times)."""
    _check_fp8_compute(_FP8_WS_SPEC, [200, 1, 0, 77, 16], [700, 0, 5, 1300, 2000], poisoned, config)


@pytest.mark.gpu
@pytest.mark.parametrize("spec_case", [0, 1])  # warp-specialized (GPU_CASES 0) and gather (GPU_CASES 2)
def test_return_lse_matches_golden(spec_case, poisoned):
    spec, q_lens, histories = GPU_CASES[[0, 2][spec_case]]
    op = PagedAttentionPrefillTileLang(**spec)
    batch = make_batch(q_lens, histories, spec["num_heads"], spec["num_kv_heads"], spec["head_dim"],
                       spec["page_size"], spec["dtype"], device="cuda", kv_layout=spec["kv_layout"],
                       use_alibi=spec.get("use_alibi", False))
    with poisoned():
        out, lse = op(**batch, return_lse=True)
    want, want_lse = paged_attention_prefill(**batch, kv_layout=spec["kv_layout"], return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == out.shape[:2]
    torch.testing.assert_close(lse, want_lse, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(out.float(), want.float(), rtol=TOL[spec["dtype"]], atol=TOL[spec["dtype"]])


@pytest.mark.gpu
@pytest.mark.parametrize("page_size,kv_dtype", [(16, None), (64, None), (16, FP8), (4, None)])
def test_plan_run_cuda_graph_capture_and_replay(page_size, kv_dtype):
    """plan once (int32 index tensors are kept, not copied), run two layers inside one CUDA graph (no host
    synchronization), replay with new q and caches; the outputs and lse match the golden."""
    spec = dict(num_heads=8, num_kv_heads=2, head_dim=128, page_size=page_size, dtype=torch.bfloat16,
                use_alibi=True, window_left=100, logits_soft_cap=20.0, kv_dtype=kv_dtype)
    op = PagedAttentionPrefillTileLang(**spec)
    first, scales = _option_batch(spec, [40, 0, 129], [7, 3, 200])
    first.update(seq_lens=first["seq_lens"].int(), cum_seq_lens_q=first["cum_seq_lens_q"].int())
    # two layers of one batch: the same index tensors, their own q and caches
    second = {**first, **{k: first[k].clone() for k in ("q", "k_cache", "v_cache")}}
    layers = [(first, scales), (second, scales)]
    plan = op.plan(first["block_tables"], first["seq_lens"], first["cum_seq_lens_q"])
    assert plan.block_tables is first["block_tables"] and plan.seq_lens is first["seq_lens"]
    outs = [torch.full_like(b["q"], float("nan")) for b, _ in layers]
    lses = []

    def step():
        lses.clear()
        for (b, scales), out in zip(layers, outs):
            lses.append(op.run(b["q"], b["k_cache"], b["v_cache"], plan, b["alibi_slopes"], out=out,
                               return_lse=True, **scales)[1])

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for (b, _), out in zip(layers, outs):
        b["q"].copy_(torch.randn_like(b["q"], dtype=torch.float32))
        b["k_cache"].copy_(torch.randn_like(b["k_cache"], dtype=torch.float32).to(b["k_cache"].dtype))
        out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for (b, scales), out, lse in zip(layers, outs, lses):
        want, want_lse = _golden(spec, b, scales)
        torch.testing.assert_close(out.float(), want.float(), rtol=4e-2, atol=4e-2)
        tol = LSE_TOL[kv_dtype == FP8]
        torch.testing.assert_close(lse, want_lse, rtol=tol, atol=tol)


@pytest.mark.gpu
def test_plan_of_another_batch_is_rejected():
    spec = GPU_CASES[0][0]
    op = PagedAttentionPrefillTileLang(**spec)
    a = make_batch([5, 9], [0, 3], 8, 2, 128, 16, torch.bfloat16, device="cuda")
    b = make_batch([5, 10], [0, 3], 8, 2, 128, 16, torch.bfloat16, device="cuda")
    plan = op.plan(a["block_tables"], a["seq_lens"], a["cum_seq_lens_q"], num_pages=a["k_cache"].shape[0])
    with pytest.raises(ValueError, match="q: expected 14 tokens"):
        op.run(b["q"], b["k_cache"], b["v_cache"], plan)
    other = PagedAttentionPrefillTileLang(**dict(spec, num_heads=16, num_kv_heads=2))  # 16-token tiles
    with pytest.raises(ValueError, match="plan: made by an op"):
        other.run(torch.randn(14, 16, 128, device="cuda", dtype=torch.bfloat16), a["k_cache"], a["v_cache"], plan)
    bad = a["seq_lens"].clone()
    bad[0] = 2
    with pytest.raises(ValueError, match="seq_lens"):
        op.plan(a["block_tables"], bad, a["cum_seq_lens_q"])


@pytest.mark.gpu
@pytest.mark.parametrize("case", [0, 2, 6])  # warp-specialized, gather, CTA pairs
def test_strided_q_and_out(case, poisoned):
    """q sliced from a fused QKV projection and out a strided view: no copies, the same result."""
    spec, q_lens, histories = GPU_CASES[case]
    op = PagedAttentionPrefillTileLang(**spec)
    batch = make_batch(q_lens, histories, spec["num_heads"], spec["num_kv_heads"], spec["head_dim"],
                       spec["page_size"], spec["dtype"], device="cuda", kv_layout=spec["kv_layout"],
                       use_alibi=spec.get("use_alibi", False))
    total, heads, d = batch["q"].shape
    fused = torch.randn(total, heads + 2 * spec["num_kv_heads"], d, device="cuda").to(spec["dtype"])
    fused[:, :heads] = batch["q"]
    q = fused[:, :heads]
    out_buf = torch.full((total, heads, 2, d), float("nan"), device="cuda", dtype=spec["dtype"])
    out = out_buf[:, :, 1]
    assert not q.is_contiguous() and not out.is_contiguous()
    with poisoned():
        got = op(**{**batch, "q": q}, out=out)
    assert got is out and torch.isnan(out_buf[:, :, 0]).all()  # nothing written outside the view
    want = paged_attention_prefill(**batch, kv_layout=spec["kv_layout"])
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[spec["dtype"]], atol=TOL[spec["dtype"]])


# ----------------------------------------------------------------------------- dynamic schedule
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])  # one CTA per item; CTA pairs (mailbox from rank 0 to rank 1)
def test_dynamic_schedule_relaunch_and_determinism(page_size):
    """The persistent kernel pulls items from a counter: relaunching with the same counter buffer (the
    kernel leaves it zeroed, as the autotuner relies on), many more items than CTAs, fewer items than
    CTAs, and a concurrent stream competing for SMs all give the golden's result, bitwise repeatable."""
    spec = dict(num_heads=8, num_kv_heads=2, head_dim=128, page_size=page_size, dtype=torch.bfloat16,
                use_alibi=True)
    op = PagedAttentionPrefillTileLang(**spec)
    assert op.sched_len > 0
    gen = torch.Generator().manual_seed(5)
    many = torch.randint(1, 700, (40,), generator=gen).tolist(), torch.randint(0, 900, (40,), generator=gen).tolist()
    for q_lens, histories in (many, ([3, 1], [0, 40])):
        batch = make_batch(q_lens, histories, 8, 2, 128, page_size, torch.bfloat16, device="cuda", use_alibi=True)
        want = paged_attention_prefill(**batch)
        args = op.tune_args(*(batch[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens",
                                                 "cum_seq_lens_q", "alibi_slopes")))
        out, sched = args[-3], args[-1]
        results = []
        for _ in range(3):  # the same Sched buffer each time
            out.fill_(float("nan"))
            op.kernel(*args)
            torch.cuda.synchronize()
            assert not sched.any()  # left zeroed
            results.append(out.clone())
        torch.testing.assert_close(results[0].float(), want.float(), rtol=2e-2, atol=2e-2)
        assert all(r.equal(results[0]) for r in results[1:])
        # a competing stream: CTAs start late and take fewer items, each item's math unchanged
        side = torch.cuda.Stream()
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        with torch.cuda.stream(side):
            for _ in range(4):
                a @ a
        got = op(**batch)
        torch.cuda.synchronize()
        assert got.equal(results[0])
