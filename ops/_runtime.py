"""Shared runtime of the operator collection: target choice, kernel disk cache, tuned-config store
and argument validation. Imported by ``ops/__init__.py`` before anything imports TileLang, because
TileLang reads its cache directory when it is first imported.

Environment variables:
  LLM_TILE_OPS_CACHE_DIR  where compiled kernels and tuned configs live
                          (default: ``compile_cache/`` of a source checkout, else ~/.cache/llm-tile-ops)
  LLM_TILE_OPS_TARGET     TileLang target, e.g. '{"kind": "cuda", "arch": "sm_90a"}'
                          (default: the current GPU's arch, else sm_90a so kernels build without a GPU)
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import pathlib
from collections.abc import Sequence

_REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
_DEFAULT_TARGET = {"kind": "cuda", "arch": "sm_90a"}


def cache_dir() -> pathlib.Path:
    override = os.environ.get("LLM_TILE_OPS_CACHE_DIR")
    if override:
        return pathlib.Path(override).expanduser()
    checkout_cache = _REPO_ROOT / "compile_cache"
    if (_REPO_ROOT / "pyproject.toml").is_file() and checkout_cache.is_dir():
        return checkout_cache
    return pathlib.Path.home() / ".cache" / "llm-tile-ops"


CACHE_DIR = cache_dir()
CACHE_DIR.mkdir(parents=True, exist_ok=True)
# TileLang's own kernel cache (keyed by kernel source, target and compile options) lives here too;
# it verifies entries and recompiles corrupted or partial ones.
os.environ["TILELANG_CACHE_DIR"] = str(CACHE_DIR / "tilelang")
os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")

import tilelang  # noqa: E402  (must follow the cache-dir setup above)
import torch  # noqa: E402


def target() -> dict:
    """The TileLang target dict kernels are built for."""
    override = os.environ.get("LLM_TILE_OPS_TARGET")
    if override:
        return json.loads(override)
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        # sm_90a unlocks wgmma/TMA paths; other arches have no arch-specific suffix we rely on.
        return {"kind": "cuda", "arch": f"sm_{major}{minor}{'a' if major == 9 else ''}"}
    return dict(_DEFAULT_TARGET)


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device | None = None) -> int:
    """SMs of a GPU (the current one by default); an H100 / H200 SXM's 132 without CUDA, so that
    kernels sized by it still build for sm_90a on a CPU machine."""
    if not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device) \
        .multi_processor_count


class _LaunchAttr(ctypes.Structure):  # CUlaunchAttribute: id, padding, 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttr)), ("num_attrs", ctypes.c_uint)]


_PROBE_PTX = b".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry probe() { ret; }\n"


@functools.lru_cache(maxsize=None)
def max_active_clusters(cluster: int, threads: int, smem_bytes: int, device: int | None = None) -> int:
    """How many clusters of `cluster` CTAs, each of `threads` threads and `smem_bytes` of dynamic shared
    memory, the GPU holds at once (cuOccupancyMaxActiveClusters on an empty kernel of that shape: with
    one CTA per SM this is set by how many SMs each GPC has, which no device property tells). A
    persistent kernel launching more clusters than this runs the extra ones after the others finish.
    Without CUDA: an H100 / H200 SXM's count for clusters of one CTA per SM (7 of 16 CTAs, every SM
    pair for 2)."""
    if not torch.cuda.is_available():
        return 7 if cluster == 16 else sm_count() // cluster
    torch.cuda.init()
    with torch.cuda.device(torch.cuda.current_device() if device is None else device):
        torch.cuda.current_stream().synchronize()  # the primary context is current on this thread
        cuda = ctypes.CDLL("libcuda.so.1")

        def check(name, err):
            if err:
                raise RuntimeError(f"{name} failed with CUresult {err}")

        mod, fn, count = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_int()
        attr = _LaunchAttr(id=4)  # cluster dimension
        attr.value[0], attr.value[1], attr.value[2] = cluster, 1, 1
        config = _LaunchConfig(grid=(ctypes.c_uint * 3)(cluster, 1, 1), block=(ctypes.c_uint * 3)(threads, 1, 1),
                               smem=smem_bytes, attrs=ctypes.pointer(attr), num_attrs=1)
        check("cuModuleLoadData", cuda.cuModuleLoadData(ctypes.byref(mod), _PROBE_PTX))
        try:
            check("cuModuleGetFunction", cuda.cuModuleGetFunction(ctypes.byref(fn), mod, b"probe"))
            check("cuFuncSetAttribute", cuda.cuFuncSetAttribute(fn, 8, smem_bytes))  # max dynamic smem
            check("cuFuncSetAttribute", cuda.cuFuncSetAttribute(fn, 14, 1))  # non-portable cluster sizes
            check("cuOccupancyMaxActiveClusters",
                  cuda.cuOccupancyMaxActiveClusters(ctypes.byref(count), fn, ctypes.byref(config)))
        finally:
            cuda.cuModuleUnload(mod)
        return count.value


def compile_kernel(prim_func, out_idx=None, pass_configs: dict | None = None):
    """Build (or load from the disk cache) a TileLang kernel for ``target()``."""
    return tilelang.compile(prim_func, out_idx=out_idx, target=target(), pass_configs=pass_configs)


# ----------------------------------------------------------------------------- tuned configs
TUNED_FILE = CACHE_DIR / "tuned_configs.json"


def _tuned_key(op: str, spec: dict) -> str:
    spec_s = ",".join(f"{k}={spec[k]}" for k in sorted(spec))
    return f"{op}|{spec_s}|{target()['arch']}|tilelang-{tilelang.__version__}"


def _read_tuned() -> dict:
    try:
        return json.loads(TUNED_FILE.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def load_tuned(op: str, spec: dict) -> dict | None:
    entry = _read_tuned().get(_tuned_key(op, spec))
    return None if entry is None else dict(entry["config"])


def save_tuned(op: str, spec: dict, config: dict, latency_ms: float | None = None) -> None:
    table = _read_tuned()
    table[_tuned_key(op, spec)] = {"config": config, "latency_ms": latency_ms}
    tmp = TUNED_FILE.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
    tmp.replace(TUNED_FILE)


def resolve_config(op: str, spec: dict, config: dict | None, default: dict) -> dict:
    """Explicit ``config=``, else the stored autotune winner, else the op's default."""
    if config is not None:
        unknown = set(config) - set(default)
        if unknown:
            raise ValueError(f"config: unknown keys {sorted(unknown)}, expected a subset of {sorted(default)}")
        return {**default, **config}
    stored = load_tuned(op, spec)
    return {**default, **stored} if stored and set(stored) <= set(default) else dict(default)


# ----------------------------------------------------------------------------- validation
def check_choice(name: str, value, choices: Sequence) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {list(choices)}, got {value!r}")


def check_int(name: str, value, lo: int | None = None, hi: int | None = None,
              multiple_of: int | None = None, power_of_two: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name}: expected >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name}: expected <= {hi}, got {value}")
    if multiple_of is not None and value % multiple_of:
        raise ValueError(f"{name}: expected a multiple of {multiple_of}, got {value}")
    if power_of_two and (value < 1 or value & (value - 1)):
        raise ValueError(f"{name}: expected a power of two, got {value}")


def check_tensor(name: str, t, dtype: torch.dtype | Sequence[torch.dtype] | None = None,
                 shape: Sequence[int | None] | None = None, device: torch.device | None = None,
                 contiguous: bool = True) -> None:
    """Raise TypeError/ValueError naming ``name`` unless ``t`` is a CUDA tensor of the given
    dtype(s) and shape (``None`` in ``shape`` accepts any size), contiguous, on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        dtypes = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in dtypes:
            want = dtypes[0] if len(dtypes) == 1 else list(dtypes)
            raise TypeError(f"{name}: expected dtype {want}, got {t.dtype}")
    if shape is not None:
        ok = t.dim() == len(shape) and all(s is None or s == a for s, a in zip(shape, t.shape))
        if not ok:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if t.device.type != "cuda":
        raise ValueError(f"{name}: expected a CUDA tensor, got device {t.device}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {list(t.stride())}")

