#!/usr/bin/env bash
# Set up and run the main job (README command a): build every operator, check it against its golden.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
# No CUDA toolkit where TileLang looks first (CUDA_HOME, nvcc on PATH, /usr/local/cuda): pip's CUDA compiler.
target=.
if [ -z "${CUDA_HOME:-${CUDA_PATH:-}}" ] && ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
    echo "no CUDA toolkit found: installing pip's CUDA compiler (extra 'nvcc')" >&2
    target=".[nvcc]"
fi
python -m pip install -q -e "$target"
python scripts/demo.py
