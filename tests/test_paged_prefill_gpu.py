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
