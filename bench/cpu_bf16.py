"""bf16 against fp32 on this CPU: the matmuls of one SmolLM2-135M layer and its head, and one training
step (forward and backward) of a one-layer model of that shape.

    python bench/cpu_bf16.py [--tokens 512] [--rounds 3] [--json cpu_bf16]

PyTorch sends bf16 matmuls to oneDNN on CPUs with AVX-512 (natively with ``avx512_bf16`` or AMX); on
AVX2-only CPUs (AMD Zen 3, older Intel) it falls back to a path many times slower than fp32. longsft says so
when a run, ``longsft eval`` or ``longsft serve`` puts a bf16 model on such a CPU (``cpu_features.bf16_hint``).
Rounds alternate the dtypes; each figure is the median. FLOPs: 2 per multiply-add of the matmuls only
(attention and elementwise work not counted), training step 3x the forward's. Writes
bench/results/cpu_bf16.json (``--json``: another name).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from machine import bad_result_name, write_result  # noqa: E402

from longsft.train.common.cpu_features import bf16_dot, cpu_fields, fast_bf16  # noqa: E402

# SmolLM2-135M: hidden 576, 9 query and 3 KV heads of 64, MLP 1536, vocabulary 49,152
HIDDEN, KV, MLP, VOCAB = 576, 192, 1536, 49152
# (name, in, out) of one decoder layer's projections and the head
GEMMS = [("q", HIDDEN, HIDDEN), ("k", HIDDEN, KV), ("v", HIDDEN, KV), ("o", HIDDEN, HIDDEN),
         ("gate", HIDDEN, MLP), ("up", HIDDEN, MLP), ("down", MLP, HIDDEN), ("head", HIDDEN, VOCAB)]


def gemms(tokens: int, dtype: torch.dtype, reps: int = 3) -> float:
    """Seconds for one pass over GEMMS at ``tokens`` rows: ``[tokens, in] @ [in, out]`` each."""
    pairs = [(torch.randn(tokens, i, dtype=dtype), torch.randn(i, o, dtype=dtype)) for _, i, o in GEMMS]
    for a, b in pairs:  # warm-up
        a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        for a, b in pairs:
            a @ b
    return (time.perf_counter() - t0) / reps


def train_step(tokens: int, dtype: torch.dtype, reps: int = 2) -> float:
    """Seconds for forward + backward of a one-layer SmolLM2-shaped LlamaForCausalLM on ``tokens``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=1, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=VOCAB, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dtype)
    ids = torch.randint(0, VOCAB, (1, tokens))
    model(input_ids=ids, labels=ids).loss.backward()  # warm-up
    t0 = time.perf_counter()
    for _ in range(reps):
        model(input_ids=ids, labels=ids).loss.backward()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default="cpu_bf16", metavar="NAME",
                    help="the results file's name in bench/results (default cpu_bf16; another CPU's: another name)")
    a = ap.parse_args()
    if bad_result_name(a.json):
        ap.exit(2, f"cpu_bf16.py: {bad_result_name(a.json)}\n")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    flops = 2 * a.tokens * sum(i * o for _, i, o in GEMMS)
    times: dict[str, dict[str, list[float]]] = {k: {"gemms": [], "train_step": []} for k in dtypes}
    for _ in range(a.rounds):
        for name, dtype in dtypes.items():
            times[name]["gemms"].append(gemms(a.tokens, dtype))
            times[name]["train_step"].append(train_step(a.tokens, dtype))
    rows = {}
    for name in dtypes:
        g, s = (statistics.median(times[name][k]) for k in ("gemms", "train_step"))
        rows[name] = {"gemms_s": round(g, 5), "gemms_gflops": round(flops / g / 1e9, 2),
                      "train_step_s": round(s, 4), "train_step_matmul_gflops": round(3 * flops / s / 1e9, 2)}
    ratio = {k: round(rows["bf16"][k] / rows["fp32"][k], 2) for k in ("gemms_s", "train_step_s")}
    fast, dot = fast_bf16(), bf16_dot(cpu_fields())
    print(f"{a.tokens} tokens, {torch.get_num_threads()} threads; oneDNN bf16: {fast}, bf16 instructions: {dot}")
    print("| dtype | layer+head matmuls, s | GFLOP/s | one-layer train step, s |")
    print("|---|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['gemms_s']:.4f} | {r['gemms_gflops']:.1f} | {r['train_step_s']:.3f} |")
    print(f"bf16 / fp32 time: matmuls {ratio['gemms_s']}x, train step {ratio['train_step_s']}x")
    write_result(a.json, {"benchmark": "cpu_bf16", "tokens": a.tokens, "rounds": a.rounds,
                              "threads": torch.get_num_threads(), "onednn_bf16": fast, "bf16_dot_instructions": dot,
                              "flop_convention": "2 per multiply-add of the listed matmuls; train step 3x forward",
                              "rows": rows, "bf16_over_fp32_time": ratio})


if __name__ == "__main__":
    main()
