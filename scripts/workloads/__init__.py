"""Per-operator demo cases and bench workloads, discovered by scripts/demo.py and scripts/bench.py.

Each module defines ``demo_cases(device) -> list[dict]`` (keys: name, shape, golden, compiled, compare)
and ``bench(b)`` (rows through the Bench object of scripts/bench.py); a module whose ops have tunables
also defines ``AUTOTUNE = {op_name: case}``, where ``case(**shape)`` returns ``[(op, call_inputs)]`` on
the GPU for scripts/autotune.py."""

import importlib
import importlib.util
import pathlib
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


def tilekernels_mhc():
    """DeepSeek TileKernels' mHC functions (``tile_kernels.modeling.mhc.functional``) from a copy of its repository
    in ``.peers/TileKernels`` (not ours to ship), or None. Only the mHC modules are imported: the package's own
    ``__init__`` pulls in kernels written for other TileLang versions."""
    import sys
    import types

    root = pathlib.Path(__file__).resolve().parents[2] / ".peers" / "TileKernels" / "tile_kernels"
    if not (root / "modeling" / "mhc" / "functional.py").is_file():
        return None
    for name, path in (("tile_kernels", root), ("tile_kernels.modeling", root / "modeling")):
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(path)]
            sys.modules[name] = pkg
    return importlib.import_module("tile_kernels.modeling.mhc.functional")


def names():
    """The workload modules' names: what ``scripts/bench.py --op`` takes."""
    return [m.name for m in pkgutil.iter_modules(__path__)]


def autotune_cases():
    """{op_name: case} over every workload module (see the module docstring)."""
    cases = {}
    for mod in modules():
        cases.update(getattr(mod, "AUTOTUNE", {}))
    return cases
