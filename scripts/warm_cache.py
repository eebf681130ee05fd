"""Build every operator's default kernels into the disk cache (no GPU needed), e.g. in a container image
build, so that the first construction at run time loads instead of compiling.

    python scripts/warm_cache.py
"""

import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from ops import _runtime  # noqa: E402

from scripts import workloads  # noqa: E402

if __name__ == "__main__":
    for mod in workloads.modules():
        start = time.perf_counter()
        names = [c["name"] for c in mod.demo_cases("cpu")]
        print(f"{', '.join(names)}: ready in {time.perf_counter() - start:.1f} s")
    print(f"kernel cache: {_runtime.CACHE_DIR}")
