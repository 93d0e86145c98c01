#!/usr/bin/env bash
# GPU tests and the benchmarks of issue 4 on the device machine, results under $OUT (results.tar).
# The device copy of the tree may carry a stale .git: pass GYRFALCON_COMMIT=<local HEAD, as a literal hash: a
# $(git rev-parse) inside the device command reads that stale copy> so the JSON
# records the commit that ran.
# Usage (from the repo root): OUT=/some/dir bash scripts/gpu_check.sh [SECTION...]
# Sections (default: tests):
#   tests        GPU tests, one step per file
#   ktests       the kernel tests only
#   attnsweep    decode-attention launch shapes at short contexts
#   attntput     the same at batch 64 / 256 and 1-2k tokens, and the key-tile layout (GYRFALCON_DECODE_K_ROWS);
#                a Llama-8B decode step's profile at batch 256 with 1024-token prompts
#   sweep        GEMV launch-shape sweep vs cuBLAS
#   kernels      kernel benchmarks at the default launch shapes; greedy argmax vs torch's at S 1/16/64
#   small        Qwen3-0.6B batch 1: fused / cuBLAS / unfused
#   llama        Llama-3.1-8B batch 1, 16, 64
#   defaults7    the defaults of session 7 (plain rows, the merge from batch 8, key tiles in row layout at
#                large batch): GPU kernel / token tests, Llama b4 / b16 / b64 / b256, Qwen b16, throughput
#   defaults8    the defaults of session 8: GPU token tests, then Qwen3-0.6B b1 / b4 with 32-token prompts and
#                96 output tokens (every context fits the one-split graphs' 128) with and without them
#   slimstep     the fused embedding lookup and bf16 greedy logits vs both off: GPU tests, Qwen3-0.6B b1 / b16
#                / b64, Llama-8B b64
#   gemm64       the GEMV kernel at 64 rows with split-K vs cuBLAS: sweep on Llama-8B shapes, Llama b64 with
#                o_proj / down_proj through it (GYRFALCON_SMALL_M_PLAIN_ROWS=64, GYRFALCON_GEMV_SPLIT_K=1 / 2)
#   fp8kv        --kv-cache-dtype fp8: GPU kernel tests, Llama b64 and throughput (also at 768 sequences:
#                twice the tokens fit) vs bf16
#   sampled      the rows at temperature 1.0 (vLLM's bench latency / throughput sample; ours default to greedy)
#   rows9        several heads per fused_qkv_prep program in prefills vs one (GYRFALCON_QKV_PREP_HEADS=1), and the
#                rows on the final commit of session 9
#   normrows     the one-pass norm in the GEMV at 8-64 rows: sweep vs RMSNorm + cuBLAS, Llama b16 / b64 with qkv
#                (GYRFALCON_NORM_GEMV_ROWS) and gate_up (GYRFALCON_NORM_GEMV_GATE_UP_ROWS) through it
#   prefillsweep prefill attention's tiles on batches of short prompts (64 x 128 ... 1 x 2048 tokens)
#   tputab       an older commit (AB_OLD=.ab/<hash>, carried) vs this tree: throughput and Llama-8B b64 in one call
#   mixed10      a throughput run's mixed step (prompt chunks beside ~290 decoders) profiled beside its halves
#                (benchmarks/mixed_step.py); prefill attention's short-query tiles: GPU tests, Llama b64 and
#                Qwen b16 TTFT with them and without (GYRFALCON_PREFILL_SHORT_TILES=0)
#   stall        what holds the host in a prefill step's launch (150-240 ms in run 36's throughput run): the mixed
#                step with torch's sync debug mode (every host-device sync printed with its stack), then
#                throughput at 768 prompts with its host time per phase, the garbage collector's pauses, and
#                the host time inside each eager launch (--launch-phases: building the inputs, each layer's
#                launches, after the forward)
#   syncdebug    stall's mixed step alone (budgetgraph's eager run has the throughput run's phases)
#   mixedprof    the mixed step under cProfile: which call holds the host in launch()
#   attnreal     decode attention on a throughput run's layout: scattered blocks over the whole pool, ctx one past
#                a tile, the fused-prep kernel (small_m_gemv.py --attn-real)
#   kvlayout     the KV cache stored [blocks, kv heads, block_size, head_dim] (GYRFALCON_KV_LAYOUT=hnd) vs the
#                default: GPU token tests, throughput and Llama-8B b64, AB
#   timeline     the device's idle time over a window of a throughput run's steps from its first mixed prefill
#                step (--gpu-timeline), at 16,384 and 8,192 tokens per step
#   gcfreeze     throughput with the collector frozen after startup (default on a GPU) vs not, launch phases
#   budgetab     the throughput row at 8,192 vs 16,384 tokens per step in ABBA order (run 36's pair ran 16,384
#                second, with Triton's cache warm from the first)
#   coldstart    startup with an empty Triton cache (a fresh TRITON_CACHE_DIR per run), Triton's compiles one
#                at a time vs in parallel threads (GYRFALCON_PARALLEL_COMPILE=1, runner/precompile.py), ABAB;
#                GPU token tests with the parallel compile
#   budgetgraph  throughput with the budget-filling mixed steps replayed as one CUDA graph (GYRFALCON_BUDGET_GRAPH=1)
#                vs eager, and the GPU token test of that graph
#   btcolumns    decode graphs' block table column-major (default) vs row-major sent whole, Llama-8B b384 with
#                512-token prompts ABBA, b64 AB
#   gemmm        Llama-8B's layer GEMMs at prefill token counts, odd (8,192 + ~290 decoders) vs round M
#   graphlogits64  the LM head and greedy argmax inside the decode graph at Llama-8B b64 / b16, ABBA
#   barrier      what a dependent step costs: kernel boundary (plain, PDL) vs a persistent kernel's grid barrier
#   qwenbatch    Qwen3-0.6B batch 16 / 64
#   tunableop    PyTorch's GEMM algorithm tuning at batch 16 / 64
#   baseline     transformers in the same run
#   throughput   768 x 1024/1024 at the default 384 sequences (TPUT_SEQS=N: also with --max-num-seqs N;
#                TPUT_EXTRA="flags": also with those engine flags; TPUT_BASE=0 skips the default run)
#   hostprof     host time per decode step by phase, and a cProfile (scripts/host_profile.py): Qwen3-0.6B
#                b1 / b64, Llama-8B b64
#   throughput_vllm_defaults   the same with vLLM's limits: 1024 seqs, 16384 tokens per step
# One-off experiment sections whose results are recorded in benchmarks/results/ (runs 6-21: pdl, defaults, prep,
# prefetch, wholerow, b16attn, mik, prefetch8b, graphlogits, graphs8b) were removed after commit 25672e9; run
# them from there (git show 25672e9:scripts/gpu_check.sh). Runs 24-25's short / peel: see commit dd042e6;
# run 30's gapcheck (GYRFALCON_GC_FREEZE, merge-in-kernel at Qwen b1): b9c072b.
# Each step has its own time limit, later steps get what is left of BUDGET seconds, and a failure does
# not stop the later steps.
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/gyrfalcon-out}
R=$OUT/results
mkdir -p "$R"
START=$(date +%s)
G="python3 -m gyrfalcon.cli"
BUDGET=${BUDGET:-570}  # seconds for the whole script: later steps get what is left
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) - 15 ))
  if [ "$left" -lt 20 ]; then echo "=== $name skipped: out of time"; return; fi
  [ "$secs" -gt "$left" ] && secs=$left
  echo "=== $name ($(( $(date +%s) - START )) s elapsed)"
  timeout "$secs" "$@" 2>&1 | tee "$R/$name.log" | grep -vE "^\s*$|Warning|warn\(" | tail -n 25
  echo "=== $name exit ${PIPESTATUS[0]}"
}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

SECTIONS=${*:-tests}  # the GPU tests take most of a call; benchmark sections fit about two per call
has() { [[ " $SECTIONS " == *" $1 "* ]]; }

if has tests; then
  # The whole GPU suite outgrew 330 s in run 9 (89 tests passed, none failed, before the limit): one
  # step per file, so that a file that runs out of time does not hide the others' results.
  for f in test_kernels_gpu test_small_m_gemv_gpu test_argmax_gpu; do
    step gpu_$f 300 python3 -m pytest -q tests/gpu/$f.py -p no:cacheprovider --durations=8
  done
  # The model tests (~9 s each, 17 per checkpoint) outgrew one 300 s step in run 38: one step per checkpoint
  for ck in llama qwen; do
    step gpu_test_model_gpu_$ck 250 python3 -m pytest -q tests/gpu/test_model_gpu.py -k $ck -p no:cacheprovider \
      --durations=8
  done
  [ -n "${CUBLAS_TESTS:-}" ] && step gpu_tests_cublas 120 env GYRFALCON_SMALL_M_GEMV=0 python3 -m pytest -q tests/gpu/test_model_gpu.py \
    -p no:cacheprovider
fi
if has attnsweep; then  # decode-attention launch shapes at the model rows' short contexts
  step attn_sweep 240 python3 benchmarks/small_m_gemv.py --attn-sweep --output-json "$R/decode_attn_sweep.json"
fi
if has attntput; then  # decode attention at the throughput benchmark's batch (64 / 256) and contexts (1-2k)
  step attn_tput 300 python3 benchmarks/small_m_gemv.py --attn-tput --output-json "$R/decode_attn_tput.json"
  # A decode step where the throughput benchmark runs (batch 256, ~1k tokens of context): its kernel profile
  [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  step lat_l8_b256 150 $G bench latency --model /tmp/ck/l8 --batch-size 256 --input-len 1024 --output-len 32 \
    --max-num-seqs 256 --profile --output-json "$R/latency_llama-3.1-8b_b256_in1024.json"
fi
if has ktests; then  # the kernel tests alone (the model tests take minutes)
  step gpu_kernel_tests 120 python3 -m pytest -q tests/gpu/test_kernels_gpu.py tests/gpu/test_small_m_gemv_gpu.py \
    tests/gpu/test_argmax_gpu.py -p no:cacheprovider
fi
if has sweep; then
  # GEMV launch-shape sweep vs cuBLAS, and decode attention with the split merge in-kernel vs a reduce kernel.
  step gemv_sweep 300 python3 benchmarks/small_m_gemv.py --output-json "$R/small_m_gemv_sweep.json"
fi
if has kernels; then  # default launch shapes only (argmax: plus a small launch-shape sweep)
  step gemv_attn 150 python3 benchmarks/small_m_gemv.py --quick --ms 1 --output-json "$R/small_m_gemv_attn.json"
  step argmax_bench 60 python3 benchmarks/small_m_gemv.py --argmax --output-json "$R/argmax.json"
fi
if has small; then
  step ckpt_q06 60 $G bench make-checkpoint --preset qwen3-0.6b --out /tmp/ck/q06
  q06="$G bench latency --model /tmp/ck/q06 --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 1"
  step lat_q06_b1 120 $q06 --async-scheduling --profile --output-json "$R/latency_qwen3-0.6b_b1.json"
  # Fused vs unfused, in the same run: GEMV path off / every fusion off.
  step lat_q06_b1_cublas 120 env GYRFALCON_SMALL_M_GEMV=0 $q06 --async-scheduling --profile \
    --output-json "$R/latency_qwen3-0.6b_b1_cublas.json"
  step lat_q06_b1_unfused 120 env GYRFALCON_DISABLE_FUSION=1 $q06 --async-scheduling --profile \
    --output-json "$R/latency_qwen3-0.6b_b1_unfused.json"
fi
if has llama; then
  step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  for B in 1 16 64; do
    l8="$G bench latency --model /tmp/ck/l8 --batch-size $B --input-len 128 --output-len 128 --max-num-seqs $B"
    step lat_l8_b$B 120 $l8 --async-scheduling --profile --output-json "$R/latency_llama-3.1-8b_b$B.json"
  done
  l8="$G bench latency --model /tmp/ck/l8 --batch-size 1 --input-len 128 --output-len 128 --max-num-seqs 1"
  step lat_l8_b1_cublas 120 env GYRFALCON_SMALL_M_GEMV=0 $l8 --async-scheduling --profile \
    --output-json "$R/latency_llama-3.1-8b_b1_cublas.json"
fi
if has defaults7; then  # session 7's defaults (runs 21-22): tests, then the rows they touch, with the old
  # settings side by side at b16 (GYRFALCON_SMALL_M_PLAIN_ROWS=1 GYRFALCON_DECODE_MERGE_IN_KERNEL=0) and b256
  # (GYRFALCON_DECODE_K_ROWS=0)
  step gpu_d7_kernels 150 python3 -m pytest -q tests/gpu/test_kernels_gpu.py tests/gpu/test_small_m_gemv_gpu.py \
    -k "with_prep or decode or gemv" -p no:cacheprovider
  step gpu_d7_tokens 150 python3 -m pytest -q tests/gpu/test_model_gpu.py -k "fp32 and (cublas or merge-in or (graphs and not prefill and not logits))" \
    -p no:cacheprovider
  [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  l8="$G bench latency --model /tmp/ck/l8 --input-len 128 --output-len 128 --profile"
  step lat_l8_b16 90 $l8 --batch-size 16 --max-num-seqs 16 --output-json "$R/latency_llama-3.1-8b_b16.json"
  step lat_l8_b16_old 90 env GYRFALCON_SMALL_M_PLAIN_ROWS=1 GYRFALCON_DECODE_MERGE_IN_KERNEL=0 $l8 --batch-size 16 \
    --max-num-seqs 16 --output-json "$R/latency_llama-3.1-8b_b16_session6_defaults.json"
  step lat_l8_b64 90 $l8 --batch-size 64 --max-num-seqs 64 --output-json "$R/latency_llama-3.1-8b_b64.json"
  b256="$G bench latency --model /tmp/ck/l8 --batch-size 256 --input-len 1024 --output-len 32 --max-num-seqs 256"
  step lat_l8_b256 90 $b256 --output-json "$R/latency_llama-3.1-8b_b256_in1024.json"
  step tput_l8 300 $G bench throughput --model /tmp/ck/l8 --num-prompts 768 --input-len 1024 --output-len 1024 \
    --async-scheduling --output-json "$R/throughput_llama-3.1-8b_768x1024_async.json"
  [ -f /tmp/ck/q06/config.json ] || step ckpt_q06 60 $G bench make-checkpoint --preset qwen3-0.6b --out /tmp/ck/q06
  step lat_q06_b16 90 $G bench latency --model /tmp/ck/q06 --batch-size 16 --input-len 128 --output-len 128 \
    --max-num-seqs 16 --profile --output-json "$R/latency_qwen3-0.6b_b16.json"
  step lat_l8_b256_krows0 90 env GYRFALCON_DECODE_K_ROWS=0 $b256 \
    --output-json "$R/latency_llama-3.1-8b_b256_in1024_krows0.json"
fi
if has defaults8; then  # session 8's defaults (runs 24-26): the one-split graphs up to 128 tokens at 1-4
  # sequences, side by side with them off on a row whose every context fits; the GPU token tests
  step gpu_d8_tokens 150 python3 -m pytest -q tests/gpu/test_model_gpu.py \
    -k "fp32 and (short-graph or (graphs and not prefill and not logits))" -p no:cacheprovider
  [ -f /tmp/ck/q06/config.json ] || step ckpt_q06 60 $G bench make-checkpoint --preset qwen3-0.6b --out /tmp/ck/q06
  for B in 1 4; do
    lat="$G bench latency --model /tmp/ck/q06 --batch-size $B --input-len 32 --output-len 96 --max-num-seqs $B --profile"
    step lat_q06_b${B}_in32 90 $lat --output-json "$R/latency_qwen3-0.6b_b${B}_in32.json"
    step lat_q06_b${B}_in32_short0 90 env GYRFALCON_SHORT_GRAPH_CONTEXT=0 $lat \
      --output-json "$R/latency_qwen3-0.6b_b${B}_in32_short0.json"
  done
fi
if has slimstep; then  # session 8, unmeasured: the decode graphs' embedding lookup reading pending tokens
  # itself (kernels/embedding.py: one launch instead of five) and greedy steps without fp32 logits, side by
  # side with both off (GYRFALCON_FUSED_EMBED=0 GYRFALCON_FP32_LOGITS=1)
  step gpu_slim_kernels 120 python3 -m pytest -q tests/gpu/test_kernels_gpu.py -k "embedding or argmax" -p no:cacheprovider
  step gpu_slim_tokens 200 python3 -m pytest -q tests/gpu/test_model_gpu.py -k "graphs and not prefill and not logits" \
    -p no:cacheprovider
  off="env GYRFALCON_FUSED_EMBED=0 GYRFALCON_FP32_LOGITS=1"
  for M in q06:qwen3-0.6b:1 q06:qwen3-0.6b:16 q06:qwen3-0.6b:64 l8:llama-3.1-8b:64; do
    IFS=: read -r ck name B <<< "$M"
    [ -f /tmp/ck/$ck/config.json ] || step ckpt_$ck 150 $G bench make-checkpoint --preset $name --out /tmp/ck/$ck
    lat="$G bench latency --model /tmp/ck/$ck --batch-size $B --input-len 128 --output-len 128 --max-num-seqs $B --profile"
    step lat_${ck}_b$B 90 $lat --output-json "$R/latency_${name}_b$B.json"
    step lat_${ck}_b${B}_slim0 90 $off $lat --output-json "$R/latency_${name}_b${B}_slim0.json"
  done
fi
if has gemm64; then  # session 8, unmeasured: gyrfalcon's GEMV kernel at 64 rows with split-K (o_proj / down_proj
  # through it at batch 64, GYRFALCON_SMALL_M_PLAIN_ROWS=64), against cuBLAS: the launch-shape sweep, then Llama b64
  step gemm64_sweep 300 python3 benchmarks/small_m_gemv.py --skip-attention --ms 64 \
    --shapes l8_qkv l8_o l8_down l8_gate_up --output-json "$R/small_m_gemv_sweep64.json"
  [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  l8="$G bench latency --model /tmp/ck/l8 --batch-size 64 --input-len 128 --output-len 128 --max-num-seqs 64 --profile"
  step lat_l8_b64 90 $l8 --output-json "$R/latency_llama-3.1-8b_b64.json"
  for SK in 1 2; do
    step lat_l8_b64_rows64_sk$SK 90 env GYRFALCON_SMALL_M_PLAIN_ROWS=64 GYRFALCON_GEMV_SPLIT_K=$SK $l8 \
      --output-json "$R/latency_llama-3.1-8b_b64_rows64_sk$SK.json"
  done
fi
if has fp8kv; then  # session 8, unmeasured: --kv-cache-dtype fp8 (K/V as float8 e4m3): GPU kernel tests, then
  # throughput (where decode attention's KV reads dominate) and Llama b64, each side by side with bf16
  step gpu_fp8_kernels 150 python3 -m pytest -q tests/gpu/test_kernels_gpu.py -k fp8 -p no:cacheprovider
  [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  l8="$G bench latency --model /tmp/ck/l8 --batch-size 64 --input-len 128 --output-len 128 --max-num-seqs 64 --profile"
  step lat_l8_b64_fp8 90 $l8 --kv-cache-dtype fp8 --output-json "$R/latency_llama-3.1-8b_b64_fp8kv.json"
  step lat_l8_b64 90 $l8 --output-json "$R/latency_llama-3.1-8b_b64.json"
  tp="$G bench throughput --model /tmp/ck/l8 --num-prompts 768 --input-len 1024 --output-len 1024 --async-scheduling"
  step tput_l8_fp8 300 $tp --kv-cache-dtype fp8 --output-json "$R/throughput_llama-3.1-8b_768x1024_async_fp8kv.json"
  step tput_l8_fp8_768seqs 300 $tp --kv-cache-dtype fp8 --max-num-seqs 768 \
    --output-json "$R/throughput_llama-3.1-8b_768x1024_async_fp8kv_768seqs.json"
fi
if has sampled; then  # the rows as vLLM's bench latency / throughput ran them: temperature 1.0 (top-p 1.0), not greedy
  for M in q06:qwen3-0.6b:1 l8:llama-3.1-8b:1 l8:llama-3.1-8b:16 l8:llama-3.1-8b:64; do
    IFS=: read -r ck name B <<< "$M"
    [ -f /tmp/ck/$ck/config.json ] || step ckpt_$ck 150 $G bench make-checkpoint --preset $name --out /tmp/ck/$ck
    step lat_${ck}_b${B}_t1 90 $G bench latency --model /tmp/ck/$ck --batch-size $B --input-len 128 --output-len 128 \
      --max-num-seqs $B --temperature 1.0 --profile --output-json "$R/latency_${name}_b${B}_temp1.json"
  done
  step tput_l8_t1 300 $G bench throughput --model /tmp/ck/l8 --num-prompts 768 --input-len 1024 --output-len 1024 \
    --async-scheduling --temperature 1.0 --output-json "$R/throughput_llama-3.1-8b_768x1024_async_temp1.json"
fi
if has rows9; then  # session 9: several heads per fused_qkv_prep program in prefills (TTFT; A/B with
  # GYRFALCON_QKV_PREP_HEADS=1), then the rows on the final commit: Qwen3-0.6B b1 / b16 / b64, Llama-8B b1 / b16 / b64
  # (b64 also with the session-8 slim step off), throughput
  step gpu_prep_kernels 120 python3 -m pytest -q tests/gpu/test_kernels_gpu.py tests/kernels/test_kernel_fused_qkv_prep.py \
    -k "qkv_prep or several_heads" -p no:cacheprovider
  [ -f /tmp/ck/q06/config.json ] || step ckpt_q06 60 $G bench make-checkpoint --preset qwen3-0.6b --out /tmp/ck/q06
  q="$G bench latency --model /tmp/ck/q06 --input-len 128 --output-len 128 --profile"
  step lat_q06_b64 90 $q --batch-size 64 --max-num-seqs 64 --output-json "$R/latency_qwen3-0.6b_b64.json"
  step lat_q06_b64_heads1 90 env GYRFALCON_QKV_PREP_HEADS=1 $q --batch-size 64 --max-num-seqs 64 \
    --output-json "$R/latency_qwen3-0.6b_b64_heads1.json"
  [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  l8="$G bench latency --model /tmp/ck/l8 --batch-size 64 --input-len 128 --output-len 128 --max-num-seqs 64"
  step lat_l8_b64 90 $l8 --profile --output-json "$R/latency_llama-3.1-8b_b64.json"
  step lat_l8_b64_heads1 90 env GYRFALCON_QKV_PREP_HEADS=1 $l8 --output-json "$R/latency_llama-3.1-8b_b64_heads1.json"
  for B in 1 16; do
    step lat_q06_b$B 90 $q --batch-size $B --max-num-seqs $B --output-json "$R/latency_qwen3-0.6b_b$B.json"
  done
  for B in 1 16; do
    step lat_l8_b$B 90 $G bench latency --model /tmp/ck/l8 --batch-size $B --input-len 128 --output-len 128 \
      --max-num-seqs $B --profile --output-json "$R/latency_llama-3.1-8b_b$B.json"
  done
  step tput_l8 300 $G bench throughput --model /tmp/ck/l8 --num-prompts 768 --input-len 1024 --output-len 1024 \
    --async-scheduling --output-json "$R/throughput_llama-3.1-8b_768x1024_async.json"
  step lat_l8_b64_slim0 90 env GYRFALCON_FUSED_EMBED=0 GYRFALCON_FP32_LOGITS=1 $l8 \
    --output-json "$R/latency_llama-3.1-8b_b64_slim0.json"
fi
if has normrows; then  # session 9, measured in run 33 (it lost): the one-pass norm (small_m_gemv ONE_PASS) at 8-64 rows against RMSNorm +
  # cuBLAS (the sweep), then batch-16 / 64 steps with qkv (GYRFALCON_NORM_GEMV_ROWS) and gate_up (_GATE_UP_ROWS) through it
  step gpu_norm_kernels 120 python3 -m pytest -q tests/gpu/test_small_m_gemv_gpu.py -p no:cacheprovider
  step gpu_norm_tokens 200 env GYRFALCON_NORM_GEMV_ROWS=16 GYRFALCON_NORM_GEMV_GATE_UP_ROWS=16 python3 -m pytest -q \
    tests/gpu/test_model_gpu.py -k "graphs and not prefill and not logits" -p no:cacheprovider
  step norm_sweep 200 python3 benchmarks/small_m_gemv.py --skip-attention --ms 8 16 64 \
    --shapes l8_qkv l8_gate_up q06_qkv q06_gate_up --output-json "$R/small_m_gemv_sweep_one_pass.json"
  [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  for B in 16 64; do
    l8="$G bench latency --model /tmp/ck/l8 --batch-size $B --input-len 128 --output-len 128 --max-num-seqs $B"
    step lat_l8_b$B 90 $l8 --profile --output-json "$R/latency_llama-3.1-8b_b$B.json"
    step lat_l8_b${B}_normqkv 90 env GYRFALCON_NORM_GEMV_ROWS=$B $l8 --profile \
      --output-json "$R/latency_llama-3.1-8b_b${B}_normqkv.json"
    step lat_l8_b${B}_normboth 90 env GYRFALCON_NORM_GEMV_ROWS=$B GYRFALCON_NORM_GEMV_GATE_UP_ROWS=$B $l8 \
      --output-json "$R/latency_llama-3.1-8b_b${B}_normboth.json"
  done
fi
if has prefillsweep; then  # prefill attention's launch shapes on batches of short prompts (64 x 128 tokens: the b64 TTFT)
  step prefill_short_sweep 150 python3 benchmarks/kernels.py --prefill-short-sweep \
    --output-json "$R/prefill_attention_short_sweep.json"
fi
if has tputab; then  # an older commit's gyrfalcon vs this tree's, side by side in one call: the throughput row and
  # Llama-8B b64. AB_OLD: a folder holding the older gyrfalcon/ package, AB_OLD_COMMIT: its hash. Prepare it here and
  # carry it: git archive 6e030e4 gyrfalcon | (mkdir -p .ab/6e030e4 && tar -x -C .ab/6e030e4); carry [".ab"]
  if [ -z "${AB_OLD:-}" ] || [ ! -d "$AB_OLD/gyrfalcon" ]; then
    echo "=== tputab: AB_OLD must name a folder that holds an older gyrfalcon/ package"
  else
    # (run from the old folder: the working directory comes first on sys.path, before PYTHONPATH)
    old="env -C $PWD/$AB_OLD PYTHONPATH=$PWD/$AB_OLD:$PYTHONPATH GYRFALCON_COMMIT=${AB_OLD_COMMIT:-old}"
    [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
    $old python3 -c "import gyrfalcon, sys; print('old tree:', gyrfalcon.__file__)"
    l8="bench latency --model /tmp/ck/l8 --batch-size 64 --input-len 128 --output-len 128 --max-num-seqs 64"
    step lat_l8_b64_new 90 $G $l8 --output-json "$R/latency_llama-3.1-8b_b64_new.json"
    step lat_l8_b64_old 90 $old $G $l8 --output-json "$R/latency_llama-3.1-8b_b64_old.json"
    tp="bench throughput --model /tmp/ck/l8 --num-prompts 768 --input-len 1024 --output-len 1024 --async-scheduling"
    step tput_l8_old 300 $old $G $tp --output-json "$R/throughput_llama-3.1-8b_768x1024_async_old.json"
    step tput_l8_new 300 $G $tp --output-json "$R/throughput_llama-3.1-8b_768x1024_async_new.json"
  fi
fi
if has mixed10; then  # session 10: where the throughput run's prefill steps go; the short-query prefill tiles
  step gpu_short_tiles 120 python3 -m pytest -q tests/gpu/test_kernels_gpu.py tests/gpu/test_small_m_gemv_gpu.py \
    -k "paged_attention or qkv_prep or matches_reference" -p no:cacheprovider
  step gpu_prefill_tokens 180 python3 -m pytest -q tests/gpu/test_model_gpu.py -k "prefill" -p no:cacheprovider
  [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  step mixed_step 120 python3 benchmarks/mixed_step.py --model /tmp/ck/l8 --output-json "$R/mixed_step_llama-3.1-8b.json"
  l8="$G bench latency --model /tmp/ck/l8 --batch-size 64 --input-len 128 --output-len 128 --max-num-seqs 64"
  step lat_l8_b64 90 $l8 --profile --output-json "$R/latency_llama-3.1-8b_b64.json"
  step lat_l8_b64_longtiles 90 env GYRFALCON_PREFILL_SHORT_TILES=0 $l8 --profile \
    --output-json "$R/latency_llama-3.1-8b_b64_longtiles.json"
  [ -f /tmp/ck/q06/config.json ] || step ckpt_q06 60 $G bench make-checkpoint --preset qwen3-0.6b --out /tmp/ck/q06
  q06="$G bench latency --model /tmp/ck/q06 --batch-size 16 --input-len 128 --output-len 128 --max-num-seqs 16"
  step lat_q06_b16 60 $q06 --output-json "$R/latency_qwen3-0.6b_b16.json"
  step lat_q06_b16_longtiles 60 env GYRFALCON_PREFILL_SHORT_TILES=0 $q06 \
    --output-json "$R/latency_qwen3-0.6b_b16_longtiles.json"
fi
if has stall || has syncdebug; then  # session 10's lead for the throughput row: prefill steps' launch() holds the
  # host ~150+ ms (syncdebug: the mixed step with every host-device sync printed, without the throughput run)
  [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  step mixed_step_sync 150 python3 benchmarks/mixed_step.py --model /tmp/ck/l8 --sync-debug \
    --output-json "$R/mixed_step_llama-3.1-8b_sync_debug.json"
fi
if has mixedprof; then  # run 39: the mixed step's launch() took 201 ms of its 197 ms on the device with no sync
  # reported by the sync debug mode; cProfile names the call that holds the host
  [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  step mixed_step_cprofile 150 python3 benchmarks/mixed_step.py --model /tmp/ck/l8 --cprofile \
    --output-json "$R/mixed_step_llama-3.1-8b_cprofile.json"
fi
if has gcfreeze; then  # the collector frozen after startup (the default on a GPU) vs not (GYRFALCON_GC_FREEZE=0):
  # the throughput row, both with --launch-phases (the prefill launches' time after the forward, split at the LM head)
  [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  tp="bench throughput --model /tmp/ck/l8 --num-prompts 768 --input-len 1024 --output-len 1024 --async-scheduling"
  for run in a_0 b_1; do
    step tput_l8_gcfreeze_$run 150 env GYRFALCON_GC_FREEZE=${run#*_} $G $tp --launch-phases \
      --output-json "$R/throughput_llama-3.1-8b_768x1024_async_gcfreeze${run#*_}_$run.json"
  done
fi
if has attnreal; then  # decode attention as a throughput run holds it (consecutive vs scattered blocks over the whole
  # 54,835-block pool, ctx 1024 / 1025 / 2047, plain and fused-prep kernels) at 288 and 384 sequences
  step attn_real 150 python3 benchmarks/small_m_gemv.py --attn-real --output-json "$R/attn_real.json"
fi
if has kvlayout; then  # the KV cache stored [blocks, kv heads, block_size, head_dim] (GYRFALCON_KV_LAYOUT=hnd: a kv
  # head's slice of a block contiguous) vs the default: GPU token tests on it, then the throughput row and
  # Llama-8B b64, each AB in one call
  [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  step gpu_tokens_hnd 150 env GYRFALCON_KV_LAYOUT=hnd python3 -m pytest -q tests/gpu/test_model_gpu.py \
    -k "llama and (graphs or eager or prefill_logits)" -p no:cacheprovider
  tp="bench throughput --model /tmp/ck/l8 --num-prompts 768 --input-len 1024 --output-len 1024 --async-scheduling"
  for run in a_hnd b_nhd; do
    step tput_l8_kvlayout_$run 150 env GYRFALCON_KV_LAYOUT=${run#*_} $G $tp \
      --output-json "$R/throughput_llama-3.1-8b_768x1024_async_kvlayout_$run.json"
  done
  for run in a_nhd b_hnd; do
    step lat_l8_b64_kvlayout_$run 90 env GYRFALCON_KV_LAYOUT=${run#*_} $G bench latency --model /tmp/ck/l8 \
      --batch-size 64 --input-len 128 --output-len 128 --max-num-seqs 64 \
      --output-json "$R/latency_llama-3.1-8b_b64_kvlayout_$run.json"
  done
fi
if has timeline; then  # does the device idle in a throughput run's mixed prefill steps? Its kernels over a window of
  # steps from the first mixed one beside >= 256 decoders (bench throughput --gpu-timeline), at 16,384 tokens per step
  # (6 steps) and 8,192 (12)
  [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  tp="bench throughput --model /tmp/ck/l8 --num-prompts 768 --input-len 1024 --output-len 1024 --async-scheduling"
  for bn in 16384:6 8192:12; do
    step tput_l8_timeline_${bn%:*} 150 $G $tp --max-num-batched-tokens ${bn%:*} --gpu-timeline ${bn#*:} \
      --gpu-timeline-decoders 256 \
      --output-json "$R/throughput_llama-3.1-8b_768x1024_async_timeline_${bn%:*}.json"
  done
fi
if has stall; then
  # 768 prompts: with 384 (run 37) every prefill step came in the first wave, beside few decoders, and took
  # 197 ms, near its GPU time; the excess (282 ms per prefill step in run 36) is in the later ones.
  step tput_l8_768 200 $G bench throughput --model /tmp/ck/l8 --num-prompts 768 --input-len 1024 --output-len 1024 \
    --async-scheduling --launch-phases --output-json "$R/throughput_llama-3.1-8b_768x1024_async_phases.json"
fi
if has budgetab; then  # the offline default token budget: 8192 / 16384 / 16384 / 8192 in one call
  [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  tp="bench throughput --model /tmp/ck/l8 --num-prompts 768 --input-len 1024 --output-len 1024 --async-scheduling"
  for run in a_8192 b_16384 c_16384 d_8192; do
    step tput_l8_$run 150 $G $tp --max-num-batched-tokens ${run#*_} \
      --output-json "$R/throughput_llama-3.1-8b_768x1024_async_budget_$run.json"
  done
fi
if has coldstart; then  # Llama-8B at the default 384 sequences: run 36's first run started in 32.6 s, later ones 13-14
  [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  for run in a_0 b_1 c_0 d_1; do
    cache="$(mktemp -d)"
    step cold_l8_$run 120 env TRITON_CACHE_DIR="$cache" GYRFALCON_PARALLEL_COMPILE=${run#*_} $G bench latency \
      --model /tmp/ck/l8 --batch-size 1 --input-len 128 --output-len 8 \
      --output-json "$R/latency_llama-3.1-8b_b1_coldstart_parallel${run#*_}_$run.json"
    # What the run compiled, against benchmarks/startup_compiles.py's census of the startup (33 variants at the
    # default 384 sequences); the benchmark's own steps add a few (the eager LM head's argmax, say)
    echo "=== cold_l8_$run compiled $(find "$cache" -name '*.cubin' | wc -l) kernels," \
      "$(find "$cache" -name '__triton_launcher*.so' | wc -l) launchers"
  done
  step gpu_tokens_parallel_compile 150 env GYRFALCON_PARALLEL_COMPILE=1 TRITON_CACHE_DIR="$(mktemp -d)" python3 -m \
    pytest -q tests/gpu/test_model_gpu.py -k "llama and graphs and not logits" -p no:cacheprovider
fi
if has budgetgraph; then  # the throughput row with its budget-filling mixed steps replayed as one graph
  # (GYRFALCON_BUDGET_GRAPH=1, runner/mixed_graph.py) vs eager, then its GPU token test; both runs with
  # --launch-phases, so the eager one is also stall's throughput run
  [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  tp="bench throughput --model /tmp/ck/l8 --num-prompts 768 --input-len 1024 --output-len 1024 --async-scheduling"
  for run in a_1 b_0; do
    step tput_l8_budgetgraph_$run 170 env GYRFALCON_BUDGET_GRAPH=${run#*_} $G $tp --launch-phases \
      --output-json "$R/throughput_llama-3.1-8b_768x1024_async_budgetgraph${run#*_}_$run.json"
  done
  step gpu_tokens_budget_graph 150 python3 -m pytest -q tests/gpu/test_model_gpu.py -k full_budget_graph \
    -p no:cacheprovider
fi
if has btcolumns; then  # the decode graphs' column-major block table (a step sends its used columns) vs the
  # row-major one sent whole (GYRFALCON_DECODE_BT_COLUMNS=0: 2.1 MB per step at b64, 12.6 MB at b384)
  [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  # b384 with 512-token prompts (the throughput row's decode steps hold 384 sequences; they ran at 30.2-31.4 ms in
  # runs 39-40 against 28.2-28.4 in run 36) ABBA, 2 timed runs each, then the b64 row AB
  for BI in 384:512:64 64:128:128; do
    B=${BI%%:*} I=${BI#*:}; O=${I#*:} I=${I%:*}
    runs="a_1 b_0 c_0 d_1"; [ $B = 64 ] && runs="a_1 b_0"
    for run in $runs; do
      step lat_l8_b${B}_btcolumns_$run 100 env GYRFALCON_DECODE_BT_COLUMNS=${run#*_} $G bench latency \
        --model /tmp/ck/l8 --batch-size $B --input-len $I --output-len $O --max-num-seqs $B --num-iters 2 \
        --output-json "$R/latency_llama-3.1-8b_b${B}_in${I}_btcolumns${run#*_}_$run.json"
    done
  done
fi
if has gemmm; then  # cuBLAS on a prefill step's GEMMs at round vs odd token counts (would padding M pay?)
  step prefill_gemm_m 120 python3 benchmarks/prefill_gemm_m.py --output-json "$R/prefill_gemm_m.json"
fi
if has graphlogits64; then  # LM head + greedy argmax inside the decode graph at Llama-8B b16 / b64, where the eager
  # LM head and argmax add ~280 us plus their launches to the 4.94 ms graph (b64, run 32); at b1 it was a wash
  # (run 16: Qwen3-0.6B 0.747 vs 0.750 ms). Off / on / on / off per batch size.
  [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  for B in 64 16; do
    for run in a_0 b_1 c_1 d_0; do
      step lat_l8_b${B}_graphlogits_$run 90 env GYRFALCON_GRAPH_LOGITS=${run#*_} $G bench latency --model /tmp/ck/l8 \
        --batch-size $B --input-len 128 --output-len 128 --max-num-seqs $B \
        --output-json "$R/latency_llama-3.1-8b_b${B}_graphlogits${run#*_}_$run.json"
    done
  done
fi
if has barrier; then  # a kernel boundary in a graph (plain / PDL) vs a grid barrier in a persistent kernel
  step grid_barrier 60 python3 benchmarks/grid_barrier.py --output-json "$R/grid_barrier.json"
fi
if has qwenbatch; then  # Qwen3-0.6B batch 16 / 64 (vLLM 0.26.0 on this H200: 5,291 / 15,080 output tok/s, GPU.md)
  [ -f /tmp/ck/q06/config.json ] || step ckpt_q06 60 $G bench make-checkpoint --preset qwen3-0.6b --out /tmp/ck/q06
  for B in 16 64; do
    step lat_q06_b$B 90 $G bench latency --model /tmp/ck/q06 --batch-size $B --input-len 128 --output-len 128 \
      --max-num-seqs $B --profile --output-json "$R/latency_qwen3-0.6b_b$B.json"
  done
fi
if has tunableop; then  # PyTorch TunableOp picking cuBLAS/cuBLASLt algorithms per GEMM shape, vs the heuristics
  [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  for B in 16 64; do
    l8="$G bench latency --model /tmp/ck/l8 --batch-size $B --input-len 128 --output-len 128 --max-num-seqs $B"
    step lat_l8_b${B}_tunableop 240 env PYTORCH_TUNABLEOP_ENABLED=1 PYTORCH_TUNABLEOP_TUNING=1 \
      PYTORCH_TUNABLEOP_FILENAME=/tmp/tunableop.csv $l8 --profile --output-json "$R/latency_llama-3.1-8b_b${B}_tunableop.json"
  done
fi
if has baseline; then  # transformers (static cache + torch.compile) in the same run
  [ -f /tmp/ck/q06/config.json ] || step ckpt_q06 60 $G bench make-checkpoint --preset qwen3-0.6b --out /tmp/ck/q06
  step lat_q06_b1_hf 240 $G bench latency --model /tmp/ck/q06 --batch-size 1 --input-len 128 --output-len 128 \
    --max-num-seqs 1 --baseline hf --output-json "$R/latency_qwen3-0.6b_b1_vs_hf.json"
fi
if has throughput; then
  [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  [ "${TPUT_BASE:-1}" = 1 ] && step tput_l8 300 $G bench throughput --model /tmp/ck/l8 --num-prompts 768 \
    --input-len 1024 --output-len 1024 --async-scheduling --output-json "$R/throughput_llama-3.1-8b_768x1024_async.json"
  [ -n "${TPUT_SEQS:-}" ] && step tput_l8_seqs$TPUT_SEQS 300 $G bench throughput --model /tmp/ck/l8 --num-prompts 768 \
    --input-len 1024 --output-len 1024 --async-scheduling --max-num-seqs "$TPUT_SEQS" \
    --output-json "$R/throughput_llama-3.1-8b_768x1024_async_${TPUT_SEQS}seqs.json"
  # TPUT_EXTRA="--max-num-batched-tokens 16384" (say): one more run with those engine flags
  [ -n "${TPUT_EXTRA:-}" ] && step tput_l8_extra 300 $G bench throughput --model /tmp/ck/l8 --num-prompts 768 \
    --input-len 1024 --output-len 1024 --async-scheduling $TPUT_EXTRA \
    --output-json "$R/throughput_llama-3.1-8b_768x1024_async_extra.json"
fi
if has hostprof; then  # where the host's time goes per decode step (scripts/host_profile.py)
  [ -f /tmp/ck/q06/config.json ] || step ckpt_q06 60 $G bench make-checkpoint --preset qwen3-0.6b --out /tmp/ck/q06
  for B in 1 64; do
    step hostprof_q06_b$B 90 python3 scripts/host_profile.py --model /tmp/ck/q06 --batch-size $B \
      --output-json "$R/host_profile_qwen3-0.6b_b$B.json"
  done
  [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  step hostprof_l8_b64 120 python3 scripts/host_profile.py --model /tmp/ck/l8 --batch-size 64 \
    --output-json "$R/host_profile_llama-3.1-8b_b64.json"
fi
if has throughput_vllm_defaults; then  # vLLM's batch limits on >= 70 GiB GPUs, side by side with ours
  [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  step tput_l8_1024seqs 300 $G bench throughput --model /tmp/ck/l8 --num-prompts 768 --input-len 1024 \
    --output-len 1024 --max-num-seqs 1024 --max-num-batched-tokens 16384 \
    --output-json "$R/throughput_llama-3.1-8b_768x1024_1024seqs.json"
fi
(cd "$OUT" && tar cf results.tar results && rm -rf results)
echo "=== done in $(( $(date +%s) - START )) s"
