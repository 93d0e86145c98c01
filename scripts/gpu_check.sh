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
#   prepsweep    decode attention with its fused prep (the kernel the batch 16 / 64 graphs run) at Llama-8B b16 / b64
#                and 144-250 tokens: first tile before the prep or not, splits, launch shapes (64-key tiles at 8 warps
#                and a one-stage 256-key tile since session 22: WIDE_TILE_CONFIG, the b16 default since run 91)
#   pdlplain     the batched graphs' plain kernels under PDL (GYRFALCON_PDL_ROWS=16, no prefetch, no peel): model token
#                tests, Llama-8B b16 ABAB, Qwen3-0.6B b16 AB
#   widerows     Llama-8B's down_proj of 17-64 rows on the GEMV kernel (GYRFALCON_GEMV_WIDE_ROWS_SHAPES): GPU tests, b64 ABAB
#   ctxsweep     the b16 fused-prep launch at 320-2,100 tokens: more splits of fewer keys, one-split reach past 256
#   midtile      the main b8 / b16 graphs' split launch on 64-key tiles, 4 warps, 2 stages (MID_TILE_CONFIG, run 96's
#                ctxsweep winner) against 128-key tiles (GYRFALCON_DECODE_MID_TILE=0): the launch ABAB at 320-2,100 tokens,
#                its least keys a split (min_part 0 / 256), Llama-8B b16 ABAB and b8 AB at 1,024-token prompts
#   tputprof     where a throughput decode step's ~28.5 ms go (run 67) against its kernels timed apart (~26.7 ms,
#                overlap_probe.py): bench throughput --gpu-timeline-kind decode over 4 steps at ~1,536 tokens of context
#                (each kernel's time a step), the probe in the same call, Llama-8B b16 / b64 with --profile
#   fp8mid       MID_TILE_CONFIG on an fp8 cache (the default since run 100) against GYRFALCON_DECODE_MID_TILE_FP8=0: the fp8
#                GPU kernel tests (mid-tile cases among them), Llama-8B b16 --kv-cache-dtype fp8 at 1,024-token prompts ABAB
#   smitrace     the SM clock and power (nvidia-smi every 250 ms) through the throughput row and through
#                overlap_probe.py: do sustained GEMMs run at lower clocks than the probe's short bursts?
#   smifp8       the same trace through the throughput row on an fp8 cache (768 sequences) and through Llama-8B b64 / b16
#   rows         issue 4's rows at one commit, each JSON with its timed runs' SM clock and power (gpu_power): Qwen3-0.6B
#                b1, Llama-8B b1 / b16 / b64, the throughput row on a bf16 cache and on an fp8 cache (768 sequences)
#                (~7 min: a call of its own)
#   ttftline     the TTFT generate's host / device timeline (bench latency --ttft-timeline) at Llama-8B b64 / b16: where
#                TTFT exceeds the prefill's GPU span
#   stepev       each decode-graph replay's device time inside the engine's timed runs and the device time between
#                replays (bench latency --step-events, CUDA events), against the graph back to back: Llama-8B b16 / b64 / b1
#   gap          the device time between decode-graph replays: benchmarks/replay_gap.py (a synthetic graph, the input copy
#                in the compute stream / on the side stream / staged), then Llama-8B b1 / b16 --step-events with
#                GYRFALCON_SIDE_STREAM_COPIES=0 against the default
#   latrows      rows' latency half alone: Qwen3-0.6B b1, Llama-8B b1 / b16 / b64 (no throughput runs)
#   energy       joules per decode kernel (benchmarks/kernel_energy.py), then Llama-8B b64 with down_proj on cuBLAS ABAB
#   attnenergy   decode attention's launch shapes by joules at b384 / b64 (kernel_energy.py --attn-configs), then the
#                throughput row with the least-energy launch within 5% of the default's time against the default (AB)
#   floors       Llama-8B b16 / b64 at 128 in / 256 out, the throughput row (bf16 and fp8 cache) with its serial floor,
#                then b64 / b16 at 128 / 128
#   widerows2    widerows' b64 ABAB alone (its GPU tests passed in run 94 on the same kernel), on another card
#   midtile2     the same with one-tile splits (default_min_part's mid_tile): GPU tests, the launch ABAB at 320-600
#                tokens, Llama-8B b16 at 512 / 2,048-token prompts, Qwen3-0.6B b16 at 1,024
#   splits3      the main b16 graph at 3 splits instead of 4 (GYRFALCON_DECODE_SPLITS=16:3), Llama-8B b16 at 2,048-token
#                prompts ABAB
#   wideshort    the one-stage 256-key tile in one-split graphs up to 256 tokens (wide_tile_context): its GPU tests,
#                Llama-8B b16 / b8 and Qwen3-0.6B b16 against GYRFALCON_DECODE_WIDE_TILE=0 (run 92's widetile section
#                found the tile losing past one tile: 5.46 vs 5.20 ms a Llama b16 step at 1,024-token prompts)
#   sidecopies   a decode step's input copy and its tokens' copy back on side streams (GYRFALCON_SIDE_STREAM_COPIES,
#                the default since run 69) or in the compute stream: the model token tests with them in the stream
#                (mode inline-copies), then Qwen3-0.6B b1 and Llama-8B b64 (ABAB)
#   sidetput     the same switch on the throughput row (AB; a call of its own)
#   stepgaps     where a decode step's device idles (bench latency --profile's idle_by_pair) at Qwen3-0.6B b1, Llama-8B
#                b16 / b64; the LM head and argmax in the decode graph (GYRFALCON_GRAPH_LOGITS): its model token
#                tests, Qwen3-0.6B b1 and Llama-8B b64 ABAB
#   rows64       o_proj and down_proj of up to 64 rows on gyrfalcon's GEMV instead of cuBLAS (GYRFALCON_SMALL_M_PLAIN_ROWS=64;
#                run 30 lost with it, before folded norms and the GEMV's later changes): Llama-8B b64 ABAB (run 72: lost,
#                5.330 / 5.343 vs 5.095 / 5.099 ms a step)
#   onepass      batch-1 qkv / gate_up GEMVs scaling by the norm's rstd after the dot (GYRFALCON_GEMV_ONE_PASS_NORM_B1=1
#                forces it; the default since run 74 where one tile spans a row of <= 1024 inputs): the GEMV's GPU
#                tests, its model token tests, Qwen3-0.6B b1 ABAB, Llama-8B b1 AB (run 74: Qwen 0.687 / 0.685 vs
#                0.699 / 0.699 ms, Llama 4.366 vs 4.225)
#   onepassab    the one-pass default (auto) against GYRFALCON_GEMV_ONE_PASS_NORM_B1=0: Qwen3-0.6B b1 ABAB, then the
#                default with --profile
#   gemvchain    the Qwen3-0.6B batch-1 chain with each single-row GEMV at 15 other launch shapes (small_m_gemv.py
#                --gemv-chain-sweep), against the defaults in the same rounds; each GEMV's winner (>= 1%) together in the
#                model, Qwen3-0.6B b1 ABAB (run 76: 0.677 / 0.678 vs 0.688 / 0.688 ms; now the defaults, B1_CHAIN_SHAPES)
#   chainenv     the Qwen3-0.6B batch-1 chain with decode attention's launch shape (GYRFALCON_DECODE_ATTN_CONFIG),
#                its splits (GYRFALCON_DECODE_PREFETCH_SPLITS) and the split merge's warps (GYRFALCON_DECODE_REDUCE_WARPS)
#                at other values (small_m_gemv.py --chain-env; CHAIN_ENVS, CHAIN_CTX), at 256 / 1,024 / 4,096 tokens;
#                the winners at 256 together in the model, Qwen3-0.6B b1 ABAB
#   b1tile       batch-1 decode attention's split tiles: 64 keys (B1_SPLIT_TILE, the default since run 77) vs 128,
#                Qwen3-0.6B b1 ABAB at 128-token prompts, AB at 4,096
#   gemv16       the GEMV kernel's 16-row launch shapes swept wide (split-K, 8 warps, 6 stages; small_m_gemv.py --wide)
#                on Llama-8B's o_proj / down_proj / qkv, the winners in the model (GYRFALCON_GEMV_ROWS_SHAPES), b16 ABAB
#   gemv16ab     the 16-row launch shapes now the default (small_m_gemv.ROWS_SHAPES) against none: GEMV and Llama model
#                GPU tests, Llama-8B b16 ABAB
#   overlap      two nano-batches of a throughput decode step on two streams (benchmarks/overlap_probe.py)
#   attntput     decode-attention launch shapes at batch 64 / 256 and 1-2k tokens, and the key-tile layout (GYRFALCON_DECODE_K_ROWS);
#                a Llama-8B decode step's profile at batch 256 with 1024-token prompts
#   sweep        GEMV launch-shape sweep vs cuBLAS
#   kernels      kernel benchmarks at the default launch shapes; greedy argmax vs torch's at S 1/16/64
#   small        Qwen3-0.6B batch 1: fused / cuBLAS / unfused
#   llama        Llama-3.1-8B batch 1, 16, 64
#   fp8kv        --kv-cache-dtype fp8 vs bf16: the throughput row at 768 sequences (twice the tokens fit) against
#                the bf16 default, Llama b64; the GPU fp8 tests unless fp8attn or ktests runs
#   fp8attn      decode attention on the fp8 KV cache at the throughput row's batches and contexts: its GPU tests, launch
#                shapes (small_m_gemv.py --attn-tput --fp8; 256-key tiles too) against the bf16 sweep (ATTN_BF16=0:
#                without it)
#   pdlchain     the Qwen3-0.6B batch-1 layer chain in a graph, PDL off / on, distinct vs L2-resident (shared) weights
#   ncu          Nsight Compute on short-context decode kernels (benchmarks/ncu_probe.py; the log holds ncu's report)
#   ncusrc       ncu's PC sampling of the batch-1 / batch-64 decode attention launches, per SASS instruction (CSV logs);
#                NCU_CASES="attn_b16" for the b16 wide tile
#   sampled      the rows at temperature 1.0 (vLLM's bench latency / throughput sample; ours default to greedy)
#   prefillsweep prefill attention's tiles on batches of short prompts (64 x 128 ... 1 x 2048 tokens)
#   tputab       an older commit (AB_OLD=.ab/<hash>, carried) vs this tree: throughput and Llama-8B b64 in one call
#   attnreal     decode attention on a throughput run's layout: scattered blocks over the whole pool, ctx one past
#                a tile, the fused-prep kernel (small_m_gemv.py --attn-real; run 42: all at 95-108% of 4.15 TB/s)
#   timeline     the device's idle time over a window of a throughput run's steps from its first mixed prefill
#                step (--gpu-timeline), at 16,384 and 8,192 tokens per step
#   budgetab     the throughput row at 8,192 vs 16,384 tokens per step in ABBA order (run 36's pair ran 16,384
#                second, with Triton's cache warm from the first)
#   coldstart    startup with an empty Triton cache (a fresh TRITON_CACHE_DIR per run), Triton's compiles one
#                at a time (GYRFALCON_PARALLEL_COMPILE=0) vs in parallel threads (the default since run 40,
#                runner/precompile.py), ABAB; GPU token tests with the parallel compile
#   gemmm        Llama-8B's layer GEMMs at prefill token counts, odd (8,192 + ~290 decoders) vs round M
#   gemmblas     the same at decode-sized M (64-512 rows), under torch's cuBLAS and cuBLASLt back ends
#                (GYRFALCON_BLAS)
#   graphlogits64  the LM head and greedy argmax inside the decode graph at Llama-8B b64 / b16, ABBA
#   normbound    Llama-8B b64 (ABBA) / b16 (AB) with RMSNorm a pass-through (benchmarks/norm_bound.py): the most
#                that folding the layers' norm launches into their neighbours could save
#   foldnorms    GYRFALCON_FOLD_NORMS=1 (the norms folded into the GEMMs around them): its GPU token tests, then
#                Llama-8B b64 (ABBA) / b16 (AB) and the throughput row (AB) against the default
#   skinny       the stream-K GEMM (kernels/skinny_gemm.py): its GPU tests and model token tests, the layer GEMMs
#                against cuBLAS at 16 / 64 / 128 rows (a launch-shape sweep at 64), then Llama-8B b64 (ABBA) / b16
#                (AB) with GYRFALCON_SKINNY_GEMM_ROWS=128 against cuBLAS
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
# run 30's gapcheck (GYRFALCON_GC_FREEZE, merge-in-kernel at Qwen b1): b9c072b. Sessions 7-12's one-offs (runs
# 21-41: defaults7, defaults8, slimstep, gemm64, rows9, normrows, mixed10, stall, syncdebug, mixedprof, gcfreeze,
# budgetgraph, btcolumns) were removed after commit d92262b; session 13's kvlayout (run 42) after e95b880; session 15's
# mergedrows (run 53) after c7d33ea; session 16's fp8ab (run 56: decode attention's K staging, prefill attention's fp16
# dots, one process each: small_m_gemv.py --attn-tput --quick --ab-env, kernels.py --prefill-fp8-ab) and l2pf (run 58)
# after b027b23; session 17's short256 and maxnreg (run 60: both lost) after 7cbc0b2; merged (run 61), minpart (run 66)
# and earlyloads (run 68) after 6a05250; session 21's l2attn (run 82: o_proj's weight prefetched into L2 beside
# decode attention lost at b16 and b64) after d484800; gemvpdl (run 84: the b16 graphs' GEMVs under PDL lost) after
# d593341; normrows16 (run 86: RMSNorm fused into the 16-row qkv / gate_up GEMVs 2-4.5x slower) after c8eac96; session
# 23's attnpf, pdlrows, latestore, unitnorm, gemv64 and tile256 (runs 87-91) after 989f30d.
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
ckpt() {  # ckpt q06|l8: the random-weight checkpoint under /tmp/ck, made once a call
  local preset=qwen3-0.6b secs=60
  [ "$1" = l8 ] && preset=llama-3.1-8b secs=150
  [ -f /tmp/ck/$1/config.json ] || step ckpt_$1 $secs $G bench make-checkpoint --preset $preset --out /tmp/ck/$1
}
lat() {  # lat q06|l8 BATCH NAME [VAR=VALUE ...] [--flag ...]: one bench latency step (128 in / 128 out, async
  # scheduling) with those variables set, as lat_<ck>_b<BATCH>_<NAME>, its JSON latency_<model>_b<BATCH>_<NAME>.json
  local ck=$1 b=$2 name=$3 model=qwen3-0.6b envs=() flags=()
  shift 3
  [ "$ck" = l8 ] && model=llama-3.1-8b
  for a in "$@"; do if [[ $a == --* ]]; then flags+=("$a"); else envs+=("$a"); fi; done
  step lat_${ck}_b${b}_$name 80 env "${envs[@]}" $G bench latency --model /tmp/ck/$ck --batch-size $b \
    --max-num-seqs $b --async-scheduling "${flags[@]}" --output-json "$R/latency_${model}_b${b}_$name.json"
}
smi_start() {  # smi_start FILE: sample the SM / memory clocks, power and temperature every 250 ms into FILE (csv)
  local q="timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu"
  nvidia-smi --query-gpu=$q,clocks_event_reasons.active --format=csv,nounits -lms 250 > "$1" 2>&1 &
  SMI_PID=$!
  sleep 1
  if ! kill -0 $SMI_PID 2>/dev/null; then  # an older driver without that field
    nvidia-smi --query-gpu=$q --format=csv,nounits -lms 250 > "$1" 2>&1 &
    SMI_PID=$!
  fi
}
smi_stop() { kill $SMI_PID 2>/dev/null; wait $SMI_PID 2>/dev/null; }
smi_summary() {  # smi_summary NAME...: the SM clock and power of $R/NAME.csv while the GPU drew > 150 W
  PYTHONPATH=$PWD python3 - "$R" "$@" <<'PY'
import sys
from gyrfalcon.bench.power import format_summary, parse_samples, summarize
for name in sys.argv[2:]:  # (parse_samples skips the csv's header line: not a number)
    try:
        samples = parse_samples(open(f"{sys.argv[1]}/{name}.csv").readlines())
    except OSError:
        continue
    busy = [x for x in samples if x["power_w"] > 150]  # while the GPU works
    if busy:
        print(f"{name}: {len(samples)} samples, {len(busy)} above 150 W: {format_summary(summarize(busy))}")
PY
}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

SECTIONS=${*:-tests}  # the GPU tests take most of a call; benchmark sections fit about two per call
has() { [[ " $SECTIONS " == *" $1 "* ]]; }

if has tests; then
  # The whole GPU suite outgrew 330 s in run 9 (89 tests passed, none failed, before the limit): one
  # step per file, so that a file that runs out of time does not hide the others' results.
  # TEST_FILES / TEST_CKPTS narrow them (e.g. TEST_FILES= TEST_CKPTS=llama: the Llama model tests only)
  for f in ${TEST_FILES-test_kernels_gpu test_small_m_gemv_gpu test_argmax_gpu}; do
    step gpu_$f 300 python3 -m pytest -q tests/gpu/$f.py -p no:cacheprovider --durations=8
  done
  # The model tests (~9 s each, 17 per checkpoint) outgrew one 300 s step in run 38: one step per checkpoint
  for ck in ${TEST_CKPTS-llama qwen}; do
    step gpu_test_model_gpu_$ck 330 python3 -m pytest -q tests/gpu/test_model_gpu.py -k $ck -p no:cacheprovider \
      --durations=8
  done
  [ -n "${CUBLAS_TESTS:-}" ] && step gpu_tests_cublas 120 env GYRFALCON_SMALL_M_GEMV=0 python3 -m pytest -q tests/gpu/test_model_gpu.py \
    -p no:cacheprovider
fi
if has attnsweep; then  # decode-attention launch shapes at the model rows' short contexts
  step attn_sweep 240 python3 benchmarks/small_m_gemv.py --attn-sweep --output-json "$R/decode_attn_sweep.json"
fi
if has prepsweep; then  # the fused-prep decode attention launch at the b16 / b64 rows' contexts; cuBLAS operand order
  # (run 65 also timed skinny_gemm.py --ms 16 64 here; the sweep's grid has grown since, so it runs alone)
  step attn_prep_sweep 500 python3 benchmarks/small_m_gemv.py --attn-prep-sweep --output-json "$R/attn_prep_sweep.json"
fi
if has wideshort; then  # the one-stage 256-key tile only in one-split graphs replayed up to 256 tokens of context
  # (wide_tile_context; run 92: it lost past one tile, 5.46 vs 5.20 ms a Llama b16 step at 1,024-token prompts):
  # its GPU kernel / model tests, then ABAB against GYRFALCON_DECODE_WIDE_TILE=0 at Llama-8B b16 and b8 (128-token
  # prompts), AB at 1,024-token prompts (the same main graph either way), Qwen3-0.6B b16 AB
  step gpu_wideshort_tests 240 python3 -m pytest -q tests/gpu/test_kernels_gpu.py tests/gpu/test_model_gpu.py \
    -k "decode_attention_with_prep or max_shared or (bf16_greedy and (wide-tile or graphs))" -p no:cacheprovider
  ckpt l8
  for run in a_1 b_0 c_0 d_1; do lat l8 16 ws_$run GYRFALCON_DECODE_WIDE_TILE=${run#*_}; done
  for run in a_1 b_0; do lat l8 8 ws_$run GYRFALCON_DECODE_WIDE_TILE=${run#*_}; done
  for run in a_1 b_0; do lat l8 16 ws1k_$run GYRFALCON_DECODE_WIDE_TILE=${run#*_} --input-len=1024; done
  ckpt q06
  for run in a_1 b_0; do lat q06 16 ws_$run GYRFALCON_DECODE_WIDE_TILE=${run#*_}; done
fi
if has ctxsweep; then  # the b16 fused-prep launch past one tile, where the main graphs' default reached 51-67% of
  # HBM at 1,100-2,100 tokens (run 92): split counts that fill whole waves (the default launch holds 3 programs an SM:
  # 72 KB of shared memory, 130 registers; 4 splits = 512 programs = 1.3 waves of 396; 3 = 384) and more splits of
  # fewer keys (min_part 0), the first tile before the prep or not, at 600-2,100 tokens; and at 320 / 480 tokens
  # whether a one-split (or 2-split) graph could reach further than 256 tokens (~4 min)
  step ctx_sweep_long 240 python3 benchmarks/small_m_gemv.py --attn-prep-sweep --prep-batches 16 \
    --prep-contexts 600 1100 2100 --prep-splits 2 3 4 6 8 16 --prep-min-part 0 \
    --prep-configs 64,4,2 128,4,3 128,8,3 64,8,3 --output-json "$R/ctx_sweep_long.json"
  step ctx_sweep_mid 120 python3 benchmarks/small_m_gemv.py --attn-prep-sweep --prep-batches 16 8 \
    --prep-contexts 320 480 --prep-splits 1 2 --prep-min-part 0 --prep-no-prefetch \
    --prep-configs 256,8,1 128,4,3 128,8,3 128,8,2 64,8,3 --output-json "$R/ctx_sweep_mid.json"
fi
if has midtile; then  # run 96's ctxsweep: at b16, 4 splits of 64-key tiles (4 warps, 2 stages) took 18.3 / 26.7 / 42.2
  # us at 600 / 1,100 / 2,100 tokens against 24.0 / 34.5 / 50.1 for the main graphs' 128-key tiles (min_part 0) (~6 min)
  step midtile_attn_ab 150 python3 benchmarks/small_m_gemv.py --attn-prep-sweep --prep-batches 16 8 \
    --prep-contexts 320 600 1100 2100 --ab-env GYRFALCON_DECODE_MID_TILE --output-json "$R/midtile_attn_ab.json"
  for mp in 0 256; do
    step midtile_minpart_$mp 60 python3 benchmarks/small_m_gemv.py --attn-prep-sweep --prep-batches 16 8 \
      --prep-contexts 320 480 600 --prep-splits 4 8 --prep-min-part $mp --prep-no-prefetch --prep-configs 64,4,2 \
      --output-json "$R/midtile_minpart_$mp.json"
  done
  ckpt l8
  for run in a_1 b_0 c_0 d_1; do lat l8 16 mt1k_$run GYRFALCON_DECODE_MID_TILE=${run#*_} --input-len=1024; done
  for run in a_1 b_0; do lat l8 8 mt1k_$run GYRFALCON_DECODE_MID_TILE=${run#*_} --input-len=1024; done
fi
if has tputprof; then  # a throughput run's decode steps kernel by kernel (4 steps from the 540th: ~380 sequences at
  # ~1,536 tokens, the first wave's midpoint) against overlap_probe.py's layer timed apart; fresh b16 / b64 profiles
  ckpt l8
  step tput_l8_decodeprof 200 $G bench throughput --model /tmp/ck/l8 --num-prompts 768 --input-len 1024 \
    --output-len 1024 --async-scheduling --gpu-timeline 4 --gpu-timeline-kind decode --gpu-timeline-decoders 370 \
    --gpu-timeline-after 540 --output-json "$R/throughput_llama-3.1-8b_768x1024_async_decodeprof.json"
  step overlap_probe 150 python3 benchmarks/overlap_probe.py --output-json "$R/overlap_probe.json"
  lat l8 64 prof --profile
  lat l8 16 prof --profile
fi
if has fp8mid; then  # MID_TILE_CONFIG on an fp8 cache against 128-key tiles: kernel tests, Llama-8B b16 ABAB
  step gpu_fp8_kernels 200 python3 -m pytest -q tests/gpu/test_kernels_gpu.py -k fp8 -p no:cacheprovider
  ckpt l8
  for run in a_1 b_0 c_0 d_1; do
    lat l8 16 fp8mt1k_$run GYRFALCON_DECODE_MID_TILE_FP8=${run#*_} --kv-cache-dtype=fp8 --input-len=1024
  done
fi
if has smitrace; then  # clocks and power through the throughput row and the overlap probe (one process each)
  ckpt l8
  smi_start "$R/smi_tput.csv"
  step tput_l8_smi 200 $G bench throughput --model /tmp/ck/l8 --num-prompts 768 --input-len 1024 --output-len 1024 \
    --async-scheduling --output-json "$R/throughput_llama-3.1-8b_768x1024_async_smi.json"
  smi_stop
  smi_start "$R/smi_probe.csv"
  step overlap_probe_smi 150 python3 benchmarks/overlap_probe.py --output-json "$R/overlap_probe_smi.json"
  smi_stop
  smi_summary smi_tput smi_probe
fi
if has rows; then  # the rows at one commit, with gpu_power in each JSON
  ckpt q06
  lat q06 1 row
  ckpt l8
  for b in 1 16 64; do lat l8 $b row; done
  tp="$G bench throughput --model /tmp/ck/l8 --num-prompts 768 --input-len 1024 --output-len 1024 --async-scheduling"
  step tput_l8_row 150 $tp --output-json "$R/throughput_llama-3.1-8b_768x1024_async_row.json"
  step tput_l8_fp8_row 150 $tp --kv-cache-dtype fp8 --max-num-seqs 768 \
    --output-json "$R/throughput_llama-3.1-8b_768x1024_async_fp8kv_768seqs_row.json"
fi
if has latrows; then  # rows' latency half alone (no throughput runs): fits what is left of a session's device time
  ckpt q06
  lat q06 1 row
  ckpt l8
  for b in 1 16 64; do lat l8 $b row; done
fi
if has floors; then  # the rows against their floors: b16 / b64 at 256 new tokens too, the throughput row's serial floor
  ckpt l8
  for b in 16 64; do lat l8 $b out256 --output-len=256; done
  tp="$G bench throughput --model /tmp/ck/l8 --num-prompts 768 --input-len 1024 --output-len 1024 --async-scheduling"
  step tput_l8_floor 150 $tp --output-json "$R/throughput_llama-3.1-8b_768x1024_async_floor.json"
  step tput_l8_fp8_floor 150 $tp --kv-cache-dtype fp8 --max-num-seqs 768 \
    --output-json "$R/throughput_llama-3.1-8b_768x1024_async_fp8kv_768seqs_floor.json"
  for b in 64 16; do lat l8 $b row; done
fi
if has energy; then  # joules per decode kernel at the b64 / throughput shapes (the rows at the 700 W cap), then b64 with
  # down_proj on cuBLAS against the GEMV's wide rows (the default since run 106), ABAB
  step kernel_energy 200 python3 benchmarks/kernel_energy.py --output-json "$R/kernel_energy.json"
  ckpt l8
  for run in a_dflt b_cublas c_cublas d_dflt; do
    if [ "${run#*_}" = cublas ]; then lat l8 64 en_$run GYRFALCON_GEMV_WIDE_ROWS_SHAPES=; else lat l8 64 en_$run; fi
  done
fi
if has attnenergy; then  # decode attention's launch shapes by joules (the throughput row runs at the 700 W cap), then
  # the throughput row with the launch of least energy within 5% of the default's time against the default (AB)
  AC="64,4,2;64,4,2/k0;64,4,3;128,4,2;128,4,3;64,8,2;32,4,2;32,2,2;128,8,3;16,4,2"
  step attn_energy 220 python3 benchmarks/kernel_energy.py --sets b384,b64 --seconds 2 --attn-configs "$AC" \
    --output-json "$R/kernel_energy_attn.json"
  PICK=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['results']['b384'].get('attn_choice') or '')" \
    "$R/kernel_energy_attn.json" 2>/dev/null)
  echo "attention launch picked for the throughput row: '${PICK}'"
  if [ -n "$PICK" ]; then
    ckpt l8
    PENV="GYRFALCON_DECODE_ATTN_CONFIG=${PICK%%/*}"
    [ "$PICK" != "${PICK#*/k}" ] && PENV="$PENV GYRFALCON_DECODE_K_ROWS=${PICK##*/k}"
    tp="$G bench throughput --model /tmp/ck/l8 --num-prompts 768 --input-len 1024 --output-len 1024 --async-scheduling"
    step tput_l8_a_dflt 150 $tp --output-json "$R/throughput_llama-3.1-8b_768x1024_async_ae_a_dflt.json"
    step tput_l8_b_pick 150 env $PENV $tp --output-json "$R/throughput_llama-3.1-8b_768x1024_async_ae_b_pick.json"
  fi
fi
if has ttftline; then  # where b64's TTFT (~190 ms) exceeds its prefill's GPU span (~175 ms): host before / after
  ckpt l8
  for b in 64 16; do lat l8 $b ttl --ttft-timeline; done
fi
if has stepev; then  # the steady step against the bare graph (run 104: the difference is the LM head, run after it)
  ckpt l8
  for b in 16 64 1; do lat l8 $b sev --step-events; done
fi
if has gap; then  # run 104's ~0.26 ms between the decode replays: the copies? (run 105: no, the LM head after the graph)
  step replay_gap 120 python3 benchmarks/replay_gap.py --output-json "$R/replay_gap.json"
  ckpt l8
  for b in 1 16; do
    for run in a_dflt b_ssc0; do
      if [ "${run#*_}" = ssc0 ]; then lat l8 $b gap_$run GYRFALCON_SIDE_STREAM_COPIES=0 --step-events
      else lat l8 $b gap_$run --step-events; fi
    done
  done
fi
if has smifp8; then  # clocks and power through the fp8-cache throughput row and the b64 / b16 latency rows
  ckpt l8
  smi_start "$R/smi_tput_fp8.csv"
  step tput_l8_fp8_smi 200 $G bench throughput --model /tmp/ck/l8 --num-prompts 768 --input-len 1024 \
    --output-len 1024 --async-scheduling --kv-cache-dtype fp8 --max-num-seqs 768 \
    --output-json "$R/throughput_llama-3.1-8b_768x1024_async_fp8kv_768seqs_smi.json"
  smi_stop
  for b in 64 16; do
    smi_start "$R/smi_b$b.csv"
    lat l8 $b smi
    smi_stop
  done
  smi_summary smi_tput_fp8 smi_b64 smi_b16
fi
if has midtile2; then  # MID_TILE_CONFIG with one-tile splits (run 97: at b16 the 256-key splits lost at 320-600
  # tokens, 16.26 / 18.21 / 18.96 vs 13.59 / 16.48 / 18.25 us): GPU kernel and model token tests, the launch ABAB at
  # 320-600 tokens, Llama-8B b16 ABAB at 512-token prompts, AB at 2,048, Qwen3-0.6B b16 AB at 1,024 (~6 min)
  step gpu_midtile_tests 240 python3 -m pytest -q tests/gpu/test_kernels_gpu.py tests/gpu/test_model_gpu.py \
    -k "paged_decode or decode_attention_with_prep or o_proj_merging or bf16_greedy" -p no:cacheprovider
  step midtile_attn_ab2 90 python3 benchmarks/small_m_gemv.py --attn-prep-sweep --prep-batches 16 8 \
    --prep-contexts 320 480 600 --ab-env GYRFALCON_DECODE_MID_TILE --output-json "$R/midtile_attn_ab2.json"
  ckpt l8
  for run in a_1 b_0 c_0 d_1; do lat l8 16 mt512_$run GYRFALCON_DECODE_MID_TILE=${run#*_} --input-len=512; done
  for run in a_1 b_0; do lat l8 16 mt2k_$run GYRFALCON_DECODE_MID_TILE=${run#*_} --input-len=2048; done
  ckpt q06
  for run in a_1 b_0; do lat q06 16 mt1k_$run GYRFALCON_DECODE_MID_TILE=${run#*_} --input-len=1024; done
fi
if has splits3; then  # the main b16 graph at 3 splits (GYRFALCON_DECODE_SPLITS=16:3: one wave of 384 programs where 4
  # splits take 1.3 of 396 slots) at 2,048-token prompts, where all 4 default splits hold keys: Llama-8B b16 ABAB
  ckpt l8
  for run in a_dflt b_s3 c_s3 d_dflt; do
    if [ "${run#*_}" = s3 ]; then lat l8 16 split_$run GYRFALCON_DECODE_SPLITS=16:3 --input-len=2048
    else lat l8 16 split_$run --input-len=2048; fi
  done
fi
if has widerows; then  # Llama-8B's down_proj of 17-64 rows on the GEMV kernel at run 90's best 64-row launch shape
  # (GYRFALCON_GEMV_WIDE_ROWS_SHAPES; 35.0 vs cuBLAS's 36.9 us at 64 rows, L2-cold): its GPU tests, then b64 ABAB
  step gpu_widerows_tests 240 python3 -m pytest -q tests/gpu/test_small_m_gemv_gpu.py tests/gpu/test_model_gpu.py \
    -k "wide_row or wide-rows" -p no:cacheprovider
  ckpt l8
  W64="4096x14336=32,256,4,4"
  for run in a_dflt b_down c_down d_dflt; do
    if [ "${run#*_}" = down ]; then lat l8 64 wrows_$run GYRFALCON_GEMV_WIDE_ROWS_SHAPES=$W64; else lat l8 64 wrows_$run; fi
  done
fi
if has widerows2; then  # run 94's +0.3% at b64 (down_proj of 17-64 rows on the GEMV kernel), once more on another card
  ckpt l8
  for run in a_dflt b_down c_down d_dflt; do
    if [ "${run#*_}" = down ]; then lat l8 64 wrows2_$run GYRFALCON_GEMV_WIDE_ROWS_SHAPES="4096x14336=32,256,4,4"
    else lat l8 64 wrows2_$run; fi
  done
fi
if has pdlplain; then  # the batched graphs under PDL with the plain kernels: no attention prefetch, no peeled GEMV tile
  # (runs 84 / 87 ran the batch-1 graphs' PDL variants there and lost; the attention prefetch lost alone too, run 87)
  step gpu_pdlplain_model 200 python3 -m pytest -q tests/gpu/test_model_gpu.py -k pdl-plain -p no:cacheprovider
  ckpt l8
  PP="GYRFALCON_PDL_ROWS=16 GYRFALCON_ATTN_PREFETCH=0 GYRFALCON_GEMV_PEEL=0"
  for run in a_dflt b_pp c_pp d_dflt; do
    if [ "${run#*_}" = pp ]; then lat l8 16 pdlp_$run $PP; else lat l8 16 pdlp_$run; fi
  done
  ckpt q06
  lat q06 16 pdlp_a_dflt
  lat q06 16 pdlp_b_pp $PP
fi
if has sidecopies; then  # the decode steps' host <-> device copies off the compute stream vs in it
  step gpu_side_copies 200 python3 -m pytest -q tests/gpu/test_model_gpu.py -k "inline-copies" -p no:cacheprovider
  ckpt q06; ckpt l8
  for run in a_0 b_1 c_1 d_0; do
    lat q06 1 side_$run GYRFALCON_SIDE_STREAM_COPIES=${run#*_}
    lat l8 64 side_$run GYRFALCON_SIDE_STREAM_COPIES=${run#*_}
  done
fi
if has sidetput; then  # the throughput row with the decode steps' copies on side streams vs in the compute stream
  ckpt l8
  for run in a_0 b_1; do
    step tput_l8_side_$run 150 env GYRFALCON_SIDE_STREAM_COPIES=${run#*_} $G bench throughput --model /tmp/ck/l8 \
      --num-prompts 768 --input-len 1024 --output-len 1024 --async-scheduling \
      --output-json "$R/throughput_llama-3.1-8b_768x1024_async_side_$run.json"
  done
fi
if has stepgaps; then  # the device's idle time inside decode steps; the LM head in the graph or after it
  ckpt q06; ckpt l8
  lat q06 1 gaps --profile
  lat l8 16 gaps --profile
  lat l8 64 gaps --profile
  step gpu_graph_logits 200 python3 -m pytest -q tests/gpu/test_model_gpu.py -k "graph-logits" -p no:cacheprovider
  for run in a_0 b_1 c_1 d_0; do
    lat q06 1 glogits_$run GYRFALCON_GRAPH_LOGITS=${run#*_}
    lat l8 64 glogits_$run GYRFALCON_GRAPH_LOGITS=${run#*_}
  done
fi
if has rows64; then  # cuBLAS's split-K down_proj at b64 (78% of HBM, plus its reduce) against the GEMV kernel's
  ckpt l8
  for run in a_16 b_64 c_64 d_16; do lat l8 64 rows_$run GYRFALCON_SMALL_M_PLAIN_ROWS=${run#*_}; done
fi
if has onepass; then  # one block-wide reduction fewer after each batch-1 norm GEMV's PDL wait
  step gpu_one_pass 150 python3 -m pytest -q tests/gpu/test_small_m_gemv_gpu.py -k test_matches_reference \
    -p no:cacheprovider
  step gpu_model_one_pass 250 python3 -m pytest -q tests/gpu/test_model_gpu.py -k "one-pass-b1" -p no:cacheprovider
  ckpt q06
  for run in a_0 b_1 c_1 d_0; do lat q06 1 op_$run GYRFALCON_GEMV_ONE_PASS_NORM_B1=${run#*_}; done
  ckpt l8
  for run in a_0 b_1; do lat l8 1 op_$run GYRFALCON_GEMV_ONE_PASS_NORM_B1=${run#*_}; done
fi
if has onepassab; then  # the auto rule as shipped, against the first pass everywhere
  ckpt q06
  for run in a_auto b_0 c_0 d_auto; do lat q06 1 opd_$run GYRFALCON_GEMV_ONE_PASS_NORM_B1=${run#*_}; done
  lat q06 1 opd_prof --profile
fi
if has gemvchain; then  # launch shapes chosen in the chain, where the work after each wait counts
  step gemv_chain 420 python3 benchmarks/small_m_gemv.py --gemv-chain-sweep --output-json "$R/gemv_chain.json"
  # Each GEMV's best shape in the chain, where >= 1% faster than its default, put in place of that default
  # (small_m_gemv.B1_CHAIN_SHAPES) and tried together in the model (GYRFALCON_GEMV_B1_SHAPES), Qwen3-0.6B b1 ABAB
  # against the defaults. (Run 76 ran this against the shapes before the table, GYRFALCON_GEMV_B1_SHAPES="".)
  SHAPES=$(python3 - "$R/gemv_chain.json" <<'PY' 2>/dev/null
import json, sys
from gyrfalcon.kernels.small_m_gemv import B1_CHAIN_SHAPES
best = {}  # (N, K) -> (speedup, BLOCK_N, warps)
for r in json.load(open(sys.argv[1]))["pdl_chain"]:
    nk = (r.get("n"), r.get("k"))
    if "error" not in r and r["gemv"] != "default" and r["speedup_vs_default"] >= 1.01 \
            and r["speedup_vs_default"] > best.get(nk, (0,))[0]:
        best[nk] = (r["speedup_vs_default"], r["block_n"], r["num_warps"])
if best:
    shapes = dict(B1_CHAIN_SHAPES) | {nk: (bn, w) for nk, (_, bn, w) in best.items()}
    print(";".join(f"{n}x{k}={bn},{w}" for (n, k), (bn, w) in shapes.items()))
PY
)
  echo "gemv chain sweep picks: ${SHAPES:-none}"
  if [ -n "$SHAPES" ]; then
    ckpt q06
    for run in a_dflt b_pick c_pick d_dflt; do
      if [ "${run#*_}" = pick ]; then lat q06 1 shapes_$run "GYRFALCON_GEMV_B1_SHAPES=$SHAPES"
      else lat q06 1 shapes_$run; fi
    done
  fi
fi
if has chainenv; then  # the chain's other launches, shaped in the chain
  # CHAIN_ENVS: the switches and values (NAME=V1/V2/..., space-separated); CHAIN_CTX: the chain's contexts. Run 77
  # (decode attention 64,8/64,4/128,4/128,16/256,8, reduce warps 1/2/8 at 256 tokens) found the 64-key tiles now
  # the default (B1_SPLIT_TILE); the defaults below swept around them in run 78 (none taken: 32-key tiles and 8
  # splits won at 256 tokens and lost at 1,024-4,096).
  CE_ARGS=()
  for spec in ${CHAIN_ENVS-GYRFALCON_DECODE_ATTN_CONFIG=128,8/32,4/32,8/64,4/64,16/64,8,2/64,8,4 \
      GYRFALCON_DECODE_PREFETCH_SPLITS=8/32 GYRFALCON_DECODE_REDUCE_WARPS=2/8}; do CE_ARGS+=(--chain-env "$spec"); done
  step chain_env 300 python3 benchmarks/small_m_gemv.py "${CE_ARGS[@]}" --chain-ctx ${CHAIN_CTX-256 1024 4096} \
    --output-json "$R/chain_env.json"
  # Each switch's best value in the chain at 256 tokens (the latency row's contexts), where >= 1% faster than
  # unset, all together in the model: Qwen3-0.6B b1 ABAB against the defaults (one VAR=VALUE a line).
  mapfile -t PICKS < <(python3 - "$R/chain_env.json" <<'PY' 2>/dev/null
import json, sys
best = {}
for r in json.load(open(sys.argv[1]))["pdl_chain"]:
    if "error" not in r and r["value"] != "unset" and r["speedup_vs_unset"] >= 1.01 and r.get("ctx", 256) == 256:
        if r["speedup_vs_unset"] > best.get(r["env"], (0, None))[0]:
            best[r["env"]] = (r["speedup_vs_unset"], r["value"])
for name, (_, value) in best.items():
    print(f"{name}={value}")
PY
)
  echo "chain env picks: ${PICKS[*]:-none}"
  if [ ${#PICKS[@]} -gt 0 ]; then
    ckpt q06
    for run in a_dflt b_pick c_pick d_dflt; do
      if [ "${run#*_}" = pick ]; then lat q06 1 env_$run "${PICKS[@]}"; else lat q06 1 env_$run; fi
    done
  fi
fi
if has b1tile; then  # batch-1 decode attention's 64-key split tiles (the default since run 77) against 128-key ones
  ckpt q06
  for run in a_64 b_128 c_128 d_64; do
    if [ "${run#*_}" = 128 ]; then lat q06 1 tile_$run GYRFALCON_DECODE_ATTN_CONFIG=128,8; else lat q06 1 tile_$run; fi
  done
  for run in a_64 b_128; do  # 4,096-token prompts: 16 splits of 4 tiles against 2
    if [ "${run#*_}" = 128 ]; then lat q06 1 tile4k_$run GYRFALCON_DECODE_ATTN_CONFIG=128,8 --input-len=4096
    else lat q06 1 tile4k_$run --input-len=4096; fi
  done
fi
if has gemv16; then  # 16-row GEMV launch shapes (split-K, 8 warps, deeper pipelines) for Llama-8B's b16 GEMMs
  step gpu_gemv16_tests 150 python3 -m pytest -q tests/gpu/test_small_m_gemv_gpu.py -k wide_row -p no:cacheprovider
  step gemv16_sweep 330 python3 benchmarks/small_m_gemv.py --skip-attention --wide --ms 16 \
    --shapes l8_o l8_down l8_qkv_plain --output-json "$R/gemv16_sweep.json"
  # A shape's best launch where >= 2% faster than what the b16 graph runs now: the GEMV kernel's default shape
  # (ROWS_SHAPES' since run 83), or cuBLAS (the sweep's "unfused") for a qkv not in the table; all together in the
  # model (the table's other entries kept), Llama-8B b16 ABAB.
  PICK=$(python3 - "$R/gemv16_sweep.json" <<'PY' 2>/dev/null
import json, sys
from gyrfalcon.kernels.small_m_gemv import ROWS_SHAPES
table, changed = dict(ROWS_SHAPES), False
for r in json.load(open(sys.argv[1]))["gemv"]:
    listed = (r["N"], r["K"]) in table
    now = r["unfused_us"] if r["shape"].endswith("_plain") and not listed else r["default_us"]
    if r["best_us"] <= 0.98 * now:
        table[r["N"], r["K"]], changed = tuple(r["best_config"]), True
if changed:
    print(";".join(f"{n}x{k}=" + ",".join(map(str, c)) for (n, k), c in table.items()))
PY
)
  echo "gemv16 sweep picks: ${PICK:-none}"
  if [ -n "$PICK" ]; then
    ckpt l8
    for run in a_dflt b_pick c_pick d_dflt; do
      if [ "${run#*_}" = pick ]; then lat l8 16 g16_$run "GYRFALCON_GEMV_ROWS_SHAPES=$PICK"; else lat l8 16 g16_$run; fi
    done
  fi
fi
if has gemv16ab; then  # ROWS_SHAPES (run 83's 16-row launch shapes, qkv off cuBLAS; the default since) vs none
  step gpu_small_m_gemv 200 python3 -m pytest -q tests/gpu/test_small_m_gemv_gpu.py -p no:cacheprovider
  step gpu_model_rows 200 python3 -m pytest -q tests/gpu/test_model_gpu.py -p no:cacheprovider \
    -k "llama and (graphs or eager or gemv-rows or cublas-rows or prefill-graphs)"
  ckpt l8
  for run in a_rows b_none c_none d_rows; do
    if [ "${run#*_}" = none ]; then lat l8 16 rows_$run GYRFALCON_GEMV_ROWS_SHAPES=; else lat l8 16 rows_$run; fi
  done
fi
if has overlap; then  # attention of one half-batch beside the other half's GEMMs, on two streams (NanoFlow)
  step overlap_probe 150 python3 benchmarks/overlap_probe.py --output-json "$R/overlap_probe.json"
fi
if has attntput; then  # decode attention at the throughput benchmark's batch (64 / 256) and contexts (1-2k)
  step attn_tput 300 python3 benchmarks/small_m_gemv.py --attn-tput --output-json "$R/decode_attn_tput.json"
  # A decode step where the throughput benchmark runs (batch 256, ~1k tokens of context): its kernel profile
  [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  step lat_l8_b256 150 $G bench latency --model /tmp/ck/l8 --batch-size 256 --input-len 1024 --output-len 32 \
    --max-num-seqs 256 --profile --output-json "$R/latency_llama-3.1-8b_b256_in1024.json"
fi
if has fp8attn; then  # decode attention on the fp8 KV cache (V widened in its row layout, pinned there by an asm
  # statement since run 53) at the throughput row's batches and contexts: its GPU tests, then its launch shapes and
  # bf16's, side by side
  step gpu_fp8_kernels 150 python3 -m pytest -q tests/gpu/test_kernels_gpu.py -k fp8 -p no:cacheprovider
  step attn_tput_fp8 280 python3 benchmarks/small_m_gemv.py --attn-tput --fp8 --output-json "$R/decode_attn_tput_fp8.json"
  [ "${ATTN_BF16:-1}" = 1 ] && step attn_tput_bf16 240 python3 benchmarks/small_m_gemv.py --attn-tput \
    --output-json "$R/decode_attn_tput_bf16.json"  # ATTN_BF16=0: the fp8 sweep alone
fi
if has pdlchain; then  # a Qwen3-0.6B decode layer's batch-1 kernels, 28 layers in a graph: PDL off / serialized / on,
  # on distinct weights and on one layer's weights shared by all (L2-resident: the bound of prefetching weights)
  step pdl_chain 150 python3 benchmarks/small_m_gemv.py --pdl-chain --output-json "$R/pdl_chain.json"
fi
if has ncu; then  # short-context decode kernels under Nsight Compute (benchmarks/ncu_probe.py): batch-64 / 16 attention,
  # Qwen3-0.6B batch 1's attention + reduce + o_proj vs the merged graph's two kernels; graph timings first
  step ncu_probe_time 120 python3 benchmarks/ncu_probe.py --output-json "$R/ncu_probe.json"
  step ncu_probe 300 ncu --clock-control none --nvtx --nvtx-include "probe/" --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
    --section SchedulerStats python3 benchmarks/ncu_probe.py --ncu
fi
if has ncusrc; then  # where the batch-1 and batch-64 decode attention launches stall, by SASS instruction: ncu's PC
  # sampling (SourceCounters) over one launch each, exported as CSV (ncu --page source). NCU_CASES: other cases of
  # benchmarks/ncu_probe.py (attn_b16: the b16 graphs' wide tile, 9-11 us against ~3 us of K/V at HBM speed)
  for c in ${NCU_CASES:-b1_main attn_b64}; do
    step ncu_src_$c 150 ncu --clock-control none --nvtx --nvtx-include "probe/" -k regex:_decode_split_kernel -c 1 \
      --section SourceCounters --section WarpStateStats --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section LaunchStats --section Occupancy --import-source yes -o "$R/ncu_src_$c" \
      python3 benchmarks/ncu_probe.py --ncu --only $c
    step ncu_src_${c}_csv 60 ncu -i "$R/ncu_src_$c.ncu-rep" --page source --csv --print-source sass
    step ncu_src_${c}_details 60 ncu -i "$R/ncu_src_$c.ncu-rep" --page details
  done
fi
if has ktests; then  # the kernel tests alone (the model tests take minutes; run 55 passed 129 of them in 120 s)
  step gpu_kernel_tests 240 python3 -m pytest -q tests/gpu/test_kernels_gpu.py tests/gpu/test_small_m_gemv_gpu.py \
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
if has fp8kv; then  # --kv-cache-dtype fp8 (K/V as float8 e4m3) against the bf16 cache: the throughput row at 768
  # sequences (twice the tokens fit) and at the default, then Llama b64 (its GPU tests unless fp8attn ran them)
  has fp8attn || has ktests || step gpu_fp8_kernels 150 python3 -m pytest -q tests/gpu/test_kernels_gpu.py -k fp8 -p no:cacheprovider
  [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  tp="$G bench throughput --model /tmp/ck/l8 --num-prompts 768 --input-len 1024 --output-len 1024 --async-scheduling"
  step tput_l8_fp8_768seqs 300 $tp --kv-cache-dtype fp8 --max-num-seqs 768 \
    --output-json "$R/throughput_llama-3.1-8b_768x1024_async_fp8kv_768seqs.json"
  step tput_l8 300 $tp --output-json "$R/throughput_llama-3.1-8b_768x1024_async.json"
  l8="$G bench latency --model /tmp/ck/l8 --batch-size 64 --input-len 128 --output-len 128 --max-num-seqs 64 --profile"
  step lat_l8_b64_fp8 90 $l8 --kv-cache-dtype fp8 --output-json "$R/latency_llama-3.1-8b_b64_fp8kv.json"
  step lat_l8_b64 90 $l8 --output-json "$R/latency_llama-3.1-8b_b64.json"
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
if has gemmblas; then  # decode-sized GEMMs (a throughput run's 288-384 decoders ran them at ~550 TFLOP/s) under
  # the two BLAS back ends torch can pick: does cuBLASLt's heuristic choose better kernels there?
  step gemm_blas 120 python3 benchmarks/prefill_gemm_m.py --ms 64 128 256 288 320 384 448 512 \
    --blas cublas cublaslt --rounds 4 --reps 20 --output-json "$R/gemm_blas.json"
fi
if has attnreal; then  # decode attention as a throughput run holds it (consecutive vs scattered blocks over the whole
  # 54,835-block pool, ctx 1024 / 1025 / 2047, plain and fused-prep kernels) at 288 and 384 sequences
  step attn_real 150 python3 benchmarks/small_m_gemv.py --attn-real --output-json "$R/attn_real.json"
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
if has gemmm; then  # cuBLAS on a prefill step's GEMMs at round vs odd token counts (would padding M pay?)
  step prefill_gemm_m 120 python3 benchmarks/prefill_gemm_m.py --output-json "$R/prefill_gemm_m.json"
fi
if has foldnorms; then  # the layers' norms folded into the GEMMs around them vs the default, in one call
  step gpu_tokens_fold 200 python3 -m pytest -q tests/gpu/test_model_gpu.py -k folded \
    -p no:cacheprovider
  [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  for br in 64:a_0 64:b_1 64:c_1 64:d_0 16:a_0 16:b_1; do
    B=${br%:*} run=${br#*:}
    step lat_l8_b${B}_fold_$run 90 env GYRFALCON_FOLD_NORMS=${run#*_} $G bench latency --model /tmp/ck/l8 \
      --batch-size $B --input-len 128 --output-len 128 --max-num-seqs $B --profile \
      --output-json "$R/latency_llama-3.1-8b_b${B}_fold${run#*_}_$run.json"
  done
  tp="bench throughput --model /tmp/ck/l8 --num-prompts 768 --input-len 1024 --output-len 1024 --async-scheduling"
  for run in a_1 b_0; do
    step tput_l8_fold_$run 150 env GYRFALCON_FOLD_NORMS=${run#*_} $G $tp \
      --output-json "$R/throughput_llama-3.1-8b_768x1024_async_fold${run#*_}_$run.json"
  done
fi
if has skinny; then  # the stream-K GEMM against cuBLAS: kernel, layer GEMMs, whole decode steps
  step gpu_skinny_tests 150 python3 -m pytest -q tests/gpu/test_skinny_gemm_gpu.py -p no:cacheprovider --durations=4
  step gpu_tokens_skinny 100 python3 -m pytest -q tests/gpu/test_model_gpu.py -k skinny -p no:cacheprovider
  step skinny_bench 200 python3 benchmarks/skinny_gemm.py --preset llama-3.1-8b qwen3-0.6b --ms 16 64 128 --sweep \
    --output-json "$R/skinny_gemm.json"
  [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  for br in 64:a_0 64:b_128 64:c_128 64:d_0 16:a_0 16:b_128; do
    B=${br%:*} run=${br#*:}
    step lat_l8_b${B}_skinny_$run 90 env GYRFALCON_SKINNY_GEMM_ROWS=${run#*_} $G bench latency --model /tmp/ck/l8 \
      --batch-size $B --input-len 128 --output-len 128 --max-num-seqs $B --profile \
      --output-json "$R/latency_llama-3.1-8b_b${B}_skinny${run#*_}_$run.json"
  done
fi
if has normbound; then  # the decode step without the layers' RMSNorm launches (meaningless tokens, real shapes):
  # the upper bound on folding the norms into the GEMMs around them, beside the unmodified command
  [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  for br in 64:a_plain 64:b_bound 64:c_bound 64:d_plain 16:a_plain 16:b_bound; do
    B=${br%:*} run=${br#*:}
    flag=; [[ $run == *bound ]] && flag=--pass-through
    step lat_l8_b${B}_normbound_$run 90 python3 benchmarks/norm_bound.py $flag bench latency --model /tmp/ck/l8 \
      --batch-size $B --input-len 128 --output-len 128 --max-num-seqs $B --profile \
      --output-json "$R/latency_llama-3.1-8b_b${B}_normbound_$run.json"
  done
fi
if has graphlogits64; then  # LM head + greedy argmax inside the decode graph at Llama-8B b16 / b64, where the eager
  # LM head and argmax add ~280 us plus their launches to the 4.94 ms graph (b64, run 32); at b1 it was a wash
  # (run 16: Qwen3-0.6B 0.747 vs 0.750 ms). Off / on / on / off per batch size.
  [ -f /tmp/ck/l8/config.json ] || step ckpt_l8 150 $G bench make-checkpoint --preset llama-3.1-8b --out /tmp/ck/l8
  for B in 64 16; do
    for run in ${GL_RUNS:-a_0 b_1 c_1 d_0}; do  # GL_RUNS="a_0 b_1": one pair per batch size
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
# A second run of this script in the same call (run 72 ran two) appends to the first one's tar, not over it.
(cd "$OUT" && if [ -f results.tar ]; then tar rf results.tar results; else tar cf results.tar results; fi && rm -rf results)
echo "=== done in $(( $(date +%s) - START )) s"
