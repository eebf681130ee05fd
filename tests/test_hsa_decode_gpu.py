"""HSA decode on the GPU: selection and decode vs the golden on random ragged batches (outputs poisoned
with NaN), given selections, ties, HSA extend's build of the top-k against the decode's, page reprs, every
validation error, CUDA-graph capture/replay, and the custom ops (eager and under torch.compile(fullgraph=True))
against the classes."""

import pytest
import torch

from golden.hsa_decode import hsa_decode, page_repr, random_case
import ops.hsa as hsa_ops
from ops.common.runtime import compile_kernel
from ops.hsa import HSADecodeTileLang, HSAPageReprTileLang
from ops.hsa.kernels.topk import hsa_topk_kernel
from ops.hsa.schedule import EXTEND_HIST_BITS, EXTEND_TOPK_THREADS
from test_hsa_extend import rows_to_key_tiles  # tests/ is on sys.path under pytest

pytestmark = pytest.mark.gpu

# One op per spec (kernels are built once per process); together they cover fp16/bf16, head dims
# 64/128/256, page sizes 16..128, G 1..16, both strategies and both combine modes.
SPECS = {
    "bench": dict(num_heads=32, num_kv_heads=8, head_dim=128, page_size=64, topk=64, dtype=torch.bfloat16,
                  selection_strategy="group", window_size=512, combine="softmax"),
    "token": dict(num_heads=32, num_kv_heads=8, head_dim=128, page_size=64, topk=64, dtype=torch.bfloat16,
                  selection_strategy="head", window_size=512, combine="token"),
    "g16": dict(num_heads=16, num_kv_heads=1, head_dim=64, page_size=16, topk=8, dtype=torch.float16,
                selection_strategy="head", window_size=0, combine="softmax"),
    "d256": dict(num_heads=4, num_kv_heads=4, head_dim=256, page_size=128, topk=4, dtype=torch.bfloat16,
                 selection_strategy="group", window_size=100, combine="token"),
    "g4": dict(num_heads=8, num_kv_heads=2, head_dim=128, page_size=32, topk=16, dtype=torch.float16,
               selection_strategy="group", window_size=40, combine="softmax", scale=0.05),
    # many short decode splits (empty ones past a request's items)
    "splits": dict(num_heads=32, num_kv_heads=8, head_dim=128, page_size=64, topk=64, dtype=torch.bfloat16,
                   selection_strategy="group", window_size=512, combine="softmax", config={"split_overhead": 0}),
    # rows of many key batches for the top-k (2048 keys a batch)
    "long": dict(num_heads=8, num_kv_heads=2, head_dim=64, page_size=16, topk=40, dtype=torch.float16,
                 selection_strategy="group", window_size=32, combine="softmax"),
    # topk past what the top-k ranks by counting (512): rows of more candidates take the radix select
    "wide": dict(num_heads=4, num_kv_heads=2, head_dim=64, page_size=16, topk=600, dtype=torch.bfloat16,
                 selection_strategy="head", window_size=16, combine="token"),
}
# Ragged lengths: 1 token, page boundaries, no candidates, candidates fewer / more than topk.
SEQ_LENS = {
    "bench": [1, 64, 65, 700, 4160, 20000, 9001],
    "token": [3000, 63, 128, 16384],
    "g16": [1, 16, 17, 100, 257, 1000],
    "d256": [129, 128, 1100, 700],
    "g4": [33, 640, 2000, 5],
    "splits": [1, 64, 65, 700, 4160, 20000, 9001],
    "long": [1, 300, 4100, 20000, 4112, 9000],  # 0..1248 candidates
    "wide": [40000, 3000, 1, 9000],  # 2499, 186, 0 and 561 candidates
}
_OPS = {}
# Output tolerances (inputs are rounded to the dtype, P is rounded to it before the PV product).
TOL = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=4e-3, rtol=4e-3)}


def get_op(name):
    if name not in _OPS:
        _OPS[name] = HSADecodeTileLang(**SPECS[name])
    return _OPS[name]


def make_case(name, seed, invalid_frac=0.1, seq_lens=None):
    torch.manual_seed(seed)
    s = SPECS[name]
    return random_case(seq_lens or SEQ_LENS[name], s["num_heads"], s["num_kv_heads"], s["head_dim"],
                       s["page_size"], dtype=s["dtype"], device="cuda", invalid_frac=invalid_frac)


def golden_of(name, inputs, **kw):
    s = SPECS[name]
    return hsa_decode(**inputs, page_size=s["page_size"], topk=s["topk"], selection_strategy=s["selection_strategy"],
                      window_size=s["window_size"], combine=s["combine"], scale=s.get("scale"), **kw)


@pytest.mark.parametrize("name", list(SPECS))
def test_select_matches_golden(name, poisoned):
    op, inputs = get_op(name), make_case(name, seed=1)
    with poisoned():
        ids, scores = op.select(inputs["q"], inputs["page_table"], inputs["seq_lens"], inputs["chunk_repr"],
                                inputs["repr_valid"])
    _, ids_ref, scores_ref = golden_of(name, inputs)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(scores, scores_ref, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("name", list(SPECS))
def test_decode_matches_golden(name, poisoned):
    op, inputs = get_op(name), make_case(name, seed=2)
    out = torch.full_like(inputs["q"], float("nan"))
    with poisoned():
        o = op(**inputs, out=out)
    o_ref, _, _ = golden_of(name, inputs)
    assert o is out
    torch.testing.assert_close(o.float(), o_ref.float(), **TOL[SPECS[name]["dtype"]])


@pytest.mark.parametrize("name", ["bench", "g16"])
def test_decode_given_selection(name, poisoned):
    """Holes (-1) anywhere, pages that are not candidates (even local ones): used as given."""
    op, inputs = get_op(name), make_case(name, seed=3)
    B, Hkv, k = inputs["q"].shape[0], SPECS[name]["num_kv_heads"], SPECS[name]["topk"]
    num_pages = inputs["chunk_repr"].shape[0]
    chosen = torch.randint(0, num_pages, (B, Hkv, k), dtype=torch.int32, device="cuda")
    chosen[torch.rand(B, Hkv, k, device="cuda") < 0.3] = -1
    with poisoned():
        o = op(**inputs, selected_page_ids=chosen)
    o_ref, _, _ = golden_of(name, inputs, selected_page_ids=chosen)
    torch.testing.assert_close(o.float(), o_ref.float(), **TOL[SPECS[name]["dtype"]])


def test_ties_go_to_smaller_logical_page():
    op, inputs = get_op("g4"), make_case("g4", seed=4, invalid_frac=0.0)
    inputs["chunk_repr"][:] = inputs["chunk_repr"][0]  # every page of a kv head scores the same
    ids, scores = op.select(inputs["q"], inputs["page_table"], inputs["seq_lens"], inputs["chunk_repr"])
    _, ids_ref, _ = golden_of("g4", inputs)
    assert torch.equal(ids, ids_ref)
    assert (ids_ref[2, :, :16] == inputs["page_table"][2, :16]).all()  # 2000 tokens: 62 candidates


@pytest.mark.parametrize("name,row", [("long", 4), ("long", 3), ("wide", 0)])
def test_ties_go_to_smaller_logical_page_crowded_bin(name, row):
    """Every score equal, so one histogram bin holds every candidate: ranked by counting (255 candidates) or,
    past 512, by the radix select (1248 candidates; 2499 with topk 600)."""
    op, inputs = get_op(name), make_case(name, seed=4, invalid_frac=0.0)
    inputs["chunk_repr"][:] = inputs["chunk_repr"][0]
    ids, _ = op.select(inputs["q"], inputs["page_table"], inputs["seq_lens"], inputs["chunk_repr"])
    _, ids_ref, _ = golden_of(name, inputs)
    assert torch.equal(ids, ids_ref)
    k = SPECS[name]["topk"]
    assert (ids_ref[row, :, :k] == inputs["page_table"][row, :k]).all()


@pytest.mark.parametrize("name,crowded", [("bench", False), ("long", False), ("long", True), ("wide", True)])
def test_extend_topk_build_selects_the_same(name, crowded):
    """HSA extend's build of the top-k (fewer threads and histogram bins, keys by score tile) picks what the decode's
    does, bitwise: random scores, and every score equal (the ranking by counting, and past 512 candidates the radix
    select)."""
    op, inputs = get_op(name), make_case(name, seed=6, invalid_frac=0.0 if crowded else 0.1)
    if crowded:
        inputs["chunk_repr"][:] = inputs["chunk_repr"][0]
    s = SPECS[name]
    keys = op.empty_keys(inputs["q"].shape[0], inputs["page_table"].shape[1], inputs["q"].device)
    op.score_kernel(inputs["q"], inputs["page_table"], inputs["seq_lens"], inputs["chunk_repr"],
                    op.valid_bytes(inputs["repr_valid"], inputs["chunk_repr"].shape[0], inputs["q"].device), keys)
    extend_topk = compile_kernel(hsa_topk_kernel(s["num_kv_heads"], s["page_size"], s["topk"], s["window_size"],
                                                 EXTEND_TOPK_THREADS, EXTEND_HIST_BITS, tile_rows=128))
    ids, scores = op.top_pages(keys, inputs["page_table"], inputs["seq_lens"])
    # the extend's layout: keys by score tiles of 128 rows, each request a row of its own
    B = keys.shape[0]
    key_rows = torch.arange(B, dtype=torch.int32, device=keys.device)
    tiles = rows_to_key_tiles(keys.view(torch.int32), key_rows, -(-B // 128), 128, keys.shape[2])
    ids_x, scores_x = torch.empty_like(ids), torch.empty_like(scores)
    extend_topk(tiles, key_rows, inputs["page_table"], inputs["seq_lens"], ids_x, scores_x)
    assert torch.equal(ids_x, ids) and torch.equal(scores_x, scores)


def test_bench_long_rows(poisoned):
    """The bench spec with requests of more candidate pages than one batch of the top-k's keys (2048)."""
    op, inputs = get_op("bench"), make_case("bench", seed=11, seq_lens=[140000, 700, 131647])
    with poisoned():
        ids, scores = op.select(inputs["q"], inputs["page_table"], inputs["seq_lens"], inputs["chunk_repr"],
                                inputs["repr_valid"])
        o = op(**inputs)
    o_ref, ids_ref, scores_ref = golden_of("bench", inputs)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(scores, scores_ref, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(o.float(), o_ref.float(), **TOL[torch.bfloat16])


def test_without_repr_valid_every_page_counts():
    """repr_valid=None: every page is valid (an all-valid buffer the op keeps per device, grown on demand)."""
    op = get_op("g4")
    for seed, seq_lens in ((14, [33, 640]), (15, [2000, 5, 900, 3000])):  # the second has more pages
        inputs = make_case("g4", seed, invalid_frac=0.0, seq_lens=seq_lens)
        args = (inputs["q"], inputs["page_table"], inputs["seq_lens"], inputs["chunk_repr"])
        ids, _ = op.select(*args)
        assert torch.equal(ids, op.select(*args, inputs["repr_valid"])[0])
        assert torch.equal(op(**dict(inputs, repr_valid=None)), op(**inputs))
        assert torch.equal(ids, golden_of("g4", dict(inputs, repr_valid=None))[1])


@pytest.mark.parametrize("name", ["bench", "d256"])
def test_back_to_back_calls_agree(name):
    """Calls queued without a sync: every output is bitwise the first one's (deterministic merge order)."""
    op, inputs = get_op(name), make_case(name, seed=12)
    outs = [op(**inputs, validate=False) for _ in range(8)]
    o_ref, _, _ = golden_of(name, inputs)
    torch.testing.assert_close(outs[0].float(), o_ref.float(), **TOL[SPECS[name]["dtype"]])
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_nothing_to_attend_gives_zero():
    op = get_op("g16")
    inputs = make_case("g16", seed=5, seq_lens=[32, 48])
    inputs["repr_valid"][:] = False
    o = op(**inputs)
    assert (o == 0).all()


@pytest.mark.parametrize("mode, dtype", [("mean", torch.bfloat16), ("last", torch.float16)])
def test_page_repr(mode, dtype):
    torch.manual_seed(6)
    op = HSAPageReprTileLang(8, 128, 64, dtype, mode)
    k_buffer = torch.randn(40 * 64, 8, 128, device="cuda").to(dtype)
    chunk_repr = torch.full((40, 8, 128), float("nan"), device="cuda", dtype=dtype)
    page_ids = torch.tensor([7, 0, 39, 12], dtype=torch.int32, device="cuda")
    assert op(k_buffer, page_ids, chunk_repr) is chunk_repr
    want = page_repr(k_buffer, page_ids, 64, mode)
    torch.testing.assert_close(chunk_repr[page_ids.long()], want, atol=1e-2 if mode == "mean" else 0, rtol=1e-2)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[page_ids.long().cpu()] = False
    assert chunk_repr[untouched.cuda()].isnan().all()
    with pytest.raises(ValueError, match="page_ids: expected values in"):
        op(k_buffer, torch.tensor([40], dtype=torch.int32, device="cuda"), chunk_repr)


def test_cuda_graph_capture_and_replay():
    op, inputs = get_op("bench"), make_case("bench", seed=7)
    out = torch.empty_like(inputs["q"])
    op(**inputs, out=out, validate=False)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op(**inputs, out=out, validate=False)
    for seed in (8, 9):
        torch.manual_seed(seed)
        inputs["q"].copy_(torch.randn_like(inputs["q"]))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        o_ref, _, _ = golden_of("bench", inputs)
        torch.testing.assert_close(out.float(), o_ref.float(), **TOL[torch.bfloat16])


BAD_ARGS = [
    ("q", lambda t: t.float(), TypeError, "q: expected dtype"),
    ("q", lambda t: t[:, :4], ValueError, "q: expected shape"),
    ("q", lambda t: t.transpose(0, 1).contiguous().transpose(0, 1), ValueError, "q: expected a contiguous"),
    ("k_buffer", lambda t: t.half(), TypeError, "k_buffer: expected dtype"),
    ("k_buffer", lambda t: t[:, :1], ValueError, "k_buffer: expected shape"),
    ("k_buffer", lambda t: t[:64], ValueError, "k_buffer: expected at least"),
    ("v_buffer", lambda t: t[:-1], ValueError, "v_buffer: expected shape"),
    ("v_buffer", lambda t: t.cpu(), ValueError, "v_buffer: expected a CUDA tensor"),
    ("page_table", lambda t: t.long(), TypeError, "page_table: expected dtype"),
    ("page_table", lambda t: t[:1], ValueError, "page_table: expected shape"),
    ("seq_lens", lambda t: t[:, None], ValueError, "seq_lens: expected shape"),
    ("seq_lens", lambda t: t.long(), TypeError, "seq_lens: expected dtype"),
    ("chunk_repr", lambda t: t[:, :1], ValueError, "chunk_repr: expected shape"),
    ("chunk_repr", lambda t: t.half(), TypeError, "chunk_repr: expected dtype"),
    ("repr_valid", lambda t: t.int(), TypeError, "repr_valid: expected dtype"),
    ("repr_valid", lambda t: t[1:], ValueError, "repr_valid: expected shape"),
    # host-sync value checks
    ("seq_lens", lambda t: torch.where(t == 65, 0, t), ValueError, "seq_len 0 is an error"),
    ("seq_lens", lambda t: torch.where(t == 65, 10 ** 6, t), ValueError, "seq_lens: expected values in"),
    ("page_table", lambda t: torch.where(t == t[2, 1], 10 ** 6, t), ValueError, "page_table: expected the pages"),
    ("selected_page_ids", None, ValueError, "selected_page_ids: expected -1 or"),
]


@pytest.mark.parametrize("key, bad, err, match", BAD_ARGS, ids=[f"{a[0]}-{a[3][:24]}" for a in BAD_ARGS])
def test_rejects_bad_input(key, bad, err, match):
    op, inputs = get_op("bench"), make_case("bench", seed=10)
    if key == "selected_page_ids":
        B = inputs["q"].shape[0]
        inputs[key] = torch.full((B, 8, 64), -2, dtype=torch.int32, device="cuda")
    else:
        inputs[key] = bad(inputs[key])
    with pytest.raises(err, match=match):
        op(**inputs)


# ----------------------------------------------------------------------------- custom ops, torch.compile
def _fn_kwargs(name, select=False):
    """The custom ops' scalar arguments for spec ``name`` (hsa_select takes no combine)."""
    s = SPECS[name]
    kw = dict(page_size=s["page_size"], topk=s["topk"], selection_strategy=s["selection_strategy"],
              window_size=s["window_size"], scale=s.get("scale"))
    return kw if select else dict(kw, combine=s["combine"])


def _select_args(inputs):
    return inputs["q"], inputs["page_table"], inputs["seq_lens"], inputs["chunk_repr"], inputs["repr_valid"]


@pytest.mark.parametrize("name", ["bench", "token", "g4"])
def test_custom_ops_match_class(name):
    """The functions (custom ops) run the classes' kernels: outputs bitwise equal, errors the same."""
    op, inputs = get_op(name), make_case(name, seed=16)
    o = hsa_ops.hsa_decode(**inputs, **_fn_kwargs(name))
    assert torch.equal(o, op(**inputs))
    ids, scores = hsa_ops.hsa_select(*_select_args(inputs), **_fn_kwargs(name, select=True))
    ids_ref, scores_ref = op.select(*_select_args(inputs))
    assert torch.equal(ids, ids_ref) and torch.equal(scores, scores_ref)
    o = torch.ops.llm_tile_ops.hsa_decode(*inputs.values(), ids, **_fn_kwargs(name), validate=False)
    assert torch.equal(o, op(**inputs, selected_page_ids=ids))
    bad = dict(inputs, seq_lens=torch.zeros_like(inputs["seq_lens"]))
    with pytest.raises(ValueError, match="seq_len 0 is an error"):
        hsa_ops.hsa_decode(**bad, **_fn_kwargs(name))
    with pytest.raises(TypeError, match="page_table: expected dtype"):
        hsa_ops.hsa_select(*_select_args(dict(inputs, page_table=inputs["page_table"].long())),
                           **_fn_kwargs(name, select=True))


@pytest.mark.parametrize("name", ["bench", "token"])
def test_torch_compile_fullgraph(name):
    """Selection, decode with and without a given selection, in one compiled graph (no graph break): equal
    to the same function run eagerly."""
    inputs = make_case(name, seed=17)
    kw, sel_kw = _fn_kwargs(name), _fn_kwargs(name, select=True)

    def fn(q, k_buffer, v_buffer, page_table, seq_lens, chunk_repr, repr_valid):
        ids, scores = hsa_ops.hsa_select(q, page_table, seq_lens, chunk_repr, repr_valid, validate=False, **sel_kw)
        o = hsa_ops.hsa_decode(q, k_buffer, v_buffer, page_table, seq_lens, chunk_repr, repr_valid,
                               validate=False, **kw)
        o_given = hsa_ops.hsa_decode(q, k_buffer, v_buffer, page_table, seq_lens, chunk_repr,
                                     selected_page_ids=ids, validate=False, **kw)
        return o, o_given, ids, scores

    eager = fn(**inputs)
    compiled = torch.compile(fn, fullgraph=True)(**inputs)
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)
    o_ref, _, _ = golden_of(name, inputs)
    torch.testing.assert_close(compiled[0].float(), o_ref.float(), **TOL[SPECS[name]["dtype"]])


def test_torch_compile_page_repr():
    """hsa_page_repr mutates chunk_repr inside a compiled graph as it does eagerly."""
    torch.manual_seed(18)
    k_buffer = torch.randn(40 * 64, 8, 128, device="cuda").bfloat16()
    page_ids = torch.tensor([7, 0, 39, 12], dtype=torch.int32, device="cuda")

    def fn(k_buffer, page_ids, chunk_repr):
        out = hsa_ops.hsa_page_repr(k_buffer, page_ids, chunk_repr, page_size=64, mode="mean", validate=False)
        return out[page_ids.long()].float().sum(dim=-1)

    reprs = [torch.full((40, 8, 128), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    eager = fn(k_buffer, page_ids, reprs[0])
    compiled = torch.compile(fn, fullgraph=True)(k_buffer, page_ids, reprs[1])
    assert torch.equal(compiled, eager)
    assert torch.equal(reprs[0].isnan(), reprs[1].isnan()) and torch.equal(reprs[0].nan_to_num(), reprs[1].nan_to_num())
    want = page_repr(k_buffer, page_ids, 64, "mean")
    torch.testing.assert_close(reprs[1][page_ids.long()], want, atol=1e-2, rtol=1e-2)
