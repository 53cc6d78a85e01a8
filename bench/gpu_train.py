"""GPU: training throughput, MFU and peak memory vs the planner, 16K-100K tokens (one GPU).

    python bench/gpu_train.py                 (bench/gpu.sh runs it; needs the deepspeed wheel)
    python bench/gpu_train.py --smoke         (CPU, a tiny shape: checks the script itself)

A Qwen3-1.7B-shaped model (random weights, real vocabulary), bf16, per-layer checkpointing, the
chunked loss (Liger's fused linear cross-entropy is not used), DeepSpeed ZeRO-3 on one GPU (no
offload) through longsft's own engine and loss code. One worker process, one engine, every row in
ascending length (16K, 32K, 100K, then 32K with model.offload_activations=true): per row the planner
decides what the trainer decides per stage (``choose`` on this GPU: ``keep_attention``, the tied
head weight held or not) and the row runs with it, as the trainer's stage would (the engine's model is
built with longsft's attention when any row keeps attention; a row that does not runs SDPA through it).
Per row 1 warm-up + 2 timed optimizer steps (1 timed above 32K) on one sequence whose last 64 tokens
are the answer; the allocator's peak is reset after the warm-up and its cache emptied between rows. A
row whose estimated time no longer fits the step's budget is skipped (and says so).

MFU two ways: model FLOPs / (time x the GPU's data-sheet dense bf16 peak), the usual definition and
the one the 0.45 goal means, and / (time x a measured 8192^3 bf16 matmul rate); model FLOPs count
6 x non-embedding parameters x tokens + 6 x layers x tokens^2 x heads x head_dim (causal attention
forward and backward, no recompute), the usual convention. Memory: the timed steps'
torch.cuda.max_memory_allocated against `longsft plan`'s ``allocated`` (its total without the margins
that allocator statistics do not see) for the row's resolved choices. The offload row: the
checkpointed layer inputs go to the host, and the loss keeps only the last hidden state.
Also: the planner's longest sequence for the Qwen3-8B shape on one such GPU with ZeRO-3 offload,
and the host memory that needs. Writes bench/results/gpu_train.json (``--smoke``:
gpu_train_smoke.json) after every row.
"""

import argparse
import json
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
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
BUDGET_S = 100  # the worker's rows must end by then (bench/gpu.sh gives the step 115 s)
MSG = "@@gpu_train "  # the worker's messages to the main process, one JSON per stdout line


def overrides(shape: dict, seq: int, dtype: str, offload: bool = False) -> list[str]:
    return [*(f"model.config.{k}={v}" for k, v in shape.items()), f"model.dtype={dtype}",
            "model.gradient_checkpointing=true", "model.loss_chunk_tokens=4096", "parallel.sp_size=1",
            "deepspeed.config=zero3", "deepspeed.torch_adam=true", "optim.grad_accum=1", f"stages.0.seq_len={seq}",
            f"model.offload_activations={str(offload).lower()}",
            "model.sdpa_cudnn=true"]  # one length per row: cuDNN builds its graphs once (as in the H200 run)


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


def timed_steps(seq: int) -> int:
    return 2 if seq <= 32768 else 1


def emit(kind: str, **kw) -> None:
    print(MSG + json.dumps({"kind": kind, **kw}, default=str), flush=True)


def worker(spec: dict) -> None:
    """Every row of ``spec`` in this one process, on one engine; each result sent as a message."""
    import dataclasses

    import torch

    from longsft.train.config.recipes import load_config
    from longsft.train.model.loss import hold_whole_weight
    from longsft.train.parallel import distributed

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    d = distributed.init(1)
    emit("start", gpu=torch.cuda.get_device_name(0) if cuda else None,
         gpu_gib=torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None)
    emit("peak", tflops=matmul_peak(device, torch.bfloat16 if cuda else torch.float32))
    rows = spec["rows"]
    cfgs = [load_config("tiny", r["args"]) for r in rows]
    made = [onestep.choices(c) for c in cfgs]  # the trainer's per-stage choices, on this GPU
    keep_any = any(m.keep_attention for m in made)
    t0 = time.perf_counter()
    # built as the trainer builds it (onestep.zero3_engine), with longsft's attention when any row keeps
    # attention: with keep_attention off in a row, that attention runs SDPA (no SP forward is opened on one rank)
    first = load_config("tiny", [*rows[0]["args"], f"model.keep_attention={str(keep_any).lower()}"])
    engine = onestep.zero3_engine(first, total_steps=100)
    attn = engine.module.config._attn_implementation
    emit("built", seconds=time.perf_counter() - t0, attn_implementation=attn)
    last = None  # (seq, step seconds) of the last measured row: the next row's time estimate
    try:
        for r, cfg, m in zip(rows, cfgs, made):
            seq, offload, timed = r["seq"], r["offload"], r["timed"]
            row = {"seq": seq, "offload_activations": offload, "keep_attention": m.keep_attention,
                   "hold_tied_weight": m.hold_tied_weight, "planner_note": m.note, "attn_implementation": attn}
            if last and spec["deadline"]:
                guess = last[1] * (seq / last[0]) ** 1.5 * (1.1 if offload else 1.0) * (1 + timed)
                left = spec["deadline"] - time.time()
                if guess > left:
                    emit("row", **row, skipped=f"time budget: about {guess:.0f} s needed, {left:.0f} s left")
                    continue
            emit("started", seq=seq, offload_activations=offload)
            t_row = time.perf_counter()
            # what changes per stage in the trainer: the resolved model config and the tied weight's hold
            engine.longsft_model_cfg = dataclasses.replace(cfg.model, keep_attention=m.keep_attention)
            engine.longsft_choices = m
            hold_whole_weight(engine.module, m.hold_tied_weight)
            batch = onestep.one_sequence(cfg, seq, d)
            try:
                times = []
                for i in range(1 + timed):
                    if cuda and i == 1:
                        torch.cuda.reset_peak_memory_stats()
                    sync()
                    t = time.perf_counter()
                    loss, n = onestep.step(engine, cfg, batch, d.attention)
                    sync()
                    times.append(time.perf_counter() - t)
                row.update(warmup_s=times[0], step_times=times[1:], step_s=sum(times[1:]) / timed, loss=loss / n,
                           peak_bytes=torch.cuda.max_memory_allocated() if cuda else None)
                last = (seq, row["step_s"])
            except torch.OutOfMemoryError:
                row["oom"] = True
            except Exception as e:  # a failed row is a result too; the next rows still try
                row.update(failed=True, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])
            if row.get("oom") or row.get("failed"):
                engine.optimizer.zero_grad(set_to_none=True)  # what the failed step left behind
            row["elapsed_s"] = time.perf_counter() - t_row
            emit("row", **row)
            del batch
            onestep.free_memory()
    finally:
        engine.destroy()
        distributed.shutdown()


def model_flops(shape: dict, seq: int) -> float:
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = h * (2 * q + 2 * kv) + 3 * h * shape["intermediate_size"]
    return 6 * layers * per_layer * seq + 6 * layers * seq * seq * q  # causal: half of 12 * s^2 * q


def longest_8b(gpu_gib: float) -> dict:
    """The planner's longest Qwen3-8B sequence on one GPU of ``gpu_gib`` with ZeRO-3 offload."""
    from longsft.train.config.recipes import load_config
    from longsft.train.plan.cost import estimate
    from longsft.train.plan.hardware import Hardware
    from longsft.train.plan.trace import model_shape

    hw = Hardware(gpus_per_node=1, gpu_gib=gpu_gib)
    base = ["parallel.sp_size=1", "deepspeed.config=zero3_offload", "model.offload_activations=false"]
    cfg = load_config("qwen3_8b", base)
    shape = model_shape(cfg)
    lo, hi = 1024, 1 << 21
    while hi - lo > 1024:
        mid = (lo + hi) // 2 // 1024 * 1024
        c = load_config("qwen3_8b", [*base, f"stages.0.seq_len={mid}"])
        est = estimate(c, c.stages[0], shape, hw, targets=ANSWER)
        lo, hi = (mid, hi) if est.fits else (lo, mid)
    c = load_config("qwen3_8b", [*base, f"stages.0.seq_len={lo}"])
    est = estimate(c, c.stages[0], shape, hw, targets=ANSWER)
    return {"longest_tokens": lo, "predicted_gpu_gib": est.total / 2**30, "host_gib": est.host_per_node / 2**30}


def die_with_parent() -> None:  # the worker must not outlive a killed main process (it holds the GPU)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class Stopped(BaseException):  # (not an Exception: no library's except clause turns it into another error)
    pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="CPU and a tiny shape: check the script")
    ap.add_argument("--lengths", type=int, nargs="+", default=None)
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for the rows (default {BUDGET_S}; --smoke: none)")
    a = ap.parse_args()
    t_start = time.time()
    from machine import describe, nominal_bf16_tflops, write_result

    shape, dtype = (SMOKE, "fp32") if a.smoke else (QWEN3_1_7B, "bf16")
    lengths = sorted(a.lengths or ([512, 1024, 2048] if a.smoke else [16384, 32768, 102400]))
    offload_seq = 32768 if 32768 in lengths else (1024 if a.smoke and 1024 in lengths else lengths[0])
    runs = [(seq, False) for seq in lengths] + [(offload_seq, True)]
    budget = a.budget if a.budget is not None else (None if a.smoke else BUDGET_S)
    spec = {"deadline": t_start + budget if budget else None,
            "rows": [{"seq": s, "offload": o, "timed": timed_steps(s), "args": overrides(shape, s, dtype, o)}
                     for s, o in runs]}
    env = onestep.rendezvous_env(**({"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""} if a.smoke else {}))
    info = {"matmul_peak_tflops": None, "nominal_bf16_tflops": None, "gpu_gib": None, "engine_build_s": None,
            "attn_implementation": None}
    rows: list[dict] = []
    machine = describe()
    out = "gpu_train_smoke" if a.smoke else "gpu_train"

    def save(longest: dict | None = None) -> None:  # after every row: a cut-off run keeps what it measured
        write_result(out, {"benchmark": "gpu_train", "shape": shape, "dtype": dtype, **info, "rows": rows,
                           "budget_s": budget, "elapsed_s": time.time() - t_start, "goal_mfu_at_32k": 0.45,
                           "goal_memory_error": 0.10, "qwen3_8b_offload_longest": longest, "machine": machine})

    def on_term(*_):
        raise Stopped()

    signal.signal(signal.SIGTERM, on_term)
    proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    longest, ended = None, False
    try:
        while True:
            left = spec["deadline"] + 8 - time.time() if spec["deadline"] else None
            try:
                line = lines.get(timeout=max(0.1, left) if left is not None else None)
            except queue.Empty:
                print(f"the worker ran past the budget ({budget:.0f} s): stopped", flush=True)
                break
            if line is None:
                ended = True
                break
            if not line.startswith(MSG):
                print(line, end="", flush=True)
                continue
            msg = json.loads(line[len(MSG):])
            kind = msg.pop("kind")
            if kind == "start":
                info["gpu_gib"] = msg["gpu_gib"]
                info["nominal_bf16_tflops"] = nominal_bf16_tflops(msg["gpu"]) if msg["gpu"] else None
            elif kind == "peak":
                info["matmul_peak_tflops"] = msg["tflops"]
                print(f"measured {dtype} matmul peak: {msg['tflops']:.0f} TFLOP/s; data-sheet dense bf16 peak: "
                      f"{info['nominal_bf16_tflops']} TFLOP/s", flush=True)
                # the planner's answer for the Qwen3-8B shape, computed here while the worker builds its engine
                try:
                    longest = longest_8b(info["gpu_gib"] or 141.0)
                except Exception as e:  # the planner's answer is a side figure: the rows go on
                    longest = {"error": f"{type(e).__name__}: {e}"}
            elif kind == "built":
                info["engine_build_s"], info["attn_implementation"] = msg["seconds"], msg["attn_implementation"]
                print(f"engine built in {msg['seconds']:.1f} s (attention: {msg['attn_implementation']})", flush=True)
            elif kind == "started":
                print(f"started {msg['seq']} tokens{' (offload_activations)' if msg['offload_activations'] else ''}",
                      flush=True)
            elif kind == "row":
                rows.append(finish_row(msg, shape, dtype, info))
                print(json.dumps(rows[-1]), flush=True)
                save(longest)
    except Stopped:
        print("stopped (SIGTERM): the rows so far are saved", flush=True)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    done = {(r["seq"], r["offload_activations"]) for r in rows}
    for seq, offload in runs:
        if (seq, offload) not in done:
            rows.append({"seq": seq, "offload_activations": offload, "failed": True,
                         "error": "the worker ended before this row" if ended else "not reached in the step's budget"})
    save(longest)
    print_table(rows, longest, info)
    failed = [r for r in rows if r.get("failed") or r.get("oom")]
    print(f"{time.time() - t_start:.1f} s in all; worker exit status {proc.returncode}")
    sys.exit(1 if failed or proc.returncode else 0)


def finish_row(row: dict, shape: dict, dtype: str, info: dict) -> dict:
    """The worker's row with the planner's prediction (for the row's resolved choices) and MFU both ways."""
    from longsft.train.config.recipes import load_config

    seq = row["seq"]
    args = [*overrides(shape, seq, dtype, row["offload_activations"]),
            f"model.keep_attention={str(row['keep_attention']).lower()}"]
    try:
        row["predicted_bytes"] = onestep.planned(load_config("tiny", args))[1].allocated
    except Exception as e:  # (the measured figures stay)
        row.update(predicted_bytes=None, planner_error=f"{type(e).__name__}: {e}")
    if "step_s" in row:
        row["tokens_per_s"] = seq / row["step_s"]
        row["tflops"] = model_flops(shape, seq) / row["step_s"] / 1e12
        row["mfu_measured_peak"] = row["tflops"] / info["matmul_peak_tflops"]
        nominal = info["nominal_bf16_tflops"]
        row["mfu"] = row["tflops"] / nominal if nominal else None  # the usual definition
        if row["peak_bytes"] and row["predicted_bytes"]:
            row["memory_error"] = row["predicted_bytes"] / row["peak_bytes"] - 1
    return row


def print_table(rows: list[dict], longest: dict | None, info: dict) -> None:
    print("\n| tokens | offload act. | step s | tokens/s | TFLOP/s | MFU (data sheet) | MFU (measured peak) | peak GiB "
          "| planner GiB | planner error | row s |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "step_s" not in r:
            why = "OOM" if r.get("oom") else ("skipped" if r.get("skipped") else "failed")
            print(f"| {r['seq']} | {r['offload_activations']} | {why} | | | | | | | | |")
            continue
        planned = f"{r['predicted_bytes'] / 2**30:.1f}" if r.get("predicted_bytes") else "-"
        mem = (f"{r['peak_bytes'] / 2**30:.1f} | {planned} | {r['memory_error']:+.1%}"
               if r.get("memory_error") is not None else f"- | {planned} | -")
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        print(f"| {r['seq']} | {r['offload_activations']} | {r['step_s']:.2f} | {r['tokens_per_s']:.0f} | "
              f"{r['tflops']:.0f} | {mfu} | {r['mfu_measured_peak']:.1%} | {mem} | {r['elapsed_s']:.1f} |")
    if longest and "longest_tokens" in longest:
        print(f"\nplanner: longest Qwen3-8B sequence on one {info['gpu_gib'] or 141.0:.0f} GiB GPU with ZeRO-3 "
              "offload: "
              f"{longest['longest_tokens']} tokens ({longest['predicted_gpu_gib']:.1f} GiB), needing "
              f"{longest['host_gib']:.0f} GiB of host memory")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(json.loads(sys.argv[2]))
    else:
        main()
