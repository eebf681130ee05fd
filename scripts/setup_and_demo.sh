#!/usr/bin/env bash
# Set up and run the main job (README command a): build every operator, check it against its golden.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q -e .
python scripts/demo.py
