"""Autotune an operator's kernel for given shapes with tilelang's AutoTuner and store the winner.

    python scripts/autotune.py --op mhc_pre [--shape n=4,D=4096] [--tokens 16384]

The winner goes to compile_cache/tuned_configs.json (keyed by op, specialization, arch and TileLang
version); constructing the op for that specialization later picks it up unless ``config=`` is given.
Needs a GPU (configs are timed).
"""

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from ops import _runtime  # noqa: E402
import torch  # noqa: E402

from scripts import workloads  # noqa: E402


def autotune(op, call_inputs, warmup=10, rep=50):
    """Time every config of ``op.config_space`` on ``call_inputs`` (progress bar by the AutoTuner)
    and store the fastest for ``op``'s specialization. Returns (config, latency_ms)."""
    from tilelang.autotuner import AutoTuner, set_autotune_inputs

    # The tuner calls a plain module-level builder with each config as keyword arguments (it inspects
    # the function's closure, so no functools.partial): the specialization rides along in every config.
    configs = [dict(op.spec, **c) for c in op.config_space(**op.spec)]
    tuner = AutoTuner.from_kernel(op.tunable_kernel, configs)
    tuner.set_compile_args(target=_runtime.target())
    with set_autotune_inputs(list(op.tune_args(*call_inputs))):
        tuner.set_profile_args(skip_check=True)  # freezes the captured inputs; outputs are checked by tests
        result = tuner.run(warmup=warmup, rep=rep)
    config = {k: v for k, v in result.config.items() if k not in op.spec}
    _runtime.save_tuned(op.op_name, op.spec, config, result.latency)
    return config, result.latency


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", required=True, help="operator module under scripts/workloads")
    parser.add_argument("--shape", default="", help="comma-separated key=value overrides of the op's tuning case")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("autotuning times kernels and needs an NVIDIA GPU.")
    mod = next(m for m in workloads.modules() if m.__name__.endswith("." + args.op))
    overrides = dict(kv.split("=") for kv in args.shape.split(",") if kv)
    for op, inputs in mod.autotune_cases(**{k: int(v) for k, v in overrides.items()}):
        config, ms = autotune(op, inputs)
        print(f"{op.op_name} {op.spec}: best {config} at {ms:.4f} ms -> {_runtime.TUNED_FILE}")


if __name__ == "__main__":
    main()
