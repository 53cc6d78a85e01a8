"""GPU: training throughput, MFU and peak memory vs the planner, 16K-100K tokens (one GPU).

    python bench/gpu_train.py                 (bench/gpu.sh runs it; needs the deepspeed wheel)
    python bench/gpu_train.py --smoke         (CPU, a tiny shape: checks the script itself)

A Qwen3-1.7B-shaped model (random weights, real vocabulary), bf16, per-layer checkpointing, the
chunked loss (Liger's fused linear cross-entropy is not used: not installed on the device image),
DeepSpeed ZeRO-3 on one GPU (no offload) through longsft's own engine and loss code. One fresh
process per length: 1 warm-up + 2 timed optimizer steps on one sequence whose last 64 tokens are
the answer. MFU two ways: model FLOPs / (time x the GPU's data-sheet dense bf16 peak), the usual
definition and the one the 0.45 goal means, and / (time x a measured 8192^3 bf16 matmul rate);
model FLOPs count 6 x non-embedding parameters x tokens + 6 x layers x tokens^2 x heads x head_dim
(causal attention forward and backward, no recompute), the usual convention. Memory: the step's
torch.cuda.max_memory_allocated against `longsft plan`'s ``allocated`` (its total without the margins
that allocator statistics do not see). One extra 32K row runs with model.offload_activations=true:
the checkpointed layer inputs go to the host, and the loss keeps only the last hidden state.
Also: the planner's longest sequence for the Qwen3-8B shape on one such GPU with ZeRO-3 offload,
and the host memory that needs. Writes bench/results/gpu_train.json.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
import onestep  # noqa: E402

QWEN3_1_7B = {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True,
              "max_position_embeddings": 131072}
SMOKE = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": True, "max_position_embeddings": 131072}
ANSWER = onestep.ANSWER


def overrides(shape: dict, seq: int, dtype: str, offload: bool = False) -> list[str]:
    return [*(f"model.config.{k}={v}" for k, v in shape.items()), f"model.dtype={dtype}",
            "model.gradient_checkpointing=true", "model.loss_chunk_tokens=4096", "parallel.sp_size=1",
            "deepspeed.config=zero3", "deepspeed.torch_adam=true", "optim.grad_accum=1", f"stages.0.seq_len={seq}",
            f"model.offload_activations={str(offload).lower()}"]


def matmul_peak(device: str, dtype) -> float:
    """Achieved TFLOP/s of a large square matmul (the MFU denominator)."""
    import torch

    n = 8192 if device == "cuda" else 1024
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    t0, reps = time.perf_counter(), 20 if device == "cuda" else 3
    for _ in range(reps):
        a @ b
    sync()
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12


def worker(seq: int, out: str, args: list[str]) -> None:
    import torch

    from longsft.train.config import load_config
    from longsft.train.parallel import distributed

    cfg = load_config("tiny", args)
    d = distributed.init(1)
    batch = onestep.one_sequence(cfg, seq, d)
    engine = onestep.zero3_engine(cfg, total_steps=3)
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    result = {"seq": seq}
    try:
        times = []
        for i in range(3):
            if cuda and i == 1:
                torch.cuda.reset_peak_memory_stats()
            sync()
            t0 = time.perf_counter()
            loss, n = onestep.step(engine, cfg, batch)
            sync()
            times.append(time.perf_counter() - t0)
        result.update(step_s=sum(times[1:]) / 2, loss=loss / n,
                      peak_bytes=torch.cuda.max_memory_allocated() if cuda else None)
    except torch.OutOfMemoryError:
        result["oom"] = True
    Path(out).write_text(json.dumps(result))
    distributed.shutdown()


def model_flops(shape: dict, seq: int) -> float:
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = h * (2 * q + 2 * kv) + 3 * h * shape["intermediate_size"]
    return 6 * layers * per_layer * seq + 6 * layers * seq * seq * q  # causal: half of 12 * s^2 * q


def longest_8b(gpu_gib: float) -> dict:
    """The planner's longest Qwen3-8B sequence on one GPU of ``gpu_gib`` with ZeRO-3 offload."""
    from longsft.train import plan
    from longsft.train.config import load_config

    hw = plan.Hardware(gpus_per_node=1, gpu_gib=gpu_gib)
    base = ["parallel.sp_size=1", "deepspeed.config=zero3_offload", "model.offload_activations=false"]
    cfg = load_config("qwen3_8b", base)
    shape = plan.model_shape(cfg)
    lo, hi = 1024, 1 << 21
    while hi - lo > 1024:
        mid = (lo + hi) // 2 // 1024 * 1024
        c = load_config("qwen3_8b", [*base, f"stages.0.seq_len={mid}"])
        est = plan.estimate(c, c.stages[0], shape, hw, targets=ANSWER)
        lo, hi = (mid, hi) if est.fits else (lo, mid)
    c = load_config("qwen3_8b", [*base, f"stages.0.seq_len={lo}"])
    est = plan.estimate(c, c.stages[0], shape, hw, targets=ANSWER)
    return {"longest_tokens": lo, "predicted_gpu_gib": est.total / 2**30, "host_gib": est.host_per_node / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="CPU and a tiny shape: check the script")
    ap.add_argument("--lengths", type=int, nargs="+", default=None)
    a = ap.parse_args()
    import torch
    from machine import nominal_bf16_tflops

    from longsft.train.config import load_config

    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    shape, dtype = (SMOKE, "fp32") if a.smoke else (QWEN3_1_7B, "bf16")
    lengths = a.lengths or ([1024, 2048] if a.smoke else [16384, 32768, 102400])
    runs = [(seq, False) for seq in lengths] + [(lengths[1 if len(lengths) > 1 else 0], True)]
    peak = matmul_peak(device, torch.float32 if a.smoke else torch.bfloat16)
    nominal = nominal_bf16_tflops(torch.cuda.get_device_name(0)) if device == "cuda" else None
    print(f"measured {dtype} matmul peak: {peak:.0f} TFLOP/s; data-sheet dense bf16 peak: {nominal} TFLOP/s", flush=True)
    env = onestep.rendezvous_env(**({"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""} if a.smoke else {}))
    rows = []
    for seq, offload in runs:
        args = overrides(shape, seq, dtype, offload)
        out = Path(f"/tmp/longsft_gpu_train_{seq}.json")
        try:
            r = subprocess.run([sys.executable, __file__, "--worker", str(seq), str(out), *args], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=90)
        except subprocess.TimeoutExpired:
            r = None
        if r is None or r.returncode or not out.exists():
            print("timed out (90 s)" if r is None else r.stderr[-3000:], file=sys.stderr)
            rows.append({"seq": seq, "offload_activations": offload, "failed": True})
            if not a.smoke:
                save(rows, peak, nominal)
            continue
        row = {**json.loads(out.read_text()), "offload_activations": offload}
        row["predicted_bytes"] = onestep.planned(load_config("tiny", args))[1].allocated
        if "step_s" in row:
            row["tokens_per_s"] = seq / row["step_s"]
            row["tflops"] = model_flops(shape, seq) / row["step_s"] / 1e12
            row["mfu_measured_peak"] = row["tflops"] / peak
            row["mfu"] = row["tflops"] / nominal if nominal else None  # the usual definition
            if row["peak_bytes"]:
                row["memory_error"] = row["predicted_bytes"] / row["peak_bytes"] - 1
        rows.append(row)
        print(json.dumps(row), flush=True)
        if not a.smoke:
            save(rows, peak, nominal)  # kept if a later run is cut off
    print("\n| tokens | offload act. | step s | tokens/s | TFLOP/s | MFU (data sheet) | MFU (measured peak) | peak GiB "
          "| planner GiB | planner error |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "step_s" not in r:
            print(f"| {r['seq']} | {r['offload_activations']} | {'OOM' if r.get('oom') else 'failed'} | | | | | | | |")
            continue
        mem = (f"{r['peak_bytes'] / 2**30:.1f} | {r['predicted_bytes'] / 2**30:.1f} | {r['memory_error']:+.1%}"
               if r.get("peak_bytes") else f"- | {r['predicted_bytes'] / 2**30:.1f} | -")
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        print(f"| {r['seq']} | {r['offload_activations']} | {r['step_s']:.2f} | {r['tokens_per_s']:.0f} | "
              f"{r['tflops']:.0f} | {mfu} | {r['mfu_measured_peak']:.1%} | {mem} |")
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if device == "cuda" else 141.0
    longest = longest_8b(gpu_gib)
    print(f"\nplanner: longest Qwen3-8B sequence on one {gpu_gib:.0f} GiB GPU with ZeRO-3 offload: "
          f"{longest['longest_tokens']} tokens ({longest['predicted_gpu_gib']:.1f} GiB), needing "
          f"{longest['host_gib']:.0f} GiB of host memory")
    if a.smoke:  # a check of the script, not a result
        return
    save(rows, peak, nominal, longest)


def save(rows: list[dict], peak: float, nominal: float | None, longest: dict | None = None) -> None:
    from machine import write_result

    write_result("gpu_train", {"benchmark": "gpu_train", "shape": QWEN3_1_7B, "dtype": "bf16",
                               "matmul_peak_tflops": peak, "nominal_bf16_tflops": nominal, "rows": rows,
                               "goal_mfu_at_32k": 0.45, "goal_memory_error": 0.10, "qwen3_8b_offload_longest": longest})

if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(int(sys.argv[2]), sys.argv[3], sys.argv[4:])
    else:
        main()
