"""Build every operator's default kernels into the disk cache (no GPU needed), e.g. in a container image
build, so that the first construction at run time loads instead of compiling.

    python scripts/warm_cache.py [--op NAME ...]

Each op class lists the specializations worth building (``warm_specs``, see ops/common/protocol.py).
"""

import argparse
import logging
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from ops.common import runtime  # noqa: E402
from ops.common.protocol import op_class, registry  # noqa: E402
from tqdm import tqdm  # noqa: E402
from tqdm.contrib.logging import logging_redirect_tqdm  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", action="append", help="op name(s) (default: every op)")
    args = parser.parse_args()
    try:
        classes = [op_class(name) for name in args.op] if args.op else list(registry().values())
    except ValueError as err:
        parser.error(str(err))
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    jobs = [(cls, spec) for cls in classes for spec in cls.warm_specs]
    start = time.perf_counter()
    with logging_redirect_tqdm():
        for cls, spec in tqdm(jobs, desc="warming the kernel cache", unit="op"):
            cls(**spec)
    print(f"{len(jobs)} specializations of {len(classes)} ops ready in {time.perf_counter() - start:.1f} s; "
          f"kernel cache: {runtime.CACHE_DIR}")


if __name__ == "__main__":
    main()
