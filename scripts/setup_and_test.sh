#!/usr/bin/env bash
# Set up and run the tests (README command b). CPU-only machines get torch's CPU build; on a GPU
# machine with a CUDA torch already installed, the pinned CPU build is not forced over it.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
# No CUDA toolkit where TileLang looks first (CUDA_HOME, nvcc on PATH, /usr/local/cuda): pip's CUDA compiler.
extras=test
if [ -z "${CUDA_HOME:-${CUDA_PATH:-}}" ] && ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
    echo "no CUDA toolkit found: installing pip's CUDA compiler (extra 'nvcc')" >&2
    extras=test,nvcc
fi
python -m pip install -q -e ".[$extras]"
# pytest exits 5 when no test ran, which fails this script as it should.
python -m pytest -q -rs "$@"
