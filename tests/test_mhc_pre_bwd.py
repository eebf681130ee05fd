import contextlib

import pytest
import torch

from golden.mhc_pre import mhc_forward_pre, random_inputs
from golden.mhc_pre_bwd import mhc_backward_pre, mhc_backward_pre_autograd
from ops import _runtime  # noqa: F401  (kernel cache dir before TileLang)
from ops.mhc_pre_bwd import MHCBackwardPreTileLang, mhc_pre

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
])
def test_constructor_validation(kwargs, err, match):
    args = {**dict(B=1, S=4, n=4, D=64), **kwargs}
    with pytest.raises(err, match=match):
        MHCBackwardPreTileLang(**args)


@pytest.mark.parametrize("n", [1, 4, 6])
def test_config_space_offers_no_hanging_config(n):
    """The one-pass kernel (n <= 4) hangs with one stage: the autotuner is never offered it."""
    stages = {cfg["num_stages"] for cfg in MHCBackwardPreTileLang.config_space(n=n, D=1024)}
    assert stages and min(stages) == (2 if n <= 4 else 1), stages


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


def gpu_op(n, D, num_stages=None):
    key = (n, D, num_stages)
    if key not in _OPS:
        _OPS[key] = MHCBackwardPreTileLang(1, 1, n, D, None if num_stages is None else {"num_stages": num_stages})
    return _OPS[key]


def run_both(B, S, n, D, present=ALL, poisoned=contextlib.nullcontext, num_stages=None):
    inputs, grads = make_inputs(B, S, n, D, device="cuda", present=present)
    aux = mhc_forward_pre(*inputs, return_aux=True)[3:]  # inv_rms, h_pre, h_mix
    with poisoned():  # every output and workspace of the op starts as NaN
        got = gpu_op(n, D, num_stages)(*inputs, *aux, *grads)
    ref = mhc_backward_pre_autograd(*inputs, *grads)
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
@pytest.mark.parametrize("n,D", [(4, 1024), (2, 520), (4, 4096)])  # (4, 4096): the single-pass forward
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
