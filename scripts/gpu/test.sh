#!/usr/bin/env bash
# The GPU tests on the device machine: every tests/gpu/test_*.py (one time-boxed step per file, the model tests one
# step per checkpoint family, since together they outgrow one step), then tests/kernels with compiled kernels on
# CUDA tensors (on a CPU the same files run under TRITON_INTERPRET=1). Logs under $OUT/results (results.tar).
# Usage, from the repo root: GYRFALCON_COMMIT=<hash> OUT=/some/dir bash scripts/gpu/test.sh [FILE-FILTER]
#   FILE-FILTER: run only tests/gpu files whose name contains it (e.g. `model`, `kernels`); `kernels-only`: only
#   tests/kernels. Environment: see scripts/gpu/lib.sh (OUT, BUDGET, GYRFALCON_COMMIT).
cd "$(dirname "$0")/../.."
source scripts/gpu/lib.sh
banner
FILTER=${1:-}
PYTEST="python3 -m pytest -q -p no:cacheprovider --durations=8"

if [ "$FILTER" != kernels-only ]; then
  for f in tests/gpu/test_*.py; do
    name=$(basename "$f" .py)
    [[ -n $FILTER && $name != *$FILTER* ]] && continue
    if [ "$name" = test_model_gpu ]; then  # ~9 s a test, ~17 a family: one step each
      for fam in llama qwen; do step gpu_${name}_$fam 330 $PYTEST "$f" -k $fam; done
    elif [ "$name" = test_moe_model_gpu ]; then  # real-width expert checkpoints (GBs each): one step a family
      for fam in qwen3 minimax; do step gpu_${name}_$fam 330 $PYTEST "$f" -k $fam; done
    else
      step gpu_$name 300 $PYTEST "$f"
    fi
  done
fi
[ -z "$FILTER" ] || [ "$FILTER" = kernels-only ] && step gpu_tests_kernels 300 $PYTEST tests/kernels
finish
