"""Shared runtime of the operator collection: target choice, kernel disk cache, kernel builds (logged
through the ``llm_tile_ops`` logger) and the tuned-config store. Imported before any kernel module
imports TileLang.

Environment variables:
  LLM_TILE_OPS_CACHE_DIR  where compiled kernels and tuned configs live
                          (default: ``compile_cache/`` of a source checkout, else ~/.cache/llm-tile-ops)
  LLM_TILE_OPS_TARGET     TileLang target, e.g. '{"kind": "cuda", "arch": "sm_90a"}'
                          (default: sm_90a on a Hopper GPU or without CUDA, so kernels build on a CPU
                          machine; any other GPU is refused at construction)
  TILELANG_CACHE_DIR      TileLang's own kernel cache; respected when set, else put beside ours
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import json
import logging
import os
import pathlib
import time

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
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
# TileLang's own kernel cache (keyed by kernel source, target and compile options; it verifies entries and
# recompiles corrupted or partial ones) lives beside ours unless the user chose a place for it. TileLang
# reads the variable at every lookup, so this holds whenever TileLang was imported.
os.environ.setdefault("TILELANG_CACHE_DIR", str(CACHE_DIR / "tilelang"))
os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")  # our logger reports builds instead

logger = logging.getLogger("llm_tile_ops")

import tilelang  # noqa: E402  (must follow the cache-dir setup above)
import torch  # noqa: E402


def target() -> dict:
    """The TileLang target dict kernels are built for: ``LLM_TILE_OPS_TARGET``, else sm_90a. On a CUDA
    machine whose GPU is not Hopper this raises: the kernels use wgmma, TMA and clusters (sm_90a)."""
    override = os.environ.get("LLM_TILE_OPS_TARGET")
    if override:
        return json.loads(override)
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) != (9, 0):
            raise RuntimeError(
                f"llm_tile_ops kernels need a Hopper GPU (sm_90: H100, H200, H20, H800); the current GPU is "
                f"{torch.cuda.get_device_name()} (sm_{major}{minor}). To only build kernels here, set "
                f"LLM_TILE_OPS_TARGET='{json.dumps(_DEFAULT_TARGET)}'.")
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


def _missing_toolkit() -> str | None:
    """What a build lacks, or None: nvcc where TileLang runs it, ``<CUDA home>/bin/nvcc``, the CUDA home
    being ``CUDA_HOME`` / ``CUDA_PATH``, else that of the nvcc on PATH, else the pip package
    ``nvidia-cuda-nvcc``, else /usr/local/cuda."""
    from tilelang import env

    if env.CUDA_HOME and os.path.isfile(os.path.join(env.CUDA_HOME, "bin", "nvcc")):
        return None
    return (f"building llm_tile_ops kernels needs nvcc, not found (CUDA home: {env.CUDA_HOME or 'none found'}). "
            "Install pip's CUDA compiler with `pip install 'llm-tile-ops[nvcc]'` (in a checkout: "
            "`pip install -e '.[nvcc]'`), or a CUDA toolkit >= 12.8 (then set CUDA_HOME or put its nvcc on PATH).")


def compile_kernel(prim_func, out_idx=None, pass_configs: dict | None = None):
    """Build (or load from the disk cache) a TileLang kernel for ``target()``, logging its name and time. A
    kernel in the cache loads without a CUDA compiler; a build without one fails naming what to install."""
    tgt = target()
    name = str(prim_func.attrs["global_symbol"]) if prim_func.attrs and "global_symbol" in prim_func.attrs else "?"
    start = time.perf_counter()
    try:
        kernel = tilelang.compile(prim_func, out_idx=out_idx, target=tgt, pass_configs=pass_configs)
    except Exception as err:
        missing = _missing_toolkit()
        if missing:
            raise RuntimeError(missing) from err
        raise
    logger.info("kernel %s for %s ready in %.1f s", name, tgt["arch"], time.perf_counter() - start)
    return kernel


# pass configs of a kernel whose software pipeline runs in its own threads (no producer warps): for kernels that
# need several CTAs per SM, or whose copies are not all TMA
NO_WARP_SPECIALIZATION = {"tl.disable_warp_specialized": True}
# pass configs of a kernel whose warps each walk their own work list (trip counts differ) and stage their own loads
# in their own slices of shared memory: TileLang's block-wide barriers around those accesses could never be met by
# all warps, and its lifetime-based reuse would overlap a fast warp's later buffers with a slow warp's stages. The
# kernel syncs its warps (sync_warp) and its block (sync_threads, outside the walks) itself.
WARP_OWN_SHARED = {"tl.disable_thread_storage_sync": True, "tl.disable_shared_memory_reuse": True}
# pass configs of a kernel that places its own block barriers (a cp.async ring synced once per tile): TileLang's
# barriers around each shared access would add more per tile
OWN_BARRIERS = {"tl.disable_thread_storage_sync": True}


def compile_kernels(*prim_funcs, pass_configs: dict | None = None) -> list:
    """``compile_kernel`` of each function, built concurrently (TileLang's lowering releases the GIL and nvcc runs
    as a subprocess), in order: an op with many kernels builds in about the time of its slowest one. An item may be
    a (function, its own pass configs) pair."""
    workers = max(1, min(len(prim_funcs), len(os.sched_getaffinity(0))))

    def build(item):
        func, configs = item if isinstance(item, tuple) else (item, pass_configs)
        return compile_kernel(func, pass_configs=configs)

    with concurrent.futures.ThreadPoolExecutor(workers, "llm-tile-ops-build") as pool:
        return list(pool.map(build, prim_funcs))


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
