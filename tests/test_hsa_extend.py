"""HSAExtendTileLang on the CPU: the plan's decode rows and tiles against the golden's, the page-major entry lists'
glue against a loop, the selection's glue with the score and top-k kernels' definitions emulated (it must give the
golden's selection), the run's glue with the entry lists', page-major, local and combine kernels' algorithms emulated
(float64) and the golden's selection (it must give golden.hsa_decode.hsa_extend), the value checks, and compile-only
builds (the golden itself is checked against the float64 decode definition token by token in test_hsa_decode.py)."""

import itertools
import math

import pytest
import torch

from golden.hsa_decode import extend_rows, hsa_extend, local_range, random_case, select_pages
import ops.hsa.decode as decode_module
import ops.hsa.extend as extend_module
from ops.hsa import HSAExtendTileLang
from ops.hsa.schedule import KEY_PAGES, key_tiles_shape
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
    allow_cpu_tensors(decode_module)  # the decode's shape checks, which run also calls


def _batch(seq_lens=(70, 16, 40, 5), q_lens=(20, 0, 40, 1)):
    torch.manual_seed(0)
    case = random_case(list(seq_lens), num_heads=4, num_kv_heads=4, head_dim=64, page_size=16, dtype=torch.float16,
                       invalid_frac=0.1)
    cum = torch.tensor((0,) + tuple(q_lens)).cumsum(0).to(torch.int32)
    case["q"] = torch.randn(int(cum[-1]), 4, 64).to(torch.float16)
    case["cum_seq_lens_q"] = cum
    return case


def _page_attention(spec, qr, k_buffer, v_buffer, chunk_repr, h, pid, keys, selected):
    """One page's softmax attention of the rows qr [G, D] over its ``keys`` (offsets in the page), float64 -> (o,
    merge logit: z = scale q . repr for a ``selected`` page in softmax combine, else the page's log-sum-exp)."""
    scale = spec["head_dim"] ** -0.5
    slots = [pid * spec["page_size"] + n for n in keys]
    s = scale * qr @ k_buffer[slots, h].double().t()
    logit = torch.logsumexp(s, -1)
    if selected and spec["combine"] == "softmax":
        logit = scale * qr @ chunk_repr[pid, h].double()
    return torch.softmax(s, -1) @ v_buffer[slots, h].double(), logit


def _local_emulation(spec, tokens, part):
    """The local kernel's algorithm for ``spec`` in float64 loops, called as the kernel: per (tile, kv head) the
    tile's local pages, each merged into every row of a token whose [lo, p] it holds, over those keys only, by the
    page's softmax and log-sum-exp (`_page_attention`). Writes partial slot ``part``: the normalized output and its
    log-sum-exp (-inf: nothing)."""
    ps, W, G = spec["page_size"], spec["window_size"], spec["num_heads"] // spec["num_kv_heads"]

    def first_local(L):
        return local_range(L, ps, W)[1]

    def kernel(q, k_buffer, v_buffer, page_table, cum, row_lens, tile_req, tile_row0, o_part, logit_part):
        for t, b in enumerate(tile_req.tolist()):
            if b < 0:
                continue
            row0 = int(tile_row0[t])
            last = min(row0 + tokens, int(cum[b + 1])) - 1
            local = range(first_local(int(row_lens[row0])) // ps, -(-int(row_lens[last]) // ps))
            for h in range(k_buffer.shape[1]):
                for i in range(last - row0 + 1):
                    L = int(row_lens[row0 + i])
                    qr = q[row0 + i, h * G:(h + 1) * G].double()
                    m_run = torch.full((G,), -math.inf, dtype=torch.float64)
                    l_run = torch.zeros(G, dtype=torch.float64)
                    acc = torch.zeros(G, q.shape[2], dtype=torch.float64)
                    for j in local:
                        keys = [n for n in range(ps) if first_local(L) <= j * ps + n < L]
                        if not keys:
                            continue
                        o_pg, logit = _page_attention(spec, qr, k_buffer, v_buffer, None, h, int(page_table[b, j]),
                                                      keys, False)
                        m_new = torch.maximum(m_run, logit)
                        acc = acc * torch.exp(m_run - m_new)[:, None] + torch.exp(logit - m_new)[:, None] * o_pg
                        l_run = l_run * torch.exp(m_run - m_new) + torch.exp(logit - m_new)
                        m_run = m_new
                    o = torch.where(l_run[:, None] > 0, acc / l_run[:, None], 0)
                    o_part[row0 + i, part, h * G:(h + 1) * G] = o.to(o_part.dtype)
                    logit_part[row0 + i, part, h * G:(h + 1) * G] = (m_run + l_run.log()).float()
    return kernel


def _pages_emulation(spec):
    """The page-major kernel's algorithm in float64 loops, called as the kernel: for every (kv head, page) group of
    the entry lists, each entry's rows over the whole page into its (row, slot) partial."""
    G = spec["num_heads"] // spec["num_kv_heads"]

    def kernel(q, k_buffer, v_buffer, chunk_repr, group_start, entry_row, entry_slot, o_part, logit_part):
        num_pages = chunk_repr.shape[0]
        for g in range(group_start.numel() - 1):
            h, pid = divmod(g, num_pages)
            for e in range(int(group_start[g]), int(group_start[g + 1])):
                row, slot = int(entry_row[e]), int(entry_slot[e])
                o, logit = _page_attention(spec, q[row, h * G:(h + 1) * G].double(), k_buffer, v_buffer, chunk_repr,
                                           h, pid, range(spec["page_size"]), True)
                o_part[row, slot, h * G:(h + 1) * G] = o.to(o_part.dtype)
                logit_part[row, slot, h * G:(h + 1) * G] = logit.float()
    return kernel


def _entries_emulation(op):
    """The two entry-list kernels (`kernels/extend_entries.py`) as loops, called as the kernels: the count per group,
    then each entry placed at its group's cursor, here the last entry first (the kernels' atomics give any order)."""
    Hkv, K = op.spec["num_kv_heads"], op.spec["topk"]

    def group(i, pid, num_pages):
        return (i // K % Hkv) * num_pages + pid

    def count(ids, counts):
        num_pages = (counts.numel() - 1) // Hkv
        for i, pid in enumerate(ids.tolist()):
            if pid >= 0:
                counts[1 + group(i, pid, num_pages)] += 1

    def place(ids, cursor, entry_row, entry_slot):
        num_pages = cursor.numel() // Hkv
        for i, pid in reversed(list(enumerate(ids.tolist()))):
            if pid >= 0:
                g = group(i, pid, num_pages)
                entry_row[cursor[g]], entry_slot[cursor[g]] = i // (Hkv * K), i % K
                cursor[g] += 1
    return count, place


def _combine_emulation(o_part, logit_part, out):
    """The combine kernel: the slots merged by the softmax of their logits, 0 where every slot is empty."""
    w = torch.softmax(logit_part.double(), dim=1).nan_to_num(0.0)
    out.copy_(torch.einsum("rsh,rshd->rhd", w, torch.where(w[..., None] > 0, o_part.double(), 0)))


def key_tiles_to_rows(keys, key_rows):
    """Keys by score tile (schedule.key_tiles_shape; any 32-bit dtype) as int32 [rows, Hkv, pages padded to
    KEY_PAGES], row r's from key row key_rows[r]."""
    Hkv, NT, PB, R, P = keys.shape
    return keys.view(torch.int32).permute(1, 3, 0, 2, 4).reshape(NT * R, Hkv, PB * P)[key_rows.long()]


def rows_to_key_tiles(rows, key_rows, num_tiles, tokens, max_pages):
    """The inverse: int32 keys [rows, Hkv, pages] placed at their key rows in uint32 keys by score tile."""
    Hkv, NT, PB, R, P = key_tiles_shape(num_tiles, rows.shape[1], max_pages, tokens)
    flat = rows.new_zeros(NT * R, Hkv, PB * P)
    m = min(rows.shape[2], PB * P)
    flat[key_rows.long(), :, :m] = rows[:, :, :m]
    return flat.view(NT, R, Hkv, PB, P).permute(2, 0, 3, 1, 4).contiguous().view(torch.uint32)


def _score_emulation(spec, tokens):
    """The score kernel's definition on the CPU: keys (by score tile, as fp32 bits) of each tile's rows against
    reprs[b - req_base], for the tiles of requests req_base .. req_base + len(reprs) - 1; a NaN score (an invalid
    repr) is key 0. Scores as the golden computes them (fp32 einsum), so selections compare exactly."""
    H, Hkv, ps = spec["num_heads"], spec["num_kv_heads"], spec["page_size"]
    G, scale = H // Hkv, spec["head_dim"] ** -0.5

    def kernel(q, cum, row_lens, tile_req, tile_row0, reprs, key_tiles, req_base):
        for t, (b, row0) in enumerate(zip(tile_req.tolist(), tile_row0.tolist())):
            if not req_base <= b < req_base + reprs.shape[0]:
                continue
            for i, row in enumerate(range(row0, min(row0 + tokens, int(cum[b + 1])))):
                n = local_range(int(row_lens[row]), ps, spec["window_size"])[1] // ps
                qg = q[row].float().view(Hkv, G, -1)
                E = reprs[b - req_base, :n].float()
                if spec["selection_strategy"] == "group":
                    s = scale * torch.einsum("hd,chd->hc", qg.sum(dim=1), E)
                else:
                    s = (scale * torch.einsum("hgd,chd->hgc", qg, E)).amax(dim=1)
                bits = s.view(torch.int32)
                key = torch.where(bits < 0, ~bits, bits | -(1 << 31))
                key = torch.where(s.isnan(), 0, key).view(torch.float32)
                for j0 in range(0, n, KEY_PAGES):
                    key_tiles[:, t, j0 // KEY_PAGES, i, :min(KEY_PAGES, n - j0)] = key[:, j0:j0 + KEY_PAGES]
    return kernel


def _topk_emulation(spec):
    """The top-k kernel's definition: per (row, kv head) its candidates' keys (0: none; by score tile, row r's at key
    row key_rows[r]) best first, ties to the smaller logical page, as page ids (-1 past the candidates)."""
    def kernel(key_tiles, key_rows, page_table, seq_lens, ids, scores):
        keys = key_tiles_to_rows(key_tiles, key_rows)
        ids.fill_(-1)
        for row in range(seq_lens.shape[0]):
            n = local_range(int(seq_lens[row]), spec["page_size"], spec["window_size"])[1] // spec["page_size"]
            for h in range(keys.shape[1]):
                k = keys[row, h, :n].long() & 0xFFFFFFFF  # the keys' unsigned order
                best = sorted((j for j in range(n) if k[j] != 0), key=lambda j: (-int(k[j]), j))[:spec["topk"]]
                ids[row, h, :len(best)] = page_table[row, best]
    return kernel


@pytest.mark.compile
def test_plan_rows_are_the_goldens(op):
    b = _batch()
    plan = op.plan(b["page_table"], b["seq_lens"], b["cum_seq_lens_q"], b["q"].shape[0], b["chunk_repr"].shape[0])
    req, lens = extend_rows(b["seq_lens"], b["cum_seq_lens_q"])
    assert torch.equal(plan.page_table, b["page_table"][req]) and torch.equal(plan.seq_lens, lens)
    assert plan.page_table.dtype == plan.seq_lens.dtype == plan.score_key_rows.dtype == torch.int32
    # each token's row of the keys: its score tile x tokens + its row in the tile
    T = op.score_tokens
    want = torch.full((b["q"].shape[0],), -1, dtype=torch.int32)
    for t, (r, row0) in enumerate(zip(plan.score_tile_req.tolist(), plan.score_tile_row0.tolist())):
        if r >= 0:
            end = min(row0 + T, int(b["cum_seq_lens_q"][r + 1]))
            want[row0:end] = torch.arange(t * T, t * T + end - row0, dtype=torch.int32)
    assert torch.equal(plan.score_key_rows, want)


@pytest.mark.compile
@pytest.mark.parametrize("q_lens", [(20, 0, 40, 1), (0, 0, 0, 0), (16, 17, 1, 33)])
@pytest.mark.parametrize("tokens", [1, 4, 16, 64])
def test_tiles_cover_every_token_once(q_lens, tokens):
    """The query tiles: every new token in exactly one tile of its request, tiles of `tokens` consecutive tokens
    (fewer at a request's end) in request order, spare tiles (request -1) last, the count the host bound."""
    cum = torch.tensor((0,) + q_lens).cumsum(0).to(torch.int32)
    tile_req, tile_row0 = HSAExtendTileLang.tiles(cum, int(cum[-1]), tokens)
    want = []
    for b, n in enumerate(q_lens):
        want += [(b, int(cum[b]) + i) for i in range(0, n, tokens)]
    got = list(zip(tile_req.tolist(), tile_row0.tolist()))
    assert got[:len(want)] == want and all(r == -1 for r, _ in got[len(want):])
    assert len(got) == (int(cum[-1]) + len(q_lens) * (tokens - 1)) // tokens
    assert tile_req.dtype == tile_row0.dtype == torch.int32


# SPEC (G = 1, window 0, softmax combine, group) and test_hsa_decode's second compile spec (G = 4, a window of 100
# over pages of 32, token combine, head strategy): both built by the compile-only tests
GLUE_SPECS = [SPEC, {k: v for k, v in COMPILE_SPECS[1].items() if k != "score_config"}]


@pytest.mark.compile
@pytest.mark.parametrize("spec", GLUE_SPECS, ids=["G1-softmax", "G4-window-token"])
def test_run_is_the_golden_extend(spec, monkeypatch):
    """The run's glue (plan, the entry lists, the page-major, local and combine kernels' algorithms emulated in
    float64) gives the golden extend: each selected page attended on its own for every token that chose it, the
    local tokens per tile, merged per token by the softmax of the slots' logits. Ragged chunks, a request of no new
    token, histories below a page and across the window."""
    op = HSAExtendTileLang(**spec)
    H, Hkv, D, ps, topk = (spec[k] for k in ("num_heads", "num_kv_heads", "head_dim", "page_size", "topk"))
    torch.manual_seed(1)
    case = random_case([500, 16, 260, 9], H, Hkv, D, ps, dtype=spec["dtype"], invalid_frac=0.1)
    cum = torch.tensor([0, 200, 0, 130, 9]).cumsum(0).to(torch.int32)
    q = torch.randn(int(cum[-1]), H, D).to(spec["dtype"])
    sel = dict(selection_strategy=spec["selection_strategy"], window_size=spec["window_size"])

    def golden_select(q, chunk_repr, plan, repr_valid=None):
        return select_pages(q, plan.page_table, plan.seq_lens, chunk_repr, ps, topk, repr_valid=repr_valid, **sel)[0]

    monkeypatch.setattr(op, "local_kernel", _local_emulation(spec, op.tile_tokens, topk))
    monkeypatch.setattr(op, "pages_kernel", _pages_emulation(spec))
    monkeypatch.setattr(op, "combine_kernel", _combine_emulation)
    count, place = _entries_emulation(op)
    monkeypatch.setattr(op, "count_kernel", count)
    monkeypatch.setattr(op, "place_kernel", place)
    monkeypatch.setattr(op, "select", golden_select)
    o, ids = op(q, case["k_buffer"], case["v_buffer"], case["page_table"], case["seq_lens"], cum, case["chunk_repr"],
                case["repr_valid"], return_selection=True, validate=False)
    o_ref, ids_ref, _ = hsa_extend(q, case["k_buffer"], case["v_buffer"], case["page_table"], case["seq_lens"], cum,
                                   case["chunk_repr"], ps, topk, combine=spec["combine"],
                                   repr_valid=case["repr_valid"], **sel)
    assert torch.equal(ids, ids_ref)
    # 16-bit outputs of a float64 and a float32 computation
    torch.testing.assert_close(o.float(), o_ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.compile
@pytest.mark.parametrize("chunked", [False, True], ids=["one-launch", "a-request-at-a-time"])
@pytest.mark.parametrize("spec", GLUE_SPECS, ids=["G1-group", "G4-head-window"])
def test_select_is_the_goldens(spec, chunked, monkeypatch):
    """The selection's glue (the reprs gathered in page-table order, invalid ones as NaN, EXTEND_REPRS_BYTES of
    requests a launch, each launch scoring its requests' tiles) with the score and top-k kernels' definitions
    emulated gives the golden's selection of every new token."""
    op = HSAExtendTileLang(**spec)
    H, Hkv, D, ps = (spec[k] for k in ("num_heads", "num_kv_heads", "head_dim", "page_size"))
    torch.manual_seed(3)
    case = random_case([500, 16, 260, 9], H, Hkv, D, ps, dtype=spec["dtype"], invalid_frac=0.1)
    cum = torch.tensor([0, 200, 0, 130, 9]).cumsum(0).to(torch.int32)
    q = torch.randn(int(cum[-1]), H, D).to(spec["dtype"])
    monkeypatch.setattr(op, "score_kernel", _score_emulation(spec, op.score_tokens))
    monkeypatch.setattr(op, "topk_kernel", _topk_emulation(spec))
    if chunked:
        monkeypatch.setattr(extend_module, "EXTEND_REPRS_BYTES", 1)
    plan = op.plan(case["page_table"], case["seq_lens"], cum, q.shape[0], case["chunk_repr"].shape[0])
    ids = op.select(q, case["chunk_repr"], plan, case["repr_valid"])
    ids_ref, _ = select_pages(q, plan.page_table, plan.seq_lens, case["chunk_repr"], ps, spec["topk"],
                              spec["selection_strategy"], spec["window_size"], case["repr_valid"])
    assert (ids >= 0).any() and torch.equal(ids, ids_ref)


def page_entries_match_a_loop(op, ids, num_pages):
    """op.page_entries(ids, num_pages): group h * num_pages + p holds the (row, slot) entries that selected page p
    for kv head h (in any order); -1 entries (no page) in no group; pages no row selected: empty groups. (The GPU
    test runs the kernels.)"""
    start, row, slot = op.page_entries(ids, num_pages)
    R, Hkv, K = ids.shape
    assert start.dtype == row.dtype == slot.dtype == torch.int32 and start.numel() == Hkv * num_pages + 1
    assert int(start[0]) == 0 and int(start[-1]) == int((ids >= 0).sum())
    expected = {}
    for (r, h, k), p in zip(itertools.product(range(R), range(Hkv), range(K)), ids.flatten().tolist()):
        if p >= 0:
            expected.setdefault(h * num_pages + p, []).append((r, k))
    start, row, slot = start.tolist(), row.tolist(), slot.tolist()
    for gi in range(Hkv * num_pages):
        got = sorted(zip(row[start[gi]:start[gi + 1]], slot[start[gi]:start[gi + 1]]))
        assert got == expected.get(gi, []), f"group {gi}"


def random_selections(R, Hkv, K, num_pages, device="cpu"):
    """ids [R, Hkv, K]: distinct pages per row below num_pages - 2 (the last two never selected), 20% -1."""
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(num_pages - 2, generator=g)[:K] for _ in range(R * Hkv)]).view(R, Hkv, K)
    return torch.where(torch.rand(R, Hkv, K, generator=g) < 0.2, -1, ids).to(torch.int32).to(device)


@pytest.mark.compile
def test_page_entries_against_a_loop(op, monkeypatch):
    """The entry lists' glue (counts, their scan, the cursors) with the two kernels emulated."""
    count, place = _entries_emulation(op)
    monkeypatch.setattr(op, "count_kernel", count)
    monkeypatch.setattr(op, "place_kernel", place)
    page_entries_match_a_loop(op, random_selections(90, op.spec["num_kv_heads"], op.spec["topk"], 12), 12)


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
    """The extend's own kernels (the tiles' score GEMM, the entry lists' two kernels, the page-major attention, the
    local tokens, the combine) and its build of the decode's top-k."""
    spec = {k: v for k, v in spec.items() if k != "score_config"}  # the decode's score kernel only
    op = HSAExtendTileLang(**spec)
    source = op.score_kernel.get_kernel_source()
    # warpgroup products where the tile has a wgmma's 64 rows (tokens), mma.sync below (G x head_dim of 4096)
    assert "__global__" in source and ("wgmma" if op.score_tokens >= 64 else "mma_sync") in source
    assert "hsa_extend_local" in op.local_kernel.get_kernel_source()
    pages = op.pages_kernel.get_kernel_source()
    body = pages[pages.index("__global__"):]
    # K and V arrive by cp.async with no wait of their own: the gather pipeline's full wait must come before any
    # product reads them
    first_product = min(body.find(m) for m in ("wgmma", "gemm") if m in body)
    assert "hsa_extend_pages" in pages and -1 < body.find("cp_async_wait<0>") < first_product
    assert "AtomicAdd" in op.count_kernel.get_kernel_source() and "AtomicAddRet" in op.place_kernel.get_kernel_source()
    assert "hsa_topk" in op.topk_kernel.get_kernel_source()
    assert "hsa_extend_combine" in op.combine_kernel.get_kernel_source()
