"""Autotune an operator's kernel for given shapes with TileLang's AutoTuner and store the winner.

    python scripts/autotune.py --op mhc_pre [--shape n=4,D=4096]

``--op`` takes any registered op name (``op_name`` of the op classes); ``--shape`` overrides keyword
arguments of that op's tuning case (``AUTOTUNE`` in ``scripts/workloads``). The winner goes to
compile_cache/tuned_configs.json (keyed by op, specialization, arch and TileLang version); constructing
the op for that specialization later picks it up unless ``config=`` is given. Needs a GPU (configs are
timed).
"""

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from ops.common import runtime  # noqa: E402
from ops.common.protocol import op_class  # noqa: E402
import torch  # noqa: E402

from scripts import workloads  # noqa: E402


def autotune(op, call_inputs, warmup=10, rep=50):
    """Time every config of the op's config space on ``call_inputs`` (the AutoTuner shows progress) and
    store the fastest for ``op``'s specialization. Returns (config, latency_ms)."""
    from tilelang.autotuner import AutoTuner, set_autotune_inputs

    # The tuner calls a plain module-level builder with each config as keyword arguments (it inspects
    # the function's closure, so no functools.partial): the specialization rides along in every config.
    configs = [dict(op.spec, **c) for c in op.config_space(op.spec)]
    tuner = AutoTuner.from_kernel(op.tunable_kernel(op.spec), configs)
    tuner.set_compile_args(target=runtime.target(), pass_configs=op.tunable_pass_configs(op.spec))
    with set_autotune_inputs(list(op.tune_args(*call_inputs))):
        tuner.set_profile_args(skip_check=True)  # freezes the captured inputs; outputs are checked by tests
        result = tuner.run(warmup=warmup, rep=rep)
    config = {k: v for k, v in result.config.items() if k not in op.spec}
    runtime.save_tuned(op.op_name, op.spec, config, result.latency)
    return config, result.latency


def parse_shape(text: str) -> dict:
    """'n=4,D=4096' -> {'n': 4, 'D': 4096}."""
    shape = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not value.lstrip("-").isdigit():
            raise ValueError(f"--shape: expected comma-separated key=int items, got {item!r}")
        shape[key.strip()] = int(value)
    return shape


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", required=True, help="op name (op_name of an op class)")
    parser.add_argument("--shape", default="", help="comma-separated key=int overrides of the op's tuning case")
    args = parser.parse_args()
    try:
        cls = op_class(args.op)
        shape = parse_shape(args.shape)
    except ValueError as err:
        parser.error(str(err))
    case = workloads.autotune_cases().get(cls.op_name)
    if case is None:
        sys.exit(f"{cls.op_name}: nothing to tune (its kernels have no config space)")
    if not torch.cuda.is_available():
        sys.exit("autotuning times kernels and needs an NVIDIA GPU.")
    for op, inputs in case(**shape):
        config, ms = autotune(op, inputs)
        print(f"{op.op_name} {op.spec}: best {config} at {ms:.4f} ms -> {runtime.TUNED_FILE}")


if __name__ == "__main__":
    main()
