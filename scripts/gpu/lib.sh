# Shared by scripts/gpu/*.sh (sourced, not run): environment, a time-boxed `step`, random-weight checkpoints,
# and packing $OUT/results into $OUT/results.tar at the end.
# The device machine's copy of the tree may carry a stale .git: pass GYRFALCON_COMMIT=<local HEAD as a literal
# hash> (a $(git rev-parse) inside the device command would read that stale copy) so each JSON records the commit
# that ran. OUT (default /tmp/gyrfalcon-out) is where results go; BUDGET (default 570) is the seconds the whole
# script may take: each step gets at most its own limit and what is left, and a failing step does not stop the rest.
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
[ -n "${GYRFALCON_COMMIT:-}" ] || echo "note: GYRFALCON_COMMIT is unset; the JSON records what git finds here"
OUT=${OUT:-/tmp/gyrfalcon-out}
R=$OUT/results
mkdir -p "$R"
START=$(date +%s)
BUDGET=${BUDGET:-570}
G="python3 -m gyrfalcon.cli"

step() {  # step NAME SECONDS CMD...: run CMD with a time limit, its output in $R/NAME.log, its tail printed
  local name=$1 secs=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) - 15 ))
  if [ "$left" -lt 20 ]; then echo "=== $name skipped: out of time"; return; fi
  [ "$secs" -gt "$left" ] && secs=$left
  echo "=== $name ($(( $(date +%s) - START )) s elapsed)"
  timeout "$secs" "$@" 2>&1 | tee "$R/$name.log" | grep -vE "^\s*$|Warning|warn\(" | tail -n 25
  echo "=== $name exit ${PIPESTATUS[0]}"
}

ckpt() {  # ckpt q06|l8: the random-weight checkpoint of Qwen3-0.6B's / Llama-3.1-8B's shape under /tmp/ck, once
  local preset=qwen3-0.6b secs=60
  [ "$1" = l8 ] && preset=llama-3.1-8b secs=150
  [ -f /tmp/ck/$1/config.json ] || step ckpt_$1 $secs $G bench make-checkpoint --preset $preset --out /tmp/ck/$1
}

cfg() {  # cfg NAME PRESET LAYERS [--fp8]: config.json + tokenizer, no weights (for --load-format dummy), under
  # /tmp/cfg/NAME, once: the way to run shapes whose checkpoints would not fit the machine's disk beside the others
  local name=$1 preset=$2 layers=$3; shift 3
  [ -f /tmp/cfg/$name/config.json ] || step cfg_$name 60 $G bench make-checkpoint --preset $preset \
    --num-layers $layers --config-only "$@" --out /tmp/cfg/$name
}

banner() {
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)"
}

finish() {  # a second script in the same call appends to the first one's tar
  (cd "$OUT" && if [ -f results.tar ]; then tar rf results.tar results; else tar cf results.tar results; fi \
    && rm -rf results)
  echo "=== done in $(( $(date +%s) - START )) s"
}
