"""mHC post (forward, backward, custom ops) and the fused post -> pre (inference)."""

import math

import pytest
import torch

from golden.mhc_post import (mhc_post, mhc_post_backward, mhc_post_backward_autograd, mhc_post_pre,
                             random_inputs)
from golden.mhc_pre import random_inputs as pre_inputs
from ops.common import runtime as _runtime
from ops.mhc.post import (MHCPostBackwardTileLang, MHCPostPreTileLang, MHCPostTileLang, check_post_inputs,
                          post_mix_config_space, post_mix_default_config, post_mix_small_config, post_mix_smem_bytes)
from ops.mhc.tiling import small_tokens_limit
from ops.mhc.custom_ops import mhc_post as mhc_post_fn
from ops.mhc.custom_ops import mhc_post_pre as mhc_post_pre_fn

NS = [1, 2, 4, 6, 8]
DS = [4096, 7168, 520]  # 520: an odd multiple of 8, not a multiple of any tile
LEADS = [(2, 37), (1001,)]  # [B, S] and [T], odd token counts


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------- golden (CPU)
def loop_post(residual, layer_out, post, comb):
    """The issue's formula, one token, stream and column at a time, in float64."""
    n, D = residual.shape[-2:]
    x, y = residual.double().reshape(-1, n, D), layer_out.double().reshape(-1, D)
    p, c = post.double().reshape(-1, n), comb.double().reshape(-1, n, n)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(n):
            for d in range(D):
                out[t, k, d] = p[t, k].item() * y[t, d].item() + sum(c[t, j, k].item() * x[t, j, d].item()
                                                                     for j in range(n))
    return out.reshape(residual.shape)


def loop_post_grads(residual, layer_out, post, comb, grad_out):
    """The gradients, one scalar at a time, in float64."""
    n, D = residual.shape[-2:]
    x, y = residual.double().reshape(-1, n, D), layer_out.double().reshape(-1, D)
    p, c, g = post.double().reshape(-1, n), comb.double().reshape(-1, n, n), grad_out.double().reshape(-1, n, D)
    gx, gy = torch.zeros_like(x), torch.zeros_like(y)
    gp, gc = torch.zeros_like(p), torch.zeros_like(c)
    for t in range(x.shape[0]):
        for d in range(D):
            gy[t, d] = sum(p[t, k].item() * g[t, k, d].item() for k in range(n))
            for j in range(n):
                gx[t, j, d] = sum(c[t, j, k].item() * g[t, k, d].item() for k in range(n))
        for k in range(n):
            gp[t, k] = sum(g[t, k, d].item() * y[t, d].item() for d in range(D))
            for j in range(n):
                gc[t, j, k] = sum(g[t, k, d].item() * x[t, j, d].item() for d in range(D))
    return (gx.reshape(residual.shape), gy.reshape(layer_out.shape), gp.reshape(post.shape), gc.reshape(comb.shape))


@pytest.mark.parametrize("n,D,lead", [(1, 8, (3,)), (2, 24, (2, 2)), (4, 16, ()), (3, 8, (1, 2, 2))])
def test_golden_matches_float64_loop(n, D, lead):
    inputs = random_inputs(lead, n, D)
    ref = loop_post(*inputs)
    # float64 inputs: the golden is the formula exactly
    assert rel_err(mhc_post(*(t.double() for t in inputs)), ref) < 1e-14
    # bf16 in and out: fp32 math, one rounding (within half a bf16 ulp of the exact value, up to fp32 error)
    got = mhc_post(*inputs)
    assert got.dtype == torch.bfloat16 and got.shape == inputs[0].shape
    assert ((got.double() - ref).abs() <= ref.abs() * 2 ** -8 * 1.001 + 1e-6).all()


def test_golden_uses_comb_transposed():
    """out[k] sums comb[j, k] residual[j] (HF's comb.transpose(-1, -2) @ streams): a comb with one nonzero
    entry [0, 1] moves stream 0 into output stream 1."""
    residual, layer_out, post, comb = random_inputs((1,), 2, 8)
    comb = torch.zeros_like(comb)
    comb[0, 0, 1] = 1
    out = mhc_post(residual, layer_out, torch.zeros_like(post), comb)
    assert torch.equal(out[0, 1], residual[0, 0]) and not out[0, 0].any()


@pytest.mark.parametrize("n,D,lead", [(1, 8, (3,)), (2, 16, (2, 2)), (4, 8, ())])
def test_golden_backward_matches_float64_loop_and_autograd(n, D, lead):
    inputs = random_inputs(lead, n, D)
    grad_out = torch.randn(inputs[0].shape).to(torch.bfloat16)
    ref = loop_post_grads(*inputs, grad_out)
    closed = mhc_post_backward(*(t.double() for t in inputs), grad_out.double())
    auto = mhc_post_backward_autograd(*inputs, grad_out, dtype=torch.float64)
    for name, c, a, r in zip(("grad_residual", "grad_layer_out", "grad_post", "grad_comb"), closed, auto, ref):
        assert c.shape == r.shape, name
        assert rel_err(c, r) < 1e-13, name
        assert rel_err(a, r) < 1e-13, name
    # in the inputs' dtypes from bf16 / fp32 inputs
    lowp = mhc_post_backward(*inputs, grad_out)
    assert [g.dtype for g in lowp] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]


def test_golden_gradcheck():
    leaves = [t.double().requires_grad_() for t in random_inputs((2,), 3, 4)]
    assert torch.autograd.gradcheck(mhc_post, leaves)


def test_golden_post_pre_is_post_then_pre():
    from golden.mhc_pre import mhc_forward_pre

    n, D = 2, 16
    post_in = random_inputs((2, 3), n, D)
    _, phi, alpha, bias = pre_inputs(1, 1, n, D)
    for iters in (0, 20):
        new, h_in, h_post, h_res = mhc_post_pre(*post_in, phi, alpha, bias, sinkhorn_iters=iters)
        assert torch.equal(new, mhc_post(*post_in))
        for g, r in zip((h_in, h_post, h_res), mhc_forward_pre(new, phi, alpha, bias, sinkhorn_iters=iters)):
            assert torch.equal(g, r)
    assert torch.allclose(h_res.sum(-2), torch.ones(2, 3, n), atol=1e-4)  # comb: doubly stochastic


# ----------------------------------------------------------------------------- validation (CPU)
@pytest.mark.parametrize("cls", [MHCPostTileLang, MHCPostBackwardTileLang, MHCPostPreTileLang])
@pytest.mark.parametrize("kwargs,err,match", [
    (dict(n=0), ValueError, "n: expected >= 1"),
    (dict(n=9), ValueError, "n: expected <= 8"),
    (dict(n=2.0), TypeError, "n: expected an int"),
    (dict(D=100), ValueError, "D: expected a multiple of 8"),
    (dict(D=0), ValueError, "D: expected >= 8"),
    (dict(D=16392), ValueError, "D: expected <= 16384"),
    (dict(config={"block_x": 1}), ValueError, "unknown keys"),
])
def test_constructor_validation(cls, kwargs, err, match):
    with pytest.raises(err, match=match):
        cls(**{**dict(n=4, D=64), **kwargs})


@pytest.mark.parametrize("cls,config,match", [
    (MHCPostTileLang, {"threads": 96}, r"config\['threads'\]"),
    (MHCPostTileLang, {"tokens_per_thread": 0}, r"config\['tokens_per_thread'\]: expected >= 1"),
    (MHCPostBackwardTileLang, {"unroll": 0}, r"config\['unroll'\]: expected >= 1"),
    (MHCPostPreTileLang, {"block_k": 48}, r"config\['block_k'\]"),
    (MHCPostPreTileLang, {"block_k": 128, "num_stages": 4}, "bytes of shared memory"),
    (MHCPostPreTileLang, {"block_t": 96}, r"config\['block_t'\]"),
    (MHCPostPreTileLang, {"threads": 384}, r"config\['threads'\]"),
    (MHCPostPreTileLang, {"block_t": 128, "threads": 128, "block_k": 16}, "a warpgroup"),
    (MHCPostPreTileLang, {"splits": 3}, r"config\['splits'\]"),
    (MHCPostPreTileLang, {"block_k": 32, "splits": 4}, r"config\['splits'\]: expected a divisor of the 2 column"),
])
def test_config_validation(cls, config, match):
    with pytest.raises(ValueError, match=match):
        cls(n=4, D=64, config=config)


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(sinkhorn_iters=-1), ValueError, "sinkhorn_iters: expected >= 0"),
    (dict(sinkhorn_iters=1.5), TypeError, "sinkhorn_iters: expected an int"),
    (dict(rms_eps=-1.0), ValueError, "rms_eps: expected >= 0"),
    (dict(hc_eps="0"), TypeError, "hc_eps: expected a float"),
])
def test_post_pre_scalar_validation(kwargs, err, match):
    with pytest.raises(err, match=match):
        MHCPostPreTileLang(4, 64, **kwargs)


def _bad(name, n=2, D=16, lead=(2, 3)):
    """Valid CPU inputs of the post, with one of them replaced as `name` says."""
    residual, layer_out, post, comb = random_inputs(lead, n, D)
    cases = {
        "residual_tail": dict(residual=residual[..., :8]),
        "layer_out_tail": dict(layer_out=layer_out[..., :8]),
        "post_tail": dict(post=torch.zeros(*lead, n + 1)),
        "comb_tail": dict(comb=torch.zeros(*lead, n, n + 1)),
        "layer_out_lead": dict(layer_out=torch.zeros(2, 4, D, dtype=torch.bfloat16)),
        "post_lead": dict(post=torch.zeros(6, n)),  # the same tokens, flattened differently
        "comb_lead": dict(comb=torch.zeros(3, n, n)),
        "residual_dtype": dict(residual=residual.float()),
        "layer_out_dtype": dict(layer_out=layer_out.half()),
        "post_dtype": dict(post=post.double()),
        "comb_dtype": dict(comb=comb.bfloat16()),
        "not_tensor": dict(comb=comb.tolist()),
        "cpu": {},
    }
    return {**dict(residual=residual, layer_out=layer_out, post=post, comb=comb), **cases[name]}


@pytest.mark.parametrize("name,err,match", [
    ("residual_tail", ValueError, r"residual: expected shape \[\.\.\., 2, 16\], got \[2, 3, 2, 8\]"),
    ("layer_out_tail", ValueError, r"layer_out: expected shape \[\.\.\., 16\], got \[2, 3, 8\]"),
    ("post_tail", ValueError, r"post: expected shape \[\.\.\., 2\], got \[2, 3, 3\]"),
    ("comb_tail", ValueError, r"comb: expected shape \[\.\.\., 2, 2\]"),
    ("layer_out_lead", ValueError, r"layer_out: expected the leading dimensions \[2, 3\] of residual, got \[2, 4\]"),
    ("post_lead", ValueError, r"post: expected the leading dimensions \[2, 3\] of residual, got \[6\]"),
    ("comb_lead", ValueError, r"comb: expected the leading dimensions \[2, 3\] of residual, got \[3\]"),
    ("residual_dtype", TypeError, r"residual: expected dtype torch.bfloat16, got torch.float32"),
    ("layer_out_dtype", TypeError, r"layer_out: expected dtype torch.bfloat16, got torch.float16"),
    ("post_dtype", TypeError, r"post: expected dtype torch.float32, got torch.float64"),
    ("comb_dtype", TypeError, r"comb: expected dtype torch.float32, got torch.bfloat16"),
    ("not_tensor", TypeError, r"comb: expected a torch.Tensor, got list"),
    ("cpu", ValueError, r"residual: expected a CUDA tensor"),
])
def test_input_validation(name, err, match):
    """Every input check, before any launch (the op classes and the custom ops run these)."""
    with pytest.raises(err, match=match):
        check_post_inputs(2, 16, **_bad(name))


def test_input_validation_grad_out():
    residual, layer_out, post, comb = random_inputs((3,), 2, 16)
    grad = torch.zeros(4, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"grad_out: expected the leading dimensions \[3\] of residual, got \[4\]"):
        check_post_inputs(2, 16, residual, layer_out, post, comb, grad_out=(grad, torch.bfloat16, (2, 16)))


@pytest.mark.compile
def test_call_validation_before_launch():
    """The op classes check their inputs before any launch (CPU tensors here: no kernel could run)."""
    with pytest.raises(ValueError, match=r"post: expected the leading dimensions \[2, 3\] of residual, got \[6\]"):
        MHCPostTileLang(2, 16)(**_bad("post_lead"))
    with pytest.raises(ValueError, match="residual: expected a CUDA tensor"):
        MHCPostTileLang(2, 16)(**_bad("cpu"))
    residual, layer_out, post, comb = random_inputs((3,), 2, 16)
    with pytest.raises(ValueError, match=r"grad_out: expected shape \[\.\.\., 2, 16\]"):
        MHCPostBackwardTileLang(2, 16)(residual, layer_out, post, comb, torch.zeros(3, 16, dtype=torch.bfloat16))
    _, phi, alpha, bias = pre_inputs(1, 1, 2, 16)
    with pytest.raises(ValueError, match=r"comb: expected the leading dimensions \[2, 3\] of residual, got \[3\]"):
        MHCPostPreTileLang(2, 16)(*_bad("comb_lead").values(), phi, alpha, bias)


# ----------------------------------------------------------------------------- protocol, tiling (CPU)
def test_protocol():
    from ops.common.protocol import Op, op_class
    from ops.mhc.kernels.post import mhc_post_bwd_kernel, mhc_post_kernel
    from ops.mhc.kernels.post_pre import mhc_post_mix_kernel

    for cls, name, builder in ((MHCPostTileLang, "mhc_post", mhc_post_kernel),
                               (MHCPostBackwardTileLang, "mhc_post_bwd", mhc_post_bwd_kernel),
                               (MHCPostPreTileLang, "mhc_post_pre", mhc_post_mix_kernel)):
        assert issubclass(cls, Op) and op_class(name) is cls
        assert {(s["n"], s["D"]) for s in cls.warm_specs} == {(4, 4096), (4, 7168)}
        for n in range(1, 9):
            spec = {"n": n, "D": 4096, "rms_eps": 1e-6, "hc_eps": 1e-6}
            assert cls.tunable_kernel(spec) is builder
            space = cls.config_space(spec)
            assert space and cls.default_config(spec) in space
            assert all(set(c) == set(cls.default_config(spec)) for c in space)


def test_post_mix_tiling_fits():
    from ops.common.hw import SMEM_BUDGET

    for n in range(1, 9):
        for D in (8, 520, 4096, 7168):
            cfg = post_mix_default_config(n, D)
            assert cfg["num_stages"] >= 2 and post_mix_smem_bytes(n, **cfg) <= SMEM_BUDGET
            chunks = -(-D // cfg["block_k"])
            assert chunks % cfg["splits"] == 0 and chunks // cfg["splits"] >= cfg["num_stages"] or cfg["splits"] == 1
            space = post_mix_config_space(n, D)
            assert all(post_mix_smem_bytes(n, **c) <= SMEM_BUDGET for c in space)
            assert all(-(-D // c["block_k"]) % c["splits"] == 0 for c in space)
    # 64-token tiles: 16384 tokens make ~2 waves of one CTA per SM, not one (a shared GPU would run two)
    assert post_mix_default_config(4, 4096) == {"block_t": 64, "threads": 256, "block_k": 64, "num_stages": 2,
                                                 "splits": 1}
    assert post_mix_default_config(8, 4096)["block_k"] == 16  # wider chunks do not fit two stages at n = 8


# ----------------------------------------------------------------------------- custom ops (CPU: fakes)
def _meta(lead, n, D, device="meta", requires_grad=False):
    """Empty (residual, layer_out, post, comb) on `device` (factories: they also work under FakeTensorMode)."""
    bf16, f32 = torch.bfloat16, torch.float32
    return tuple(torch.empty(*lead, *tail, device=device, dtype=dtype, requires_grad=requires_grad)
                 for tail, dtype in (((n, D), bf16), ((D,), bf16), ((n,), f32), ((n, n), f32)))


@pytest.mark.parametrize("lead,n,D", [((2, 3), 4, 64), ((5,), 1, 24), ((), 8, 16)])
def test_custom_op_fake_shapes(lead, n, D):
    from torch._subclasses.fake_tensor import FakeTensorMode

    inputs = _meta(lead, n, D)
    out = torch.ops.llm_tile_ops.mhc_post(*inputs)
    assert (tuple(out.shape), out.dtype, out.device.type) == ((*lead, n, D), torch.bfloat16, "meta")
    grads = torch.ops.llm_tile_ops.mhc_post_bwd(*inputs, torch.empty_like(inputs[0]))
    assert [(tuple(g.shape), g.dtype) for g in grads] == [(tuple(t.shape), t.dtype) for t in inputs]
    N = n * n + 2 * n
    phi, alpha, bias = (torch.empty(*s, device="meta") for s in ((N, n * D), (3,), (N,)))
    outs = torch.ops.llm_tile_ops.mhc_post_pre(*inputs, phi, alpha, bias, 1e-6, 1e-6, 20)
    assert [(tuple(o.shape), o.dtype) for o in outs] == [
        ((*lead, n, D), torch.bfloat16), ((*lead, D), torch.bfloat16), ((*lead, n), torch.float32),
        ((*lead, n, n), torch.float32)]
    with FakeTensorMode():
        out = torch.ops.llm_tile_ops.mhc_post(*_meta(lead, n, D, device="cuda"))
        assert out.device.type == "cuda" and tuple(out.shape) == (*lead, n, D)


def test_mhc_post_autograd_shapes_on_meta():
    """mhc_post is differentiable through torch.library: on meta tensors the backward reaches
    llm_tile_ops::mhc_post_bwd and gives every input a gradient of its shape and dtype."""
    inputs = _meta((2, 3), 4, 64, requires_grad=True)
    out = mhc_post_fn(*inputs)
    out.float().sum().backward()
    for t in inputs:
        assert t.grad.shape == t.shape and t.grad.dtype == t.dtype


def test_mhc_post_traces_fullgraph_on_meta():
    inputs = _meta((2, 3), 4, 64, requires_grad=True)

    def fn(residual, layer_out, post, comb):
        return mhc_post_fn(residual, layer_out, post, comb).float().square().sum()

    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend="aot_eager")(*inputs).backward()
    for t in inputs:
        assert t.grad.shape == t.shape


def test_mhc_post_pre_function_validation():
    inputs = _meta((2,), 2, 16)
    phi, alpha, bias = (torch.empty(*s, device="meta") for s in ((8, 32), (3,), (8,)))
    with pytest.raises(ValueError, match="sinkhorn_iters: expected >= 0"):
        mhc_post_pre_fn(*inputs, phi, alpha, bias, sinkhorn_iters=-1)
    with pytest.raises(ValueError, match="rms_eps: expected >= 0"):
        mhc_post_pre_fn(*inputs, phi, alpha, bias, rms_eps=-1.0)


# ----------------------------------------------------------------------------- compile-only (sm_90a)
@pytest.mark.compile
@pytest.mark.parametrize("n,D", [(4, 4096), (4, 7168), (1, 520), (8, 520)])
def test_post_kernels_compile_for_sm90a(n, D):
    fwd, bwd = MHCPostTileLang(n, D), MHCPostBackwardTileLang(n, D)
    if _runtime.target()["arch"].startswith("sm_90"):
        for op in (fwd, bwd):
            src = op._kernel.get_kernel_source()
            assert "uint4" in src, "expected 16-byte loads and stores"
            assert "atomic" not in src.lower(), "expected no atomics (deterministic)"
        assert "warp_reduce_sum" in bwd._kernel.get_kernel_source()


@pytest.mark.compile
@pytest.mark.parametrize("n,D,iters", [(4, 4096, 20), (4, 7168, 0), (2, 520, 1), (8, 520, 0)])
def test_post_pre_kernels_compile_for_sm90a(n, D, iters):
    op = MHCPostPreTileLang(n, D, sinkhorn_iters=iters)
    assert not hasattr(op, "_sinkhorn")  # the projection runs in the mix kernel's epilogue
    if _runtime.target()["arch"].startswith("sm_90"):
        src = op._mix.get_kernel_source()
        assert "wgmma" in src and "tma_load" in src
        if iters:  # against the same kernel without the projection
            from ops.mhc.kernels.post_pre import mhc_post_mix_kernel
            plain = _runtime.compile_kernel(mhc_post_mix_kernel(**op.spec, **op.config))
            assert src.count("exp") > plain.get_kernel_source().count("exp")
        # each input stream's vector is loaded once (16 bytes) for all n outputs, not once per output stream
        assert src.count("*(uint4*)(r + ") == n and src.count("*(uint4*)(y + 0)") == 1
        assert "cudaGridDependencySynchronize" not in src and "cluster" not in src.lower()
        # D = 4096 / 7168 split their chunks over CTAs, whose last adds the partials (no CTA waits)
        assert src.count("mhc_last_split(") == 1  # the prelude's definition: one CTA per tile, no split
        split = MHCPostPreTileLang(n, D, sinkhorn_iters=iters, config={"splits": 2}) if D % 128 == 0 else None
        if split is not None:  # its last CTA per tile adds the partials
            assert split._mix.get_kernel_source().count("mhc_last_split(") == 2
        # small token counts: the default's tiles with their chunks split (D = 4096 / 7168: 8 CTAs per tile)
        small = post_mix_small_config(n, D)
        assert (op._small is None) == (small is None) and (small is None or small["splits"] == 8)
        if small is not None:
            assert op._small[1] == small and op._small[0].get_kernel_source().count("mhc_last_split(") == 2
            limit = small_tokens_limit(small["splits"], _runtime.sm_count())
            assert op._mix_for(limit, None)[0] is op._small[0] and op._mix_for(limit + 1, None)[0] is op._mix


# ----------------------------------------------------------------------------- GPU
def _cuda_inputs(lead, n, D):
    return random_inputs(lead, n, D, device="cuda")


def _assert_bf16_close(got, ref, name):
    """bf16 results of the same fp32 math rounded once: equal up to one rounding step (fp32 ordering and FMA
    contraction may flip a rounding)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, name
    diff = (got.float() - ref.float()).abs()
    bound = ref.float().abs() * 2 ** -7 + 1e-5
    assert (diff <= bound).all(), f"{name}: max excess {(diff - bound).max().item():.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("D", DS)
@pytest.mark.parametrize("n", NS)
def test_forward_matches_golden(n, D, poisoned):
    op = MHCPostTileLang(n, D)
    for lead in LEADS + [(1,), (3, 1, 5)]:
        inputs = _cuda_inputs(lead, n, D)
        ref = mhc_post(*inputs)  # fp32 math, one rounding
        for _ in range(2):
            with poisoned():
                got = op(*inputs)
            assert not torch.isnan(got).any(), "unwritten (NaN) elements"
            _assert_bf16_close(got, ref, f"out lead={lead}")
            assert rel_err(got, mhc_post(*(t.double() for t in inputs))) < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("D", DS)
@pytest.mark.parametrize("n", NS)
def test_backward_matches_golden_autograd(n, D, poisoned):
    op = MHCPostBackwardTileLang(n, D)
    for lead in LEADS + [(1,)]:
        inputs = _cuda_inputs(lead, n, D)
        grad_out = torch.randn(inputs[0].shape, device="cuda").to(torch.bfloat16)
        ref = mhc_post_backward_autograd(*inputs, grad_out)  # fp32
        ref64 = mhc_post_backward(*(t.double() for t in inputs), grad_out.double())
        with poisoned():
            got = op(*inputs, grad_out)
        for name, g, r, r64, t in zip(("grad_residual", "grad_layer_out", "grad_post", "grad_comb"), got, ref, ref64,
                                      inputs):
            assert g.shape == t.shape and g.dtype == t.dtype, name
            assert not torch.isnan(g).any(), f"{name}: unwritten (NaN) elements"
            if g.dtype == torch.bfloat16:
                _assert_bf16_close(g, r.to(torch.bfloat16), name)
            else:  # fp32 dots over D
                assert rel_err(g, r) < 1e-5, f"{name}: rel err {rel_err(g, r):.2e}"
                assert rel_err(g, r64) < 1e-5, f"{name}: rel err vs fp64 {rel_err(g, r64):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("n,D", [(4, 4096), (8, 520)])
def test_bitwise_deterministic(n, D):
    fwd, bwd = MHCPostTileLang(n, D), MHCPostBackwardTileLang(n, D)
    inputs = _cuda_inputs((3, 777), n, D)
    grad_out = torch.randn(inputs[0].shape, device="cuda").to(torch.bfloat16)
    assert torch.equal(fwd(*inputs), fwd(*inputs))
    a, b = bwd(*inputs, grad_out), bwd(*inputs, grad_out)
    assert all(torch.equal(u, v) for u, v in zip(a, b)), "backward must be bitwise reproducible"


@pytest.mark.gpu
def test_zero_tokens():
    inputs = _cuda_inputs((0,), 4, 520)
    assert MHCPostTileLang(4, 520)(*inputs).shape == (0, 4, 520)
    grads = MHCPostBackwardTileLang(4, 520)(*inputs, torch.empty_like(inputs[0]))
    assert [g.shape for g in grads] == [t.shape for t in inputs]


@pytest.mark.gpu
def test_call_validation_on_gpu():
    op = MHCPostTileLang(2, 64)
    residual, layer_out, post, comb = _cuda_inputs((4, 3), 2, 64)
    with pytest.raises(ValueError, match="residual: expected a contiguous tensor"):
        op(residual.transpose(0, 1).contiguous().transpose(0, 1), layer_out, post, comb)
    with pytest.raises(ValueError, match="post: expected a CUDA tensor"):
        op(residual, layer_out, post.cpu(), comb)
    flat = torch.empty(comb.numel() + 1, device="cuda")
    flat[1:] = comb.flatten()
    with pytest.raises(ValueError, match="comb: expected a 16-byte aligned tensor"):
        op(residual, layer_out, post, flat[1:].view(comb.shape))


@pytest.mark.gpu
def test_custom_op_matches_op_class_and_torch_compile_fullgraph():
    """mhc_post (the custom op, eager and under torch.compile(fullgraph=True)) forward and backward: the same
    kernels as the op classes, so bitwise equal."""
    n, D = 4, 4096
    inputs = _cuda_inputs((2, 301), n, D)
    grad_out = torch.randn(inputs[0].shape, device="cuda").to(torch.bfloat16)
    ref_out = MHCPostTileLang(n, D)(*inputs)
    ref_grads = MHCPostBackwardTileLang(n, D)(*inputs, grad_out)

    def fn(residual, layer_out, post, comb):
        return mhc_post_fn(residual, layer_out, post, comb) * 1  # an op around it in the same graph

    torch._dynamo.reset()
    for f in (fn, torch.compile(fn, fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = f(*leaves)
        out.backward(grad_out)
        assert torch.equal(out, ref_out)
        for t, g in zip(leaves, ref_grads):
            assert torch.equal(t.grad, g)


@pytest.mark.gpu
@pytest.mark.parametrize("n,D,iters", [(1, 520, 20), (2, 7168, 0), (4, 4096, 0), (4, 4096, 20), (4, 7168, 20),
                                       (6, 520, 20), (8, 4096, 20), (8, 520, 0)])
def test_post_pre_matches_golden(n, D, iters, poisoned):
    """The fused post -> pre against the golden post followed by the golden pre (float64 on the golden's new
    residual), with and without Sinkhorn."""
    op = MHCPostPreTileLang(n, D, sinkhorn_iters=iters)
    for lead in ((2, 37), (517,), (1,)):
        post_in = _cuda_inputs(lead, n, D)
        _, phi, alpha, bias = pre_inputs(1, 1, n, D, device="cuda")
        ref_new = mhc_post(*post_in)
        ref = mhc_post_pre(*post_in, phi.double(), alpha.double(), bias.double(), sinkhorn_iters=iters)[1:]
        for _ in range(2):
            with poisoned():
                got = op(*post_in, phi, alpha, bias)
            for g in got:
                assert not torch.isnan(g).any(), "unwritten (NaN) elements"
            _assert_bf16_close(got[0], ref_new, "new_residual")
            for name, g, r, tol in zip(("h_in", "h_post", "h_res"), got[1:], ref, (8e-3, 2e-3, 2e-3)):
                assert g.shape == r.shape, name
                assert rel_err(g, r) <= tol, f"{name} (iters={iters}): rel err {rel_err(g, r):.2e} > {tol}"


@pytest.mark.gpu
def test_post_pre_matches_post_then_pre_ops_and_is_deterministic():
    """Against our own post followed by our own pre (the composition it replaces), and bitwise reproducible."""
    from ops.mhc.pre import MHCForwardPreTileLang

    n, D, iters = 4, 4096, 20
    post_in = _cuda_inputs((3, 1001), n, D)
    _, phi, alpha, bias = pre_inputs(1, 1, n, D, device="cuda")
    op = MHCPostPreTileLang(n, D, sinkhorn_iters=iters)
    got = op(*post_in, phi, alpha, bias)
    assert all(torch.equal(a, b) for a, b in zip(got, op(*post_in, phi, alpha, bias)))
    new = MHCPostTileLang(n, D)(*post_in)
    _assert_bf16_close(got[0], new, "new_residual")  # the same fp32 formula in both kernels
    pre = MHCForwardPreTileLang(1, 1, n, D, sinkhorn_iters=iters)(new, phi, alpha, bias)
    for name, g, r in zip(("h_in", "h_post", "h_res"), got[1:], pre):
        assert rel_err(g, r) <= 8e-3, f"{name}: rel err {rel_err(g, r):.2e}"
    with torch.no_grad():
        fused = torch.compile(lambda *a: mhc_post_pre_fn(*a, sinkhorn_iters=iters), fullgraph=True)
        assert all(torch.equal(a, b) for a, b in zip(fused(*post_in, phi, alpha, bias), got))


@pytest.mark.gpu
def test_post_pre_split_chunks(poisoned):
    """config splits = 4 (a tile's D chunks over four CTAs, the last to finish adding the partials in split order):
    the new residual bitwise equal to one CTA's, the weights the golden's, bitwise reproducible (each tile's last
    CTA resets its arrival count for the next launch)."""
    n, D, iters = 4, 4096, 20
    post_in = _cuda_inputs((517,), n, D)
    _, phi, alpha, bias = pre_inputs(1, 1, n, D, device="cuda")
    ref = mhc_post_pre(*post_in, phi.double(), alpha.double(), bias.double(), sinkhorn_iters=iters)[1:]
    split = MHCPostPreTileLang(n, D, sinkhorn_iters=iters, config={"splits": 4})
    with poisoned():
        got = split(*post_in, phi, alpha, bias)
    assert torch.equal(got[0], MHCPostPreTileLang(n, D, sinkhorn_iters=iters)(*post_in, phi, alpha, bias)[0])
    for name, g, r, tol in zip(("h_in", "h_post", "h_res"), got[1:], ref, (8e-3, 2e-3, 2e-3)):
        assert rel_err(g, r) <= tol, f"{name}: rel err {rel_err(g, r):.2e} > {tol}"
    assert all(torch.equal(a, b) for a, b in zip(got, split(*post_in, phi, alpha, bias)))


@pytest.mark.gpu
def test_post_pre_small_token_kernel_at_its_limit(poisoned):
    """The bench shape at the small-token kernel's last token count and one past it, against the golden, the new
    residual bitwise equal to the unsplit kernel's (the same formula per element), bitwise reproducible."""
    n, D, iters = 4, 4096, 20
    op = MHCPostPreTileLang(n, D, sinkhorn_iters=iters)
    pinned = MHCPostPreTileLang(n, D, sinkhorn_iters=iters, config=post_mix_default_config(n, D))
    limit = small_tokens_limit(op._small[1]["splits"], _runtime.sm_count())
    _, phi, alpha, bias = pre_inputs(1, 1, n, D, device="cuda")
    for tokens in (1, limit, limit + 1):
        post_in = _cuda_inputs((tokens,), n, D)
        ref = mhc_post_pre(*post_in, phi.double(), alpha.double(), bias.double(), sinkhorn_iters=iters)[1:]
        with poisoned():
            got = op(*post_in, phi, alpha, bias)
        assert torch.equal(got[0], pinned(*post_in, phi, alpha, bias)[0])
        for name, g, r, tol in zip(("h_in", "h_post", "h_res"), got[1:], ref, (8e-3, 2e-3, 2e-3)):
            assert not torch.isnan(g).any() and rel_err(g, r) <= tol, f"{name} ({tokens} tokens): {rel_err(g, r):.2e}"
        assert all(torch.equal(a, b) for a, b in zip(got, op(*post_in, phi, alpha, bias)))


@pytest.mark.gpu
def test_post_pre_zero_tokens():
    post_in = _cuda_inputs((0, 3), 2, 520)
    _, phi, alpha, bias = pre_inputs(1, 1, 2, 520, device="cuda")
    outs = MHCPostPreTileLang(2, 520)(*post_in, phi, alpha, bias)
    assert [tuple(o.shape) for o in outs] == [(0, 3, 2, 520), (0, 3, 520), (0, 3, 2), (0, 3, 2, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,D", [(3, 24), (1, 8), (5, 136)])
def test_small_shapes(n, D, poisoned):
    """D under one tile (the fused kernel's TMA boxes reach past the row), n outside the main matrix."""
    inputs = _cuda_inputs((3, 5), n, D)
    grad_out = torch.randn(inputs[0].shape, device="cuda").to(torch.bfloat16)
    _, phi, alpha, bias = pre_inputs(1, 1, n, D, device="cuda")
    with poisoned():
        out = MHCPostTileLang(n, D)(*inputs)
        grads = MHCPostBackwardTileLang(n, D)(*inputs, grad_out)
        fused = MHCPostPreTileLang(n, D, sinkhorn_iters=3)(*inputs, phi, alpha, bias)
    _assert_bf16_close(out, mhc_post(*inputs), "out")
    for name, g, r in zip(("grad_residual", "grad_layer_out", "grad_post", "grad_comb"), grads,
                          mhc_post_backward_autograd(*inputs, grad_out)):
        assert rel_err(g, r) < (4e-3 if g.dtype == torch.bfloat16 else 1e-5), name
    ref = mhc_post_pre(*inputs, phi.double(), alpha.double(), bias.double(), sinkhorn_iters=3)
    _assert_bf16_close(fused[0], ref[0], "new_residual")
    for name, g, r, tol in zip(("h_in", "h_post", "h_res"), fused[1:], ref[1:], (8e-3, 2e-3, 2e-3)):
        assert rel_err(g, r) <= tol, f"{name}: rel err {rel_err(g, r):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("n,D", [(4, 4096)])
def test_large_token_count(n, D):
    """A bench-sized call (16384 tokens): every tile of the grid, compared in float64 on a sample of tokens."""
    inputs = _cuda_inputs((16384,), n, D)
    got = MHCPostTileLang(n, D)(*inputs)
    idx = torch.randperm(16384, device="cuda")[:257]
    ref = mhc_post(*(t[idx] for t in inputs))
    _assert_bf16_close(got[idx], ref, "out")
    assert math.isfinite(got.float().abs().max().item())
