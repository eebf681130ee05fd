"""htree forward: golden vs a literal float64 loop, golden properties, the op's host side vs the golden,
validation, the op protocol, the custom op's fake, compile-only builds."""

import inspect
import math
import struct

import pytest
import torch

import golden.htree
from golden.htree import apply_rope, build_tree, htree_forward, num_layers, pack_bits, rope_tables
from ops.common.protocol import Op, op_class
from ops.htree import HTreeForwardTileLang, htree_attention
from ops.htree import tree
from ops.htree.kernels.walk import htree_fwd_kernel


# ----------------------------------------------------------------------------- literal definition
def _literal(q, k, v, r, top_k, max_top_nodes, rope_base=10000.0):
    """One (b, t, kv head) at a time, straight from the issue's rules, float64 except the fp32 importance."""
    B, T, H, K = q.shape
    Hkv = k.shape[2]
    G = H // Hkv
    scale = K ** -0.5
    log_n = int(math.log2(max(max_top_nodes, top_k * r)))
    tree = [(k.double(), v.double())]
    while tree[-1][0].shape[1] > max_top_nodes:
        ks, vs = tree[-1]
        n = ks.shape[1]
        m = -(-n // r)
        tree.append((torch.stack([ks[:, i * r:min(n, (i + 1) * r)].mean(1) for i in range(m)], 1),
                     torch.stack([vs[:, i * r:min(n, (i + 1) * r)].mean(1) for i in range(m)], 1)))
    L = len(tree)

    def rope(x, p):
        h = K // 2
        y = x.clone()
        for i in range(h):
            a = p * rope_base ** (-2 * i / K)
            y[i] = x[i] * math.cos(a) - x[i + h] * math.sin(a)
            y[i + h] = x[i] * math.sin(a) + x[i + h] * math.cos(a)
        return y

    def packed(imp32, p):
        bits = struct.unpack("<I", struct.pack("<f", imp32))[0]
        mask = (1 << log_n) - 1
        return (bits & ~mask) | (~p & mask)

    out = torch.zeros(B, T, H, v.shape[3], dtype=torch.float64)
    sel = [torch.full((B, T, Hkv, top_k), -1, dtype=torch.int32) for _ in range(L - 1)]
    for b in range(B):
        for t in range(T):
            for h in range(Hkv):
                merged = [[] for _ in range(G)]  # (score, value) per head
                parents = None
                for l in range(L - 1, -1, -1):
                    lk, lv = tree[l][0][b, :, h], tree[l][1][b, :, h]
                    last = t // r ** l
                    if parents is None:
                        cand = list(range(last + 1))
                    else:
                        cand = [c for p in parents for c in range(p * r, p * r + r) if c <= last]
                    n = len(cand)
                    kr = [rope(lk[c], p) for p, c in enumerate(cand)]
                    s = [[scale * float(rope(q[b, t, h * G + g].double(), n - 1) @ kr[p]) for p in range(n)]
                         for g in range(G)]
                    winners = set()
                    if l > 0:
                        imp = []
                        for p in range(n):
                            acc = struct.unpack("<f", struct.pack("<f", 0.0))[0]
                            for g in range(G):
                                lse = max(s[g]) + math.log(sum(math.exp(x - max(s[g])) for x in s[g]))
                                e = struct.unpack("<f", struct.pack("<f", math.exp(s[g][p] - lse)))[0]
                                e = 0.0 if e < 2.0 ** -126 else e
                                acc = struct.unpack("<f", struct.pack("<f", acc + e))[0]
                            imp.append(1e3 if p == n - 1 else acc)
                        keys = sorted(range(n), key=lambda p: packed(imp[p], p), reverse=True)
                        winners = set(keys[:min(top_k, n)])
                        parents = sorted(cand[p] for p in winners)
                        sel[l - 1][b, t, h, :len(parents)] = torch.tensor(parents, dtype=torch.int32)
                    for p in range(n):
                        if p not in winners:
                            for g in range(G):
                                merged[g].append((s[g][p], lv[cand[p]]))
                for g in range(G):
                    mx = max(x for x, _ in merged[g])
                    w = [math.exp(x - mx) for x, _ in merged[g]]
                    out[b, t, h * G + g] = sum(wi * vi for wi, (_, vi) in zip(w, merged[g])) / sum(w)
    return out, sel


def _inputs(B, T, H, Hkv, K, V, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, H, K, generator=g, dtype=dtype), torch.randn(B, T, Hkv, K, generator=g, dtype=dtype),
            torch.randn(B, T, Hkv, V, generator=g, dtype=dtype))


@pytest.mark.parametrize("T,G,seed", [(300, 1, 0), (200, 2, 1), (77, 4, 2)])
def test_golden_matches_literal(T, G, seed):
    r, top_k, max_top = 4, 4, 16
    q, k, v = _inputs(1, T, 2 * G, 2, 8, 6, seed=seed)
    o, sel = htree_forward(q, k, v, r, top_k, max_top, return_selection=True, rows_per_tile=37)
    o_ref, sel_ref = _literal(q, k, v, r, top_k, max_top)
    assert len(sel) == num_layers(T, r, max_top) - 1 >= 1
    for s, s_ref in zip(sel, sel_ref):
        assert torch.equal(s, s_ref)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)


def _dense_rope_attention(q, k, v, rope_base=10000.0):
    B, T, H, K = q.shape
    G = H // k.shape[2]
    cos, sin = rope_tables(K, T, rope_base, torch.float64)
    qr = apply_rope(q.double(), cos[:, None], sin[:, None])
    kr = apply_rope(k.double(), cos[:, None], sin[:, None]).repeat_interleave(G, dim=2)
    s = torch.einsum("bthk,bshk->bhts", qr, kr) * K ** -0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    return torch.einsum("bhts,bshv->bthv", s.softmax(-1), v.double().repeat_interleave(G, dim=2))


@pytest.mark.parametrize("T,top_k,max_top", [(16, 4, 16), (200, 64, 16)])
def test_golden_equals_dense_when_everything_is_selected(T, top_k, max_top):
    q, k, v = _inputs(2, T, 4, 2, 16, 8, seed=T)
    torch.testing.assert_close(htree_forward(q, k, v, 4, top_k, max_top), _dense_rope_attention(q, k, v),
                               rtol=1e-10, atol=1e-10)


def test_golden_ties_go_to_smaller_positions():
    T, r, top_k, max_top = 64, 4, 4, 16  # top layer: 16 nodes, all scores equal with k = 0
    q, k, v = _inputs(1, T, 2, 1, 8, 8)
    _, sel = htree_forward(q, torch.zeros_like(k), v, r, top_k, max_top, return_selection=True)
    for t in range(T):
        last = t // r
        want = sorted(set(range(min(top_k - 1, last))) | {last})
        assert sel[0][0, t, 0, :len(want)].tolist() == want
        assert (sel[0][0, t, 0, len(want):] == -1).all()


def test_build_tree_means_existing_children():
    k = torch.randn(1, 37, 1, 4, dtype=torch.float64)
    tree = build_tree(k, k, 4, 2)
    assert [lk.shape[1] for lk, _ in tree] == [37, 10, 3, 1]
    torch.testing.assert_close(tree[1][0][0, 9], k[0, 36:37].mean(0))
    torch.testing.assert_close(tree[2][0][0, 2], tree[1][0][0, 8:10].mean(0))
    assert pack_bits(16, 512, 8192) == 13 and pack_bits(4, 4, 16) == 4


# ----------------------------------------------------------------------------- the op's host side
def test_op_tables_match_the_golden():
    """ops.htree.tree keeps its own copies of the golden's constants and tables (ops never import golden)."""
    assert tree.RIGHTMOST_IMPORTANCE == golden.htree.RIGHTMOST_IMPORTANCE
    for r in (2, 4, 16, 32):
        for top_k in (1, 4, 512):
            for max_top in (16, 8192):
                assert tree.pack_bits(r, top_k, max_top) == golden.htree.pack_bits(r, top_k, max_top)
    for K, n, base in ((32, 100, 10000.0), (128, 8192, 500000.0)):
        for got, want in zip(tree.rope_tables(K, n, base), golden.htree.rope_tables(K, n, base)):
            assert torch.equal(got, want)


@pytest.mark.parametrize("T,r,max_top", [(1, 4, 16), (16, 4, 16), (17, 4, 16), (37, 4, 2), (300, 16, 8),
                                         (5003, 16, 512)])
def test_layer_sizes_match_the_golden_tree(T, r, max_top):
    sizes, offs = tree.layer_sizes(T, r, max_top)
    k = torch.zeros(1, T, 1, 2)
    assert sizes == [lk.shape[1] for lk, _ in build_tree(k, k, r, max_top)]
    assert len(sizes) == num_layers(T, r, max_top)
    assert offs[:2] == [0, 0] and all(offs[l + 1] == offs[l] + sizes[l] for l in range(1, len(sizes) - 1))


def test_split_tf32_halves():
    x = torch.tensor([1.0, -3.14159265, 1e-30, 123456.789, float("inf")])
    hi, lo = tree.split_tf32(x)
    finite = x.isfinite()
    # both halves carry the TF32 rounding offset (half a TF32 ulp); without it the high half keeps 10 mantissa
    # bits and the two add up to x exactly
    assert torch.equal((hi.view(torch.int32) & 0x1FFF)[finite], torch.full((4,), 0x1000, dtype=torch.int32))
    assert hi[-1] == float("inf")  # non-finite values keep their bits
    hi, lo = ((h.view(torch.int32) - 0x1000).view(torch.float32) for h in (hi, lo))
    assert torch.equal((hi + lo)[finite], x[finite])


# ----------------------------------------------------------------------------- op: validation, compile-only
GOOD = dict(num_heads=8, num_kv_heads=2, head_dim=32)


@pytest.mark.parametrize("kw,err,msg", [
    (dict(num_heads=6, num_kv_heads=4), ValueError, "num_heads"),
    (dict(num_heads=64, num_kv_heads=2), ValueError, "num_kv_heads"),
    (dict(head_dim=33), ValueError, "head_dim"),
    (dict(head_dim=48), ValueError, "head_dim"),
    (dict(v_head_dim=96), ValueError, "v_head_dim"),
    (dict(compression_rate=12), ValueError, "compression_rate"),
    (dict(top_k_per_layer=100), ValueError, "top_k_per_layer"),
    (dict(max_top_nodes=1000), ValueError, "max_top_nodes"),
    (dict(top_k_per_layer=4096, compression_rate=16), ValueError, "top_k_per_layer \\* compression_rate"),
    (dict(dtype=torch.float64), TypeError, "dtype"),
    (dict(rope_base=-1.0), ValueError, "rope_base"),
    (dict(num_heads=8.0), TypeError, "num_heads"),
])
def test_bad_static_params(kw, err, msg):
    with pytest.raises(err, match=msg):
        HTreeForwardTileLang(**{**GOOD, **kw})


@pytest.mark.parametrize("kw,err", [
    (dict(scale=0.0), ValueError), (dict(scale=-0.125), ValueError), (dict(scale=float("nan")), ValueError),
    (dict(scale=float("inf")), ValueError), (dict(scale="0.1"), TypeError), (dict(scale=True), TypeError),
    (dict(rope_base=0.0), ValueError), (dict(rope_base=float("inf")), ValueError), (dict(rope_base="1e4"), TypeError),
])
def test_bad_scale_and_rope_base(kw, err):
    """The scale check every op shares (and rope_base's), before any kernel is built; the same from the custom op's
    functional form, before the op is looked up."""
    name = next(iter(kw))
    with pytest.raises(err, match=name):
        HTreeForwardTileLang(**{**GOOD, **kw})
    q, k, v = (torch.empty(1, 4, h, 32, device="meta") for h in (8, 2, 2))
    with pytest.raises(err, match=name):
        htree_attention(q, k, v, **kw)


@pytest.mark.parametrize("kw", [dict(compression_rate=16.0), dict(top_k_per_layer="512"), dict(max_top_nodes=None)])
def test_htree_attention_bad_ints(kw):
    q, k, v = (torch.empty(1, 4, h, 32, device="meta") for h in (8, 2, 2))
    with pytest.raises(TypeError, match=next(iter(kw))):
        htree_attention(q, k, v, **kw)


# ----------------------------------------------------------------------------- op protocol, custom op
def test_protocol():
    assert issubclass(HTreeForwardTileLang, Op) and op_class("htree") is HTreeForwardTileLang
    small, large = (HTreeForwardTileLang.default_config(dict(head_dim=K)) for K in (32, 128))
    assert small == {"block_n": 64, "threads": 128, "min_blocks": 3, "chunk_rope": True, "tiles0": 2, "min_blocks0": 4}
    assert large == {"block_n": 32, "threads": 128, "min_blocks": 3, "chunk_rope": True, "tiles0": 2, "min_blocks0": 3}
    space = HTreeForwardTileLang.config_space(dict(head_dim=128))
    assert space and all(set(c) <= set(large) for c in space)
    assert HTreeForwardTileLang.tunable_kernel({}) is htree_fwd_kernel
    for spec in HTreeForwardTileLang.warm_specs:  # constructor keyword sets
        inspect.signature(HTreeForwardTileLang).bind(**spec)


def test_autotune_case_registered():
    from scripts.workloads.htree import AUTOTUNE

    assert set(AUTOTUNE) == {HTreeForwardTileLang.op_name}
    inspect.signature(AUTOTUNE["htree"]).bind(T=1024, fp32=1)  # scripts/autotune.py --shape T=1024,fp32=1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shapes", [((2, 100, 8, 64), (2, 100, 2, 64), (2, 100, 2, 32)),
                                    ((1, 7, 4, 128), (1, 7, 4, 128), (1, 7, 4, 128))])
def test_custom_op_fake(dtype, shapes):
    """llm_tile_ops::htree_forward's fake: o [B, T, H, V] in q's dtype, for meta tensors and under FakeTensorMode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    (B, T, H, _), _, (_, _, _, V) = shapes
    q, k, v = (torch.empty(s, dtype=dtype, device="meta") for s in shapes)
    o = torch.ops.llm_tile_ops.htree_forward(q, k, v, 4, 4, 16, 10000.0, None)
    assert o.shape == (B, T, H, V) and o.dtype == dtype and o.device.type == "meta"
    with FakeTensorMode():
        q, k, v = (torch.empty(s, dtype=dtype, device="cuda") for s in shapes)
        o = htree_attention(q, k, v, compression_rate=4, top_k_per_layer=4, max_top_nodes=16, scale=0.1)
        assert o.shape == (B, T, H, V) and o.dtype == dtype and o.device.type == "cuda"


# the bench configurations (a) fp32 G=16 K=32 and (b) bf16 G=4 K=128
@pytest.fixture(scope="module", params=[(64, 4, 32, torch.float32), (32, 8, 128, torch.bfloat16)],
                ids=["a-fp32-G16-K32", "b-bf16-G4-K128"])
def bench_op(request):
    H, Hkv, K, dtype = request.param
    return HTreeForwardTileLang(H, Hkv, K, dtype=dtype)


@pytest.mark.compile
def test_compiles_for_sm90a(bench_op):
    assert all(kernel is not None for kernel in (bench_op.kernel, bench_op.pool, bench_op.rope, bench_op.top_lse,
                                                 bench_op.top_keys, bench_op.top_merge, bench_op.layer0))
    # 16-bit (r >= 16): K pre-rotated for the layer kernel, which also takes the middle layers
    assert (bench_op.rope0 is None) == (bench_op.middle is None) == (bench_op.dtype == torch.float32)


@pytest.mark.compile
def test_tunable_kernel_takes_spec_and_config(bench_op):
    """scripts/autotune.py calls tunable_kernel(spec)(**spec, **config) for the configs of config_space."""
    builder = bench_op.tunable_kernel(bench_op.spec)
    for config in bench_op.config_space(bench_op.spec):
        inspect.signature(builder).bind(**bench_op.spec, **config)
    func = builder(**bench_op.spec, **bench_op.config_space(bench_op.spec)[0])  # the TIR builds (no nvcc)
    assert str(func.attrs["global_symbol"]) == "htree_fwd"


@pytest.mark.compile
def test_compiles_fp32_layer0_variants():
    """fp32 layer 0 from register fragments with K != V, r < 8 (candidate rows one by one) and one tile per step."""
    op = HTreeForwardTileLang(16, 1, 64, 32, compression_rate=4, top_k_per_layer=16, max_top_nodes=64,
                              dtype=torch.float32, config={"tiles0": 1})
    assert op.kernel is not None and op.layer0 is not None


@pytest.mark.compile
def test_compiles_16bit_layer0_variants():
    """16-bit layer 0 and middle layers from register fragments with two head tiles (G = 16), K != V and r = 32;
    r < 16 keeps them in the walk."""
    op = HTreeForwardTileLang(16, 1, 64, 32, compression_rate=32, top_k_per_layer=16, max_top_nodes=64,
                              dtype=torch.float16)
    assert op.layer0 is not None and op.middle is not None and op.rope0 is not None
    op = HTreeForwardTileLang(8, 2, 32, 64, compression_rate=4, top_k_per_layer=4, max_top_nodes=16,
                              dtype=torch.bfloat16)
    assert op.layer0 is None and op.middle is None and op.rope0 is None


@pytest.mark.compile
def test_bad_tensors(bench_op):
    op, dt = bench_op, bench_op.dtype
    H, Hkv, K = op.num_heads, op.num_kv_heads, op.head_dim
    q, k, v = torch.randn(1, 5, H, K).to(dt), torch.randn(1, 5, Hkv, K).to(dt), torch.randn(1, 5, Hkv, K).to(dt)
    with pytest.raises(ValueError, match="CUDA"):
        op(q, k, v)
    with pytest.raises(TypeError, match="q: expected dtype"):
        op(q.double(), k, v)
    with pytest.raises(ValueError, match="q: expected shape"):
        op(q[..., :K - 2], k, v)
    with pytest.raises(ValueError, match="B >= 1 and T >= 1"):
        op(q[:, :0], k[:, :0], v[:, :0])
    with pytest.raises(ValueError, match="B >= 1 and T >= 1"):
        op(q[:0], k[:0], v[:0])
    with pytest.raises(TypeError, match="torch.Tensor"):
        op(q.tolist(), k, v)
