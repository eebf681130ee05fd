"""Time each operator while another stream holds some of the GPU's SMs (as NCCL or DeepEP kernels do during
overlapped communication): does it keep running at its share of the GPU, or wait for the other kernel?

    python scripts/shared_gpu.py --hog PATH/sm_hog.py [--op NAME ...] [--sms 16 40] [--hold-ms 600]

``--hog``: a module with ``time_shared(fn, n_sms, hold_ms) -> (ms alone, ms while n_sms SMs are held)`` (one call
each, device events; the GPU machine's ``sm_hog.py``). Workload modules opt in with
``SHARED_GPU = {label: make}``, ``make()`` returning a zero-argument callable that runs the op once on the GPU.
Each line prints both times, the bound 1.3 x alone x SMs / (SMs - k) the operator issues set, and STALLED where
the call took over half the hold (it waited for the other kernel to end)."""

import argparse
import importlib.util
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from scripts import workloads  # noqa: E402


def load_hog(path: str):
    spec = importlib.util.spec_from_file_location("sm_hog", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hog", required=True, help="path of a module with time_shared(fn, n_sms, hold_ms)")
    parser.add_argument("--op", action="append", help=f"workload module(s), from {workloads.names()} (default: all)")
    parser.add_argument("--sms", type=int, nargs="+", default=[16, 40], help="SMs held by the other stream")
    parser.add_argument("--hold-ms", type=float, default=600.0, help="how long the other kernel holds them")
    args = parser.parse_args()
    unknown = sorted(set(args.op or ()) - set(workloads.names()))
    if unknown:
        parser.error(f"--op: expected names from {workloads.names()}, got {unknown}")
    if not torch.cuda.is_available():
        sys.exit("scripts/shared_gpu.py times kernels and needs an NVIDIA GPU.")
    hog = load_hog(args.hog)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device: {torch.cuda.get_device_name()} ({sms} SMs), other kernel holds k SMs for {args.hold_ms:.0f} ms")
    failed = 0
    for mod in workloads.modules():
        if args.op and mod.__name__.rsplit(".", 1)[-1] not in args.op:
            continue
        for label, make in getattr(mod, "SHARED_GPU", {}).items():
            fn = make()
            for k in args.sms:
                alone, shared = hog.time_shared(fn, n_sms=k, hold_ms=args.hold_ms)
                bound = 1.3 * alone * sms / (sms - k)
                verdict = "STALLED" if shared > args.hold_ms / 2 else ("ok" if shared <= bound else "SLOW")
                failed += verdict != "ok"
                print(f"{label:<58} k={k:<3} alone {alone:8.3f} ms  shared {shared:8.3f} ms  "
                      f"({shared / alone:4.2f}x, bound {bound:7.3f} ms)  {verdict}", flush=True)
            del fn
            torch.cuda.empty_cache()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
