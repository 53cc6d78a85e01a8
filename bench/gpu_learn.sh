#!/usr/bin/env bash
# bench/learn.py on the GPU machine: the real model (SmolLM2-135M-Instruct) learns the task (issue 34).
# First bring the model and the wheels there with bench/gpu_carry.sh (two calls), then, on the same warm
# machine:   bash bench/gpu_learn.sh [learn.py options]      (results: bench/results/learn_gpu.json, and $OUT)
#            bash bench/gpu_learn.sh table5 [options]        (bench/table5_mini.py --gpu: table5_mini.json;
#                                                              its MMA judges: learn.py's checkpoint if it ran,
#                                                              else one it trains first, 200 steps)
# Every phase of learn.py resumes: a run cut off by the time limit goes on where it stopped when run again.
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=/tmp/longsft_carry
MODEL=$DEST/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$MODEL" ] || { echo "no model at $MODEL: run bench/gpu_carry.sh receive first (see its header)" >&2; exit 2; }
site=$(mktemp -d)
mkdir -p "$site/longsft"
for pkg in train eval recipes ds_configs launch; do ln -sfn "$PWD/$pkg" "$site/longsft/$pkg"; done
export PYTHONPATH="$site:$DEST/site:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 LONGSFT_CACHE=/tmp/longsft_cache
# What a run left, without weights or data, to $OUT (also after a cut-off run): logs, state, metrics, evals.
keep() {  # keep DIR NAME
  [ -n "${OUT:-}" ] && tar czf "$OUT/$2.tgz" -C "$1" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' \
    --exclude='./data' --exclude='./sample' . 2>/dev/null || true
}
# Stopped by SIGTERM before the device call's 600 s (LIMIT): the trainer saves a checkpoint on it, and a
# rerun resumes there; `timeout` signals the whole process group (learn.py, torchrun, its workers).
LIMIT=${LIMIT:-530}
if [ "${1:-}" = table5 ]; then
  shift
  # the MMA judges: the checkpoints learn.py --gpu trained (its first stage's best and its latest stage's
  # best), when it ran first on this machine
  mapfile -t judges < <(python3 -c 'import json, os
s = json.load(open("/tmp/longsft_learn_gpu/run/state.json"))["stages"]
best = [b for b in (f"/tmp/longsft_learn_gpu/run/stages/{n}/best" for n in s) if os.path.isdir(b)]
for b in dict.fromkeys(best[-1:] + best[:1]): print(b)' 2>/dev/null)
  judge_args=()
  for j in "${judges[@]}"; do judge_args+=(--judge-model "$j"); done
  if [ ${#judge_args[@]} -gt 0 ]; then
    echo "MMA judges: ${judges[*]}"
  else
    echo "MMA judges: none from learn.py on this machine: table5_mini.py trains its own first (--judge-steps)" >&2
  fi
  timeout -s TERM -k 30 "$LIMIT" python3 bench/table5_mini.py --gpu --model "$MODEL" --out /tmp/longsft_table5_gpu \
    "${judge_args[@]}" "$@"
  rc=$?
  if [ -n "${OUT:-}" ]; then cp bench/results/table5_mini.json /tmp/longsft_table5_gpu/table5.md "$OUT"/ 2>/dev/null || true; fi
  keep /tmp/longsft_table5_gpu table5_state
  exit $rc
fi
timeout -s TERM -k 30 "$LIMIT" python3 bench/learn.py --gpu --model "$MODEL" --out /tmp/longsft_learn_gpu "$@"
rc=$?
if [ -n "${OUT:-}" ]; then cp bench/results/learn_gpu.json /tmp/longsft_learn_gpu/report.md "$OUT"/ 2>/dev/null || true; fi
keep /tmp/longsft_learn_gpu learn_state
exit $rc
