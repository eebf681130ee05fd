import json
import os
import subprocess
import sys

import pytest

from ops import _runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _probe(code, **env):
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, **env),
                         capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_target_default_and_override():
    if not _runtime.torch.cuda.is_available():
        assert _runtime.target() == {"kind": "cuda", "arch": "sm_90a"}
    override = '{"kind": "cuda", "arch": "sm_80"}'
    assert _probe("from ops import _runtime; print(_runtime.target())", LLM_TILE_OPS_TARGET=override) == \
        "{'kind': 'cuda', 'arch': 'sm_80'}"


def test_cache_dir_is_checkout_cache_and_overridable(tmp_path):
    assert _runtime.CACHE_DIR == _runtime._REPO_ROOT / "compile_cache" or "LLM_TILE_OPS_CACHE_DIR" in os.environ
    code = "from ops import _runtime; import os; print(os.environ['TILELANG_CACHE_DIR'])"
    assert _probe(code, LLM_TILE_OPS_CACHE_DIR=str(tmp_path)) == str(tmp_path / "tilelang")


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
    (lambda: _runtime.check_int("n", 3.0), TypeError, "n: expected an int, got float 3.0"),
    (lambda: _runtime.check_int("n", 3, power_of_two=True), ValueError, "n: expected a power of two, got 3"),
    (lambda: _runtime.check_choice("mode", "x", ["a", "b"]), ValueError, r"mode: expected one of \['a', 'b'\], got 'x'"),
    (lambda: _runtime.check_tensor("q", [1]), TypeError, "q: expected a torch.Tensor, got list"),
])
def test_validation_messages(call, err, match):
    with pytest.raises(err, match=match):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("D,space", [
    (520, [dict(block_t=64, block_k=64, num_stages=2, threads=128),  # two kernels
           dict(block_t=128, block_k=128, num_stages=2, threads=128)]),
    (8192, [dict(x_slots=16, phi_stages=4), dict(x_slots=17, phi_stages=8)]),  # single pass (clusters)
])
def test_autotune_stores_winner_for_the_op(tmp_path, monkeypatch, D, space):
    """scripts/autotune.py times an op's configs with tilelang's AutoTuner and stores the winner, which a
    new op of the same specialization then uses."""
    from golden.mhc_pre import random_inputs
    from ops import MHCForwardPreTileLang
    from scripts.autotune import autotune

    monkeypatch.setattr(_runtime, "TUNED_FILE", tmp_path / "tuned.json")
    monkeypatch.setattr(MHCForwardPreTileLang, "config_space", staticmethod(lambda **_: space))
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
