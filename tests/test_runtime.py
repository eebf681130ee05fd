import json
import logging
import os
import re
import subprocess
import sys

import pytest

from ops.common import runtime as _runtime
from ops.common import validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, **env):
    """A fresh Python process in the checkout, without the TileLang cache dir this process chose."""
    base = {k: v for k, v in os.environ.items() if k != "TILELANG_CACHE_DIR"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=dict(base, **env), capture_output=True, text=True)


def _probe(code, **env):
    out = _run(["-c", code], **env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_target_default_and_override():
    if not _runtime.torch.cuda.is_available():
        assert _runtime.target() == {"kind": "cuda", "arch": "sm_90a"}
    override = '{"kind": "cuda", "arch": "sm_80"}'
    assert _probe("from ops.common import runtime as _runtime; print(_runtime.target())", LLM_TILE_OPS_TARGET=override) == \
        "{'kind': 'cuda', 'arch': 'sm_80'}"


def test_cache_dir_is_checkout_cache_and_overridable(tmp_path):
    assert _runtime.CACHE_DIR == _runtime._REPO_ROOT / "compile_cache" or "LLM_TILE_OPS_CACHE_DIR" in os.environ
    code = "import ops, os; print(os.environ['TILELANG_CACHE_DIR'])"
    assert _probe(code, LLM_TILE_OPS_CACHE_DIR=str(tmp_path)) == str(tmp_path / "tilelang")
    # a user's own choice of TileLang's cache is kept
    assert _probe(code, LLM_TILE_OPS_CACHE_DIR=str(tmp_path), TILELANG_CACHE_DIR=str(tmp_path / "mine")) == \
        str(tmp_path / "mine")


def test_target_refuses_a_gpu_that_is_not_hopper(monkeypatch):
    monkeypatch.delenv("LLM_TILE_OPS_TARGET", raising=False)
    monkeypatch.setattr(_runtime.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_runtime.torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(_runtime.torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(RuntimeError, match=r"need a Hopper GPU .* A100-SXM4-80GB \(sm_80\)"):
        _runtime.target()
    monkeypatch.setattr(_runtime.torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert _runtime.target() == {"kind": "cuda", "arch": "sm_90a"}


def test_tuned_config_store(tmp_path, monkeypatch):
    monkeypatch.setattr(_runtime, "TUNED_FILE", tmp_path / "tuned.json")
    spec, default = {"n": 4, "D": 4096}, {"block_t": 64, "block_d": 64}
    assert _runtime.resolve_config("op", spec, None, default) == default
    _runtime.save_tuned("op", spec, {"block_t": 128, "block_d": 64}, 0.5)
    assert _runtime.resolve_config("op", spec, None, default) == {"block_t": 128, "block_d": 64}
    assert _runtime.resolve_config("op", {"n": 2, "D": 4096}, None, default) == default  # other specialization
    assert _runtime.resolve_config("op", spec, {"block_d": 128}, default) == {"block_t": 64, "block_d": 128}
    key = next(iter(json.loads((tmp_path / "tuned.json").read_text())))
    assert key.startswith("op|D=4096,n=4|sm_") and "tilelang-0.1.15" in key
    with pytest.raises(ValueError, match=r"config: unknown keys \['bogus'\]"):
        _runtime.resolve_config("op", spec, {"bogus": 1}, default)
    (tmp_path / "tuned.json").write_text("{not json")  # a damaged store is ignored, not fatal
    assert _runtime.resolve_config("op", spec, None, default) == default


@pytest.mark.parametrize("call,err,match", [
    (lambda: validate.check_int("n", 3.0), TypeError, "n: expected an int, got float 3.0"),
    (lambda: validate.check_int("n", 3, power_of_two=True), ValueError, "n: expected a power of two, got 3"),
    (lambda: validate.check_choice("mode", "x", ["a", "b"]), ValueError, r"mode: expected one of \['a', 'b'\], got 'x'"),
    (lambda: validate.check_tensor("q", [1]), TypeError, "q: expected a torch.Tensor, got list"),
])
def test_validation_messages(call, err, match):
    with pytest.raises(err, match=match):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("D", [520, 8192])
def test_autotune_stores_winner_for_the_op(tmp_path, monkeypatch, D):
    """scripts/autotune.py times an op's configs with tilelang's AutoTuner and stores the winner, which a
    new op of the same specialization then uses."""
    from golden.mhc_pre import random_inputs
    from ops import MHCForwardPreTileLang
    from scripts.autotune import autotune

    full = MHCForwardPreTileLang.config_space(dict(n=2, D=D))
    space = [full[0], full[-1]]  # two of the op's own configs (the last one splits its columns)
    monkeypatch.setattr(_runtime, "TUNED_FILE", tmp_path / "tuned.json")
    monkeypatch.setattr(MHCForwardPreTileLang, "config_space", classmethod(lambda cls, spec: space))
    op = MHCForwardPreTileLang(1, 300, 2, D)
    config, ms = autotune(op, random_inputs(1, 300, 2, D, "cuda"), warmup=2, rep=5)
    assert config in space and ms > 0
    assert MHCForwardPreTileLang(1, 300, 2, D).config == config


@pytest.mark.gpu
def test_max_active_clusters_counts_co_resident_clusters():
    """One CTA per SM: at most one 16-CTA cluster per 16 SMs (fewer where a GPC has fewer SMs); small
    CTAs pack several to an SM."""
    assert 1 <= _runtime.max_active_clusters(16, 256, 200 * 1024) <= _runtime.sm_count() // 16
    assert _runtime.max_active_clusters(2, 128, 1024) >= _runtime.sm_count() // 2


@pytest.mark.parametrize("call,err,match", [
    (lambda: validate.check_scale(True, 64), TypeError, "scale: expected a float, got bool True"),
    (lambda: validate.check_scale("0.1", 64), TypeError, "scale: expected a float, got str '0.1'"),
    (lambda: validate.check_scale(float("inf"), 64), ValueError, "scale: expected a finite value, got inf"),
    (lambda: validate.check_scale(-0.5, 64), ValueError, "scale: expected a positive value, got -0.5"),
    (lambda: validate.check_scale(0, 64), ValueError, "scale: expected a positive value, got 0"),
    (lambda: validate.check_float("eps", -1e-6, lo=0), ValueError, r"eps: expected >= 0, got -1e-06"),
    (lambda: validate.dtype_name(validate.torch.int8, [validate.torch.bfloat16]), TypeError,
     r"dtype: expected one of \[torch.bfloat16\], got torch.int8"),
])
def test_shared_checks(call, err, match):
    with pytest.raises(err, match=match):
        call()


def test_scale_default_and_renamed_keywords():
    assert validate.check_scale(None, 64) == 0.125 and validate.check_scale(2, 64) == 2.0
    with pytest.warns(FutureWarning, match="'head_size' is deprecated, use 'head_dim'"):
        assert validate.renamed({"head_size": 64}, {"head_size": "head_dim"}, "Op") == {"head_dim": 64}
    with pytest.raises(TypeError, match="got both 'head_size' and its new name 'head_dim'"):
        validate.renamed({"head_size": 64, "head_dim": 64}, {"head_size": "head_dim"}, "Op")


def test_every_op_follows_the_protocol():
    from ops.common.protocol import Op, op_class, registry

    ops = registry()
    assert set(ops) == {"mhc_pre", "mhc_pre_bwd", "mhc_post", "mhc_post_bwd", "mhc_post_pre", "paged_prefill",
                        "paged_decode", "hsa_decode", "hsa_extend", "hsa_page_repr", "htree", "htree_bwd"}
    for name, cls in ops.items():
        assert issubclass(cls, Op) and cls.op_name == name and op_class(name) is cls
        assert cls.warm_specs and all(isinstance(s, dict) for s in cls.warm_specs), name
    with pytest.raises(ValueError, match=r"op: expected one of \['hsa_decode', .*\], got 'typo'"):
        op_class("typo")


@pytest.mark.parametrize("script,expect", [
    ("scripts/autotune.py", r"op: expected one of \['hsa_decode'"),
    ("scripts/warm_cache.py", r"op: expected one of \['hsa_decode'"),
    ("scripts/bench.py", r"--op: expected names from \['hsa_decode'"),
])
def test_scripts_reject_an_unknown_op(script, expect):
    out = _run([script, "--op", "typo"])
    assert out.returncode == 2 and re.search(expect, out.stderr), out.stderr


@pytest.mark.compile
def test_kernel_builds_are_logged(caplog):
    import tilelang.language as T

    @T.prim_func
    def tiny_copy(A: T.Tensor((128,), "float32"), B: T.Tensor((128,), "float32")):
        with T.Kernel(1, threads=128) as _:
            for i in T.Parallel(128):
                B[i] = A[i]

    with caplog.at_level(logging.INFO, logger="llm_tile_ops"):
        _runtime.compile_kernel(tiny_copy)
    assert re.search(r"kernel tiny_copy for sm_90a ready in \d+\.\d s", caplog.text)


@pytest.mark.compile
def test_concurrent_builds_keep_their_order():
    """compile_kernels builds concurrently and returns the kernels in the order of the functions given."""
    import tilelang.language as T

    def scaled_copy(factor):
        @T.prim_func
        def scaled(A: T.Tensor((64,), "float32"), B: T.Tensor((64,), "float32")):
            with T.Kernel(1, threads=64) as _:
                for i in T.Parallel(64):
                    B[i] = A[i] * factor

        return scaled

    kernels = _runtime.compile_kernels(*(scaled_copy(f) for f in (2.0, 3.0, 5.0)))
    sources = [k.get_kernel_source() for k in kernels]
    assert len(sources) == 3 and all(f in src for f, src in zip(("2.0", "3.0", "5.0"), sources))


def test_ops_does_not_import_the_references():
    """The runtime never depends on golden/ (the readable references): importing every op loads none of it."""
    code = "import sys, ops; print(sorted(m for m in sys.modules if m == 'golden' or m.startswith('golden.')))"
    assert _probe(code) == "[]"
