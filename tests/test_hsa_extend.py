"""HSAExtendTileLang on the CPU: the plan's decode rows against the golden's, the run's glue with the golden in
place of the decode's kernels (it must give golden.hsa_decode.hsa_extend), and the value checks (the golden itself
is checked against the float64 decode definition token by token in test_hsa_decode.py)."""

import pytest
import torch

from golden.hsa_decode import extend_rows, hsa_decode, hsa_extend, random_case, select_pages
import ops.hsa.extend as extend_module
from ops.hsa import HSAExtendTileLang
from test_hsa_decode import COMPILE_SPECS  # tests/ is on sys.path under pytest

# the spec of test_hsa_decode.py's COMPILE_SPECS[0]: its kernels are built there
SPEC = dict(num_heads=4, num_kv_heads=4, head_dim=64, page_size=16, topk=8, dtype=torch.float16,
            selection_strategy="group", window_size=0, combine="softmax", config={"split_overhead": 0})


@pytest.fixture(scope="module")
def op():
    return HSAExtendTileLang(**SPEC)


@pytest.fixture(autouse=True)
def cpu_tensors_ok(allow_cpu_tensors):
    """Lets the op's checks run on CPU tensors: only the CUDA-device error is waived."""
    allow_cpu_tensors(extend_module)


def _batch(seq_lens=(70, 16, 40, 5), q_lens=(20, 0, 40, 1)):
    torch.manual_seed(0)
    case = random_case(list(seq_lens), num_heads=4, num_kv_heads=4, head_dim=64, page_size=16, dtype=torch.float16,
                       invalid_frac=0.1)
    cum = torch.tensor((0,) + tuple(q_lens)).cumsum(0).to(torch.int32)
    case["q"] = torch.randn(int(cum[-1]), 4, 64).to(torch.float16)
    case["cum_seq_lens_q"] = cum
    return case


def _golden_select(q, chunk_repr, plan, repr_valid=None):
    """HSAExtendTileLang.select (the tiles' score GEMM, then the decode's top-k) computed by the golden."""
    return select_pages(q, plan.page_table, plan.seq_lens, chunk_repr, 16, 8, "group", 0, repr_valid)[0]


class _GoldenDecode:
    """HSADecodeTileLang's call as extend's run uses it, computed by the golden."""

    def __call__(self, q, k_buffer, v_buffer, page_table, seq_lens, chunk_repr, repr_valid=None,
                 selected_page_ids=None, out=None, validate=True):
        o, _, _ = hsa_decode(q, k_buffer, v_buffer, page_table, seq_lens, chunk_repr, 16, 8,
                             selected_page_ids=selected_page_ids)
        return o


@pytest.mark.compile
def test_plan_rows_are_the_goldens(op):
    b = _batch()
    plan = op.plan(b["page_table"], b["seq_lens"], b["cum_seq_lens_q"], b["q"].shape[0], b["chunk_repr"].shape[0])
    req, lens = extend_rows(b["seq_lens"], b["cum_seq_lens_q"])
    assert torch.equal(plan.page_table, b["page_table"][req]) and torch.equal(plan.seq_lens, lens)
    assert plan.page_table.dtype == plan.seq_lens.dtype == torch.int32


@pytest.mark.compile
@pytest.mark.parametrize("q_lens", [(20, 0, 40, 1), (0, 0, 0, 0), (16, 17, 1, 33)])
def test_tiles_cover_every_token_once(op, q_lens):
    """The score tiles: every new token in exactly one tile of its request, tiles of tile_tokens consecutive tokens
    (fewer at a request's end) in request order, spare tiles (request -1) last, the count the host bound."""
    cum = torch.tensor((0,) + q_lens).cumsum(0).to(torch.int32)
    tile_req, tile_row0 = op.tiles(cum, int(cum[-1]))
    tokens, want = op.tile_tokens, []
    for b, n in enumerate(q_lens):
        want += [(b, int(cum[b]) + i) for i in range(0, n, tokens)]
    got = list(zip(tile_req.tolist(), tile_row0.tolist()))
    assert got[:len(want)] == want and all(r == -1 for r, _ in got[len(want):])
    assert len(got) == (int(cum[-1]) + len(q_lens) * (tokens - 1)) // tokens
    assert tile_req.dtype == tile_row0.dtype == torch.int32


@pytest.mark.compile
def test_run_is_the_golden_extend(op, monkeypatch):
    b = _batch()
    monkeypatch.setattr(op, "decode", _GoldenDecode())
    monkeypatch.setattr(op, "select", _golden_select)
    o, ids = op(b["q"], b["k_buffer"], b["v_buffer"], b["page_table"], b["seq_lens"], b["cum_seq_lens_q"],
                b["chunk_repr"], b["repr_valid"], return_selection=True, validate=False)
    o_ref, ids_ref, _ = hsa_extend(b["q"], b["k_buffer"], b["v_buffer"], b["page_table"], b["seq_lens"],
                                b["cum_seq_lens_q"], b["chunk_repr"], 16, 8, repr_valid=b["repr_valid"])
    assert torch.equal(ids, ids_ref) and torch.equal(o, o_ref)


@pytest.mark.compile
@pytest.mark.parametrize("cum,seq_lens,match", [
    ([1, 21, 21, 61, 62], None, "cum_seq_lens_q: expected to start at 0"),
    ([0, 30, 20, 61, 61], None, "never decrease"),
    ([0, 20, 20, 60, 60], None, "end at total_q = 61"),
    ([0, 20, 20, 60, 61], [70, 16, 39, 5], r"q_len\) <= its seq_len"),
    ([0, 20, 20, 60, 61], [70, 0, 40, 5], "seq_lens: expected values in"),
])
def test_value_checks(op, cum, seq_lens, match):
    b = _batch()
    sl = b["seq_lens"] if seq_lens is None else torch.tensor(seq_lens, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        op.plan(b["page_table"], sl, torch.tensor(cum, dtype=torch.int32), 61, b["chunk_repr"].shape[0])


@pytest.mark.compile
def test_rejects_bad_types(op):
    b = _batch()
    with pytest.raises(TypeError, match="cum_seq_lens_q"):
        op.plan(b["page_table"], b["seq_lens"], b["cum_seq_lens_q"].long(), 61)
    with pytest.raises(ValueError, match="total_q"):
        op.plan(b["page_table"], b["seq_lens"], b["cum_seq_lens_q"], -1)
    plan = op.plan(b["page_table"], b["seq_lens"], b["cum_seq_lens_q"], 61)
    with pytest.raises(ValueError, match="q"):
        op.run(b["q"][:60], b["k_buffer"], b["v_buffer"], b["chunk_repr"], plan)
    with pytest.raises(TypeError, match="plan"):
        op.run(b["q"], b["k_buffer"], b["v_buffer"], b["chunk_repr"], (plan.page_table, plan.seq_lens))


# ----------------------------------------------------------------------------- compile-only (sm_90a)
@pytest.mark.compile
@pytest.mark.parametrize("spec", COMPILE_SPECS,
                         ids=lambda s: f"{s['selection_strategy']}G{s['num_heads'] // s['num_kv_heads']}")
def test_compiles_for_sm90a(spec):
    """The extend's own kernel (the tiles' score GEMM); the rest are the decode's, built in test_hsa_decode.py."""
    spec = {k: v for k, v in spec.items() if k != "score_config"}  # the decode's score kernel only
    source = HSAExtendTileLang(**spec).score_kernel.get_kernel_source()
    assert "__global__" in source and "wgmma" in source
