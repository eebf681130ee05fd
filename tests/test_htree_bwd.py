"""htree backward on the CPU: the golden's gradients (gradcheck, the dense limit, forced selections, lse), the
backward's decomposition emulated in float64 from the host-side index structures (ops.htree.bwd_index) against the
golden's autograd, the selections' formats, validation, the custom ops' fakes, compile-only builds."""

import inspect
import math

import pytest
import torch

from golden.htree import apply_rope, build_tree, htree_forward, num_layers, pack_bits, rope_tables
from ops.common.protocol import Op, op_class
from ops.common import runtime as _runtime
from ops.common.runtime import WARP_OWN_SHARED, compile_kernel
from ops.htree import HTreeBackwardTileLang, HTreeForwardTileLang, htree_attention
from ops.htree.backward import _transposed, top_dk_finish, top_operands
from ops.htree.bwd_index import candidate_counts, parent_lists, slab_index
from ops.htree.kernels.bwd_common import uses_fp32_fragments
from ops.htree.kernels.bwd_nodes32 import htree_bwd_nodes32_kernel
from ops.htree.kernels.bwd_rows16 import htree_bwd_rows16_kernel, uses_rows16
from ops.htree.kernels.bwd_rows32 import htree_bwd_rows32_kernel
from ops.htree.tree import nodes_to_positions, positions_to_nodes


def _inputs(B, T, H, Hkv, K, V, dtype=torch.float64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    xs = (torch.randn(B, T, H, K, generator=g, dtype=dtype), torch.randn(B, T, Hkv, K, generator=g, dtype=dtype),
          torch.randn(B, T, Hkv, V, generator=g, dtype=dtype))
    return tuple(x.requires_grad_(grad) for x in xs)


def _dense_rope_attention(q, k, v, rope_base=10000.0, return_lse=False):
    B, T, H, K = q.shape
    G = H // k.shape[2]
    cos, sin = rope_tables(K, T, rope_base, torch.float64)
    qr = apply_rope(q, cos[:, None], sin[:, None])
    kr = apply_rope(k, cos[:, None], sin[:, None]).repeat_interleave(G, dim=2)
    s = torch.einsum("bthk,bshk->bhts", qr, kr) * K ** -0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    o = torch.einsum("bhts,bshv->bthv", s.softmax(-1), v.repeat_interleave(G, dim=2))
    return (o, s.logsumexp(-1).transpose(1, 2)) if return_lse else o


# (T, r, top_k, max_top_nodes): 2, 3 and 4 layers
TREES = [(20, 4, 2, 8), (24, 4, 2, 2), (40, 2, 2, 8)]


# ----------------------------------------------------------------------------- the golden's gradients
@pytest.mark.parametrize("T,r,top_k,max_top", TREES, ids=["L2", "L3", "L4"])
def test_golden_gradcheck(T, r, top_k, max_top):
    """The golden's autograd gradients against finite differences (float64), with the selections held constant."""
    q, k, v = _inputs(1, T, 4, 2, 4, 3, seed=T + r, grad=True)
    assert num_layers(T, r, max_top) == {20: 2, 24: 3, 40: 4}[T]
    with torch.no_grad():
        _, sel = htree_forward(q, k, v, r, top_k, max_top, return_selection=True)

    def fn(q, k, v):
        return htree_forward(q, k, v, r, top_k, max_top, selection=sel)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("T,r,max_top", [(30, 4, 4), (50, 2, 8), (13, 4, 16)])
def test_golden_gradients_equal_dense_when_everything_is_selected(T, r, max_top):
    """top_k >= every layer's candidates: every node is expanded down to the tokens, which are merged at their own
    positions, so output, lse and gradients are dense causal attention's with RoPE at absolute positions."""
    q, k, v = _inputs(2, T, 4, 2, 8, 6, seed=T, grad=True)
    do = torch.randn(2, T, 4, 6, dtype=torch.float64)
    o, lse = htree_forward(q, k, v, r, 64, max_top, return_lse=True)
    grads = torch.autograd.grad(o, (q, k, v), do)
    o_ref, lse_ref = _dense_rope_attention(q, k, v, return_lse=True)
    grads_ref = torch.autograd.grad(o_ref, (q, k, v), do)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-10, atol=1e-10)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-10)


def test_golden_lse_is_the_merged_softmax_normalizer():
    """o = sum_c exp(s_c - lse) v_c: the lse of a one-layer tree is dense attention's; with forced selections the
    output and lse follow the forced nodes."""
    q, k, v = _inputs(1, 12, 2, 1, 8, 4)
    o, lse = htree_forward(q, k, v, 4, 2, 16, return_lse=True)
    o_ref, lse_ref = _dense_rope_attention(q, k, v, return_lse=True)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    assert lse.dtype == torch.float64
    lse32 = htree_forward(q.float(), k.float(), v.float(), 4, 2, 16, return_lse=True)[1]
    assert lse32.dtype == torch.float32


def test_golden_forced_selection():
    T, r, top_k, max_top = 60, 4, 2, 4
    q, k, v = _inputs(1, T, 4, 2, 8, 6, seed=3)
    o, sel, lse = htree_forward(q, k, v, r, top_k, max_top, return_selection=True, return_lse=True)
    o2, sel2, lse2 = htree_forward(q, k, v, r, top_k, max_top, return_selection=True, return_lse=True, selection=sel)
    assert torch.equal(o, o2) and torch.equal(lse, lse2) and all(torch.equal(a, b) for a, b in zip(sel, sel2))
    # another valid selection: the top layer keeps only the rightmost node where it can
    forced = [s.clone() for s in sel]
    top = forced[-1]
    last = torch.arange(T) // r ** (len(sel))
    top[:] = -1
    top[0, :, :, 0] = last[:, None]
    # the layer below must then expand the children of that one node only: its rightmost child
    below = forced[-2]
    below[:] = -1
    below[0, :, :, 0] = (torch.arange(T) // r ** (len(sel) - 1))[:, None]
    o3 = htree_forward(q, k, v, r, top_k, max_top, selection=forced)
    assert not torch.allclose(o3, o)


@pytest.mark.parametrize("mutate,err,msg", [
    (lambda s: s[:-1], ValueError, "list of"),
    (lambda s: [s[0].float()] + s[1:], TypeError, "integer"),
    (lambda s: [s[0][:, :-1]] + s[1:], ValueError, "shape"),
    (lambda s: [s[0].flip(-1)] + s[1:], ValueError, "ascending"),
    (lambda s: [torch.where(s[0] >= 0, s[0] + 1000, s[0])] + s[1:], ValueError, "not a candidate"),
    (lambda s: s[:-1] + [torch.where(s[-1] == s[-1].max(-1, keepdim=True).values, -1, s[-1])], ValueError, "rightmost"),
])
def test_golden_bad_selection(mutate, err, msg):
    T, r, top_k, max_top = 60, 4, 2, 4
    q, k, v = _inputs(1, T, 4, 2, 8, 6, seed=3)
    _, sel = htree_forward(q, k, v, r, top_k, max_top, return_selection=True)
    with pytest.raises(err, match=msg):
        htree_forward(q, k, v, r, top_k, max_top, selection=mutate(list(sel)))


def test_golden_node_dtype_rounds_the_tree_straight_through():
    """fp32 leaves holding bf16 values with node_dtype=bf16: the bf16 forward's values, gradients in fp32."""
    q, k, v = (x.bfloat16() for x in _inputs(1, 70, 4, 2, 16, 8, dtype=torch.float32))
    o16 = htree_forward(q, k, v, 4, 2, 16)
    qf, kf, vf = (x.float().requires_grad_() for x in (q, k, v))
    o32 = htree_forward(qf, kf, vf, 4, 2, 16, node_dtype=torch.bfloat16)
    assert torch.equal(o32.bfloat16(), o16)
    o32.sum().backward()
    assert kf.grad.dtype == torch.float32 and kf.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- the selections' formats
def test_positions_and_nodes_round_trip():
    for T, r, top_k, max_top in TREES + [(300, 4, 4, 16)]:
        q, k, v = _inputs(2, T, 4, 2, 8, 6, seed=T)
        _, sel = htree_forward(q, k, v, r, top_k, max_top, return_selection=True)
        pos = nodes_to_positions(sel, r)
        assert pos.dtype == torch.int16 and pos.shape == (len(sel),) + tuple(sel[0].shape)
        nodes = positions_to_nodes(pos, r)
        assert all(torch.equal(a, b) for a, b in zip(nodes.unbind(0), sel))
        # the top layer's positions are its nodes; below, positions stay under top_k * r
        assert torch.equal(pos[-1].int(), sel[-1]) and (len(sel) == 1 or int(pos[:-1].max()) < top_k * r)


def test_candidate_counts_match_the_golden():
    T, r, top_k, max_top = 300, 4, 4, 16
    q, k, v = _inputs(1, T, 4, 2, 8, 6)
    _, sel = htree_forward(q, k, v, r, top_k, max_top, return_selection=True)
    L = len(sel) + 1
    n = candidate_counts(torch.arange(T), L, r, top_k)
    assert torch.equal(n[-1], torch.arange(T) // r ** (L - 1) + 1)
    for l in range(L - 1):  # n_l = (parents - 1) r + t's child + 1, parents = the winners one layer up
        parents = (sel[l] >= 0).sum(-1)[0, :, 0]
        assert torch.equal(n[l], (parents - 1) * r + (torch.arange(T) // r ** l) % r + 1)
        assert torch.equal(parents, n[l + 1].clamp_max(top_k))


def test_parent_lists_are_ordered_by_query():
    par = torch.tensor([[[[3, 5, -1]], [[5, 7, 8]], [[0, 3, 5]]]], dtype=torch.int32)  # [B=1, S=3, Hkv=1, top_k=3]
    start, entries = parent_lists(par, 10)
    assert start.shape == (1, 1, 11)
    got = {j: [(int(e) >> 14, int(e) & 16383) for e in entries[start[0, 0, j]:start[0, 0, j + 1]]] for j in range(10)}
    assert got[5] == [(0, 1), (1, 0), (2, 2)] and got[3] == [(0, 0), (2, 1)] and got[0] == [(2, 0)]
    assert got[1] == [] and got[8] == [(1, 2)] and int(start[0, 0, 10]) == 8


# ----------------------------------------------------------------------------- the backward's decomposition
def _unrotate(x, cos, sin):
    lo, hi = x.chunk(2, dim=-1)
    return torch.cat([lo * cos + hi * sin, hi * cos - lo * sin], dim=-1)


def test_top_operands_planes():
    """The top layer's operand planes: 16-bit K as it is and V per kv head; fp32 a TF32 high part (low 13 mantissa
    bits clear) and a remainder that add up to the value exactly; fp32 at "high" one plane, the nearest TF32 value."""
    g = torch.Generator().manual_seed(3)
    B, Hkv, NT, NV, K, V, off = 2, 3, 5, 9, 8, 6, 4
    for dtype in (torch.bfloat16, torch.float32):
        top_k = torch.randn(B, Hkv, NT, K, generator=g).to(dtype)
        top_v = torch.randn(B, NV, Hkv, V, generator=g).to(dtype)
        ks, vs = top_operands(top_k, top_v, off, dtype)
        want_v = top_v[:, off:off + NT].transpose(1, 2)
        if dtype == torch.float32:
            assert ks.shape == (2, B, Hkv, NT, K) and vs.shape == (2, B, Hkv, NT, V)
            for planes, x in ((ks, top_k), (vs, want_v)):
                assert ((planes[0].view(torch.int32) & 8191) == 0).all()
                assert torch.equal(planes[0] + planes[1], x)
        else:
            assert torch.equal(ks[0], top_k) and torch.equal(vs[0], want_v) and vs.is_contiguous()
    # the fp32 top dq kernel's B operand: planes transposed, rows padded to a multiple of 4 with zeros
    t = _transposed(vs)
    assert t.shape == (2, B, Hkv, V, 8) and torch.equal(t[..., :NT], vs.transpose(-1, -2)) and (t[..., NT:] == 0).all()
    x = torch.randn(B, Hkv, NT, K, generator=g, dtype=torch.float64)
    ks, _ = top_operands(x.float(), top_v.float(), off, torch.float32, "high")
    assert ks.shape == (1, B, Hkv, NT, K) and ((ks[0].view(torch.int32) & 8191) == 0).all()
    # nearest: within half a TF32 ulp (2^-11 relative) of the value, in float64
    assert ((ks[0].double() - x.float().double()).abs() <= x.float().double().abs() * 2.0 ** -11).all()


def test_top_dk_finish_undoes_the_node_frame():
    """top_dk_finish turns rows accumulated in the node's rotated frame, log2 domain (dK R_node log2(e)) back to
    dK, in place, and leaves the other rows alone."""
    g = torch.Generator().manual_seed(4)
    B, NA, Hkv, K, off, NT = 2, 12, 3, 16, 5, 6
    cos, sin = rope_tables(K, 64, 10000.0, torch.float64)  # orthogonal to fp64 rounding
    dk = torch.randn(B, NT, Hkv, K, generator=g, dtype=torch.float64)
    c, s_ = cos[:NT, None, :], sin[:NT, None, :]
    x, y = dk[..., :K // 2], dk[..., K // 2:]
    acc = torch.randn(B, NA, Hkv, K, generator=g, dtype=torch.float64)
    before = acc.clone()
    acc[:, off:off + NT] = torch.cat((x * c - y * s_, x * s_ + y * c), -1) * math.log2(math.e)
    top_dk_finish(acc, off, NT, c[:, 0], s_[:, 0])
    assert torch.allclose(acc[:, off:off + NT], dk, rtol=1e-12, atol=1e-12)
    assert torch.equal(acc[:, :off], before[:, :off]) and torch.equal(acc[:, off + NT:], before[:, off + NT:])


def emulate_backward(do, q, k, v, o, lse, sel, r, top_k, max_top, slab, rope_base=10000.0, child_frame=False):
    """dq, dk, dv the way the kernels compute them (float64 loops): per slab the host index (slab_index,
    parent_lists), the top layer's dq and dK/dV, the lower layers' dq per row and dK/dV per parent's children from
    the lists, then the push-down of the mean pooling. ``child_frame``: the lower layers' dq as
    htree_bwd_rows16_kernel computes it, per parent slot with K rotated at the child index."""
    B, T, H, K = q.shape
    Hkv = k.shape[2]
    G, scale = H // Hkv, K ** -0.5
    layers = build_tree(k, v, r, max_top)
    L = len(layers)
    sizes = [lk.shape[1] for lk, _ in layers]
    nbuf = 1 << pack_bits(r, top_k, max_top)
    cos, sin = rope_tables(K, nbuf, rope_base, torch.float64)
    D = (do * o).sum(-1)
    acc_k = [torch.zeros_like(lk) for lk, _ in layers]
    acc_v = [torch.zeros_like(lv) for _, lv in layers]
    dq = torch.zeros_like(q)
    shift = (L - 1) * int(math.log2(r))
    for t0 in range(0, T, slab):
        S = min(slab, T - t0)
        idx = slab_index(sel[:, :, t0:t0 + S], t0, r, top_k, nbuf, checks=True)
        assert all(bool(ok) for _, ok in idx.checks)
        for b in range(B):
            for h in range(Hkv):
                heads = slice(h * G, (h + 1) * G)
                ktop, vtop = layers[-1][0][b, :, h], layers[-1][1][b, :, h]
                kr_top = apply_rope(ktop, cos[:len(ktop)], sin[:len(ktop)])
                for ts in range(S):  # the top layer (htree_bwd_top_dq / htree_bwd_top_dkv)
                    t = t0 + ts
                    n = (t >> shift) + 1
                    merged = torch.ones(n, dtype=torch.bool) if L == 1 else idx.flags[L - 2, b, ts, h, :n] == 0
                    qr = apply_rope(q[b, t, heads], cos[n - 1], sin[n - 1])
                    P = torch.exp(scale * qr @ kr_top[:n].T - lse[b, t, heads, None]) * merged
                    dS = P * (do[b, t, heads] @ vtop[:n].T - D[b, t, heads, None])
                    dq[b, t, heads] += scale * _unrotate(dS @ kr_top[:n], cos[n - 1], sin[n - 1])
                    acc_k[-1][b, :n, h] += _unrotate(scale * dS.T @ qr, cos[:n], sin[:n])
                    acc_v[-1][b, :n, h] += P.T @ do[b, t, heads]
                for l in range(L - 2, -1, -1):  # the lower layers' dq (htree_bwd_rows)
                    lk, lv = layers[l][0][b, :, h], layers[l][1][b, :, h]
                    for ts in range(S):
                        t = t0 + ts
                        n = int(idx.ncand[l, b, ts, h])
                        p = torch.arange(n)
                        node = idx.par[l, b, ts, h].long()[p // r] * r + p % r
                        merged = torch.ones(n, dtype=torch.bool) if l == 0 else idx.flags[l - 1, b, ts, h, :n] == 0
                        if child_frame:  # the query at n - 1 - slot r, dq rotated back there, slot by slot
                            for slot in range(-(-n // r)):
                                c = p[slot * r:(slot + 1) * r]
                                rel = n - 1 - slot * r
                                kc = apply_rope(lk[node[c]], cos[c % r], sin[c % r])
                                qs = apply_rope(q[b, t, heads], cos[rel], sin[rel])
                                P = torch.exp(scale * qs @ kc.T - lse[b, t, heads, None]) * merged[c]
                                dS = P * (do[b, t, heads] @ lv[node[c]].T - D[b, t, heads, None])
                                dq[b, t, heads] += scale * _unrotate(dS @ kc, cos[rel], sin[rel])
                            continue
                        kr = apply_rope(lk[node], cos[p], sin[p])
                        qr = apply_rope(q[b, t, heads], cos[n - 1], sin[n - 1])
                        P = torch.exp(scale * qr @ kr.T - lse[b, t, heads, None]) * merged
                        dS = P * (do[b, t, heads] @ lv[node].T - D[b, t, heads, None])
                        dq[b, t, heads] += scale * _unrotate(dS @ kr, cos[n - 1], sin[n - 1])
        for l in range(L - 2, -1, -1):  # the lower layers' dK, dV from the parent lists (htree_bwd_nodes)
            start, entries = parent_lists(idx.par[l], sizes[l + 1])
            for b in range(B):
                for h in range(Hkv):
                    heads = slice(h * G, (h + 1) * G)
                    lk, lv = layers[l][0][b, :, h], layers[l][1][b, :, h]
                    for j in range(sizes[l + 1]):
                        for e in entries[start[b, h, j]:start[b, h, j + 1]].tolist():
                            ts, slot = e >> 14, e & 16383
                            t = t0 + ts
                            n = int(idx.ncand[l, b, ts, h])
                            rel = n - 1 - slot * r
                            cut = (t >> (l * int(math.log2(r)))) % r if t >> ((l + 1) * int(math.log2(r))) == j \
                                else r - 1
                            for c in range(r):
                                node = j * r + c
                                if c > cut or node >= sizes[l] or (l > 0 and idx.flags[l - 1, b, ts, h, slot * r + c]):
                                    continue
                                qr = apply_rope(q[b, t, heads], cos[rel], sin[rel])
                                kc = apply_rope(lk[node], cos[c], sin[c])
                                P = torch.exp(scale * qr @ kc - lse[b, t, heads])
                                dS = P * (do[b, t, heads] @ lv[node] - D[b, t, heads])
                                acc_k[l][b, node, h] += _unrotate(scale * dS @ qr, cos[c], sin[c])
                                acc_v[l][b, node, h] += P @ do[b, t, heads]
    for l in range(L - 1, 0, -1):  # the mean pooling's gradient (htree_bwd_unpool)
        n_lo = sizes[l - 1]
        count = torch.full((sizes[l],), float(r), dtype=torch.float64)
        count[-1] = n_lo - (sizes[l] - 1) * r
        for acc in (acc_k, acc_v):
            acc[l - 1] += (acc[l] / count[None, :, None, None]).repeat_interleave(r, dim=1)[:, :n_lo]
    return dq, acc_k[0], acc_v[0]


@pytest.mark.parametrize("child_frame", [False, True], ids=["rows", "rows16"])
@pytest.mark.parametrize("T,r,top_k,max_top,G,slab", [
    (20, 4, 2, 8, 2, 7),    # 2 layers
    (40, 4, 2, 4, 1, 16),   # 3 layers
    (40, 2, 2, 8, 4, 40),   # 4 layers
    (45, 4, 64, 4, 2, 11),  # everything selected
    (9, 4, 2, 16, 2, 4),    # one layer
])
def test_emulated_backward_matches_golden_autograd(T, r, top_k, max_top, G, slab, child_frame):
    """The kernels' decomposition (host index structures, per-layer formulas, lists, push-down) in float64 equals the
    golden's autograd with the golden's own selections; the lower layers' dq either way (htree_bwd_rows_kernel's
    candidates rotated at their positions, htree_bwd_rows16_kernel's per-slot frames)."""
    q, k, v = _inputs(2, T, 2 * G, 2, 8, 6, seed=T + G, grad=True)
    do = torch.randn(2, T, 2 * G, 6, dtype=torch.float64)
    o, sel, lse = htree_forward(q, k, v, r, top_k, max_top, return_selection=True, return_lse=True)
    grads = torch.autograd.grad(o, (q, k, v), do)
    L = num_layers(T, r, max_top)
    pos = nodes_to_positions(sel, r) if L > 1 else torch.empty(0, 2, T, 2, top_k, dtype=torch.int16)
    got = emulate_backward(do, q.detach(), k.detach(), v.detach(), o.detach(), lse.detach(), pos, r, top_k, max_top,
                           slab, child_frame=child_frame)
    for g, g_ref in zip(got, grads):
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-10)


def test_slab_index_rejects_foreign_selections():
    T, r, top_k, max_top = 60, 4, 2, 4
    q, k, v = _inputs(1, T, 4, 2, 8, 6, seed=3)
    _, sel = htree_forward(q, k, v, r, top_k, max_top, return_selection=True)
    pos = nodes_to_positions(sel, r)
    nbuf = 1 << pack_bits(r, top_k, max_top)
    assert all(bool(ok) for _, ok in slab_index(pos, 0, r, top_k, nbuf, checks=True).checks)
    for bad in (pos.flip(-1), torch.where(pos == pos.amax(-1, keepdim=True), -1, pos), pos + 100):
        checks = slab_index(bad, 0, r, top_k, nbuf, checks=True).checks
        assert not all(bool(ok) for _, ok in checks)


# ----------------------------------------------------------------------------- op: validation, protocol, fakes
GOOD = dict(num_heads=8, num_kv_heads=2, head_dim=32)


@pytest.mark.parametrize("kw,err,msg", [
    (dict(num_heads=6, num_kv_heads=4), ValueError, "num_heads"),
    (dict(head_dim=48), ValueError, "head_dim"),
    (dict(compression_rate=12), ValueError, "compression_rate"),
    (dict(top_k_per_layer=4096, compression_rate=16), ValueError, "top_k_per_layer \\* compression_rate"),
    (dict(dtype=torch.float64), TypeError, "dtype"),
    (dict(scale=-1.0), ValueError, "scale"),
    (dict(scale="x"), TypeError, "scale"),
    (dict(rope_base=0.0), ValueError, "rope_base"),
    (dict(fp32_precision="medium"), ValueError, "fp32_precision"),
])
def test_backward_bad_static_params(kw, err, msg):
    """The forward's specification checks, before any kernel is built."""
    with pytest.raises(err, match=msg):
        HTreeBackwardTileLang(**{**GOOD, **kw})


def test_backward_protocol():
    assert issubclass(HTreeBackwardTileLang, Op) and op_class("htree_bwd") is HTreeBackwardTileLang
    for spec in HTreeBackwardTileLang.warm_specs:
        inspect.signature(HTreeBackwardTileLang).bind(**spec)
    # the tile choices fit: bench rows (a), (b), and fp32 at the largest head dims
    for K, V, dt, r, prec in ((32, 32, "float32", 16, "highest"), (32, 32, "float32", 16, "high"),
                              (128, 128, "bfloat16", 16, "highest"), (128, 128, "float32", 4, "highest"),
                              (64, 32, "float16", 32, "highest")):
        cfg = HTreeBackwardTileLang.default_config(dict(num_heads=16, num_kv_heads=1, head_dim=K, v_head_dim=V,
                                                        compression_rate=r, dtype=dt, fp32_precision=prec))
        assert set(cfg) == {"top_dq_block_m", "top_dq_block_n", "top_dkv_block_n", "top_dkv_block_m", "top_stages",
                            "top_threads", "rows_block_n", "nodes_block_m"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,L", [(100, 3), (7, 1), (40, 2)])
def test_custom_op_fakes(dtype, T, L):
    """llm_tile_ops::htree_forward_train and ::htree_backward on meta tensors and under FakeTensorMode: (o, lse,
    selections [L-1, B, T, Hkv, top_k] int16) and (dq, dk, dv)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    B, H, Hkv, K, V, r, top_k, max_top = 2, 8, 2, 64, 32, 4, 4, 16
    assert num_layers(T, r, max_top) == L
    shapes = ((B, T, H, K), (B, T, Hkv, K), (B, T, Hkv, V))
    q, k, v = (torch.empty(s, dtype=dtype, device="meta") for s in shapes)
    o, lse, sel = torch.ops.llm_tile_ops.htree_forward_train(q, k, v, r, top_k, max_top, 10000.0, None)
    assert o.shape == (B, T, H, V) and o.dtype == dtype
    assert lse.shape == (B, T, H) and lse.dtype == torch.float32
    assert sel.shape == (L - 1, B, T, Hkv, top_k) and sel.dtype == torch.int16
    dq, dk, dv = torch.ops.llm_tile_ops.htree_backward(o, q, k, v, o, lse, sel, r, top_k, max_top, 10000.0, None)
    assert (dq.shape, dk.shape, dv.shape) == shapes and dq.dtype == dk.dtype == dv.dtype == dtype
    with FakeTensorMode():
        q, k, v = (torch.empty(s, dtype=dtype, device="cuda") for s in shapes)
        o, lse, sel = torch.ops.llm_tile_ops.htree_forward_train(q, k, v, r, top_k, max_top, 10000.0, 0.1)
        assert sel.shape == (L - 1, B, T, Hkv, top_k) and o.device.type == "cuda"
        dq, dk, dv = torch.ops.llm_tile_ops.htree_backward(o, q, k, v, o, lse, sel, r, top_k, max_top, 10000.0, 0.1)
        assert (dq.shape, dk.shape, dv.shape) == shapes
    # autograd through the fakes (meta tensors): htree_attention keeps (o, lse, selections) when a gradient is
    # needed, the plain forward recomputes them in its backward
    for fn in (lambda q, k, v: htree_attention(q, k, v, compression_rate=r, top_k_per_layer=top_k,
                                              max_top_nodes=max_top),
               lambda q, k, v: torch.ops.llm_tile_ops.htree_forward(q, k, v, r, top_k, max_top, 10000.0, None)):
        q, k, v = (torch.empty(s, dtype=dtype, device="meta").requires_grad_() for s in shapes)
        o = fn(q, k, v)
        assert o.shape == (B, T, H, V) and o.requires_grad
        o.sum().backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    with torch.no_grad():
        assert htree_attention(q, k, v, compression_rate=r, top_k_per_layer=top_k, max_top_nodes=max_top).grad_fn \
            is None


# the bench configurations (a) fp32 G=16 K=32 and (b) bf16 G=4 K=128, and a small fp16 one (K != V, r = 4)
@pytest.fixture(scope="module", params=[(64, 4, 32, 32, 16, torch.float32), (32, 8, 128, 128, 16, torch.bfloat16),
                                        (8, 2, 64, 32, 4, torch.float16)],
                ids=["a-fp32-G16-K32", "b-bf16-G4-K128", "fp16-G4-K64-V32-r4"])
def bwd_op(request):
    H, Hkv, K, V, r, dtype = request.param
    kw = dict(compression_rate=r) if r != 16 else {}
    if r == 4:
        kw.update(top_k_per_layer=4, max_top_nodes=16)
    return HTreeBackwardTileLang(H, Hkv, K, V, dtype=dtype, **kw)


@pytest.mark.compile
def test_backward_compiles_for_sm90a(bwd_op):
    """Every backward kernel builds for sm_90a (and the forward's variant for the differentiable forward)."""
    kernels = bwd_op.kernels()
    assert all(kernel is not None for kernel in kernels.values())
    dtype, G = str(bwd_op.dtype)[6:], bwd_op.num_heads // bwd_op.num_kv_heads
    # (a) and (b): the rows kernel from fragments, with K rotated at the child index
    frag = uses_rows16(dtype, bwd_op.compression_rate) or uses_fp32_fragments(dtype, bwd_op.head_dim,
                                                                              bwd_op.v_head_dim, G,
                                                                              bwd_op.compression_rate)
    assert len(kernels) == 10 + frag and ("rope_child" in kernels) == frag


@pytest.mark.compile
@pytest.mark.parametrize("H,Hkv,K,V,r,precision", [(8, 2, 64, 32, 32, "highest"), (16, 1, 32, 64, 16, "high")])
def test_fp32_fragment_kernels_compile_for_sm90a(H, Hkv, K, V, r, precision):
    """htree_bwd_nodes32_kernel and htree_bwd_rows32_kernel (fp32, r >= 16) build at a GPU test's specification
    (two child tiles, K != V) and with TF32 products (the bench's (a): above)."""
    G = H // Hkv
    assert uses_fp32_fragments("float32", K, V, G, r)
    nodes = compile_kernel(htree_bwd_nodes32_kernel(H, Hkv, K, V, r, 4, K ** -0.5, precision),
                           pass_configs=WARP_OWN_SHARED)
    if _runtime.target()["arch"].startswith("sm_90"):
        # the warps walk entry lists of their own lengths: one block-wide barrier, after the walks
        src = nodes.get_kernel_source()
        assert src.count("__syncthreads()") == 1 and "cp_async" in src
    rows = compile_kernel(htree_bwd_rows32_kernel(H, Hkv, K, V, r, 4, K ** -0.5, precision),
                          pass_configs=WARP_OWN_SHARED)
    if _runtime.target()["arch"].startswith("sm_90"):
        # the block syncs only around each layer's parents and before the warps' sums, outside the warps' walks
        src = rows.get_kernel_source()
        assert src.count("__syncthreads()") == 3 and "cp_async" in src


@pytest.mark.compile
def test_backward_tf32_compiles_for_sm90a():
    """fp32 at fp32_precision="high" (one TF32 product, one operand plane) builds at the bench's (a)."""
    op = HTreeBackwardTileLang(64, 4, 32, dtype=torch.float32, fp32_precision="high")
    assert all(kernel is not None for kernel in op.kernels().values())


@pytest.mark.compile
@pytest.mark.parametrize("H,Hkv,K,V,r,top_k,dtype", [
    (8, 2, 128, 64, 16, 16, "bfloat16"),  # the GPU tests' bf16 G=4 K != V case
    (16, 1, 128, 64, 16, 8, "float16"),   # G = 16 (two head tiles), fp16
    (16, 1, 64, 32, 32, 4, "bfloat16"),   # r = 32
    (8, 2, 32, 64, 16, 8, "float16"),     # K = 32 (8-byte loads)
], ids=["bf16-G4-K128-V64", "fp16-G16-K128", "bf16-G16-r32", "fp16-G4-K32-V64"])
def test_rows16_kernel_compiles_for_sm90a(H, Hkv, K, V, r, top_k, dtype):
    """htree_bwd_rows16_kernel (16-bit, r >= 16) builds at the GPU tests' specifications (the bench's (b): above)."""
    assert uses_rows16(dtype, r)
    assert compile_kernel(htree_bwd_rows16_kernel(H, Hkv, K, V, r, top_k, K ** -0.5, dtype)) is not None


@pytest.mark.compile
def test_forward_for_backward_variant_compiles(bwd_op):
    """The forward's for_backward kernels (int16 positions, the final lse) at the same specifications."""
    fwd = HTreeForwardTileLang(bwd_op.num_heads, bwd_op.num_kv_heads, bwd_op.head_dim, bwd_op.v_head_dim,
                               bwd_op.compression_rate, bwd_op.top_k_per_layer, bwd_op.max_top_nodes,
                               dtype=bwd_op.dtype)
    saved = fwd._saved_kernels()
    assert saved.kernel is not None and saved.top_merge is not None
    assert (saved.middle is None) == (fwd.middle is None)
    q = torch.empty(1, 5, fwd.num_heads, fwd.head_dim, dtype=fwd.dtype)
    k = torch.empty(1, 5, fwd.num_kv_heads, fwd.head_dim, dtype=fwd.dtype)
    v = torch.empty(1, 5, fwd.num_kv_heads, fwd.v_head_dim, dtype=fwd.dtype)
    with pytest.raises(TypeError, match="return_lse"):
        fwd(q, k, v, return_lse=1)
    with pytest.raises(ValueError, match="CUDA"):
        fwd.forward_for_backward(q, k, v)


@pytest.mark.compile
def test_backward_bad_tensors(bwd_op):
    """do, the saved tensors and the inputs checked before any launch: CPU tensors (device), then CUDA fake tensors
    (dtype, shape, layout), and validate's type."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op, dt = bwd_op, bwd_op.dtype
    B, T = 1, 40
    H, Hkv, K, V = op.num_heads, op.num_kv_heads, op.head_dim, op.v_head_dim
    L = num_layers(T, op.compression_rate, op.max_top_nodes)
    shapes = dict(do=(B, T, H, V), q=(B, T, H, K), k=(B, T, Hkv, K), v=(B, T, Hkv, V), o=(B, T, H, V))

    def make(device):
        args = {name: torch.empty(shape, dtype=dt, device=device) for name, shape in shapes.items()}
        args["lse"] = torch.empty(B, T, H, device=device)
        args["selections"] = torch.empty(L - 1, B, T, Hkv, op.top_k_per_layer, dtype=torch.int16, device=device)
        return args

    args = make("cpu")
    with pytest.raises(ValueError, match="CUDA"):
        op(**args)
    with pytest.raises(TypeError, match="torch.Tensor"):
        op(**{**args, "q": args["q"].tolist()})
    with pytest.raises(TypeError, match="validate"):
        op(**args, validate=1)
    with FakeTensorMode():  # (CUDA fake tensors made directly: views of them need a CUDA build)
        args = make("cuda")

        def cuda(shape, dtype=dt):
            return torch.empty(shape, dtype=dtype, device="cuda")

        L1 = (L - 1, B, T, Hkv, op.top_k_per_layer)
        for name, bad, err, msg in [
            ("do", cuda(shapes["do"], torch.float64), TypeError, "do: expected dtype"),
            ("do", cuda((B, T, H, V // 2)), ValueError, "do: expected shape"),
            ("do", torch.empty_strided(shapes["do"], (T * H * V, 1, T * V, T), dtype=dt, device="cuda"), ValueError,
             "do: expected a contiguous"),
            ("o", cuda((B, T - 1, H, V)), ValueError, "o: expected shape"),
            ("lse", cuda((B, T, H), torch.float64), TypeError, "lse: expected dtype"),
            ("lse", cuda((B, T, 1), torch.float32), ValueError, "lse: expected shape"),
            ("selections", cuda(L1, torch.int32), TypeError, "selections: expected dtype"),
            ("selections", cuda((L, B, T, Hkv, op.top_k_per_layer), torch.int16), ValueError,
             "selections: expected shape"),
            ("k", cuda(shapes["k"], torch.float64), TypeError, "k: expected dtype"),
        ]:
            with pytest.raises(err, match=msg):
                op(**{**args, name: bad})
