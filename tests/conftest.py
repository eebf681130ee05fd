import contextlib

import pytest
import torch

import ops  # noqa: F401  (sets the kernel cache dir before any test imports TileLang)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA not available)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@contextlib.contextmanager
def _poisoned_allocations():
    """Every CUDA tensor made by torch.empty / torch.empty_like inside the block starts as NaN
    (integers as -7), so any element a kernel fails to write is caught."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        if t.is_cuda:
            t.fill_(float("nan") if t.is_floating_point() else -7)
        return t

    torch.empty = lambda *a, **k: poison(real_empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(real_empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like


@pytest.fixture
def poisoned():
    """Context manager: ``with poisoned(): out = op(...)`` poisons the op's output allocations."""
    return _poisoned_allocations


@pytest.fixture
def allow_cpu_tensors(monkeypatch):
    """``allow_cpu_tensors(module)``: the module's ``check_tensor`` takes CPU tensors (only its CUDA-device error is
    waived), so an op's shape, dtype and value checks run on a machine without a GPU."""
    def allow(module):
        real = module.check_tensor

        def check(name, t, *args, **kwargs):
            try:
                real(name, t, *args, **kwargs)
            except ValueError as e:
                if "expected a CUDA tensor" not in str(e):
                    raise

        monkeypatch.setattr(module, "check_tensor", check)
    return allow
