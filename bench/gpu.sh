#!/usr/bin/env bash
# GPU checks in one command (< 8 minutes on one H200). The device image has torch+CUDA and
# transformers but not deepspeed or liger-kernel: carry the wheels that shared/gpu/make-wheels.sh
# builds in .whl/. Each script writes its bench/results/<name>.json; copy them to $OUT to keep them.
set -euo pipefail
cd "$(dirname "$0")/.."
site=$(mktemp -d)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
fi
# Expose the source folders as the longsft namespace without installing (no network there).
mkdir -p "$site/longsft"
for pkg in train eval recipes ds_configs; do ln -sfn "$PWD/$pkg" "$site/longsft/$pkg"; done
export PYTHONPATH="$site:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,memory.total --format=csv
export PYTHONUNBUFFERED=1
status=0
timeout 100 python3 bench/gpu_attention.py || status=1   # issue 3: ring block kernels vs SDPA, 16K-100K
timeout 80 python3 bench/gpu_loss.py || status=1         # issue 4: Liger vs chunked loss, plain and ZeRO-3
timeout 270 python3 bench/gpu_train.py || status=1       # issue 4: tokens/s, MFU, memory vs planner
if [ -n "${OUT:-}" ]; then cp bench/results/gpu_*.json "$OUT"/ 2>/dev/null || true; fi
exit $status
