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


def sdpa_decode_peers(b, op: str, workload: str, batch_size: int, num_heads: int, num_kv_heads: int,
                      head_dim: int, seq_len: int, nbytes: float):
    """SDPA's decode (one bf16 query token per sequence over a context of ``seq_len`` stored contiguously,
    [B, Hkv, S, D], GQA) per backend, each a row of ``op`` / ``workload`` moving ``nbytes``; the fastest's ms, or
    None. A backend that cannot run the case is reported, not fatal."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(batch_size, num_heads, 1, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch_size, num_kv_heads, seq_len, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    best = None
    for name, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION),
                          ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def run(backend=backend):
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        try:
            run()
            ms = b.time(run)
        except RuntimeError as e:
            print(f"{workload}: {name} unavailable ({str(e).splitlines()[0][:80]})")
            continue
        b.row(op, workload, name, ms, bytes=nbytes)
        best = ms if best is None else min(best, ms)
    del q, k, v
    torch.cuda.empty_cache()
    return best


def graph_replay(step, keep=()):
    """``step`` run once (builds and warms what it needs), then captured in a CUDA graph, as serving engines replay
    a step; returns a call that replays the graph and holds ``keep`` (tensors the graph reads and writes beyond
    what the caller keeps) alive as long as itself."""
    import torch

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    def replay(inputs=keep):
        graph.replay()
    return replay


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
