#!/usr/bin/env bash
# The README's performance rows on the device machine (NVIDIA H200), as they were measured: random weights of the
# real shapes (`gyrfalcon bench make-checkpoint`), bf16, greedy, async scheduling.
#   q06_b1 q06_b16            Qwen3-0.6B, bench latency at batch 1 / 16 (128 in / 128 out)
#   l8_b1 l8_b16 l8_b64       Llama-3.1-8B, the same at batch 1 / 16 / 64
#   tput tput_fp8             Llama-3.1-8B, bench throughput 768 prompts x 1024 in / 1024 out on a bf16 KV cache
#                             (384 sequences at once, the default) and on an fp8 cache (768 at once: twice fit)
# The batch-1 rows also run transformers (static cache + torch.compile) in the same call (--baseline hf): set
# HF=0 to skip it. DUMMY=1: the throughput rows on weights filled at load (--load-format dummy, no checkpoint to
# write first: the same shapes and kernels; the latency rows keep a checkpoint, since their startup counts the load).
# Startup (load + graph capture) is in every JSON (startup_s). vLLM 0.26.0's figures for the
# same rows are in docs/performance.md.
# Usage, from the repo root: GYRFALCON_COMMIT=<hash> OUT=/some/dir bash scripts/gpu/rows.sh [ROW...]
# (default: every row, ~12 min: more than one 10-minute device call, so split it, e.g. `q06_b1 q06_b16 l8_b1` then
# `l8_b16 l8_b64 tput tput_fp8`). Each row writes $OUT/results/<row name>_row.json; file the new ones as
# benchmarks/results/<row name>_row-h200-<date>-run<N>.json in place of the old, and add a line to
# benchmarks/results/history.csv. Environment: see scripts/gpu/lib.sh.
cd "$(dirname "$0")/../.."
source scripts/gpu/lib.sh
banner
ROWS=${*:-q06_b1 q06_b16 l8_b1 l8_b16 l8_b64 tput tput_fp8}
HF=${HF:-1}
DUMMY=${DUMMY:-0}

lat() {  # lat q06|l8 BATCH: one bench latency row
  local ck=$1 b=$2 model=qwen3-0.6b secs=120 extra=()
  [ "$ck" = l8 ] && model=llama-3.1-8b
  if [ "$b" = 1 ] && [ "$HF" = 1 ]; then extra=(--baseline hf); secs=420; fi
  ckpt $ck
  step lat_${ck}_b$b $secs $G bench latency --model /tmp/ck/$ck --batch-size $b --max-num-seqs $b \
    --input-len 128 --output-len 128 --async-scheduling "${extra[@]}" \
    --output-json "$R/latency_${model}_b${b}_row.json"
}
if [ "$DUMMY" = 1 ]; then TPM="/tmp/cfg/l8 --load-format dummy"; else TPM=/tmp/ck/l8; fi
TP="$G bench throughput --model $TPM --num-prompts 768 --input-len 1024 --output-len 1024 --async-scheduling"

tput_model() { if [ "$DUMMY" = 1 ]; then cfg l8 llama-3.1-8b 32; else ckpt l8; fi; }

for row in $ROWS; do
  case $row in
    q06_b1) lat q06 1 ;;
    q06_b16) lat q06 16 ;;
    l8_b1) lat l8 1 ;;
    l8_b16) lat l8 16 ;;
    l8_b64) lat l8 64 ;;
    tput) tput_model; step tput_l8_row 200 $TP --output-json "$R/throughput_llama-3.1-8b_768x1024_async_row.json" ;;
    tput_fp8) tput_model; step tput_l8_fp8_row 200 $TP --kv-cache-dtype fp8 --max-num-seqs 768 \
      --output-json "$R/throughput_llama-3.1-8b_768x1024_async_fp8kv_768seqs_row.json" ;;
    *) echo "unknown row: $row (rows: q06_b1 q06_b16 l8_b1 l8_b16 l8_b64 tput tput_fp8)" ;;
  esac
done
finish
