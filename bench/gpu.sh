#!/usr/bin/env bash
# GPU checks in one command (< 8 minutes on one H200). The device image has torch+CUDA and
# transformers but not deepspeed: carry wheels built by shared/gpu/make-wheels.sh in .whl/.
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
timeout 420 python3 bench/gpu_attention.py
