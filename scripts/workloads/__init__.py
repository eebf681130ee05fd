"""Per-operator demo cases and bench workloads, discovered by scripts/demo.py and scripts/bench.py.

Each module defines ``demo_cases(device) -> list[dict]`` (keys: name, shape, golden, compiled, compare)
and ``bench(b)`` (rows through the Bench object of scripts/bench.py)."""

import importlib
import importlib.util
import pkgutil


def modules():
    return [importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__)]


def peer_module(path):
    """Import a peer implementation kept outside the repository's tracked files (``.peers/``,
    ``.htree_ref/``: code that is not ours to ship), or None if no copy is there."""
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
