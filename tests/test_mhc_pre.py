import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from golden.mhc_pre import mhc_forward_pre, random_inputs, sinkhorn
from ops import MHCForwardPreTileLang
from ops.common import runtime as _runtime
from ops.mhc.tiling import forward_small_config, fused_fits, small_tokens_limit


def loop_sinkhorn(z, iters, hc_eps):
    """The issue's Sinkhorn projection of one token's logits (a list of n lists), element by element."""
    n = len(z)
    c = []
    for row in z:
        top = max(row)
        e = [math.exp(v - top) for v in row]
        c.append([v / sum(e) + hc_eps for v in e])

    def cols(c):
        sums = [sum(c[i][j] for i in range(n)) for j in range(n)]
        return [[c[i][j] / (sums[j] + hc_eps) for j in range(n)] for i in range(n)]

    def rows(c):
        return [[c[i][j] / (sum(c[i]) + hc_eps) for j in range(n)] for i in range(n)]

    c = cols(c)
    for _ in range(iters - 1):
        c = cols(rows(c))
    return c


def loop_reference(x, phi, alpha, bias, rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=0):
    """The issue's formula, one token and one output at a time, in float64; x [..., n, D]."""
    *lead, n, D = x.shape
    x = x.reshape(-1, n, D)
    h_in = torch.zeros(x.shape[0], D, dtype=torch.float64)
    h_post = torch.zeros(x.shape[0], n, dtype=torch.float64)
    h_res = torch.zeros(x.shape[0], n, n, dtype=torch.float64)
    a = alpha.double().tolist()
    bb = bias.double().tolist()
    sig = lambda z: 1.0 / (1.0 + math.exp(-z))  # noqa: E731
    for t in range(x.shape[0]):
        v = [float(e) for e in x[t].double().flatten()]
        mix = [sum(p * e for p, e in zip(phi[r].double().tolist(), v)) for r in range(n * n + 2 * n)]
        inv_rms = 1.0 / math.sqrt(sum(e * e for e in v) / len(v) + rms_eps)
        h_pre = [sig(a[0] * inv_rms * mix[i] + bb[i]) + hc_eps for i in range(n)]
        logits = [[a[2] * inv_rms * mix[2 * n + i * n + j] + bb[2 * n + i * n + j] for j in range(n)]
                  for i in range(n)]
        res = loop_sinkhorn(logits, sinkhorn_iters, hc_eps) if sinkhorn_iters else logits
        for i in range(n):
            h_post[t, i] = 2 * sig(a[1] * inv_rms * mix[n + i] + bb[n + i])
            for j in range(n):
                h_res[t, i, j] = res[i][j]
        for d in range(D):
            h_in[t, d] = sum(h_pre[i] * v[i * D + d] for i in range(n))
    return h_in.reshape(*lead, D), h_post.reshape(*lead, n), h_res.reshape(*lead, n, n)


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("sinkhorn_iters", [0, 1, 20])
@pytest.mark.parametrize("n,D,shape", [(1, 8, (1, 3)), (2, 24, (2, 2)), (4, 16, (1, 2)), (3, 8, (3,)),
                                       (4, 8, (2, 1, 2))])
def test_golden_matches_float64_loop(n, D, shape, sinkhorn_iters):
    x, phi, alpha, bias = random_inputs(1, math.prod(shape), n, D)
    x = x.reshape(*shape, n, D)  # any leading dimensions
    ref = loop_reference(x, phi, alpha, bias, sinkhorn_iters=sinkhorn_iters)
    got = mhc_forward_pre(x, phi.double(), alpha.double(), bias.double(), sinkhorn_iters=sinkhorn_iters)
    assert [tuple(g.shape) for g in got] == [(*shape, D), (*shape, n), (*shape, n, n)]
    # h_in is rounded to bf16 by definition; the fp32 outputs are compared in float64 here.
    assert rel_err(got[0], ref[0]) < 8e-3
    assert rel_err(got[1], ref[1]) < 1e-12
    assert rel_err(got[2], ref[2]) < 1e-12


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_golden_sinkhorn_20_is_doubly_stochastic(n):
    """20 iterations from logits of order one: the columns sum to 1 (up to the hc_eps terms), the rows nearly
    (Sinkhorn converges slowly for a few matrices), all entries positive; one iteration leaves the rows off."""
    torch.manual_seed(n)
    logits = torch.randn(1024, n, n, dtype=torch.float64)
    comb = sinkhorn(logits, 20, 1e-6)
    rows = (comb.sum(-1) - 1).abs()
    assert (comb > 0).all()
    assert (comb.sum(-2) - 1).abs().max() < 2e-5
    assert rows.max() < 5e-3 and rows.mean() < 1e-4
    if n > 1:
        assert (sinkhorn(logits, 1, 1e-6).sum(-1) - 1).abs().mean() > 1e-2


def test_golden_sinkhorn_fp32_matches_fp64():
    """The golden in fp32 (the compiled kernels' precision) stays close to float64 over 20 iterations."""
    x, phi, alpha, bias = random_inputs(2, 50, 4, 64)
    got = mhc_forward_pre(x, phi, alpha, bias, sinkhorn_iters=20)[2]
    ref = mhc_forward_pre(x, phi.double(), alpha.double(), bias.double(), sinkhorn_iters=20)[2]
    assert got.dtype == torch.float32 and rel_err(got, ref) < 1e-5


def test_golden_leading_dims():
    """[B, S, n, D], [tokens, n, D] and [n, D] give the same per-token results."""
    x, phi, alpha, bias = random_inputs(2, 3, 2, 16)
    full = mhc_forward_pre(x, phi, alpha, bias, return_aux=True, sinkhorn_iters=20)
    flat = mhc_forward_pre(x.reshape(6, 2, 16), phi, alpha, bias, return_aux=True, sinkhorn_iters=20)
    one = mhc_forward_pre(x[1, 2], phi, alpha, bias, return_aux=True, sinkhorn_iters=20)
    for f, g, o in zip(full, flat, one):
        assert torch.equal(f.reshape(g.shape), g)
        assert o.shape == f.shape[2:] and torch.allclose(o, f[1, 2], rtol=1e-6, atol=1e-6)


def test_golden_aux_outputs():
    x, phi, alpha, bias = random_inputs(2, 3, 2, 16)
    h_in, h_post, h_res, inv_rms, h_pre, h_mix = mhc_forward_pre(x, phi, alpha, bias, return_aux=True)
    xf = x.double().reshape(2, 3, -1)
    assert torch.allclose(inv_rms.double(), xf.square().mean(-1).add(1e-6).rsqrt(), rtol=1e-5)
    assert torch.allclose(h_mix.double(), xf @ phi.double().t(), rtol=1e-4, atol=1e-5)
    assert torch.allclose(h_in.float(), (h_pre[..., None] * x.float()).sum(2).bfloat16().float())


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(n=0), ValueError, "n: expected >= 1"),
    (dict(n=9), ValueError, "n: expected <= 8"),
    (dict(D=100), ValueError, "D: expected a multiple of 8"),
    (dict(D=16392), ValueError, "D: expected <= 16384"),
    (dict(n=2.0), TypeError, "n: expected an int"),
    (dict(rms_eps=-1.0), ValueError, "rms_eps"),
    (dict(config={"block_x": 1}), ValueError, "unknown keys"),
    (dict(config={"block_k": 96}), ValueError, r"config\['block_k'\]: expected a multiple of 64"),
    (dict(config={"block_t": 32}), ValueError, r"config\['block_t'\]: expected >= 64"),
    (dict(D=4096, config={"x_slots": 17}), ValueError, "unknown keys"),  # the default path: the two kernels
    (dict(D=4096, single_pass=True, config={"block_t": 64}), ValueError, "unknown keys"),  # the single pass's keys
    (dict(D=4096, single_pass=True, config={"x_slots": 15}), ValueError, r"config\['x_slots'\]: expected >= 16"),
    (dict(D=4096, single_pass=True, config={"x_slots": 20, "phi_stages": 8}), ValueError, "bytes of shared memory"),
    (dict(D=7168, single_pass=True), ValueError, "single_pass: expected False for n=4, D=7168"),
    (dict(single_pass=1), TypeError, "single_pass: expected a bool"),
    (dict(D=4096, single_pass=True, num_sms=15), ValueError, "num_sms: expected >= 16 with single_pass=True"),
    (dict(num_sms=0), ValueError, "num_sms: expected >= 1"),
    (dict(num_sms=10_000), ValueError, "num_sms: expected <= "),
    (dict(num_sms=64.0), TypeError, "num_sms: expected an int"),
    (dict(D=4096, config={"splits": 3}), ValueError, r"config\['splits'\]: expected a divisor of the 128 column chunks"),
    (dict(config={"splits": 0}), ValueError, r"config\['splits'\]: expected >= 1"),
    (dict(n=1, D=520, config={"splits": 3}), ValueError, "leaving each split at least num_stages=3"),
    (dict(n=8, config={"num_stages": 4}), ValueError, "bytes of shared memory"),  # 80 phi rows per stage
    (dict(sinkhorn_iters=-1), ValueError, "sinkhorn_iters: expected >= 0"),
    (dict(sinkhorn_iters=101), ValueError, "sinkhorn_iters: expected <= 100"),
    (dict(sinkhorn_iters=2.0), TypeError, "sinkhorn_iters: expected an int"),
    (dict(sinkhorn_iters=True), TypeError, "sinkhorn_iters: expected an int"),
    (dict(sinkhorn_iters=None), TypeError, "sinkhorn_iters: expected an int"),
])
def test_constructor_validation(kwargs, err, match):
    args = dict(B=1, S=1, n=4, D=64)
    args.update(kwargs)
    with pytest.raises(err, match=match):
        MHCForwardPreTileLang(**args)


@pytest.fixture(scope="module")
def small_op():
    return MHCForwardPreTileLang(1, 4, 2, 64)


@pytest.mark.compile
def test_call_validation(small_op):
    x, phi, alpha, bias = random_inputs(1, 4, 2, 64)
    with pytest.raises(ValueError, match="x: expected a CUDA tensor"):
        small_op(x, phi, alpha, bias)
    with pytest.raises(TypeError, match=r"x: expected dtype torch.bfloat16, got torch.float32"):
        small_op(x.float(), phi, alpha, bias)
    with pytest.raises(ValueError, match=r"x: expected shape \[\*, \*, 2, 64\], got \[1, 4, 2, 32\]"):
        small_op(x[..., :32], phi, alpha, bias)
    with pytest.raises(ValueError, match=r"x: expected shape .* got \[1, 4, 4, 32\]"):
        small_op(x.reshape(1, 4, 4, 32), phi, alpha, bias)
    with pytest.raises(ValueError, match=r"x: expected shape \[\*, 2, 64\], got \[4, 2, 32\]"):
        small_op(x[0, :, :, :32], phi, alpha, bias)  # any leading dimensions, here one
    with pytest.raises(ValueError, match=r"x: expected shape \[\.\.\., n, D\], got \[64\]"):
        small_op(x[0, 0, 0, :], phi, alpha, bias)
    if torch.cuda.is_available():
        x, phi, alpha, bias = (t.cuda() for t in (x, phi, alpha, bias))
        with pytest.raises(ValueError, match="x: expected a contiguous tensor"):
            small_op(x.transpose(1, 2).contiguous().transpose(1, 2), phi, alpha, bias)
        with pytest.raises(ValueError, match=r"phi: expected shape \[8, 128\]"):
            small_op(x, phi[:, :64], alpha, bias)
        with pytest.raises(TypeError, match="alpha: expected dtype torch.float32"):
            small_op(x, phi, alpha.double(), bias)


@pytest.mark.compile
@pytest.mark.parametrize("n,D,single_pass", [(4, 4096, False), (4, 4096, True), (4, 7168, False), (2, 520, False)])
def test_compiles_for_sm90a(n, D, single_pass):
    """The default path is the two kernels everywhere; the single pass only on request (where it fits)."""
    op = MHCForwardPreTileLang(2, 8, n, D, single_pass=single_pass)
    assert (op._fused is not None) == single_pass and fused_fits(n, D) == (D == 4096)
    src = (op._mix if op._fused is None else op._fused).get_kernel_source()
    if _runtime.target()["arch"].startswith("sm_90"):
        assert "wgmma" in src, "expected Hopper tensor-core MMA"
        assert op._fused is None or "tma_store_cluster" in src, "expected the cluster exchange"
        # cluster launches allow programmatic dependent launch: the phi split must be waited for
        assert op._fused is None or "cudaGridDependencySynchronize" in src
        if op._fused is not None:  # the side kernel starts behind the single pass's trigger
            assert "cudaTriggerProgrammaticLaunchCompletion" in src
            assert "cudaGridDependencySynchronize" in op._side.get_kernel_source()


@pytest.mark.compile
def test_split_mix_compiles_for_sm90a():
    """The mix kernel with its K split over 4 CTAs per tile: partials out, the tile's last CTA sums them (a count
    per tile) and runs the epilogue; one split builds none of that."""
    op = MHCForwardPreTileLang(2, 8, 4, 4096, config={"splits": 4})
    src = op._mix.get_kernel_source().split("__global__")[-1]
    assert "mhc_last_split(" in src and "mhc_ld_cg(" in src
    one = MHCForwardPreTileLang(2, 8, 4, 4096)._mix.get_kernel_source()
    assert "mhc_last_split(" not in one.split("__global__")[-1]


def test_small_token_config():
    """Small token counts: 64-token tiles whose columns split over the widest of 8 / 4 / 2 CTAs that leaves each
    split at least 8 column chunks, up to the token count whose grid is about two CTAs per SM."""
    assert forward_small_config(4, 4096) == dict(block_t=64, block_k=128, num_stages=3, threads=128, splits=8)
    assert forward_small_config(4, 1024)["splits"] == 4  # 32 chunks of 128 columns
    assert forward_small_config(2, 520) is None and forward_small_config(1, 8) is None  # 12 and 2 chunks
    assert small_tokens_limit(8, 132) == 2112 and small_tokens_limit(4, 132) == 4224


@pytest.mark.compile
def test_small_token_kernel_dispatch():
    """Without a config the op builds the small-token mix kernel (split) beside its own and picks it by the call's
    token count; a config of the caller's pins the one kernel."""
    op = MHCForwardPreTileLang(1, 8, 4, 1024)
    kernel, config = op._small
    assert config == forward_small_config(4, 1024) and "mhc_last_split(" in kernel.get_kernel_source()
    limit = small_tokens_limit(config["splits"], _runtime.sm_count())
    assert op._mix_for(1, None)[0] is kernel and op._mix_for(limit, None)[0] is kernel
    assert op._mix_for(limit + 1, None) == (op._mix, op.config)
    assert MHCForwardPreTileLang(1, 8, 4, 1024, config={"splits": 1})._small is None


@pytest.mark.compile
@pytest.mark.parametrize("n,D,splits", [(2, 520, 1), (4, 1024, 2), (8, 256, 1)])
def test_compiles_with_sinkhorn(n, D, splits):
    """sinkhorn_iters >= 1 projects h_res in the mix kernel's epilogue (also behind the split reduction), with
    no kernel of its own and the same spec; 0 leaves the logits."""
    op = MHCForwardPreTileLang(2, 8, n, D, sinkhorn_iters=20, config={"splits": splits})
    plain = MHCForwardPreTileLang(2, 8, n, D, config={"splits": splits})
    assert op._sinkhorn is None and op.spec == plain.spec
    src, plain_src = op._mix.get_kernel_source(), plain._mix.get_kernel_source()
    assert src.count("__expf") + src.count("exp") > plain_src.count("__expf") + plain_src.count("exp")


@pytest.mark.compile
@pytest.mark.parametrize("n,iters", [(1, 1), (3, 2), (4, 20), (6, 20), (8, 20), (8, 100)])
def test_sinkhorn_kernels_compile_for_sm90a(n, iters):
    """Both Sinkhorn kernels for n = 1..8 (the backward's segments: one at n = 4, 20 iterations; several
    at n = 8, 20 and 100)."""
    from ops.common.runtime import compile_kernel
    from ops.mhc.kernels.sinkhorn import mhc_pre_sinkhorn_bwd_kernel, mhc_pre_sinkhorn_kernel

    fwd = compile_kernel(mhc_pre_sinkhorn_kernel(n, iters, 1e-6)).get_kernel_source()
    bwd = compile_kernel(mhc_pre_sinkhorn_bwd_kernel(n, iters, 1e-6)).get_kernel_source()
    assert "mhc_pre_sinkhorn_kernel" in fwd and "mhc_pre_sinkhorn_bwd_kernel" in bwd
    # The backward's denominators live in shared memory, a column per thread; no CTA barrier.
    assert "__shared__" in bwd and "__syncthreads" not in bwd


def test_sinkhorn_segment():
    """The Sinkhorn backward's segments: even, within 2 * iters, their denominators within the shared
    memory budget; one segment for DeepSeek-V4's n = 4, 20 iterations."""
    from ops.mhc.tiling import _SINKHORN_SMEM, _SINKHORN_THREADS, sinkhorn_segment

    assert sinkhorn_segment(4, 20) == 40
    for n in range(1, 9):
        for iters in (1, 2, 20, 100):
            seg = sinkhorn_segment(n, iters)
            assert seg % 2 == 0 and 2 <= seg <= 2 * iters
            assert seg * n * _SINKHORN_THREADS * 4 <= _SINKHORN_SMEM


def test_mix_config_space_fits_shared_memory():
    """Every offered two-kernel config fits (n=8 has 80 phi rows per stage: 4 stages of 128 x 128 do not)."""
    from ops.common.hw import SMEM_BUDGET as _SMEM_BUDGET
    from ops.mhc.tiling import mix_smem_bytes
    space = MHCForwardPreTileLang.config_space({"n": 8, "D": 1024})
    assert space and all(mix_smem_bytes(8, **c) <= _SMEM_BUDGET for c in space)
    assert dict(block_t=128, block_k=128, num_stages=4, threads=256, splits=1) not in space
    assert dict(block_t=128, block_k=128, num_stages=3, threads=256, splits=4) in space
    assert mix_smem_bytes(8, 128, 128, 3) == 221184  # TileLang's allocation for that kernel


def test_side_tokens_whole_rounds_that_end_with_the_single_pass():
    """One tile per idle SM per round, only as many rounds as the single pass outlasts."""
    from ops.mhc.tiling import side_tokens
    assert side_tokens(16384, 0) == 0  # no idle SM
    assert side_tokens(8192, 20) == 0  # a round would outlast the single pass
    assert side_tokens(16384, 20) == 20 * 128
    for tokens in (1, 3, 1000, 16384, 50000, 1 << 20):
        side = side_tokens(tokens, 20)
        assert side % (20 * 128) == 0 and 0 <= side < tokens


def test_protocol():
    """The op class follows ops.common.protocol: the tunable kernel is the mix kernel (the default path's; the
    opt-in single pass is not tuned); every offered config has the default's keys; the bench shapes are warm
    specs."""
    from ops.common.protocol import Op, op_class
    from ops.mhc.kernels.fwd_mix import mhc_pre_mix_kernel
    from ops.mhc.tiling import forward_config_space, forward_default_config

    cls = MHCForwardPreTileLang
    assert issubclass(cls, Op) and op_class("mhc_pre") is cls
    for D in (4096, 7168):
        spec = {"n": 4, "D": D, "rms_eps": 1e-6, "hc_eps": 1e-6}
        assert cls.tunable_kernel(spec) is mhc_pre_mix_kernel
        space = cls.config_space(spec)
        assert space and all(set(c) == set(cls.default_config(spec)) for c in space)
    single = forward_config_space(4, 4096, single_pass=True)
    assert single and all(set(c) == set(forward_default_config(4, 4096, True)) == {"x_slots", "phi_stages"}
                          for c in single)
    assert {(s["n"], s["D"]) for s in cls.warm_specs} == {(4, 4096), (4, 7168)}


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(hc_eps=-1e-6), ValueError, r"hc_eps: expected >= 0"),
    (dict(rms_eps=float("nan")), ValueError, "rms_eps: expected a finite value"),
    (dict(rms_eps="1e-6"), TypeError, "rms_eps: expected a float"),
])
def test_eps_validation(kwargs, err, match):
    with pytest.raises(err, match=match):
        MHCForwardPreTileLang(B=1, S=1, n=4, D=64, **kwargs)


def _meta_inputs(lead, n, D, device="meta"):
    N = n * n + 2 * n
    return (torch.empty(*lead, n, D, device=device, dtype=torch.bfloat16), torch.empty(N, n * D, device=device),
            torch.empty(3, device=device), torch.empty(N, device=device))


@pytest.mark.parametrize("sinkhorn_iters", [0, 20])
@pytest.mark.parametrize("lead,n,D", [((2, 3), 4, 64), ((1, 5), 1, 24), ((3, 1), 8, 16), ((7,), 4, 64),
                                      ((), 2, 16), ((2, 1, 3), 6, 8)])
def test_custom_op_fake_shapes(lead, n, D, sinkhorn_iters):
    """llm_tile_ops::mhc_pre_fwd propagates shapes and dtypes without a kernel (meta and fake tensors), for
    any leading dimensions of x [..., n, D]."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    want = [((*lead, D), torch.bfloat16), ((*lead, n), torch.float32), ((*lead, n, n), torch.float32),
            (lead, torch.float32), ((*lead, n), torch.float32), ((*lead, n * n + 2 * n), torch.float32)]
    outs = torch.ops.llm_tile_ops.mhc_pre_fwd(*_meta_inputs(lead, n, D), 1e-6, 1e-6, sinkhorn_iters)
    assert [(tuple(o.shape), o.dtype) for o in outs] == want
    assert all(o.device.type == "meta" for o in outs)
    with FakeTensorMode():
        outs = torch.ops.llm_tile_ops.mhc_pre_fwd(*_meta_inputs(lead, n, D, "cuda"), 1e-6, 1e-6, sinkhorn_iters)
        assert [(tuple(o.shape), o.dtype) for o in outs] == want
        assert all(o.device.type == "cuda" for o in outs)


@pytest.mark.parametrize("iters,err,match", [(-1, ValueError, "sinkhorn_iters: expected >= 0"),
                                             (101, ValueError, "sinkhorn_iters: expected <= 100")])
def test_custom_op_fake_validation(iters, err, match):
    """The fake checks sinkhorn_iters too, so a traced program fails as the eager one does."""
    with pytest.raises(err, match=match):
        torch.ops.llm_tile_ops.mhc_pre_fwd(*_meta_inputs((2, 3), 4, 64), 1e-6, 1e-6, iters)
    with pytest.raises(ValueError, match=r"x: expected shape \[\.\.\., n, D\]"):
        torch.ops.llm_tile_ops.mhc_pre_fwd(torch.empty(64, device="meta", dtype=torch.bfloat16),
                                           *_meta_inputs((2, 3), 4, 64)[1:], 1e-6, 1e-6)


@pytest.mark.compile
def test_disk_cache_hit_in_fresh_process(tmp_path):
    """A second process builds the same op from disk: it must not run nvcc (we make nvcc fail)."""
    script = textwrap.dedent("""
        import sys
        from ops import MHCForwardPreTileLang
        if sys.argv[1] == "no-nvcc":
            import tilelang.contrib.nvcc as nvcc
            def refuse(*a, **k):
                raise RuntimeError("nvcc was called")
            nvcc.compile_cuda = refuse
        MHCForwardPreTileLang(1, 1, 2, 136)
        print("built")
    """)
    # Without the TileLang cache dir this process chose (a fresh process keeps a user's own choice).
    env = {k: v for k, v in os.environ.items() if k != "TILELANG_CACHE_DIR"}
    env["LLM_TILE_OPS_CACHE_DIR"] = str(tmp_path)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def run(mode):
        return subprocess.run([sys.executable, "-c", script, mode], cwd=root, env=env, capture_output=True, text=True)

    first = run("no-nvcc")
    assert first.returncode != 0 and "nvcc was called" in first.stderr, "an empty cache must compile"
    assert run("compile").returncode == 0
    second = run("no-nvcc")
    assert second.returncode == 0 and "built" in second.stdout, second.stderr[-2000:]

    # A corrupted entry is rebuilt, not fatal.
    for path in (tmp_path / "tilelang").rglob("*"):
        if path.is_file() and path.suffix in (".cubin", ".so", ".cu"):
            path.write_bytes(b"garbage")
    third = run("compile")
    assert third.returncode == 0 and "built" in third.stdout, third.stderr[-2000:]


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("n,D", [(1, 1032), (1, 16384), (2, 520), (2, 8192), (4, 2048), (4, 4096), (4, 7168),
                                 (8, 1024)])
@pytest.mark.parametrize("shape", [(1, 1), (1, 3), (2, 500), (4, 4096), (3, 5001)])
@pytest.mark.parametrize("single_pass", [False, True])
def test_compiled_matches_golden(n, D, shape, single_pass, poisoned):
    """Both kernel families: the two kernels everywhere, and on request the single pass where it fits ((1, 16384),
    (2, 8192), (4, 2048), (4, 4096); 4 x 4096 tokens is many tiles per persistent cluster). From 4 x 4096 tokens
    the side kernel takes the last ones; with 3 x 5001 the single pass ends mid-tile there."""
    if single_pass and not fused_fits(n, D):
        pytest.skip("the single pass does not fit this shape")
    op = MHCForwardPreTileLang(*shape, n, D, single_pass=single_pass)
    x, phi, alpha, bias = random_inputs(*shape, n, D, device="cuda")
    ref = mhc_forward_pre(x.double(), phi.double(), alpha.double(), bias.double(), return_aux=True)
    for _ in range(2):  # the second run reuses workspace and counters
        with poisoned():
            got = op(x, phi, alpha, bias, return_aux=True)
        for name, g, r, tol in zip(("h_in", "h_post", "h_res", "inv_rms", "h_pre", "h_mix"), got, ref,
                                   (8e-3, 2e-3, 2e-3, 1e-5, 2e-3, 2e-3)):
            assert not torch.isnan(g).any(), f"{name}: unwritten (NaN) elements"
            assert rel_err(g, r) <= tol, f"{name}: rel err {rel_err(g, r):.2e} > {tol}"


@pytest.mark.gpu
@pytest.mark.parametrize("single_pass", [False, True])
def test_tokens_dynamic_and_deterministic(single_pass):
    op = MHCForwardPreTileLang(1, 1, 4, 4096, single_pass=single_pass)
    for shape in ((1, 7), (3, 1000)):
        x, phi, alpha, bias = random_inputs(*shape, 4, 4096, device="cuda")
        a = op(x, phi, alpha, bias)
        b = op(x, phi, alpha, bias)
        assert all(torch.equal(u, v) for u, v in zip(a, b)), "forward must be bitwise reproducible"
        assert a[0].shape == (*shape, 4096)


@pytest.mark.gpu
@pytest.mark.parametrize("sinkhorn_iters", [0, 20])
def test_custom_op_torch_compile_fullgraph(sinkhorn_iters):
    """torch.compile(fullgraph=True) over a function calling llm_tile_ops::mhc_pre_fwd: no graph break,
    and the same outputs as the op class (the same kernels: bitwise)."""
    n, D = 4, 4096
    x, phi, alpha, bias = random_inputs(2, 300, n, D, device="cuda")

    def fn(x, phi, alpha, bias):
        h_in, h_post, h_res, inv_rms, h_pre, h_mix = torch.ops.llm_tile_ops.mhc_pre_fwd(
            x, phi, alpha, bias, 1e-6, 1e-6, sinkhorn_iters)
        return h_in, h_post * 2, h_res, inv_rms, h_pre, h_mix

    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True)(x, phi, alpha, bias)
    ref = MHCForwardPreTileLang(1, 1, n, D, sinkhorn_iters=sinkhorn_iters)(x, phi, alpha, bias, return_aux=True)
    ref = (ref[0], ref[1] * 2, *ref[2:])
    for g, r in zip(got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype
        assert torch.equal(g, r)


# ----------------------------------------------------------------------------- GPU: Sinkhorn (h_res -> comb)
_SK_OPS = {}


def sinkhorn_op(n, D, sinkhorn_iters):
    key = (n, D, sinkhorn_iters)
    if key not in _SK_OPS:
        _SK_OPS[key] = MHCForwardPreTileLang(1, 1, n, D, sinkhorn_iters=sinkhorn_iters)
    return _SK_OPS[key]


def check_against_golden(op, x, phi, alpha, bias, sinkhorn_iters, poisoned):
    """op's outputs (NaN-poisoned allocations) against the float64 golden; a second run bitwise equal."""
    ref = mhc_forward_pre(x.double(), phi.double(), alpha.double(), bias.double(), return_aux=True,
                          sinkhorn_iters=sinkhorn_iters)
    with poisoned():
        got = op(x, phi, alpha, bias, return_aux=True)
    for name, g, r, tol in zip(("h_in", "h_post", "h_res", "inv_rms", "h_pre", "h_mix"), got, ref,
                               (8e-3, 2e-3, 2e-3, 1e-5, 2e-3, 2e-3)):
        assert g.shape == r.shape, (name, g.shape, r.shape)
        assert not torch.isnan(g).any(), f"{name}: unwritten (NaN) elements"
        assert rel_err(g, r) <= tol, f"{name}: rel err {rel_err(g, r):.2e} > {tol}"
    if sinkhorn_iters:
        comb = got[2].double()
        assert (comb > 0).all()
        assert (comb.sum(-2) - 1).abs().max() < 1e-4, "columns of comb must sum to 1"
    again = op(x, phi, alpha, bias, return_aux=True)
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "forward must be bitwise reproducible"
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("sinkhorn_iters", [0, 1, 20])
@pytest.mark.parametrize("n,D", [(1, 1032), (2, 520), (4, 1024), (4, 4096), (6, 520), (8, 1024)])
@pytest.mark.parametrize("lead", [(), (1,), (3, 333), (2, 5, 7)])
def test_sinkhorn_matches_golden(n, D, lead, sinkhorn_iters, poisoned):
    """h_res as comb for n = 1..8 (the two kernels), any leading dimensions of x (none: one token), odd token
    counts; every output against the float64 golden."""
    x, phi, alpha, bias = random_inputs(1, math.prod(lead), n, D, device="cuda")
    check_against_golden(sinkhorn_op(n, D, sinkhorn_iters), x.view(*lead, n, D), phi, alpha, bias,
                         sinkhorn_iters, poisoned)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [4096, 7168])
def test_sinkhorn_bench_shape(D, poisoned):
    """16384 tokens at the bench shapes, and at D = 4096 the opt-in single pass, whose side kernel also wrote
    logits the Sinkhorn kernel turns into comb."""
    x, phi, alpha, bias = random_inputs(4, 4096, 4, D, device="cuda")
    check_against_golden(sinkhorn_op(4, D, 20), x, phi, alpha, bias, 20, poisoned)
    if D == 4096:
        op = MHCForwardPreTileLang(1, 1, 4, D, sinkhorn_iters=20, single_pass=True)
        check_against_golden(op, x, phi, alpha, bias, 20, poisoned)


@pytest.mark.gpu
@pytest.mark.parametrize("n,D,splits", [(4, 4096, 2), (4, 4096, 4), (4, 7168, 4), (1, 520, 2), (8, 1024, 2)])
@pytest.mark.parametrize("lead", [(1,), (3, 333), (4, 4096)])
def test_split_mix_matches_golden(n, D, splits, lead, poisoned):
    """The mix kernel's K split over CTAs (the last of a tile's CTAs sums the partials): against the golden, bitwise
    reproducible (check_against_golden runs it twice), with and without Sinkhorn."""
    x, phi, alpha, bias = random_inputs(1, math.prod(lead), n, D, device="cuda")
    for iters in (0, 20):
        op = MHCForwardPreTileLang(1, 1, n, D, sinkhorn_iters=iters, config={"splits": splits})
        check_against_golden(op, x.view(*lead, n, D), phi, alpha, bias, iters, poisoned)


@pytest.mark.gpu
@pytest.mark.parametrize("iters", [0, 20])
def test_small_token_kernel_at_its_limit(iters, poisoned):
    """The bench shape at the small-token kernel's last token count and one past it (the default kernel), against
    the golden and bitwise reproducible."""
    op = MHCForwardPreTileLang(1, 1, 4, 4096, sinkhorn_iters=iters)
    limit = small_tokens_limit(op._small[1]["splits"], _runtime.sm_count())
    for tokens in (limit, limit + 1):
        x, phi, alpha, bias = random_inputs(1, tokens, 4, 4096, device="cuda")
        assert (op._mix_for(tokens, x.device)[0] is op._small[0]) == (tokens == limit)
        check_against_golden(op, x, phi, alpha, bias, iters, poisoned)


@pytest.mark.gpu
def test_split_mix_relaunch_on_the_same_buffers():
    """The tile's last CTA zeroes its count: the mix kernel launched again on the same arguments (a timing loop,
    tune_args) runs every epilogue again."""
    op = MHCForwardPreTileLang(1, 1, 4, 1024, config={"splits": 4})
    x, phi, alpha, bias = random_inputs(1, 1000, 4, 1024, device="cuda")
    args = op.tune_args(x, phi, alpha, bias)
    op._mix(*args)
    first = [t.clone() for t in args[5:10]]  # h_post, h_res, inv_rms, h_pre, h_mix
    assert int(args[-1].abs().sum()) == 0, "counts not zeroed"
    for t in args[5:10]:
        t.fill_(float("nan"))
    op._mix(*args)
    assert all(torch.equal(a, b) for a, b in zip(first, args[5:10]))


@pytest.mark.gpu
@pytest.mark.parametrize("num_sms", [16, 64, 100])
def test_single_pass_within_sm_budget(num_sms, poisoned):
    """The single pass with an SM budget: 1 or 4 clusters and no side kernel (16, 64), 6 clusters and a side
    kernel on the 4 SMs they leave (100: a round of 4 tiles at 16384 tokens)."""
    x, phi, alpha, bias = random_inputs(4, 4096, 4, 4096, device="cuda")
    op = MHCForwardPreTileLang(1, 1, 4, 4096, num_sms=num_sms, single_pass=True)
    assert op._kernel_args(x, phi, alpha, bias, op._outputs(x))[-1] <= num_sms // 16
    check_against_golden(op, x, phi, alpha, bias, 0, poisoned)


@pytest.mark.gpu
def test_sinkhorn_large_logits(poisoned):
    """Logits near 200 (exp overflows fp32 past 88): the softmax subtracts each row's maximum, so comb is
    finite and the golden's."""
    n, D = 4, 1024
    x, phi, alpha, bias = random_inputs(1, 777, n, D, device="cuda")
    bias[2 * n:] += 200.0
    got = check_against_golden(sinkhorn_op(n, D, 20), x, phi, alpha, bias, 20, poisoned)
    assert torch.isfinite(got[2]).all()


@pytest.mark.gpu
def test_sinkhorn_leading_dims_agree():
    """[B, S, n, D] and [tokens, n, D] inputs give the same results bitwise, [n, D] (one token) its token's."""
    n, D = 4, 1024
    op = sinkhorn_op(n, D, 20)
    x, phi, alpha, bias = random_inputs(3, 41, n, D, device="cuda")
    full = op(x, phi, alpha, bias, return_aux=True)
    flat = op(x.view(123, n, D), phi, alpha, bias, return_aux=True)
    one = op(x[2, 40], phi, alpha, bias, return_aux=True)
    for f, g, o in zip(full, flat, one):
        assert f.shape[:2] == (3, 41) and g.shape[0] == 123 and o.shape == f.shape[2:]
        assert torch.equal(f.reshape(g.shape), g)
        assert torch.allclose(o.float(), f[2, 40].float(), rtol=1e-5, atol=1e-6)
