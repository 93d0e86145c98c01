#!/usr/bin/env bash
# Where the time goes, on the device machine: the kernels one at a time, then whole decode steps.
#   kernels    benchmarks/kernels.py: each Triton kernel against its plain-torch reference (and torch SDPA) at
#              Llama-3-8B shapes, GPU time of a CUDA-graph replay with L2 flushed, plus a small launch-shape sweep
#   steps      bench latency --profile (kernel launches per decode step and per layer, each kernel's time, the
#              device's idle time between them) at Qwen3-0.6B b1 and Llama-3.1-8B b1 / b16 / b64
#   timeline   bench throughput --gpu-timeline-kind decode: the kernels of 4 decode steps of the throughput row
#   unfused    Qwen3-0.6B b1 with GYRFALCON_DISABLE_FUSION=1 (separate norm, RoPE, K/V store launches)
# Usage, from the repo root: GYRFALCON_COMMIT=<hash> OUT=/some/dir bash scripts/gpu/profile.sh [SECTION...]
# (default: kernels steps). JSON and logs under $OUT/results (results.tar). Environment: see scripts/gpu/lib.sh.
cd "$(dirname "$0")/../.."
source scripts/gpu/lib.sh
banner
SECTIONS=${*:-kernels steps}
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
LAT="bench latency --input-len 128 --output-len 128 --async-scheduling"

if has kernels; then
  step kernels 300 python3 benchmarks/kernels.py --output-json "$R/kernels.json"
fi
if has steps; then
  ckpt q06
  step prof_q06_b1 120 $G $LAT --model /tmp/ck/q06 --batch-size 1 --max-num-seqs 1 --profile \
    --output-json "$R/latency_qwen3-0.6b_b1_profile.json"
  ckpt l8
  for b in 1 16 64; do
    step prof_l8_b$b 120 $G $LAT --model /tmp/ck/l8 --batch-size $b --max-num-seqs $b --profile \
      --output-json "$R/latency_llama-3.1-8b_b${b}_profile.json"
  done
fi
if has timeline; then
  ckpt l8
  step tput_timeline 300 $G bench throughput --model /tmp/ck/l8 --num-prompts 768 --input-len 1024 \
    --output-len 1024 --async-scheduling --gpu-timeline 4 --gpu-timeline-kind decode --gpu-timeline-after 540 \
    --output-json "$R/throughput_llama-3.1-8b_768x1024_async_timeline.json"
fi
if has unfused; then
  ckpt q06
  step unfused_q06_b1 120 env GYRFALCON_DISABLE_FUSION=1 $G $LAT --model /tmp/ck/q06 --batch-size 1 \
    --max-num-seqs 1 --profile --output-json "$R/latency_qwen3-0.6b_b1_unfused.json"
fi
finish
