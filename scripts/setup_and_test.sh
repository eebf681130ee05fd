#!/usr/bin/env bash
# Set up and run the tests (README command b). CPU-only machines get torch's CPU build; on a GPU
# machine with a CUDA torch already installed, the pinned CPU build is not forced over it.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test]"
# pytest exits 5 when no test ran, which fails this script as it should.
python -m pytest -q -rs "$@"
