"""HSA decode: golden vs a float64 per-request loop written from the issue's rules, validation errors,
and compile-only builds for sm_90a (GPU checks live in test_hsa_decode_gpu.py)."""

import math

import pytest
import torch

from golden.hsa_decode import extend_rows, hsa_decode, hsa_extend, page_repr, random_case, select_pages
from ops.common.validate import check_values
from ops.hsa import HSADecodeTileLang, HSAPageReprTileLang
from ops.hsa.schedule import ZCOLS, num_splits


# ----------------------------------------------------------------------------- float64 definition
def _softmax_attend(qv, keys, vals, scale):
    """Plain-Python softmax attention of one query over lists of key / value vectors -> (o, lse)."""
    logits = [scale * float(qv @ k) for k in keys]
    m = max(logits)
    w = [math.exp(x - m) for x in logits]
    total = sum(w)
    o = sum(wi * v for wi, v in zip(w, vals)) / total
    return o, m + math.log(total)


def reference(q, k_buffer, v_buffer, page_table, seq_lens, chunk_repr, page_size, topk, strategy,
              window_size, combine, repr_valid=None, scale=None):
    """The issue's rules, one request, kv head and query head at a time, in float64."""
    q, k_buffer, v_buffer, chunk_repr = (t.double() for t in (q, k_buffer, v_buffer, chunk_repr))
    B, Hq, D = q.shape
    Hkv = chunk_repr.shape[1]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    o = torch.zeros(B, Hq, D, dtype=torch.float64)
    ids = torch.full((B, Hkv, topk), -1, dtype=torch.int32)
    for b in range(B):
        L = int(seq_lens[b])
        n_full = L // page_size
        lo = min(max(0, L - window_size), n_full * page_size)
        cands = [j for j in range(n_full) if (j + 1) * page_size <= lo
                 and (repr_valid is None or bool(repr_valid[int(page_table[b, j])]))]
        local = [int(page_table[b, t // page_size]) * page_size + t % page_size for t in range(lo, L)]
        for h in range(Hkv):
            heads = [q[b, h * G + g] for g in range(G)]
            score = {}
            for j in cands:
                E = chunk_repr[int(page_table[b, j]), h]
                if strategy == "group":
                    score[j] = scale * float(sum(heads) @ E)
                else:
                    score[j] = max(scale * float(qg @ E) for qg in heads)
            chosen = sorted(cands, key=lambda j: (-score[j], j))[:topk]
            pages = [int(page_table[b, j]) for j in chosen]
            ids[b, h, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
            for g in range(G):
                qv = heads[g]
                page_slots = [[p * page_size + i for i in range(page_size)] for p in pages]
                if combine == "token":
                    slots = [s for ps in page_slots for s in ps] + local
                    if slots:
                        o[b, h * G + g] = _softmax_attend(qv, [k_buffer[s, h] for s in slots],
                                                          [v_buffer[s, h] for s in slots], scale)[0]
                    continue
                outs, logits = [], []
                for p, slots in zip(pages, page_slots):
                    outs.append(_softmax_attend(qv, [k_buffer[s, h] for s in slots],
                                                [v_buffer[s, h] for s in slots], scale)[0])
                    logits.append(scale * float(qv @ chunk_repr[p, h]))
                if local:
                    o_loc, lse_loc = _softmax_attend(qv, [k_buffer[s, h] for s in local],
                                                     [v_buffer[s, h] for s in local], scale)
                    outs.append(o_loc)
                    logits.append(lse_loc)
                if outs:
                    m = max(logits)
                    w = [math.exp(x - m) for x in logits]
                    o[b, h * G + g] = sum(wi * oi for wi, oi in zip(w, outs)) / sum(w)
    return o, ids


# window 0, smaller than a page, several pages (page_size 8); seq_lens hit page boundaries and
# requests with no candidate at all (5) or none outside the window (20).
CASES = [
    dict(window_size=0, topk=3), dict(window_size=5, topk=2), dict(window_size=21, topk=4),
    dict(window_size=0, topk=50),  # topk beyond the candidates
]


@pytest.mark.parametrize("strategy", ["group", "head"])
@pytest.mark.parametrize("combine", ["softmax", "token"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"w{c['window_size']}k{c['topk']}")
def test_golden_matches_float64_definition(strategy, combine, case):
    torch.manual_seed(len(strategy) * 100 + len(combine) * 10 + case["topk"] + case["window_size"])
    inputs = random_case([37, 5, 64, 20, 81], num_heads=6, num_kv_heads=2, head_dim=16, page_size=8,
                         dtype=torch.float64, invalid_frac=0.2)
    o, ids, scores = hsa_decode(**inputs, page_size=8, selection_strategy=strategy, combine=combine, **case)
    o_ref, ids_ref = reference(**inputs, page_size=8, strategy=strategy, combine=combine, **case)
    assert torch.equal(ids, ids_ref)
    assert torch.isneginf(scores[ids < 0]).all() and torch.isfinite(scores[ids >= 0]).all()
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("strategy", ["group", "head"])
@pytest.mark.parametrize("combine", ["softmax", "token"])
def test_golden_extend_is_a_decode_per_new_token(strategy, combine):
    """hsa_extend against the float64 decode definition run token by token: new token i of request b at position
    p = seq_len - q_len + i is a decode of b with seq_len p + 1 and that token's query. Ragged chunks: 0 new
    tokens, a whole request (no history), chunks across page boundaries, a window of several pages."""
    torch.manual_seed(7 + len(strategy) + len(combine))
    seq_lens, q_lens = [37, 5, 64, 20, 81], [5, 0, 17, 20, 9]
    inputs = random_case(seq_lens, num_heads=6, num_kv_heads=2, head_dim=16, page_size=8, dtype=torch.float64,
                         invalid_frac=0.2)
    cum = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    q = torch.randn(int(cum[-1]), 6, 16, dtype=torch.float64)
    kw = dict(page_size=8, topk=3, window_size=13, combine=combine)
    o, ids, _ = hsa_extend(q, inputs["k_buffer"], inputs["v_buffer"], inputs["page_table"], inputs["seq_lens"], cum,
                        inputs["chunk_repr"], selection_strategy=strategy, repr_valid=inputs["repr_valid"], **kw)
    assert o.shape == q.shape and ids.shape == (q.shape[0], 2, 3)
    t = 0
    for b, (L, n) in enumerate(zip(seq_lens, q_lens)):
        for i in range(n):
            o_ref, ids_ref = reference(q[t:t + 1], inputs["k_buffer"], inputs["v_buffer"], inputs["page_table"][b:b + 1],
                                       torch.tensor([L - n + i + 1], dtype=torch.int32), inputs["chunk_repr"],
                                       strategy=strategy, repr_valid=inputs["repr_valid"], **kw)
            assert torch.equal(ids[t:t + 1], ids_ref)
            torch.testing.assert_close(o[t:t + 1], o_ref, rtol=1e-10, atol=1e-10)
            t += 1


def test_golden_extend_of_one_token_is_decode():
    """q_len = 1 for every request: hsa_extend equals hsa_decode of the same batch."""
    torch.manual_seed(3)
    inputs = random_case([37, 5, 64, 20], num_heads=4, num_kv_heads=2, head_dim=16, page_size=8, invalid_frac=0.1)
    cum = torch.arange(5, dtype=torch.int32)
    kw = dict(page_size=8, topk=2, window_size=9)
    o, ids, _ = hsa_extend(cum_seq_lens_q=cum, **inputs, **kw)
    o_dec, ids_dec, _ = hsa_decode(**inputs, **kw)
    assert torch.equal(ids, ids_dec) and torch.equal(o, o_dec)


def test_extend_rows():
    """Each new token's request and decode length: request 0 adds 2 of 5, request 1 none, request 2 all 3."""
    req, lens = extend_rows(torch.tensor([5, 4, 3], dtype=torch.int32), torch.tensor([0, 2, 2, 5]))
    assert req.tolist() == [0, 0, 2, 2, 2] and lens.tolist() == [4, 5, 1, 2, 3]


def test_golden_ties_go_to_smaller_logical_page():
    inputs = random_case([80, 57], num_heads=4, num_kv_heads=1, head_dim=8, page_size=8, dtype=torch.float64)
    inputs["chunk_repr"][:] = torch.randn(8, dtype=torch.float64)  # every page scores the same
    ids, scores = select_pages(inputs["q"], inputs["page_table"], inputs["seq_lens"], inputs["chunk_repr"],
                               page_size=8, topk=3)
    assert torch.equal(ids[:, 0], inputs["page_table"][:, :3])
    assert (scores == scores[:, :, :1]).all()


def test_golden_scale_and_given_selection():
    inputs = random_case([70, 33], num_heads=4, num_kv_heads=2, head_dim=16, page_size=8, dtype=torch.float64)
    chosen = torch.tensor([[[3, -1, 0], [5, 6, -1]], [[-1, -1, -1], [1, 2, 4]]], dtype=torch.int32)
    chosen = inputs["page_table"].gather(1, chosen.clamp(min=0).view(2, -1)).view(2, 2, 3).where(chosen >= 0, -1)
    for combine in ("softmax", "token"):
        o, ids, scores = hsa_decode(**inputs, page_size=8, topk=3, window_size=9, combine=combine,
                                    selected_page_ids=chosen, scale=0.3)
        assert scores is None and ids is chosen
        # The float64 definition with the same pages: rebuild it through a one-page-per-slot table.
        o_ref = _reference_given(inputs, chosen, combine, window_size=9, scale=0.3)
        torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)


def _reference_given(inputs, chosen, combine, window_size, scale):
    """Definition with given pages: each given page k contributes as in ``reference`` (softmax over its
    tokens, logit z_k), so compare against the golden's per-chunk rule computed by hand."""
    q, kb, vb, pt, sl, E = (inputs[k] for k in ("q", "k_buffer", "v_buffer", "page_table", "seq_lens", "chunk_repr"))
    B, Hq, D = q.shape
    Hkv = E.shape[1]
    G = Hq // Hkv
    o = torch.zeros(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        L = int(sl[b])
        lo = min(max(0, L - window_size), (L // 8) * 8)
        local = [int(pt[b, t // 8]) * 8 + t % 8 for t in range(lo, L)]
        for h in range(Hkv):
            pages = [int(p) for p in chosen[b, h] if p >= 0]
            for g in range(G):
                qv = q[b, h * G + g]
                if combine == "token":
                    slots = [p * 8 + i for p in pages for i in range(8)] + local
                    o[b, h * G + g] = _softmax_attend(qv, [kb[s, h] for s in slots], [vb[s, h] for s in slots],
                                                      scale)[0]
                    continue
                outs, logits = [], []
                for p in pages:
                    slots = [p * 8 + i for i in range(8)]
                    outs.append(_softmax_attend(qv, [kb[s, h] for s in slots], [vb[s, h] for s in slots], scale)[0])
                    logits.append(scale * float(qv @ E[p, h]))
                o_loc, lse_loc = _softmax_attend(qv, [kb[s, h] for s in local], [vb[s, h] for s in local], scale)
                outs.append(o_loc)
                logits.append(lse_loc)
                m = max(logits)
                w = [math.exp(x - m) for x in logits]
                o[b, h * G + g] = sum(wi * oi for wi, oi in zip(w, outs)) / sum(w)
    return o


def test_golden_nothing_to_attend_gives_zero():
    # seq_len a multiple of page_size, window 0, every repr stale: no candidate and no local token.
    inputs = random_case([16], num_heads=2, num_kv_heads=1, head_dim=8, page_size=8, dtype=torch.float64)
    inputs["repr_valid"][:] = False
    o, ids, _ = hsa_decode(**inputs, page_size=8, topk=2)
    assert (ids == -1).all() and (o == 0).all()


@pytest.mark.parametrize("mode", ["mean", "last"])
def test_golden_page_repr(mode):
    kb = torch.randn(5 * 4, 3, 8, dtype=torch.float64)
    pids = torch.tensor([4, 1])
    rep = page_repr(kb, pids, 4, mode)
    for i, p in enumerate(pids.tolist()):
        keys = [kb[p * 4 + t] for t in range(4)]
        want = sum(keys) / 4 if mode == "mean" else keys[-1]
        torch.testing.assert_close(rep[i], want, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- validation
# Each dtype, head dim, page size, G in {1, 4, 8, 16}, strategy and combine mode at least once; more
# decode splits, and a score kernel with more loads in flight.
COMPILE_SPECS = [
    dict(num_heads=4, num_kv_heads=4, head_dim=64, page_size=16, topk=8, dtype=torch.float16,
         selection_strategy="group", window_size=0, combine="softmax",
         config={"split_overhead": 0}),
    dict(num_heads=16, num_kv_heads=4, head_dim=128, page_size=32, topk=16, dtype=torch.bfloat16,
         selection_strategy="head", window_size=100, combine="token",
         score_config={"unroll": 8, "blocks_per_sm": 3}),
    dict(num_heads=64, num_kv_heads=8, head_dim=128, page_size=64, topk=64, dtype=torch.float16,
         selection_strategy="head", window_size=512, combine="softmax"),
    dict(num_heads=32, num_kv_heads=2, head_dim=256, page_size=128, topk=32, dtype=torch.bfloat16,
         selection_strategy="group", window_size=256, combine="token"),
]


GOOD = dict(num_heads=8, num_kv_heads=2, head_dim=64, page_size=16, topk=4, dtype=torch.float16)


@pytest.mark.parametrize("change, err, match", [
    (dict(num_heads=6, num_kv_heads=4), ValueError, "G = num_heads / num_kv_heads is an integer"),
    (dict(num_heads=34, num_kv_heads=2), ValueError, "G"),
    (dict(head_dim=96), ValueError, "head_dim"),
    (dict(page_size=24), ValueError, "page_size"),
    (dict(topk=0), ValueError, "topk"),
    (dict(topk=2.0), TypeError, "topk"),
    (dict(dtype=torch.float32), TypeError, "dtype"),
    (dict(selection_strategy="softmax_head"), ValueError, "selection_strategy"),
    (dict(combine="mean"), ValueError, "combine"),
    (dict(window_size=-1), ValueError, "window_size"),
    (dict(scale=0.0), ValueError, "scale"),
    (dict(config={"split_overhead": -1}), ValueError, "split_overhead"),
    (dict(config={"block": 4}), ValueError, "unknown keys"),
])
def test_constructor_rejects(change, err, match):
    with pytest.raises(err, match=match):
        HSADecodeTileLang(**{**GOOD, **change})


def test_page_repr_constructor_rejects():
    with pytest.raises(ValueError, match="mode"):
        HSAPageReprTileLang(2, 64, 16, torch.float16, mode="first")
    with pytest.raises(TypeError, match="dtype"):
        HSAPageReprTileLang(2, 64, 16, torch.float32)


@pytest.fixture(scope="module")
def small_op():
    return HSADecodeTileLang(**COMPILE_SPECS[0])  # shares its kernels with test_compiles_for_sm90a


def _good_call():
    return random_case([40, 70], num_heads=4, num_kv_heads=4, head_dim=64, page_size=16, dtype=torch.float16)


@pytest.mark.compile
@pytest.mark.parametrize("bad, err, match", [
    (lambda t: t.float(), TypeError, "q: expected dtype"),
    (lambda t: t[:, :2], ValueError, r"q: expected shape \[\*, 4, 64\]"),
    (lambda t: t, ValueError, "q: expected a CUDA tensor"),
])
def test_call_rejects_before_launch(small_op, bad, err, match):
    """On CPU only q's checks are reachable (the device check comes with each tensor's own checks);
    test_hsa_decode_gpu.py covers every other argument."""
    inputs = _good_call()
    inputs["q"] = bad(inputs["q"])
    with pytest.raises(err, match=match):
        small_op(**inputs)
    with pytest.raises(err, match=match):
        small_op.select(inputs["q"], inputs["page_table"], inputs["seq_lens"], inputs["chunk_repr"])


@pytest.mark.compile
def test_value_checks(small_op):
    """The host-sync checks, on CPU tensors through the op's own check list."""
    inputs = _good_call()
    pt, sl = inputs["page_table"], inputs["seq_lens"]
    num_pages = inputs["chunk_repr"].shape[0]
    check_values(small_op._value_checks(pt, sl, num_pages))
    for bad_sl, match in [([0, 70], "seq_len 0 is an error"), ([40, 81], "seq_lens: expected values in")]:
        with pytest.raises(ValueError, match=match):
            check_values(small_op._value_checks(pt, torch.tensor(bad_sl, dtype=torch.int32), num_pages))
    bad_pt = pt.clone()
    bad_pt[1, 4] = num_pages
    with pytest.raises(ValueError, match="page_table: expected the pages"):
        check_values(small_op._value_checks(bad_pt, sl, num_pages))
    bad_pt[1, 4] = -1  # a -1 inside the request's pages is out of range too
    with pytest.raises(ValueError, match="page_table: expected the pages"):
        check_values(small_op._value_checks(bad_pt, sl, num_pages))
    bad_pt = pt.clone()
    bad_pt[0, 4] = 10 ** 6  # past request 0's pages: never read, accepted
    check_values(small_op._value_checks(bad_pt, sl, num_pages))


# ----------------------------------------------------------------------------- compile-only (sm_90a)
@pytest.mark.compile
@pytest.mark.parametrize("spec", COMPILE_SPECS, ids=lambda s: f"D{s['head_dim']}p{s['page_size']}"
                         f"G{s['num_heads'] // s['num_kv_heads']}")
def test_compiles_for_sm90a(spec):
    op = HSADecodeTileLang(**spec)
    for k in (op.score_kernel, op.topk_kernel, op.decode_kernel, op.combine_kernel):
        assert "__global__" in k.get_kernel_source()
    # The top-k's two scatters (candidates above the histogram's cut, the radix select's winners) run in
    # branches only some threads take: a barrier there hangs the CTA.
    scatters = op.topk_kernel.get_kernel_source().split("AtomicAddRet(")[1:]
    assert len(scatters) == 2
    for scatter in scatters:
        scatter = scatter[:scatter.rindex("AtomicStore(")]
        assert "__syncthreads" not in scatter and "bar.sync" not in scatter


@pytest.mark.parametrize("batch, splits", [(32, 4), (8, 7), (1, 37)])
def test_num_splits_suits_a_shared_gpu(batch, splits):
    """Bench shape (73 items: 64 selected + up to 9 local pages), 132 SMs x 4 CTAs. (b)'s 8 requests get 7 splits
    of 11 items (448 CTAs), not 8 of 10 (512: exactly one wave of the whole GPU, two when 16 SMs are held): in
    the wave model the whole GPU then costs 13 instead of 12, and with 16 or 40 of 132 SMs held 13 and 26 instead
    of 24 and 24."""
    rows, slots = batch * 8, 132 * 4
    s = num_splits(rows, 73, slots, 2)
    assert s == splits and -(-73 // s) <= ZCOLS
    assert num_splits(rows, 73, slots, 0) >= s  # no fixed cost: more, shorter splits
    for rows_, items in [(8, 1000), (4096, 73), (4096, 1000)]:  # a split never exceeds the z tile
        assert -(-items // num_splits(rows_, items, slots, 2)) <= ZCOLS


def test_num_splits_average_closest_to_the_best():
    """The chosen count, by an independent search, is the one whose cost is on average closest to each share's
    best (whole GPU, 16 and 40 of 132 SMs held)."""
    for rows, items, slots, overhead in [(64, 73, 528, 2), (256, 20, 528, 2), (8, 300, 528, 2), (3, 5, 100, 1)]:
        frees = [slots, round(slots * 116 / 132), round(slots * 92 / 132)]
        counts = list(range(-(-items // ZCOLS), items + 1))
        table = [[-(-rows * s // m) * (-(-items // s) + overhead) for m in frees] for s in counts]
        best = [min(col) for col in zip(*table)]
        score = [sum(c / b for c, b in zip(row, best)) for row in table]
        assert num_splits(rows, items, slots, overhead) == counts[score.index(min(score))]


@pytest.mark.compile
@pytest.mark.parametrize("mode, dtype", [("mean", torch.bfloat16), ("last", torch.float16)])
def test_page_repr_compiles(mode, dtype):
    op = HSAPageReprTileLang(8, 128, 64, dtype, mode)
    assert "__global__" in op.kernel.get_kernel_source()


# ----------------------------------------------------------------------------- protocol, scale, custom ops
def test_protocol():
    import inspect

    from ops.common.protocol import Op, op_class

    for cls, name in ((HSADecodeTileLang, "hsa_decode"), (HSAPageReprTileLang, "hsa_page_repr")):
        assert issubclass(cls, Op) and cls.op_name == name and op_class(name) is cls
        assert cls.warm_specs and cls.config_space({}) == [] and cls.tunable_kernel({}) is None
        for spec in cls.warm_specs:  # constructor keyword sets (not built here)
            inspect.signature(cls).bind(**spec)
    assert HSADecodeTileLang.default_config({}) == {"split_overhead": 2}
    assert {s["combine"] for s in HSADecodeTileLang.warm_specs} == {"softmax", "token"}


@pytest.mark.parametrize("scale, err", [("0.1", TypeError), (True, TypeError), (float("nan"), ValueError),
                                        (float("inf"), ValueError), (-0.1, ValueError)])
def test_constructor_rejects_scale(scale, err):
    with pytest.raises(err, match="scale"):
        HSADecodeTileLang(**GOOD, scale=scale)


def _meta_case(B=3, Hq=8, Hkv=2, D=64, ps=16, max_pages=10, num_pages=40, dtype=torch.bfloat16):
    m = dict(device="meta")
    return dict(q=torch.empty(B, Hq, D, dtype=dtype, **m),
                k_buffer=torch.empty(num_pages * ps, Hkv, D, dtype=dtype, **m),
                v_buffer=torch.empty(num_pages * ps, Hkv, D, dtype=dtype, **m),
                page_table=torch.empty(B, max_pages, dtype=torch.int32, **m),
                seq_lens=torch.empty(B, dtype=torch.int32, **m),
                chunk_repr=torch.empty(num_pages, Hkv, D, dtype=dtype, **m),
                repr_valid=torch.empty(num_pages, dtype=torch.bool, **m))


@pytest.mark.parametrize("given", [False, True])
def test_custom_op_fakes_on_meta(given):
    """The fakes give shapes and dtypes on meta tensors without building or launching anything."""
    import ops.hsa as hsa_ops

    t = _meta_case()
    sel = torch.empty(3, 2, 5, dtype=torch.int32, device="meta") if given else None
    o = torch.ops.llm_tile_ops.hsa_decode(*t.values(), sel, page_size=16, topk=5, window_size=20,
                                          combine="token", scale=0.2, validate=False)
    assert o.shape == (3, 8, 64) and o.dtype == torch.bfloat16 and o.device.type == "meta"
    o = hsa_ops.hsa_decode(*t.values(), selected_page_ids=sel, page_size=16, topk=5)
    assert o.shape == (3, 8, 64) and o.dtype == torch.bfloat16
    args = [t[k] for k in ("q", "page_table", "seq_lens", "chunk_repr")]
    for ids, scores in (torch.ops.llm_tile_ops.hsa_select(*args, t["repr_valid"], page_size=16, topk=5,
                                                          selection_strategy="head", validate=False),
                        hsa_ops.hsa_select(*args, page_size=16, topk=5)):
        assert ids.shape == scores.shape == (3, 2, 5)
        assert ids.dtype == torch.int32 and scores.dtype == torch.float32 and ids.device.type == "meta"
    page_ids = torch.empty(7, dtype=torch.int32, device="meta")
    assert torch.ops.llm_tile_ops.hsa_page_repr(t["k_buffer"], page_ids, t["chunk_repr"], page_size=16,
                                                repr_mode="last") is None
    assert hsa_ops.hsa_page_repr(t["k_buffer"], page_ids, t["chunk_repr"], page_size=16) is t["chunk_repr"]


def test_custom_op_fakes_under_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        t = {k: mode.from_tensor(torch.empty(v.shape, dtype=v.dtype))
             for k, v in _meta_case(dtype=torch.float16).items()}
        o = torch.ops.llm_tile_ops.hsa_decode(*t.values(), page_size=16, topk=4)
        ids, scores = torch.ops.llm_tile_ops.hsa_select(t["q"], t["page_table"], t["seq_lens"], t["chunk_repr"],
                                                        page_size=16, topk=4)
    assert o.shape == (3, 8, 64) and o.dtype == torch.float16
    assert ids.shape == scores.shape == (3, 2, 4) and (ids.dtype, scores.dtype) == (torch.int32, torch.float32)


def test_custom_op_schemas():
    """Mutation and outputs as declared: hsa_page_repr writes chunk_repr in place and returns nothing."""
    schema = torch.ops.llm_tile_ops.hsa_page_repr.default._schema
    assert [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write] == ["chunk_repr"]
    assert len(schema.returns) == 0
    for name in ("hsa_decode", "hsa_select"):
        schema = getattr(torch.ops.llm_tile_ops, name).default._schema
        assert not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        assert "validate" in [a.name for a in schema.arguments]


@pytest.mark.compile
def test_call_rejects_non_bool_validate(small_op):
    inputs = _good_call()
    with pytest.raises(TypeError, match="validate"):
        small_op(**inputs, validate=1)
    with pytest.raises(TypeError, match="validate"):
        small_op.select(inputs["q"], inputs["page_table"], inputs["seq_lens"], inputs["chunk_repr"], validate=None)
