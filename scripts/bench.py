"""Benchmark every operator's workloads against its peers and against this GPU's own ceilings.

    python scripts/bench.py [--op mhc_pre ...] [--quick] [--out bench_out]

In the same run it measures the copy bandwidth (a large device-to-device copy, bytes read + written) and
the bf16 matmul rate, then times each workload (median of device-event timings after warm-up) and prints
time, achieved GB/s and TFLOP/s, the fraction of the measured ceiling, and our speedup over each peer.
Each operator issue's targets are printed with met / NOT MET. Writes bench.json and bench.png to --out.
"""

import argparse
import json
import os
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from scripts import workloads  # noqa: E402


class Bench:
    def __init__(self, quick: bool = False):
        import triton.testing

        self._do_bench = triton.testing.do_bench
        self.quick = quick
        self.device = torch.cuda.get_device_name()
        self.rows, self.targets = [], []
        src = torch.randint(0, 255, (2 << 30,), dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        self.copy_gbs = 2 * src.numel() / self.time(lambda: dst.copy_(src)) / 1e6
        del src, dst
        a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        self.matmul_tflops = 2 * 8192**3 / self.time(lambda: a @ b) / 1e9

    def time(self, fn, warmup_ms: int = 50, rep_ms: int = 300) -> float:
        """Median milliseconds over device-event timings, after warm-up."""
        return self._do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")

    def time_many(self, fns: dict, rounds: int = 3) -> dict:
        """{name: median ms} of competing implementations, timed in interleaved rounds whose order rotates:
        a GPU at its power cap clocks each run by what ran just before it, so none is always timed first."""
        names = list(fns)
        times = {n: [] for n in names}
        for r in range(rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                times[n].append(self.time(fns[n]))
        return {n: statistics.median(t) for n, t in times.items()}

    def row(self, op: str, workload: str, impl: str, ms: float, bytes: float | None = None,
            flops: float | None = None, ours: bool = False) -> dict:
        gbs = bytes / ms / 1e6 if bytes else None
        tflops = flops / ms / 1e9 if flops else None
        frac = max(gbs / self.copy_gbs if gbs else 0.0, tflops / self.matmul_tflops if tflops else 0.0)
        row = dict(op=op, workload=workload, impl=impl, ms=ms, gbs=gbs, tflops=tflops,
                   ceiling_frac=frac or None, ours=ours)
        self.rows.append(row)
        return row

    def speedup(self, op: str, workload: str, peer: str) -> float:
        ours = next(r for r in self.rows if (r["op"], r["workload"]) == (op, workload) and r["ours"])
        other = next(r for r in self.rows if (r["op"], r["workload"], r["impl"]) == (op, workload, peer))
        return other["ms"] / ours["ms"]

    def target(self, op: str, workload: str, text: str, met: bool) -> None:
        self.targets.append(dict(op=op, workload=workload, target=text, met=bool(met)))

    def report(self, out_dir: pathlib.Path) -> None:
        print(f"\ndevice: {self.device}   copy {self.copy_gbs:.0f} GB/s   bf16 matmul {self.matmul_tflops:.0f} TFLOP/s")
        head = f"{'op':<14}{'workload':<34}{'impl':<24}{'ms':>10}{'GB/s':>8}{'TFLOP/s':>9}{'ceil%':>7}  speedup"
        print(head + "\n" + "-" * len(head))
        for r in self.rows:
            peers = [p for p in self.rows if (p["op"], p["workload"]) == (r["op"], r["workload"]) and not p["ours"]]
            sp = ", ".join(f"{p['ms'] / r['ms']:.2f}x vs {p['impl']}" for p in peers) if r["ours"] else ""
            fmt = lambda v, f: format(v, f) if v is not None else "-"  # noqa: E731
            print(f"{r['op']:<14}{r['workload']:<34}{r['impl'] + (' *' if r['ours'] else ''):<24}{r['ms']:>10.4f}"
                  f"{fmt(r['gbs'], '8.0f'):>8}{fmt(r['tflops'], '9.1f'):>9}"
                  f"{fmt(r['ceiling_frac'] and 100 * r['ceiling_frac'], '7.1f'):>7}  {sp}")
        if self.targets:
            print("\ntargets:")
            for t in self.targets:
                print(f"  [{'met' if t['met'] else 'NOT MET'}] {t['op']} {t['workload']}: {t['target']}")
        out_dir.mkdir(parents=True, exist_ok=True)
        meta = dict(device=self.device, copy_gbs=self.copy_gbs, matmul_tflops=self.matmul_tflops)
        (out_dir / "bench.json").write_text(json.dumps(dict(**meta, rows=self.rows, targets=self.targets), indent=1))
        self._plot(out_dir / "bench.png")

    def _plot(self, path: pathlib.Path) -> None:
        if not self.rows:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        groups = sorted({(r["op"], r["workload"]) for r in self.rows}, key=lambda g: [r["op"] for r in self.rows].index(g[0]))
        fig, axes = plt.subplots(len(groups), 1, figsize=(9, 1.2 + 0.45 * len(self.rows)), squeeze=False)
        for ax, (op, wl) in zip(axes[:, 0], groups):
            rows = [r for r in self.rows if (r["op"], r["workload"]) == (op, wl)]
            ax.barh([r["impl"] for r in rows], [r["ms"] for r in rows],
                    color=["tab:green" if r["ours"] else "tab:gray" for r in rows])
            ax.set_title(f"{op}: {wl}", fontsize=9)
            ax.set_xlabel("ms (lower is better)", fontsize=8)
            ax.tick_params(labelsize=8)
        fig.suptitle(f"{self.device}: copy {self.copy_gbs:.0f} GB/s, bf16 matmul {self.matmul_tflops:.0f} TFLOP/s", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", action="append", help=f"workload(s) to run, from {workloads.names()} (default: all)")
    parser.add_argument("--quick", action="store_true", help="smallest workloads, skip slow peers")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="folder for bench.json / bench.png")
    args = parser.parse_args()
    unknown = sorted(set(args.op or ()) - set(workloads.names()))
    if unknown:
        parser.error(f"--op: expected names from {workloads.names()}, got {unknown}")
    if not torch.cuda.is_available():
        sys.exit("scripts/bench.py times kernels and needs an NVIDIA GPU.")
    b = Bench(quick=args.quick)
    for mod in workloads.modules():
        if args.op and mod.__name__.rsplit(".", 1)[-1] not in args.op:
            continue
        mod.bench(b)
    b.report(pathlib.Path(args.out))


if __name__ == "__main__":
    main()
