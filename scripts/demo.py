"""The main job: build every operator at its default shapes (from the disk cache where possible) and
check it against its golden reference.

    python scripts/demo.py

On a GPU it prints, per operator: shape, max error, relative error, compiled time, golden time, speedup.
Without a GPU it builds every kernel for sm_90a into the cache, runs the goldens on the CPU, and says
that executing the kernels needs an NVIDIA GPU.
"""

import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from ops.common import runtime  # noqa: E402  (sets up the kernel cache before TileLang is imported)
import torch  # noqa: E402

from scripts import workloads  # noqa: E402


def _time_ms(fn, device):
    fn()  # warm-up (and first-call compilation for torch)
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"target {runtime.target()}, kernel cache {runtime.CACHE_DIR}")
    rows = []
    for mod in workloads.modules():
        start = time.perf_counter()
        cases = mod.demo_cases(device)
        print(f"built {', '.join(c['name'] for c in cases)} in {time.perf_counter() - start:.1f} s")
        for case in cases:
            golden_ms = _time_ms(case["golden"], device)
            if case["compiled"] is None:
                rows.append((case["name"], case["shape"], "-", "-", "-", f"{golden_ms:.2f}", "-"))
                continue
            max_err, rel_err = case["compare"](case["golden"](), case["compiled"]())
            ms = _time_ms(case["compiled"], device)
            rows.append((case["name"], case["shape"], f"{max_err:.2e}", f"{rel_err:.2e}", f"{ms:.4f}",
                         f"{golden_ms:.4f}", f"{golden_ms / ms:.1f}x"))
    head = ("operator", "shape", "max err", "rel err", "compiled ms", "golden ms", "speedup")
    widths = [max(len(str(r[i])) for r in rows + [head]) + 2 for i in range(len(head))]
    for r in [head] + rows:
        print("".join(str(v).ljust(w) for v, w in zip(r, widths)))
    if device == "cpu":
        print("\nNo CUDA GPU here: every kernel was built for sm_90a into the cache and the goldens ran on the "
              "CPU. Executing the compiled kernels needs an NVIDIA GPU (Hopper).")


if __name__ == "__main__":
    main()
