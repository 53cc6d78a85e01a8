#!/usr/bin/env bash
# make demo's job (recipe=tiny), shortened, on the GPU: bench/gpu_tiny.sh RUN_DIR [NPROC]
# NPROC ranks share each sequence (parallel.sp_size=NPROC). bench/gpu.sh runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$1 nproc=${2:-1}
rm -rf "$dir"
python3 -m torch.distributed.run --nproc_per_node="$nproc" launch/curriculum.py recipe=tiny \
  parallel.sp_size="$nproc" run_dir="$dir" data.sample_size=4 validation.max_new_tokens=16 logging.progress=false \
  "stages=[{name: a, bucket: '512', seq_len: 512, max_steps: 6, validate: false}, {name: b, bucket: 1k, seq_len: 1024, max_steps: 6, every_steps: 3}]"
