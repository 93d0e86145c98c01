#!/usr/bin/env bash
# Set up gyrfalcon and run its main job on this machine: complete a prompt with `gyrfalcon generate`.
# Uses MODEL if set, else the bundled demo model, else a tiny random checkpoint created here.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
MODEL=${MODEL:-}
if [ -z "$MODEL" ] && ! "$PY" -c "import sys; from gyrfalcon.config import default_model_path as d; sys.exit(d() is None)"; then
  MODEL=.cache/tiny-qwen3
  if [ ! -f "$MODEL/config.json" ]; then
    echo "No model given and none bundled: creating a tiny random Qwen3 checkpoint in $MODEL"
    "$PY" -c "import sys; sys.path.insert(0, 'tests'); from checkpoints import make_checkpoint; make_checkpoint('$MODEL')"
  fi
fi
exec gyrfalcon generate ${MODEL:+--model "$MODEL"} --prompt "${PROMPT:-def fib(n):}" --max-tokens "${MAX_TOKENS:-64}"
