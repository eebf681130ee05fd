"""htree forward on the GPU: compiled vs golden (selections and outputs), poisoned outputs, the custom op under
torch.compile, the autotune path."""

import contextlib

import pytest
import torch

from golden.htree import htree_forward
from ops.common.runtime import compile_kernel
from ops.htree import HTreeForwardTileLang, htree_attention

# (dtype, H, Hkv, K, V, r, top_k, max_top_nodes, T): T never a multiple of a tile, 2-4 layers
CASES = [
    (torch.float32, 8, 2, 32, 64, 4, 4, 16, 300),
    (torch.bfloat16, 8, 2, 32, 64, 4, 4, 16, 300),
    (torch.float32, 32, 2, 64, 32, 8, 16, 64, 2001),
    (torch.bfloat16, 2, 2, 128, 128, 16, 32, 512, 5003),
    # K = V = 32 in fp32 (layer 0 from register fragments, htree_layer0_kernel, as all fp32 cases here); r >= 8
    # takes its contiguous-children loads
    (torch.float32, 16, 1, 32, 32, 4, 8, 32, 777),
    (torch.float32, 8, 2, 32, 32, 4, 4, 16, 300),
    (torch.float32, 32, 2, 32, 32, 16, 8, 128, 3001),
    # 16-bit with r >= 16: layer 0 and (L = 3) the middle layer from register fragments (htree_layer16_kernel;
    # CASES[3] too, L = 2), two head tiles with G = 16, r = 32
    (torch.bfloat16, 32, 8, 128, 128, 16, 16, 64, 3001),
    (torch.float16, 16, 1, 64, 32, 16, 8, 32, 1500),
    (torch.bfloat16, 8, 2, 32, 64, 32, 4, 64, 2100),
]
TOL = {torch.float32: dict(atol=1e-4, rtol=2e-5), torch.bfloat16: dict(atol=6e-2, rtol=1e-2),
       torch.float16: dict(atol=1e-2, rtol=2e-3)}


def run_case(dtype, H, Hkv, K, V, r, top_k, max_top, T, B=2, poisoned=contextlib.nullcontext, keys_bytes=None,
             config=None, **kw):
    """Returns (fraction of agreeing selection rows, max error and rel-norm error on agreeing rows,
    number of agreeing rows); raises on unwritten (NaN) outputs. ``keys_bytes`` shrinks the top-layer key
    workspace, so the queries go through the top kernels in many slabs; ``kw``: rope_base, scale."""
    q = torch.randn(B, T, H, K, device="cuda", dtype=dtype)
    k = torch.randn(B, T, Hkv, K, device="cuda", dtype=dtype)
    v = torch.randn(B, T, Hkv, V, device="cuda", dtype=dtype)
    op = HTreeForwardTileLang(H, Hkv, K, V, r, top_k, max_top, dtype=dtype, config=config, **kw)
    if keys_bytes is not None:
        op._KEYS_BYTES = keys_bytes
    out = torch.full((B, T, H, V), float("nan"), device="cuda", dtype=dtype)
    with poisoned():  # selections and tree nodes start as garbage too
        o, sel = op(q, k, v, return_selection=True, out=out)
    o_ref, sel_ref = htree_forward(q, k, v, r, top_k, max_top, return_selection=True, **kw)
    assert o.data_ptr() == out.data_ptr() and not o.isnan().any()
    assert len(sel) == len(sel_ref) >= 1
    rows_ok = torch.stack([(s == s_ref).all(-1) for s, s_ref in zip(sel, sel_ref)])  # [L-1, B, T, Hkv]
    agree = rows_ok.all(0).repeat_interleave(H // Hkv, dim=2)  # [B, T, H]
    diff = (o.float() - o_ref.float())[agree]
    rel = (diff.norm() / o_ref.float()[agree].norm()).item()
    return rows_ok.float().mean().item(), diff.abs().max().item(), rel, agree.sum().item()


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES,
                         ids=lambda c: f"{str(c[0])[6:]}-G{c[1] // c[2]}-K{c[3]}-r{c[5]}-k{c[6]}-m{c[7]}-T{c[8]}")
def test_htree_matches_golden(case, poisoned):
    check_case(case, poisoned)


def check_case(case, poisoned, keys_bytes=None, config=None, **kw):
    dtype = case[0]
    frac, max_err, rel, n_agree = run_case(*case, poisoned=poisoned, keys_bytes=keys_bytes, config=config, **kw)
    if dtype == torch.float32:
        assert frac >= 0.999, f"selections agree on {frac:.5f} of rows"
    assert n_agree > 0.5 * case[8] * 2 * case[1]
    assert max_err <= TOL[dtype]["atol"] and rel <= TOL[dtype]["rtol"], (max_err, rel)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles0", [1, 4])
@pytest.mark.parametrize("case", [CASES[4], CASES[6]], ids=["r4", "r16"])
def test_htree_layer0_tiles(case, tiles0, poisoned):
    """The fp32 layer 0's chunk size per warp (8 x tiles0 candidates; the default is 2)."""
    check_case(case, poisoned, config={"tiles0": tiles0})


@pytest.mark.gpu
@pytest.mark.parametrize("case,keys_bytes", [(CASES[2], 2 * 2 * 32 * 4 * 100), (CASES[3], 2 * 2 * 313 * 4 * 10),
                                              (CASES[7], 2 * 8 * 12 * 4 * 100)],
                         ids=["fp32-slabs-of-64", "bf16-slabs-of-10", "bf16-middle-layer-slabs-of-64"])
def test_htree_in_slabs(case, keys_bytes, poisoned):
    """Queries split into slabs (the last one partial, and slabs smaller than a top-kernel CTA's queries)."""
    check_case(case, poisoned, keys_bytes)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=lambda c: f"T{c[8]}")
def test_htree_table_rope(case, poisoned):
    """16-bit inputs rotated with the golden's table rows below the top layer (not the default)."""
    check_case(case, poisoned, config={"chunk_rope": False})


@pytest.mark.gpu
def test_htree_single_layer_and_no_selection():
    """T <= max_top_nodes: one layer, no selections; plain call returns only the output."""
    q, k, v = (torch.randn(1, 13, h, d, device="cuda") for h, d in ((8, 32), (2, 32), (2, 64)))
    op = HTreeForwardTileLang(8, 2, 32, 64, compression_rate=4, top_k_per_layer=4, max_top_nodes=16,
                              dtype=torch.float32)
    o, sel = op(q, k, v, return_selection=True)
    assert sel == []
    torch.testing.assert_close(op(q, k, v), htree_forward(q, k, v, 4, 4, 16), **TOL[torch.float32])


@pytest.mark.gpu
@pytest.mark.parametrize("case", [CASES[2], CASES[7]], ids=lambda c: str(c[0])[6:])
def test_htree_scale_and_rope_base(case, poisoned):
    """A given softmax scale and RoPE base, as the golden takes them."""
    check_case(case, poisoned, scale=0.07, rope_base=500.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_htree_attention_torch_compile(dtype):
    """llm_tile_ops::htree_forward inside torch.compile(fullgraph=True): one graph, eager's result, and the
    op class's."""
    q = torch.randn(2, 300, 8, 32, device="cuda", dtype=dtype)
    k = torch.randn(2, 300, 2, 32, device="cuda", dtype=dtype)
    v = torch.randn(2, 300, 2, 64, device="cuda", dtype=dtype)

    def fn(q, k, v):
        return htree_attention(q * 1, k, v, compression_rate=4, top_k_per_layer=4, max_top_nodes=16) * 2

    compiled = torch.compile(fn, fullgraph=True)
    out = compiled(q, k, v)
    assert out.shape == (2, 300, 8, 64) and out.dtype == dtype
    assert torch.equal(out, fn(q, k, v))
    op = HTreeForwardTileLang(8, 2, 32, 64, compression_rate=4, top_k_per_layer=4, max_top_nodes=16, dtype=dtype)
    assert torch.equal(out, op(q, k, v) * 2)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [CASES[2], CASES[7]], ids=["fp32-L3-layer0", "bf16-L3-middle"])
def test_htree_autotune_path(case, poisoned):
    """What scripts/autotune.py runs: tune_args (the walk's arguments for the first slab) and the walk built as
    tunable_kernel(spec)(**spec, **config) for a config of config_space; the top layer's thresholds agree
    with the default walk's and the state it hands on is written."""
    dtype, H, Hkv, K, V, r, top_k, max_top, T = case
    q = torch.randn(2, T, H, K, device="cuda", dtype=dtype)
    k = torch.randn(2, T, Hkv, K, device="cuda", dtype=dtype)
    v = torch.randn(2, T, Hkv, V, device="cuda", dtype=dtype)
    op = HTreeForwardTileLang(H, Hkv, K, V, r, top_k, max_top, dtype=dtype)
    with poisoned():
        args = op.tune_args(q, k, v)
    thr, part_o, part_ml = args[11:14]
    op.kernel(*args)
    thr_ref = thr.clone()
    config = next(c for c in op.config_space(op.spec) if c["block_n"] != op.config["block_n"])
    tuned = compile_kernel(op.tunable_kernel(op.spec)(**op.spec, **config))
    thr.fill_(-7)
    part_o.fill_(float("nan"))
    part_ml.fill_(float("nan"))
    tuned(*args)
    assert torch.equal(thr, thr_ref)
    assert part_o.isfinite().all() and not part_ml.isnan().any()
