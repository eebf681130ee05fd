"""HSA extend on the GPU: compiled vs golden.hsa_decode.hsa_extend on ragged chunks over paged histories (outputs
poisoned with NaN), both strategies and combines, windows of 0, less than a page and several pages, stale reprs,
top-k above the candidates, histories of 0 and less than a page, q_len = 1 against the decode op, CUDA-graph
capture of plan + run with validation off, bitwise equal repeated calls, the scores run a request at a time, and the
entry lists' kernels against a loop.
Selections are compared up to near-ties (assert_selection_up_to_ties)."""

import pytest
import torch

from golden.hsa_decode import extend_rows, hsa_extend, random_case, select_pages
from ops.hsa import HSADecodeTileLang, HSAExtendTileLang
from test_hsa_extend import page_entries_match_a_loop, random_selections  # tests/ is on sys.path under pytest

pytestmark = pytest.mark.gpu

SPECS = {
    "bench": dict(num_heads=32, num_kv_heads=8, head_dim=128, page_size=64, topk=64, dtype=torch.bfloat16,
                  selection_strategy="group", window_size=512, combine="softmax"),
    "head_token": dict(num_heads=8, num_kv_heads=2, head_dim=128, page_size=32, topk=4, dtype=torch.float16,
                       selection_strategy="head", window_size=20, combine="token"),  # window below a page
    "no_window": dict(num_heads=16, num_kv_heads=1, head_dim=64, page_size=16, topk=300, dtype=torch.bfloat16,
                      selection_strategy="group", window_size=0, combine="softmax"),  # topk above the candidates
    # G = 1, head_dim 64: many score steps (pages of 16) over 128-token tiles
    "group_g1": dict(num_heads=8, num_kv_heads=8, head_dim=64, page_size=16, topk=8, dtype=torch.float16,
                     selection_strategy="group", window_size=0, combine="token"),
    # G x head_dim = 2048: 32-token score tiles on mma.sync, 16 accumulators maxed
    "wide_group": dict(num_heads=32, num_kv_heads=2, head_dim=128, page_size=16, topk=16, dtype=torch.bfloat16,
                       selection_strategy="head", window_size=40, combine="token"),
}
# (history, new tokens) per request: no history, history below a page, chunks across pages, a request with no new
# token, long histories
BATCHES = {
    "bench": [(0, 700), (50, 64), (4000, 129), (9000, 0), (20000, 333), (15000, 40)],
    "group_g1": [(0, 200), (3000, 130), (20000, 64), (500, 0), (100, 1)],
    "head_token": [(0, 1), (17, 40), (300, 100), (2000, 7)],
    "no_window": [(5, 3), (1000, 200), (0, 33), (3000, 1)],
    "wide_group": [(0, 50), (300, 70), (1500, 33)],
}
TOL = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=4e-3, rtol=4e-3)}
# Selection scores are fp32 dots summed in another order than the golden's: pages whose scores differ by less
# may swap (scores here are of order 1-10, their rounding errors ~1e-6).
SCORE_TOL = 1e-4
_OPS = {}


def get_op(name):
    if name not in _OPS:
        _OPS[name] = HSAExtendTileLang(**SPECS[name])
    return _OPS[name]


def make_batch(name, seed, invalid_frac=0.1):
    torch.manual_seed(seed)
    s = SPECS[name]
    hist_new = BATCHES[name]
    case = random_case([h + n for h, n in hist_new], s["num_heads"], s["num_kv_heads"], s["head_dim"], s["page_size"],
                       dtype=s["dtype"], device="cuda", invalid_frac=invalid_frac)
    cum = torch.tensor([0] + [n for _, n in hist_new]).cumsum(0).to(torch.int32).cuda()
    case["q"] = torch.randn(int(cum[-1]), s["num_heads"], s["head_dim"], device="cuda").to(s["dtype"])
    case["cum_seq_lens_q"] = cum
    return case


def golden_of(name, b, selected_page_ids=None):
    s = SPECS[name]
    return hsa_extend(b["q"], b["k_buffer"], b["v_buffer"], b["page_table"], b["seq_lens"], b["cum_seq_lens_q"],
                      b["chunk_repr"], s["page_size"], s["topk"], s["selection_strategy"], s["window_size"],
                      s["combine"], b["repr_valid"], selected_page_ids=selected_page_ids)


def assert_selection_up_to_ties(name, b, ids, ids_ref, scores_ref):
    """The kernel's selection is the golden's, except where near-ties swap pages: at every rank of a differing
    row, the page the kernel chose has (by the golden's scores of all candidates) the golden's score at that rank
    within SCORE_TOL, and such rows are rare."""
    differ = (ids != ids_ref).any(-1)  # [rows, Hkv]
    if not differ.any():
        return
    assert differ.float().mean() < 0.01, f"{int(differ.sum())} of {differ.numel()} selections differ"
    s = SPECS[name]
    req, row_lens = extend_rows(b["seq_lens"], b["cum_seq_lens_q"])
    rows = differ.any(-1).nonzero().flatten()
    # every candidate of the differing rows, scored by the golden (top-k = all pages)
    every, every_scores = select_pages(b["q"][rows], b["page_table"][req[rows]], row_lens[rows], b["chunk_repr"],
                                       s["page_size"], b["page_table"].shape[1], s["selection_strategy"],
                                       s["window_size"], b["repr_valid"])
    for i, r in enumerate(rows.tolist()):
        for h in differ[r].nonzero().flatten().tolist():
            score_of = dict(zip(every[i, h].tolist(), every_scores[i, h].tolist()))
            score_of[-1] = float("-inf")  # padding past the candidates
            chosen = ids[r, h].tolist()
            assert len(set(chosen) - {-1}) == sum(p >= 0 for p in chosen), f"row {r} head {h}: a page chosen twice"
            got = torch.tensor([score_of[p] for p in chosen])  # KeyError: a page that is no candidate
            torch.testing.assert_close(got, scores_ref[r, h].cpu(), atol=SCORE_TOL, rtol=0)


def check_against_golden(name, b, o, ids):
    """The op's selection against the golden's up to near-ties, then its output against the golden run on that
    selection (like with like where near-ties swapped pages)."""
    _, ids_ref, scores_ref = golden_of(name, b)
    assert_selection_up_to_ties(name, b, ids, ids_ref, scores_ref)
    o_ref, _, _ = golden_of(name, b, selected_page_ids=ids)
    torch.testing.assert_close(o.float(), o_ref.float(), **TOL[SPECS[name]["dtype"]])


@pytest.mark.parametrize("name", list(SPECS))
def test_extend_matches_golden(name, poisoned):
    op, b = get_op(name), make_batch(name, seed=1)
    with poisoned():
        o, ids = op(b["q"], b["k_buffer"], b["v_buffer"], b["page_table"], b["seq_lens"], b["cum_seq_lens_q"],
                    b["chunk_repr"], b["repr_valid"], return_selection=True)
    check_against_golden(name, b, o, ids)


def test_extend_is_deterministic():
    """Bitwise equal outputs of two calls: the entry lists' order within a group varies (atomics), the page-major
    kernel's rows do not depend on it."""
    name = "bench"
    op, b = get_op(name), make_batch(name, seed=5)
    args = (b["q"], b["k_buffer"], b["v_buffer"], b["page_table"], b["seq_lens"], b["cum_seq_lens_q"], b["chunk_repr"],
            b["repr_valid"])
    assert torch.equal(op(*args), op(*args))


@pytest.mark.parametrize("name", ["bench", "head_token"])
def test_reprs_gathered_a_request_at_a_time(name, monkeypatch):
    """With a workspace of one request's reprs (EXTEND_REPRS_BYTES = 1), the score kernel runs once per request
    (each launch scoring only its request's tiles): the same selection and output, bitwise."""
    import ops.hsa.extend as extend
    op, b = get_op(name), make_batch(name, seed=6)
    args = (b["q"], b["k_buffer"], b["v_buffer"], b["page_table"], b["seq_lens"], b["cum_seq_lens_q"], b["chunk_repr"],
            b["repr_valid"])
    o, ids = op(*args, return_selection=True)
    monkeypatch.setattr(extend, "EXTEND_REPRS_BYTES", 1)
    o_1, ids_1 = op(*args, return_selection=True)
    assert torch.equal(ids, ids_1) and torch.equal(o, o_1)


@pytest.mark.parametrize("name", list(SPECS))
def test_page_entries_kernels(name):
    s = SPECS[name]
    page_entries_match_a_loop(get_op(name), random_selections(300, s["num_kv_heads"], s["topk"], s["topk"] + 40,
                                                              "cuda"), s["topk"] + 40)


def test_one_new_token_is_decode():
    """q_len = 1 for every request: the golden decode's selection (up to near-ties: the extend scores by a GEMM,
    the decode by its own kernel), and the decode op's output on that selection (within the 16-bit tolerance: the
    extend's page-major kernels and the decode's split kernel sum in other orders)."""
    name = "head_token"
    torch.manual_seed(2)
    s = SPECS[name]
    case = random_case([1, 40, 700, 2000], s["num_heads"], s["num_kv_heads"], s["head_dim"], s["page_size"],
                       dtype=s["dtype"], device="cuda", invalid_frac=0.1)
    cum = torch.arange(5, dtype=torch.int32, device="cuda")
    o, ids = get_op(name)(case["q"], case["k_buffer"], case["v_buffer"], case["page_table"], case["seq_lens"], cum,
                          case["chunk_repr"], case["repr_valid"], return_selection=True)
    torch.testing.assert_close(o.float(), HSADecodeTileLang(**s)(**case, selected_page_ids=ids).float(),
                               **TOL[s["dtype"]])
    b = dict(case, cum_seq_lens_q=cum)
    _, ids_ref, scores_ref = golden_of(name, b)
    assert_selection_up_to_ties(name, b, ids, ids_ref, scores_ref)


def test_cuda_graph_capture_with_validation_off():
    name = "bench"
    op, b = get_op(name), make_batch(name, seed=3)
    plan = op.plan(b["page_table"], b["seq_lens"], b["cum_seq_lens_q"], b["q"].shape[0], validate=False)
    out = torch.empty_like(b["q"])
    op.run(b["q"], b["k_buffer"], b["v_buffer"], b["chunk_repr"], plan, b["repr_valid"], out=out)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op.run(b["q"], b["k_buffer"], b["v_buffer"], b["chunk_repr"], plan, b["repr_valid"], out=out)
    b["q"].copy_(torch.randn_like(b["q"]))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    o_ref, _, _ = golden_of(name, b)
    torch.testing.assert_close(out.float(), o_ref.float(), **TOL[SPECS[name]["dtype"]])


@pytest.mark.parametrize("name", list(SPECS))
def test_extend_memcheck_shapes(name):
    """Small ragged batches for ``PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python -m pytest
    -m gpu tests/test_hsa_extend_gpu.py -k memcheck``: the last tile of a request short of tokens, a request of no new
    token, histories below and across the window, every kernel of the selection and the attention."""
    torch.manual_seed(4)
    s = SPECS[name]
    hist_new = [(0, 3), (70, 0), (700, 19), (90, 1), (9000, 5)]
    case = random_case([h + n for h, n in hist_new], s["num_heads"], s["num_kv_heads"], s["head_dim"], s["page_size"],
                       dtype=s["dtype"], device="cuda", invalid_frac=0.2)
    cum = torch.tensor([0] + [n for _, n in hist_new]).cumsum(0).to(torch.int32).cuda()
    case["q"] = torch.randn(int(cum[-1]), s["num_heads"], s["head_dim"], device="cuda").to(s["dtype"])
    b = dict(case, cum_seq_lens_q=cum)
    o, ids = get_op(name)(b["q"], b["k_buffer"], b["v_buffer"], b["page_table"], b["seq_lens"], cum,
                                b["chunk_repr"], b["repr_valid"], return_selection=True)
    check_against_golden(name, b, o, ids)
