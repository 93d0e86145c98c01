#!/usr/bin/env bash
# Install gyrfalcon and what it needs into the current Python environment.
# On a machine without a GPU this takes the CPU build of torch (a local wheel on our machines).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch>=2.11"
  else
    "$PY" -m pip install -q "torch==2.13.0"
  fi
fi
"$PY" -m pip install -q -e ".[dev]"
