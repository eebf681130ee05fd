"""Per-operator demo cases and bench workloads, discovered by scripts/demo.py and scripts/bench.py.

Each module defines ``demo_cases(device) -> list[dict]`` (keys: name, shape, golden, compiled, compare)
and ``bench(b)`` (rows through the Bench object of scripts/bench.py)."""

import importlib
import pkgutil


def modules():
    return [importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__)]
