import contextlib

import pytest
import torch

from golden.mhc_pre import mhc_forward_pre, random_inputs
from golden.mhc_pre_bwd import mhc_backward_pre, mhc_backward_pre_autograd
from ops.common import runtime  # noqa: F401  (kernel cache dir before TileLang)
from ops.mhc import MHCBackwardPreTileLang, mhc_pre

# The three output gradients in order (h_in, h_post, h_res); a pattern says which are present.
ALL = (True, True, True)
PARTIAL = [(True, False, False), (False, True, True), (True, False, True)]


def make_inputs(B, S, n, D, device="cpu", dtype=torch.bfloat16, present=ALL):
    inputs = random_inputs(B, S, n, D, device, dtype)
    grads = (torch.randn(B, S, D, device=device).to(dtype), torch.randn(B, S, n, device=device),
             torch.randn(B, S, n, n, device=device))
    return inputs, tuple(g if p else None for g, p in zip(grads, present))


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def to64(ts):
    return tuple(None if t is None else t.double() for t in ts)


# ----------------------------------------------------------------------------- golden (CPU)
@pytest.mark.parametrize("n,D,present", [(1, 8, ALL), (2, 24, ALL), (4, 16, ALL), (3, 8, PARTIAL[0]),
                                         (2, 16, PARTIAL[1]), (4, 8, PARTIAL[2])])
def test_closed_form_matches_autograd_float64(n, D, present):
    inputs, grads = make_inputs(2, 3, n, D, present=present)
    inputs, grads = to64(inputs), to64(grads)
    closed = mhc_backward_pre(*inputs, *grads)
    auto = mhc_backward_pre_autograd(*inputs, *grads, dtype=torch.float64)
    for name, c, a in zip(("grad_x", "grad_phi", "grad_alpha", "grad_bias"), closed, auto):
        assert c.dtype == torch.float64
        assert rel_err(c, a) < 1e-12, name


@pytest.mark.parametrize("sinkhorn_iters", [1, 2, 20])
@pytest.mark.parametrize("n,D,present", [(1, 8, ALL), (2, 24, ALL), (4, 16, ALL), (3, 8, PARTIAL[1]),
                                         (4, 8, PARTIAL[2]), (4, 8, (False, False, True))])
def test_closed_form_sinkhorn_matches_autograd_float64(n, D, present, sinkhorn_iters):
    """Through the Sinkhorn iterations: the reverse recurrence (golden.mhc_pre_bwd.sinkhorn_backward) against
    autograd through golden.mhc_pre.sinkhorn, every input's gradient, x with three leading dimensions."""
    inputs, grads = make_inputs(2, 3, n, D, present=present)
    inputs, grads = to64(inputs), to64(grads)
    inputs = (inputs[0].reshape(3, 1, 2, n, D), *inputs[1:])
    grads = tuple(None if g is None else g.reshape(3, 1, 2, *g.shape[2:]) for g in grads)
    closed = mhc_backward_pre(*inputs, *grads, sinkhorn_iters=sinkhorn_iters)
    auto = mhc_backward_pre_autograd(*inputs, *grads, dtype=torch.float64, sinkhorn_iters=sinkhorn_iters)
    plain = mhc_backward_pre(*inputs, *grads)
    for name, c, a, p in zip(("grad_x", "grad_phi", "grad_alpha", "grad_bias"), closed, auto, plain):
        assert c.shape == a.shape
        assert rel_err(c, a) < 1e-12, name
    if present[2]:
        assert rel_err(closed[3], plain[3]) > 1e-3  # the projection changes the logits' gradient


@pytest.mark.parametrize("n,iters", [(2, 1), (3, 4), (4, 20)])
def test_sinkhorn_backward_gradcheck(n, iters):
    """golden.mhc_pre.sinkhorn by finite differences in float64 (so the reverse recurrence checked against
    autograd above is checked against numbers too)."""
    from golden.mhc_pre import sinkhorn
    from golden.mhc_pre_bwd import sinkhorn_backward

    torch.manual_seed(n)
    z = torch.randn(3, n, n, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: sinkhorn(z, iters, 1e-6), (z,))
    g = torch.randn(3, n, n, dtype=torch.float64)
    (auto,) = torch.autograd.grad(sinkhorn(z, iters, 1e-6), z, g)
    assert rel_err(sinkhorn_backward(z.detach(), g, iters, 1e-6), auto) < 1e-12


def test_closed_form_alpha_zero():
    # alpha = 0 hides h_mix from the outputs; grad_alpha must still see it.
    inputs, grads = make_inputs(1, 4, 2, 8)
    inputs, grads = to64(inputs), to64(grads)
    inputs = (inputs[0], inputs[1], torch.zeros(3, dtype=torch.float64), inputs[3])
    closed = mhc_backward_pre(*inputs, *grads)
    auto = mhc_backward_pre_autograd(*inputs, *grads, dtype=torch.float64)
    assert closed[2].abs().min() > 0
    for c, a in zip(closed, auto):
        assert rel_err(c, a) < 1e-12


@pytest.mark.parametrize("n,D", [(1, 4), (2, 3), (3, 2)])
def test_autograd_reference_gradcheck(n, D):
    """torch.autograd.gradcheck of the golden forward (finite differences in float64)."""
    (x, phi, alpha, bias), _ = make_inputs(1, 2, n, D)
    leaves = [t.double().requires_grad_() for t in (x, phi, alpha, bias)]
    assert torch.autograd.gradcheck(lambda *a: mhc_forward_pre(*a), leaves)


def test_closed_form_float32_inputs():
    inputs, grads = make_inputs(2, 5, 4, 32)
    closed = mhc_backward_pre(*inputs, *grads)
    auto = mhc_backward_pre_autograd(*inputs, *grads)
    assert closed[0].dtype == torch.bfloat16 and closed[1].dtype == torch.float32
    assert rel_err(closed[0], auto[0]) < 5e-3
    for c, a in zip(closed[1:], auto[1:]):
        assert rel_err(c, a) < 1e-5


# ----------------------------------------------------------------------------- validation (CPU)
@pytest.mark.parametrize("kwargs,err,match", [
    (dict(n=0), ValueError, "n: expected >= 1"),
    (dict(n=9), ValueError, "n: expected <= 8"),
    (dict(n=7), ValueError, "n: expected one of"),
    (dict(n=5), ValueError, "n: expected one of"),
    (dict(D=100), ValueError, "D: expected a multiple of 8"),
    (dict(D=16392), ValueError, "D: expected <= 16384"),
    (dict(B=0), ValueError, "B: expected >= 1"),
    (dict(S=2.0), TypeError, "S: expected an int"),
    (dict(config={"block_x": 1}), ValueError, "unknown keys"),
    (dict(config={"block_t": 96}), ValueError, "block_t"),
    (dict(config={"block_d": 48}), ValueError, "block_d"),
    (dict(n=2, config={"block_d": 16}), ValueError, "multiple of 64"),
    (dict(n=8, config={"block_d": 64}), ValueError, "shared memory"),
    (dict(config={"block_t": 128}), ValueError, "must be 64 for n=4"),
    (dict(D=4096, config={"token_groups": 3}), ValueError, r"token_groups'\]: expected <= 2 for D=4096"),
    (dict(n=2, config={"num_stages": 1}), ValueError, r"num_stages'\]: expected >= 2 for n=2"),
    (dict(sinkhorn_iters=-1), ValueError, "sinkhorn_iters: expected >= 0"),
    (dict(sinkhorn_iters=101), ValueError, "sinkhorn_iters: expected <= 100"),
    (dict(sinkhorn_iters=20.0), TypeError, "sinkhorn_iters: expected an int"),
    (dict(sinkhorn_iters=False), TypeError, "sinkhorn_iters: expected an int"),
    (dict(hc_eps=-1.0), ValueError, "hc_eps: expected >= 0"),
    (dict(hc_eps="1e-6"), TypeError, "hc_eps: expected a float"),
    (dict(num_sms=0), ValueError, "num_sms: expected >= 1"),
    (dict(num_sms=10_000), ValueError, "num_sms: expected <= "),
    (dict(num_sms=True), TypeError, "num_sms: expected an int"),
    (dict(D=4096, num_sms=100, config={"token_groups": 2}), ValueError,
     r"token_groups'\]: expected <= 1 for D=4096 \(the one pass's persistent grid within 100 SMs\)"),
])
def test_constructor_validation(kwargs, err, match):
    args = {**dict(B=1, S=4, n=4, D=64), **kwargs}
    with pytest.raises(err, match=match):
        MHCBackwardPreTileLang(**args)


def test_sm_budget_bounds_the_one_pass():
    """num_sms bounds the one pass's grid (a CTA per 64-column slice and token group); below one token group the
    two kernels run; the default config follows the budget."""
    from ops.mhc.tiling import backward_config_space, backward_default_config, one_pass

    assert backward_default_config(4, 4096)["token_groups"] == 2  # 64 slices on 132 SMs
    assert backward_default_config(4, 4096, 100)["token_groups"] == 1
    assert backward_default_config(4, 1024, 100)["token_groups"] == 6
    assert one_pass(4, 7168) and not one_pass(4, 7168, 100)  # 112 slices
    assert backward_default_config(4, 7168, 100) == {"block_t": 64, "block_d": 64, "token_groups": 4,
                                                     "num_stages": 1}  # the two kernels' config
    assert all(c["token_groups"] == 1 and c["num_stages"] >= 2 for c in backward_config_space(4, 4096, 100))
    assert min(c["num_stages"] for c in backward_config_space(4, 7168, 100)) == 1  # the two kernels: 1 stage ok


@pytest.mark.compile
def test_sm_budget_picks_the_kernels():
    """With 100 SMs: D = 4096 keeps the one pass with one token group, D = 8192 (128 slices) runs the two
    kernels."""
    one = MHCBackwardPreTileLang(1, 4, 4, 4096, num_sms=100)
    assert one._one and one.config["token_groups"] == 1 and not one._stats
    two = MHCBackwardPreTileLang(1, 4, 2, 8192, num_sms=100)
    assert not two._one and set(two._stats) == {ALL}


@pytest.mark.parametrize("n", [1, 4, 6])
def test_config_space_offers_no_hanging_config(n):
    """The one-pass kernel (n <= 4) hangs with one stage: the autotuner is never offered it."""
    stages = {cfg["num_stages"] for cfg in MHCBackwardPreTileLang.config_space({"n": n, "D": 1024})}
    assert stages and min(stages) == (2 if n <= 4 else 1), stages


def test_protocol():
    """The op class follows ops.common.protocol; the GPU-querying DEFAULT_CONFIG is gone."""
    from ops.common.protocol import Op, op_class
    from ops.mhc.pre_bwd import grad_kernel

    cls = MHCBackwardPreTileLang
    assert issubclass(cls, Op) and op_class("mhc_pre_bwd") is cls and not hasattr(cls, "DEFAULT_CONFIG")
    for n, D in ((4, 4096), (4, 7168), (6, 520)):
        spec = {"n": n, "D": D}
        assert cls.tunable_kernel(spec) is grad_kernel
        space = cls.config_space(spec)
        assert space and all(set(c) == set(cls.default_config(spec)) for c in space)
    assert {(s["n"], s["D"]) for s in cls.warm_specs} == {(4, 4096), (4, 7168)}


# ----------------------------------------------------------------------------- custom ops (CPU: fakes)
def meta_call(B, S, n, D, present=ALL, requires_grad=False, device="meta", lead=None):
    """Meta tensors for every argument of llm_tile_ops::mhc_pre_bwd (absent gradients None); x [B, S, n, D],
    or [*lead, n, D]."""
    M = n * n + 2 * n
    lead = (B, S) if lead is None else tuple(lead)

    def t(*shape, dtype=torch.float32):
        return torch.empty(shape, device=device, dtype=dtype, requires_grad=requires_grad)

    inputs = (t(*lead, n, D, dtype=torch.bfloat16), t(M, n * D), t(3), t(M))
    aux = (t(*lead), t(*lead, n), t(*lead, M))
    grads = (t(*lead, D, dtype=torch.bfloat16), t(*lead, n), t(*lead, n, n))
    return inputs, aux, tuple(g if p else None for g, p in zip(grads, present))


@pytest.mark.parametrize("sinkhorn_iters", [0, 20])
@pytest.mark.parametrize("present", [ALL, *PARTIAL])
@pytest.mark.parametrize("lead,n,D", [((2, 3), 4, 64), ((1, 7), 6, 520), ((5,), 2, 16), ((2, 1, 3), 4, 64)])
def test_custom_op_fake_shapes(lead, n, D, present, sinkhorn_iters):
    """llm_tile_ops::mhc_pre_bwd propagates shapes and dtypes without a kernel, absent gradients included,
    for any leading dimensions of x."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    inputs, aux, grads = meta_call(0, 0, n, D, present, lead=lead)
    M = n * n + 2 * n
    want = [((*lead, n, D), torch.bfloat16), ((M, n * D), torch.float32), ((3,), torch.float32),
            ((M,), torch.float32)]
    outs = torch.ops.llm_tile_ops.mhc_pre_bwd(*inputs, *aux, *grads, 1e-6, sinkhorn_iters)
    assert [(tuple(o.shape), o.dtype) for o in outs] == want
    with FakeTensorMode():
        inputs, aux, grads = meta_call(0, 0, n, D, present, device="cuda", lead=lead)
        outs = torch.ops.llm_tile_ops.mhc_pre_bwd(*inputs, *aux, *grads, 1e-6, sinkhorn_iters)
        assert [(tuple(o.shape), o.dtype) for o in outs] == want
        assert all(o.device.type == "cuda" for o in outs)
    inputs, aux, grads = meta_call(0, 0, n, D, present, lead=lead)
    with pytest.raises(ValueError, match="sinkhorn_iters: expected >= 0"):
        torch.ops.llm_tile_ops.mhc_pre_bwd(*inputs, *aux, *grads, 1e-6, -1)


@pytest.mark.parametrize("sinkhorn_iters", [0, 20])
def test_mhc_pre_autograd_shapes_on_meta(sinkhorn_iters):
    """mhc_pre is differentiable through torch.library: on meta tensors (fakes only) the backward reaches
    llm_tile_ops::mhc_pre_bwd and gives every input a gradient of its shape; the aux outputs of
    llm_tile_ops::mhc_pre_fwd are not differentiable."""
    (x, phi, alpha, bias), _, _ = meta_call(2, 3, 4, 64, requires_grad=True)
    aux = torch.ops.llm_tile_ops.mhc_pre_fwd(x, phi, alpha, bias, 1e-6, 1e-6, sinkhorn_iters)[3:]
    assert [o.requires_grad for o in aux] == [False] * 3
    h_in, h_post, h_res = mhc_pre(x, phi, alpha, bias, sinkhorn_iters=sinkhorn_iters)
    assert (h_in.shape, h_post.shape, h_res.shape) == ((2, 3, 64), (2, 3, 4), (2, 3, 4, 4))
    (h_in.float().sum() + h_post.sum()).backward()  # h_res unused: its gradient stays None
    for t in (x, phi, alpha, bias):
        assert t.grad.shape == t.shape and t.grad.dtype == t.dtype


def test_mhc_pre_autograd_leading_dims_on_meta():
    """x [..., n, D] with three leading dimensions, or none, through forward and backward (fakes only)."""
    for lead in ((2, 1, 3), ()):
        (x, phi, alpha, bias), _, _ = meta_call(0, 0, 4, 64, requires_grad=True, lead=lead)
        h_in, h_post, h_res = mhc_pre(x, phi, alpha, bias, sinkhorn_iters=20)
        assert (h_in.shape, h_post.shape, h_res.shape) == ((*lead, 64), (*lead, 4), (*lead, 4, 4))
        (h_in.float().sum() + h_post.sum() + h_res.sum()).backward()
        for t in (x, phi, alpha, bias):
            assert t.grad.shape == t.shape


@pytest.mark.parametrize("sinkhorn_iters", [0, 20])
def test_mhc_pre_traces_fullgraph_on_meta(sinkhorn_iters):
    """torch.compile(fullgraph=True) traces mhc_pre's forward and backward through the fakes (no kernel,
    no graph break); the GPU test below runs it for real."""
    (x, phi, alpha, bias), _, _ = meta_call(2, 3, 4, 64, requires_grad=True)

    def fn(x, phi, alpha, bias):
        h_in, h_post, h_res = mhc_pre(x, phi, alpha, bias, sinkhorn_iters=sinkhorn_iters)
        return h_in.float().sum() + h_post.sum() + h_res.sum()

    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend="aot_eager")(x, phi, alpha, bias).backward()
    for t in (x, phi, alpha, bias):
        assert t.grad.shape == t.shape


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(rms_eps=-1.0), ValueError, "rms_eps: expected >= 0"),
    (dict(hc_eps="0"), TypeError, "hc_eps: expected a float"),
    (dict(sinkhorn_iters=-1), ValueError, "sinkhorn_iters: expected >= 0"),
    (dict(sinkhorn_iters=1000), ValueError, "sinkhorn_iters: expected <= 100"),
    (dict(sinkhorn_iters=2.5), TypeError, "sinkhorn_iters: expected an int"),
    (dict(sinkhorn_iters="20"), TypeError, "sinkhorn_iters: expected an int"),
])
def test_mhc_pre_validation(kwargs, err, match):
    (x, phi, alpha, bias), _, _ = meta_call(1, 2, 2, 16)
    with pytest.raises(err, match=match):
        mhc_pre(x, phi, alpha, bias, **kwargs)


# ----------------------------------------------------------------------------- compile-only (sm_90a)
@pytest.fixture(scope="module")
def op_2_520():
    return MHCBackwardPreTileLang(1, 4, 2, 520)


@pytest.mark.compile
@pytest.mark.parametrize("n,D", [(4, 4096), (4, 7168), (1, 64), (8, 512), (3, 520), (6, 520), (2, 8456)])
def test_compiles_for_sm90a(n, D):
    """n <= 4 up to 132 D-slices: the one pass alone; else the stats and grad kernels ((2, 8456): 133 slices)."""
    op = MHCBackwardPreTileLang(1, 4, n, D)
    if n <= 4 and D <= 132 * 64:
        assert not op._stats and set(op._grad) == {ALL}
    else:
        assert set(op._stats) == {ALL} and set(op._grad) == {True}


@pytest.mark.compile
def test_compiles_with_sinkhorn():
    """sinkhorn_iters >= 1 adds the Sinkhorn backward kernel and nothing else (the same spec and config)."""
    op = MHCBackwardPreTileLang(1, 4, 2, 520, sinkhorn_iters=20, hc_eps=1e-5)
    plain = MHCBackwardPreTileLang(1, 4, 2, 520)
    assert plain._sinkhorn_bwd is None and op._sinkhorn_bwd is not None
    assert (op.spec, op.config) == (plain.spec, plain.config)
    assert "mhc_pre_sinkhorn_bwd_kernel" in op._sinkhorn_bwd.get_kernel_source()


@pytest.mark.compile
def test_compiles_absent_gradient_variants(op_2_520):
    for present in PARTIAL:
        op_2_520._kernels(*present)
    assert len(op_2_520._grad) == 1 + len(PARTIAL) and not op_2_520._stats  # one pass per pattern


def call_with(which, make, device):
    (x, phi, alpha, bias), (g_in, g_post, g_res) = make_inputs(1, 4, 2, 520, device=device)
    call = dict(x=x, phi=phi, alpha=alpha, bias=bias, inv_rms=torch.ones(1, 4, device=device),
                h_pre=torch.ones(1, 4, 2, device=device), h_mix=torch.ones(1, 4, 8, device=device),
                grad_h_in=g_in, grad_h_post=g_post, grad_h_res=g_res)
    call[which] = make(call[which])
    return call


@pytest.mark.compile
@pytest.mark.parametrize("make,err,match", [
    (lambda t: t.float(), TypeError, "x: expected dtype torch.bfloat16"),
    (lambda t: t[..., :8], ValueError, r"x: expected shape \[\*, \*, 2, 520\]"),
    (lambda t: t, ValueError, "x: expected a CUDA tensor"),
])
def test_call_validation_cpu(op_2_520, make, err, match):
    with pytest.raises(err, match=match):
        op_2_520(**call_with("x", make, "cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("which,make,err,match", [
    ("phi", lambda t: t[:, :16], ValueError, "phi: expected shape"),
    ("phi", lambda t: t.cpu(), ValueError, "phi: expected a CUDA tensor"),
    ("inv_rms", lambda t: t[:, :1], ValueError, "inv_rms: expected shape"),
    ("h_pre", lambda t: t.double(), TypeError, "h_pre: expected dtype torch.float32"),
    ("h_mix", lambda t: t[..., :3], ValueError, "h_mix: expected shape"),
    ("grad_h_in", lambda t: t.float(), TypeError, "grad_h_in: expected dtype torch.bfloat16"),
    ("grad_h_in", lambda t: t.transpose(0, 1), ValueError, "grad_h_in: expected shape"),
    ("grad_h_post", lambda t: t[..., :1], ValueError, "grad_h_post: expected shape"),
    ("grad_h_res", lambda t: t.bfloat16(), TypeError, "grad_h_res: expected dtype torch.float32"),
    ("grad_h_res", lambda t: t.transpose(2, 3), ValueError, "grad_h_res: expected a contiguous tensor"),
])
def test_call_validation_gpu(op_2_520, which, make, err, match):
    with pytest.raises(err, match=match):
        op_2_520(**call_with(which, make, "cuda"))


# ----------------------------------------------------------------------------- GPU
_OPS = {}


def gpu_op(n, D, num_stages=None, sinkhorn_iters=0):
    key = (n, D, num_stages, sinkhorn_iters)
    if key not in _OPS:
        _OPS[key] = MHCBackwardPreTileLang(1, 1, n, D, None if num_stages is None else {"num_stages": num_stages},
                                           sinkhorn_iters=sinkhorn_iters)
    return _OPS[key]


def run_both(B, S, n, D, present=ALL, poisoned=contextlib.nullcontext, num_stages=None, sinkhorn_iters=0,
             lead=None):
    """The op's gradients (NaN-poisoned allocations) and the golden autograd's (float64 with Sinkhorn), for x
    [B, S, n, D] or [*lead, n, D]."""
    inputs, grads = make_inputs(B, S, n, D, device="cuda", present=present)
    if lead is not None:
        inputs = (inputs[0].view(*lead, n, D), *inputs[1:])
        grads = tuple(None if g is None else g.view(*lead, *g.shape[2:]) for g in grads)
    aux = mhc_forward_pre(*inputs, return_aux=True)[3:]  # inv_rms, h_pre, h_mix
    with poisoned():  # every output and workspace of the op starts as NaN
        got = gpu_op(n, D, num_stages, sinkhorn_iters)(*inputs, *aux, *grads)
    dtype = torch.float64 if sinkhorn_iters else torch.float32
    ref = mhc_backward_pre_autograd(*inputs, *grads, dtype=dtype, sinkhorn_iters=sinkhorn_iters)
    return got, ref


def assert_close(got, ref):
    assert got[0].dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in got[1:])
    for name, g, r, tol in zip(("grad_x", "grad_phi", "grad_alpha", "grad_bias"), got, ref,
                               (5e-3, 2e-3, 2e-3, 2e-3)):
        assert g.shape == r.shape, name
        assert torch.isfinite(g).all(), name
        assert rel_err(g, r) <= tol, (name, rel_err(g, r))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 1000, 16384])
@pytest.mark.parametrize("n,D", [(1, 520), (2, 520), (4, 1024), (8, 256)])
def test_matches_golden(poisoned, tokens, n, D):
    assert_close(*run_both(1, tokens, n, D, poisoned=poisoned))


@pytest.mark.gpu
@pytest.mark.parametrize("n,D", [(3, 520), (6, 520)])
def test_matches_golden_other_n(poisoned, n, D):
    # 1000 tokens: 4 token tiles per grad CTA, D not a multiple of block_d, h_pre rows under 16 bytes.
    assert_close(*run_both(1, 1000, n, D, poisoned=poisoned))


@pytest.mark.gpu
@pytest.mark.parametrize("n,D", [(2, 520), (4, 1024)])
def test_matches_golden_two_stage_grad(poisoned, n, D):
    """The grad kernel's other point of config_space: two pipeline stages."""
    assert_close(*run_both(1, 1000, n, D, poisoned=poisoned, num_stages=2))


@pytest.mark.gpu
def test_matches_golden_bench_shape(poisoned):
    assert_close(*run_both(4, 4096, 4, 4096, poisoned=poisoned))


@pytest.mark.gpu
def test_matches_golden_two_kernels_n_le_4(poisoned):
    """n <= 4 with more D-slices than SMs (133 at D = 8456): the stats and pipelined grad kernels."""
    assert_close(*run_both(1, 300, 2, 8456, poisoned=poisoned))


@pytest.mark.gpu
@pytest.mark.parametrize("n,D,num_sms", [(4, 4096, 64), (4, 1024, 20), (2, 8192, 100), (4, 520, 9)])
def test_matches_golden_within_sm_budget(poisoned, n, D, num_sms):
    """The one pass on a budget: one token group of 64 CTAs at D = 4096, one of 16 at D = 1024 (6 tiles of 1000
    tokens per CTA); with 128 slices over a budget of 100 the two kernels; 9 slices on 9 SMs."""
    inputs, grads = make_inputs(1, 1000, n, D, device="cuda")
    aux = mhc_forward_pre(*inputs, return_aux=True)[3:]
    op = MHCBackwardPreTileLang(1, 1, n, D, num_sms=num_sms)
    with poisoned():
        got = op(*inputs, *aux, *grads)
    assert_close(got, mhc_backward_pre_autograd(*inputs, *grads))


@pytest.mark.gpu
@pytest.mark.parametrize("present", [ALL, (False, True, True)])
def test_one_pass_relaunch_on_the_same_buffers(present):
    """The one pass zeroes its counters in its last CTA: launched again on the same arguments (as a timing loop
    does, tune_args) it redoes the whole work and writes the same bits (poisoned outputs rewritten)."""
    inputs, grads = make_inputs(2, 777, 4, 1024, device="cuda", present=present)
    aux = mhc_forward_pre(*inputs, return_aux=True)[3:]
    op = gpu_op(4, 1024)
    args = op.tune_args(*inputs, *aux, *grads)
    kernel = op._kernels(*present)[1]
    kernel(*args)
    first = [t.clone() for t in args[-5:]]  # ready, claim (the counters), terms, grad_x, part_phi_t
    assert int(args[-5].abs().sum()) == 0 and int(args[-4].abs().sum()) == 0, "counters not zeroed at the end"
    for t in (args[11], args[12], args[-3], args[-2], args[-1]):  # g_mix, coef, terms, grad_x, part_phi_t
        t.fill_(float("nan"))
    kernel(*args)
    for a, b in zip(first, args[-5:]):
        assert torch.equal(a, b)
    for t in (args[11], args[12]):
        assert not torch.isnan(t.float()).any()


@pytest.mark.gpu
@pytest.mark.parametrize("present", PARTIAL)
def test_absent_gradients(poisoned, present):
    got, ref = run_both(3, 333, 2, 520, present, poisoned)
    assert_close(got, ref)


@pytest.mark.gpu
def test_deterministic():
    inputs, grads = make_inputs(2, 3000, 4, 1024, device="cuda")
    aux = mhc_forward_pre(*inputs, return_aux=True)[3:]
    op = gpu_op(4, 1024)
    first = op(*inputs, *aux, *grads)
    for _ in range(4):
        again = op(*inputs, *aux, *grads)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("n,D", [(4, 1024), (2, 520), (4, 4096)])  # (4, 4096): the bench shape
def test_mhc_pre_end_to_end(poisoned, n, D):
    inputs, grads = make_inputs(2, 500, n, D, device="cuda")
    leaves = [t.clone().requires_grad_() for t in inputs]
    with poisoned():
        outs = mhc_pre(*leaves)
        # One output unused: its gradient reaches the backward as None.
        loss = sum((o.float() * g).sum() for o, g in zip(outs[:2], grads[:2]))
        loss.backward()
    ref_outs = mhc_forward_pre(*inputs)
    for o, r in zip(outs, ref_outs):
        assert rel_err(o, r) < 8e-3
    ref = mhc_backward_pre_autograd(*inputs, grads[0], grads[1], None)
    assert_close([t.grad for t in leaves], ref)


@pytest.mark.gpu
@pytest.mark.parametrize("n,D", [(4, 4096), (2, 520)])  # the backward's one pass at two widths
def test_mhc_pre_torch_compile(n, D):
    """torch.compile(fullgraph=True) over a training step's forward and backward through mhc_pre: no graph
    break, the eager op's outputs and (within rounding of the loss's own gradients) its gradients."""
    inputs, grads = make_inputs(2, 500, n, D, device="cuda")
    comp_grads = _compiled_step_matches_eager(inputs, grads)
    assert_close(comp_grads, mhc_backward_pre_autograd(*inputs, *grads))


def _compiled_step_matches_eager(inputs, grads, **pre_kwargs):
    """A training step through mhc_pre, eager and under torch.compile(fullgraph=True): the outputs bitwise equal,
    the gradients of the same shapes and dtypes within 1e-5 (the loss's own rounding); returns the compiled ones."""
    def step(x, phi, alpha, bias):
        h_in, h_post, h_res = mhc_pre(x, phi, alpha, bias, **pre_kwargs)
        loss = sum((o.float() * g).sum() for o, g in zip((h_in, h_post, h_res), grads))
        return (h_in, h_post, h_res), loss

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in inputs]
        outs, loss = fn(*leaves)
        loss.backward()
        results.append((outs, [t.grad for t in leaves]))
    (eager_outs, eager_grads), (comp_outs, comp_grads) = results
    for o, r in zip(comp_outs, eager_outs):
        assert torch.equal(o, r)
    for g, r in zip(comp_grads, eager_grads):
        assert g.shape == r.shape and g.dtype == r.dtype
        assert rel_err(g, r) <= 1e-5
    return comp_grads


@pytest.mark.gpu
def test_custom_op_bwd_torch_compile():
    """llm_tile_ops::mhc_pre_bwd called in a compiled function, one gradient absent (None): no graph break,
    the op class's result (the same kernel variant: bitwise)."""
    n, D = 2, 520
    inputs, grads = make_inputs(1, 333, n, D, device="cuda", present=PARTIAL[0])
    aux = mhc_forward_pre(*inputs, return_aux=True)[3:]

    def fn(*args):
        return torch.ops.llm_tile_ops.mhc_pre_bwd(*args)

    got = torch.compile(fn, fullgraph=True)(*inputs, *aux, *grads)
    ref = gpu_op(n, D)(*inputs, *aux, *grads)
    for g, r in zip(got, ref):
        assert torch.equal(g, r)


# ----------------------------------------------------------------------------- GPU: through the Sinkhorn iterations
@pytest.mark.gpu
@pytest.mark.parametrize("sinkhorn_iters", [0, 1, 20])
@pytest.mark.parametrize("n,D", [(1, 520), (2, 520), (4, 1024), (6, 520), (8, 256)])
@pytest.mark.parametrize("tokens", [1, 333, 4097])
def test_sinkhorn_matches_golden(poisoned, tokens, n, D, sinkhorn_iters):
    """grad_x, grad_phi, grad_alpha, grad_bias through comb (the forward's saved h_mix and inv_rms recompute
    the logits), n = 1..8 where the backward runs, odd token counts, against float64 autograd."""
    assert_close(*run_both(1, tokens, n, D, poisoned=poisoned, sinkhorn_iters=sinkhorn_iters))


@pytest.mark.gpu
@pytest.mark.parametrize("sinkhorn_iters", [1, 20, 100])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_sinkhorn_comb_gradient_only(poisoned, n, sinkhorn_iters):
    """Only comb has a gradient: grad_bias's comb entries are then the per-token sums of the Sinkhorn kernel's
    output alone (100 iterations: several recomputed segments at n = 8)."""
    got, ref = run_both(3, 111, n, 256, present=(False, False, True), poisoned=poisoned,
                        sinkhorn_iters=sinkhorn_iters)
    assert_close(got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("lead", [(5, 1, 133), (665,)])
def test_sinkhorn_leading_dims(poisoned, lead):
    """x [..., n, D] with other leading dimensions than [B, S]."""
    got, ref = run_both(1, 665, 4, 1024, poisoned=poisoned, sinkhorn_iters=20, lead=lead)
    assert got[0].shape == (*lead, 4, 1024)
    assert_close(got, ref)


@pytest.mark.gpu
def test_sinkhorn_bench_shape(poisoned):
    assert_close(*run_both(4, 4096, 4, 4096, poisoned=poisoned, sinkhorn_iters=20))


@pytest.mark.gpu
def test_sinkhorn_deterministic():
    inputs, grads = make_inputs(2, 3001, 4, 1024, device="cuda")
    aux = mhc_forward_pre(*inputs, return_aux=True)[3:]
    op = gpu_op(4, 1024, sinkhorn_iters=20)
    first = op(*inputs, *aux, *grads)
    for _ in range(4):
        again = op(*inputs, *aux, *grads)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("sinkhorn_iters", [1, 20])
@pytest.mark.parametrize("n,D", [(4, 4096), (2, 520), (8, 1024)])  # (8, 1024): the two-kernel backward
def test_mhc_pre_sinkhorn_end_to_end(poisoned, n, D, sinkhorn_iters):
    """mhc_pre(..., sinkhorn_iters) forward and loss.backward() against the golden's autograd (float64), every
    output used, x with three leading dimensions; a second step bitwise equal."""
    inputs, grads = make_inputs(1, 2 * 3 * 167, n, D, device="cuda")
    inputs = (inputs[0].view(2, 3, 167, n, D), *inputs[1:])
    grads = tuple(g.view(2, 3, 167, *g.shape[2:]) for g in grads)
    results = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in inputs]
        with poisoned():
            outs = mhc_pre(*leaves, sinkhorn_iters=sinkhorn_iters)
            loss = sum((o.float() * g.float()).sum() for o, g in zip(outs, grads))
            loss.backward()
        results.append((outs, [t.grad for t in leaves]))
    (outs, got), (outs2, got2) = results
    ref_outs = mhc_forward_pre(*to64(inputs), sinkhorn_iters=sinkhorn_iters)
    for o, r in zip(outs, ref_outs):
        assert o.shape == r.shape and rel_err(o, r) < 8e-3
    assert_close(got, mhc_backward_pre_autograd(*inputs, *grads, dtype=torch.float64, sinkhorn_iters=sinkhorn_iters))
    assert all(torch.equal(a, b) for a, b in zip((*outs, *got), (*outs2, *got2)))


@pytest.mark.gpu
def test_mhc_pre_sinkhorn_torch_compile():
    """torch.compile(fullgraph=True) over a training step through mhc_pre with 20 Sinkhorn iterations: no graph
    break, the eager op's outputs bitwise and its gradients."""
    n, D = 4, 4096
    inputs, grads = make_inputs(2, 500, n, D, device="cuda")
    torch._dynamo.reset()
    _compiled_step_matches_eager(inputs, grads, sinkhorn_iters=20)
