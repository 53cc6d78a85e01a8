#!/usr/bin/env bash
# bench/learn.py on the GPU machine: the real model (SmolLM2-135M-Instruct) learns the task (issue 34).
# First bring the model and the wheels there with bench/gpu_carry.sh (two calls), then, on the same warm
# machine:   bash bench/gpu_learn.sh [learn.py options]      (results: bench/results/learn_gpu.json, and $OUT;
#                                                              then bench/retest.py: learn_gpu_retest.json)
#            bash bench/gpu_learn.sh table5 [options]        (bench/table5_mini.py --gpu: table5_mini.json;
#                                                              its MMA judges: two of learn.py's checkpoints if
#                                                              it ran, else two it trains first, 200 steps each)
# Every phase of both resumes: a run cut off goes on where it stopped when run again on the same machine.
# LIMIT (seconds, default 530): the run's own limit, after which it is stopped by SIGTERM and its results
# copied to $OUT. It must end before the device call does: a call's limit is its timeout_s or the session's
# device time left, whichever is less, so on a late call set LIMIT to that less about 70 s (the copy, the
# transfers). Its results file and state also go to $OUT every 30 s while it runs, so that even a call cut off
# from outside returns what was measured up to then.
# On a fresh machine (a later allocation), a run goes on from the state a cut-off one returned: put its
# learn_state.tgz / table5_state.tgz (from $OUT) in .carry/ here and name it in the call's carry list. The
# archive holds no weights, and for learn.py no data (made again, the same files: seeded): what it finished
# (Table 5's data and MMA data, evaluations) is kept, a training run not yet evaluated is trained again
# (bench/restore.py), an unfinished MMA phase starts over. `table5 --smoke` has a folder and archive of its
# own (table5_smoke_state.tgz): a smoke run never meets the full run's state.
set -uo pipefail
cd "$(dirname "$0")/.."
# the warm machine's folder outside the checkout (a rehearsal sets another); as Python resolves it, so that
# the run's trainers are found by their run_dir below
TMP=$(realpath -m "${LONGSFT_DEVICE_TMP:-/tmp}")
DEST=$TMP/longsft_carry LEARN=$TMP/longsft_learn_gpu T5=$TMP/longsft_table5_gpu T5_STATE=table5_state
for arg in "$@"; do
  if [ "$arg" = --smoke ]; then T5=${T5}_smoke T5_STATE=table5_smoke_state; fi
done
MODEL=$DEST/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$MODEL" ] || { echo "no model at $MODEL: run bench/gpu_carry.sh receive first (see its header)" >&2; exit 2; }
site=$(mktemp -d)
mkdir -p "$site/longsft"
for pkg in train eval recipes ds_configs launch; do ln -sfn "$PWD/$pkg" "$site/longsft/$pkg"; done
export PYTHONPATH="$site:$DEST/site:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 LONGSFT_CACHE=$TMP/longsft_cache
LIMIT=${LIMIT:-530}
started=$site/started  # results files older than this run are not its own (a committed one, say)
touch "$started"

keep() {  # keep DIR NAME: what the run has left, without weights or data, to $OUT as NAME.tgz: logs, state,
  # metrics, evaluations; and the results files (bench/results/*.json) this run wrote
  [ -n "${OUT:-}" ] && [ -d "$1" ] || return 0
  # (exit 1: a file changed while it was read, the run going on; the archive is still whole)
  tar czf "$OUT/.$2.tgz" -C "$1" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' \
    --exclude='./data' --exclude='./sample' . 2>/dev/null
  if [ $? -le 1 ]; then mv "$OUT/.$2.tgz" "$OUT/$2.tgz"; else rm -f "$OUT/.$2.tgz"; fi
  local result
  for result in bench/results/*.json; do
    if [ "$result" -nt "$started" ]; then
      cp "$result" "$OUT/.${result##*/}" && mv "$OUT/.${result##*/}" "$OUT/${result##*/}"
    fi
  done
  for f in "$1"/report.md "$1"/table5.md; do
    if [ -f "$f" ] && [ "$f" -nt "$started" ]; then cp "$f" "$OUT"/; fi
  done
  return 0
}

restore() {  # restore DIR NAME: DIR from .carry/NAME.tgz where DIR is not on this machine
  [ ! -d "$1" ] && [ -f ".carry/$2.tgz" ] || return 0
  rm -rf "$1.partial" && mkdir -p "$1.partial" && tar xzf ".carry/$2.tgz" -C "$1.partial" 2>/dev/null \
    && mv "$1.partial" "$1" || { rm -rf "$1.partial"; echo ".carry/$2.tgz: not a whole state archive" >&2; exit 2; }
  echo "restored $1 from .carry/$2.tgz (no weights: bench/restore.py)"
  if [ "$2" = "$T5_STATE" ]; then  # the MMA phase's answers come from its judges, which were on the other
    # machine: an unfinished MMA phase starts over, with judges chosen here
    [ -f "$1/mma.jsonl" ] || rm -f "$1/mma.jsonl.cache.jsonl" "$1/judges.txt"
  fi
  return 0
}

run() {  # run DIR NAME COMMAND...: COMMAND under LIMIT, kept to $OUT every 30 s and at its end
  local dir=$1 name=$2; shift 2
  # (its output to /dev/null: a sleep it leaves behind must not hold the call's output open)
  ( while sleep 30; do keep "$dir" "$name"; done ) > /dev/null 2>&1 &
  local snapshots=$!
  # `timeout` signals its process group (this script's Python and torchrun); torchrun passes SIGTERM on to
  # its workers, which run in sessions of their own: the trainer saves a checkpoint at its next step, and a
  # rerun resumes there
  timeout -s TERM -k 30 "$LIMIT" "$@"
  local rc=$?
  # stopped: the trainer's ranks may still be saving their checkpoint; the last snapshot and a rerun wait
  # for them (at most 60 s), so that no two trainers write one run folder
  for _ in $(seq 60); do pgrep -f "run_dir=$dir/" > /dev/null 2>&1 || break; sleep 1; done
  pkill -P "$snapshots" 2>/dev/null; kill "$snapshots" 2>/dev/null
  wait "$snapshots" 2>/dev/null
  keep "$dir" "$name"
  return $rc
}

if [ "${1:-}" = table5 ]; then
  shift
  restore "$T5" "$T5_STATE"
  # the MMA judges: the checkpoints learn.py --gpu trained (its latest finished stage's best and its first
  # stage's best), when it ran first on this machine: only stages it finished (a stage cut off has a best
  # from before its labels settled) and with weights here (not restored from an archive)
  mapfile -t judges < <(python3 -c 'import glob, json, sys
s = json.load(open(f"{sys.argv[1]}/run/state.json"))["stages"]
best = [f"{sys.argv[1]}/run/stages/{n}/best" for n, st in s.items() if st["status"] == "done"]
for b in dict.fromkeys(b for b in best[-1:] + best[:1] if glob.glob(f"{b}/*.safetensors")): print(b)' "$LEARN" 2>/dev/null)
  # two or none: one checkpoint (only learn.py's first stage finished) would leave judge B sampling from it,
  # its requests served one at a time; without two, table5_mini.py trains two of its own
  [ ${#judges[@]} -ge 2 ] || judges=()
  # once chosen, the same judges on every rerun: MMA's answers so far are cached per judge
  [ -f "$T5/judges.txt" ] && mapfile -t judges < "$T5/judges.txt"
  mkdir -p "$T5" && printf '%s\n' "${judges[@]}" | sed '/^$/d' > "$T5/judges.txt"
  judge_args=()
  for j in "${judges[@]}"; do [ -n "$j" ] && judge_args+=(--judge-model "$j"); done
  # the MMA phase serves the generator and both judges at once, three processes on the one GPU: a GPU that
  # takes one process at a time (compute mode Exclusive_Process) would fail it after minutes; say so now
  mode=$(nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>/dev/null | head -1)
  if [ ! -f "$T5/mma.jsonl" ] && [ -n "$mode" ] && [ "$mode" != Default ]; then
    echo "the GPU's compute mode is $mode: Table 5's MMA phase runs three model servers on it at once" >&2
    exit 2
  fi
  if [ -f "$T5/mma.jsonl" ]; then
    echo "MMA data made: no judges needed"
  elif [ ${#judge_args[@]} -gt 0 ]; then
    echo "MMA judges: ${judges[*]}"
  else
    echo "MMA judges: none from learn.py on this machine: table5_mini.py trains its own first (--judges, --judge-steps)" >&2
  fi
  run "$T5" "$T5_STATE" \
    python3 bench/table5_mini.py --gpu --model "$MODEL" --out "$T5" "${judge_args[@]}" "$@"
  exit $?
fi
restore "$LEARN" learn_state
run "$LEARN" learn_state \
  python3 bench/learn.py --gpu --model "$MODEL" --out "$LEARN" --retest-seed 2026 "$@" || exit $?
# then the final checkpoint and the base model on fresh items (seed 2026, the run's test size): the ones the
# CPU runs were tested again on (bench/retest.py), where learn.py's test shares its first 200 items with the
# set the CPU runs' settings were chosen on. Two evaluations (not yet timed on a GPU); what is left of LIMIT,
# else on a rerun (which, on a fresh machine, trains learn.py's run again if this one had not evaluated it)
LIMIT=$((LIMIT - SECONDS))
if [ "$LIMIT" -lt 60 ]; then
  echo "learn.py done; no time left in LIMIT for bench/retest.py: run the same command again" >&2
  exit 124
fi
run "$LEARN" learn_state \
  python3 bench/retest.py --run "$LEARN" --seed 2026 --gpu --model "$MODEL" --json learn_gpu_retest
