import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from golden.mhc_pre import mhc_forward_pre, random_inputs
from ops import MHCForwardPreTileLang
from ops.mhc_pre import fused_fits
from ops import _runtime


def loop_reference(x, phi, alpha, bias, rms_eps=1e-6, hc_eps=1e-6):
    """The issue's formula, one token and one output at a time, in float64."""
    B, S, n, D = x.shape
    h_in = torch.zeros(B, S, D, dtype=torch.float64)
    h_post = torch.zeros(B, S, n, dtype=torch.float64)
    h_res = torch.zeros(B, S, n, n, dtype=torch.float64)
    for b in range(B):
        for s in range(S):
            v = [float(e) for e in x[b, s].double().flatten()]
            mix = [sum(p * e for p, e in zip(phi[r].double().tolist(), v)) for r in range(n * n + 2 * n)]
            inv_rms = 1.0 / math.sqrt(sum(e * e for e in v) / len(v) + rms_eps)
            a = alpha.double().tolist()
            bb = bias.double().tolist()
            sig = lambda z: 1.0 / (1.0 + math.exp(-z))  # noqa: E731
            h_pre = [sig(a[0] * inv_rms * mix[i] + bb[i]) + hc_eps for i in range(n)]
            for i in range(n):
                h_post[b, s, i] = 2 * sig(a[1] * inv_rms * mix[n + i] + bb[n + i])
                for j in range(n):
                    h_res[b, s, i, j] = a[2] * inv_rms * mix[2 * n + i * n + j] + bb[2 * n + i * n + j]
            for d in range(D):
                h_in[b, s, d] = sum(h_pre[i] * v[i * D + d] for i in range(n))
    return h_in, h_post, h_res


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("n,D,shape", [(1, 8, (1, 3)), (2, 24, (2, 2)), (4, 16, (1, 2))])
def test_golden_matches_float64_loop(n, D, shape):
    x, phi, alpha, bias = random_inputs(*shape, n, D)
    ref = loop_reference(x, phi, alpha, bias)
    got = mhc_forward_pre(x, phi.double(), alpha.double(), bias.double())
    # h_in is rounded to bf16 by definition; the fp32 outputs are compared in float64 here.
    assert rel_err(got[0], ref[0]) < 8e-3
    assert rel_err(got[1], ref[1]) < 1e-12
    assert rel_err(got[2], ref[2]) < 1e-12


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
    (dict(D=4096, config={"block_t": 64}), ValueError, "unknown keys"),  # the single-pass kernel's keys
    (dict(D=4096, config={"x_slots": 15}), ValueError, r"config\['x_slots'\]: expected >= 16"),
    (dict(D=4096, config={"x_slots": 20, "phi_stages": 8}), ValueError, "bytes of shared memory"),
    (dict(n=8, config={"num_stages": 4}), ValueError, "bytes of shared memory"),  # 80 phi rows per stage
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
    if torch.cuda.is_available():
        x, phi, alpha, bias = (t.cuda() for t in (x, phi, alpha, bias))
        with pytest.raises(ValueError, match="x: expected a contiguous tensor"):
            small_op(x.transpose(1, 2).contiguous().transpose(1, 2), phi, alpha, bias)
        with pytest.raises(ValueError, match=r"phi: expected shape \[8, 128\]"):
            small_op(x, phi[:, :64], alpha, bias)
        with pytest.raises(TypeError, match="alpha: expected dtype torch.float32"):
            small_op(x, phi, alpha.double(), bias)


@pytest.mark.compile
@pytest.mark.parametrize("n,D", [(4, 4096), (4, 7168), (2, 520)])
def test_compiles_for_sm90a(n, D):
    op = MHCForwardPreTileLang(2, 8, n, D)
    assert (op._fused is not None) == fused_fits(n, D) == (D == 4096)  # both kernel families are built
    src = (op._mix if op._fused is None else op._fused).get_kernel_source()
    if _runtime.target()["arch"].startswith("sm_90"):
        assert "wgmma" in src, "expected Hopper tensor-core MMA"
        assert op._fused is None or "tma_store_cluster" in src, "expected the cluster exchange"
        # cluster launches allow programmatic dependent launch: the phi split must be waited for
        assert op._fused is None or "cudaGridDependencySynchronize" in src
        if op._fused is not None:  # the side kernel starts behind the single pass's trigger
            assert "cudaTriggerProgrammaticLaunchCompletion" in src
            assert "cudaGridDependencySynchronize" in op._side.get_kernel_source()


def test_mix_config_space_fits_shared_memory():
    """Every offered two-kernel config fits (n=8 has 80 phi rows per stage: 4 stages of 128 x 128 do not)."""
    from ops.mhc_pre import _SMEM_BUDGET, mix_smem_bytes
    space = MHCForwardPreTileLang.config_space(8, 1024)
    assert space and all(mix_smem_bytes(8, **c) <= _SMEM_BUDGET for c in space)
    assert dict(block_t=128, block_k=128, num_stages=4, threads=256) not in space
    assert mix_smem_bytes(8, 128, 128, 3) == 221184  # TileLang's allocation for that kernel


def test_side_tokens_whole_rounds_that_end_with_the_single_pass():
    """One tile per idle SM per round, only as many rounds as the single pass outlasts."""
    from ops.mhc_pre import side_tokens
    assert side_tokens(16384, 0) == 0  # no idle SM
    assert side_tokens(8192, 20) == 0  # a round would outlast the single pass
    assert side_tokens(16384, 20) == 20 * 128
    for tokens in (1, 3, 1000, 16384, 50000, 1 << 20):
        side = side_tokens(tokens, 20)
        assert side % (20 * 128) == 0 and 0 <= side < tokens


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
    env = dict(os.environ, LLM_TILE_OPS_CACHE_DIR=str(tmp_path))
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
def test_compiled_matches_golden(n, D, shape, poisoned):
    """Both kernel families: (1, 16384), (2, 8192), (4, 2048) and (4, 4096) run the single-pass kernel
    (4 x 4096 tokens is many tiles per persistent cluster), the others the two kernels. From 4 x 4096
    tokens the side kernel takes the last ones; with 3 x 5001 the single pass ends mid-tile there."""
    op = MHCForwardPreTileLang(*shape, n, D)
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
def test_tokens_dynamic_and_deterministic():
    op = MHCForwardPreTileLang(1, 1, 4, 4096)
    for shape in ((1, 7), (3, 1000)):
        x, phi, alpha, bias = random_inputs(*shape, 4, 4096, device="cuda")
        a = op(x, phi, alpha, bias)
        b = op(x, phi, alpha, bias)
        assert all(torch.equal(u, v) for u, v in zip(a, b)), "forward must be bitwise reproducible"
        assert a[0].shape == (*shape, 4096)
