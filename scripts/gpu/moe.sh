#!/usr/bin/env bash
# The MoE rows on the device machine (NVIDIA H200): Qwen3-30B-A3B (whole, 48 layers) and MiniMax-M2 cut to 14 layers
# of its real dims, in bf16 and in FP8 block weights (the released format: e4m3 + 128x128 weight_scale_inv, experts
# included), random weights filled on the GPU (--load-format dummy: the 61-98 GB checkpoints would not fit the
# machine's disk beside the others), bench latency 128 in / 128 out, greedy, async scheduling.
#   sweep                     benchmarks/moe_sweep.py: the fused-MoE op's launch shapes at both shapes, T = 1-256
#   q30_b1 q30_b64            Qwen3-30B-A3B bf16 at batch 1 (with --profile: launches per layer) / 64
#   q30f_b1 q30f_b64          the same in FP8
#   mm_b1 mm_b64 mmf_b1 mmf_b64   MiniMax-M2 (14 layers), bf16 / FP8
#   ds_b1 dsf_b1              DeepSeek-V3.2 cut to 5 layers of its real dims (the first dense), bf16 / FP8
#   ds_ttft8k ds3_ttft8k      TTFT of one 8,192-token prompt in one step, bf16 (issue 37's target: <= 80 ms; vLLM 0.26:
#                             114 ms): DeepSeek-V3.2 (5 layers; past index_topk 2048 keys its prefill is sparse, in the
#                             absorbed form) and DeepSeek-V3 (5 layers, dense MLA: prefill in the expanded form)
#   mla_prefill               one MLA layer's prefill attention at the real dims, absorbed vs expanded form
#                             (scripts/gpu/mla_prefill_bench.py): an 8k prompt, and a 2k chunk over a 6k prefix
# Each row writes $OUT/results/latency_<model>_b<B>_row.json with the read roofline of the bytes a step reads
# (attention, the selected experts, the LM head, K/V: bench/common.py step_weight_bytes).
# Usage, from the repo root: GYRFALCON_COMMIT=<hash> OUT=/some/dir bash scripts/gpu/moe.sh [ROW...]
cd "$(dirname "$0")/../.."
source scripts/gpu/lib.sh
banner
ROWS=${*:-q30_b1 q30_b64 q30f_b1 q30f_b64 mm_b1 mm_b64 mmf_b1 mmf_b64}

row() {  # row NAME PRESET LAYERS BATCH [--fp8]
  local name=$1 preset=$2 layers=$3 b=$4; shift 4
  local extra=() fp8=() model=$preset
  [ "$b" = 1 ] && extra=(--profile)
  if [ "${1:-}" = --fp8 ]; then fp8=(--fp8); model=${preset}-fp8; fi
  [ "$preset" = minimax-m2 ] && model=${model/minimax-m2/minimax-m2-14l}
  [ "$preset" = deepseek-v3.2 ] && model=${model/deepseek-v3.2/deepseek-v3.2-5l}
  cfg $name $preset $layers "${fp8[@]}"
  step lat_${name}_b$b 240 $G bench latency --model /tmp/cfg/$name --load-format dummy --batch-size $b \
    --max-num-seqs $b --input-len 128 --output-len 128 --async-scheduling "${extra[@]}" \
    --output-json "$R/latency_${model}_b${b}_row.json"
}

ttft8k() {  # ttft8k NAME PRESET: 5 layers, one 8,192-token prompt as one prefill step
  local name=$1 preset=$2
  cfg $name $preset 5
  step ttft8k_$name 300 $G bench latency --model /tmp/cfg/$name --load-format dummy --batch-size 1 --max-num-seqs 1 \
    --input-len 8192 --output-len 8 --max-num-batched-tokens 8192 --max-model-len 8448 --async-scheduling \
    --ttft-timeline --output-json "$R/ttft8k_${preset}-5l_row.json"
}

for r in $ROWS; do
  case $r in
    sweep) step moe_sweep 300 python3 benchmarks/moe_sweep.py --quick --output-json "$R/moe_sweep.json" ;;
    q30_b1) row q30 qwen3-30b-a3b 48 1 ;;
    q30_b64) row q30 qwen3-30b-a3b 48 64 ;;
    q30f_b1) row q30f qwen3-30b-a3b 48 1 --fp8 ;;
    q30f_b64) row q30f qwen3-30b-a3b 48 64 --fp8 ;;
    mm_b1) row mm minimax-m2 14 1 ;;
    mm_b64) row mm minimax-m2 14 64 ;;
    mmf_b1) row mmf minimax-m2 14 1 --fp8 ;;
    mmf_b64) row mmf minimax-m2 14 64 --fp8 ;;
    ds_b1) row ds deepseek-v3.2 5 1 ;;
    dsf_b1) row dsf deepseek-v3.2 5 1 --fp8 ;;
    ds_ttft8k) ttft8k ds deepseek-v3.2 ;;
    ds3_ttft8k) ttft8k ds3 deepseek-v3 ;;
    mla_prefill)
      step mla_prefill_8k 120 python3 scripts/gpu/mla_prefill_bench.py --output-json "$R/mla_prefill_8k.json"
      step mla_prefill_chunk 120 python3 scripts/gpu/mla_prefill_bench.py --tokens 2048 --prefix 6144 \
        --output-json "$R/mla_prefill_2k_over_6k.json" ;;
    *) echo "unknown row: $r" ;;
  esac
done
finish
