"""GPU: longsft against DeepSpeed's ALST on one GPU, the same model, seed and sequence (issue 33, item 5).

    bash bench/gpu.sh vs_alst           (on the GPU machine: the wheels installed, this script alone)
    python bench/gpu_vs_alst.py --smoke (CPU, a tiny shape: every code path of the script but CUDA's)

Qwen3-8B's shape (36 layers, hidden 4096, 32 query / 8 KV heads of 128, MLP 12288, untied head, the
real vocabulary), random weights, bf16, DeepSpeed ZeRO-3 with parameters and optimizer state offloaded
to the host, one GPU, one sequence whose last 64 tokens are the answer. Each (phase, implementation) runs
in its own process: the host holds one model's ZeRO-3 state at a time.

1. ``time``: 32K, 64K and 100K tokens; per length one warm-up and one timed forward and backward.
   - ``longsft``: as its trainer runs such a stage: the planner's choices at that length (``choose``:
     ``keep_attention``), gradient checkpointing per layer, the chunked loss on the answer's positions;
   - ``alst`` (``bench/alst.py``): transformers' own model on ``sdpa``, ALST's tiled logits and loss
     over every position (prompt labels masked; ArcticTraining's 1 GiB shards at the longest length,
     the count kept for all lengths) and the checkpointed layer inputs offloaded to pinned host memory
     on a side stream (``CheckpointHiddenStatesOffload``; each row records its counts, and a row where
     nothing reached the offload fails: see ``alst.CheckpointMarks``).
   The optimizer step is left out of both: it depends on neither the implementation nor the length, and
   for 8B parameters ZeRO-3's fp32 master weights and gradients plus Adam's moments (about 130 GB) do not
   fit this machine's 128 GiB host. Gradients are computed and reduced into the offloaded partitions, then
   dropped.
2. ``fit``: the longest sequence each runs, from 128K tokens growing by 1.5x until out of GPU memory,
   short of host memory, or out of the budget, one forward and backward per length, every memory feature
   on: longsft with ``model.offload_activations``, ``model.mlp_tile_tokens=4096`` and
   ``keep_attention=false``; ALST with its ``TiledMLP`` as well. The model keeps the full width but only
   ``--fit-layers`` (2) layers: with every checkpointed input offloaded the GPU holds one layer's work at a
   time, so its peak does not grow with depth; the host's offloaded inputs do (36 x tokens x 4096 x 2
   bytes: 190 GB at 650K, more than this host has). Rows give the host memory the full depth would need.

Per row: seconds, tokens/s, MFU (model FLOPs / (time x the data-sheet dense bf16 peak); model FLOPs
6 x non-embedding parameters x tokens + 6 x layers x tokens^2 x heads x head_dim, causal attention
forward and backward without recompute: ``gpu_train.model_flops``), ``max_memory_allocated`` (for
longsft's rows also the planner's estimate: issue 33's ±10 %), the process's peak host RSS, and the loss (the same weights and sequence: the two losses agree to bf16's
precision). Writes bench/results/gpu_vs_alst.json (``--smoke``: gpu_vs_alst_smoke.json) after every row.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
import alst  # noqa: E402
import gpu_train  # noqa: E402
import onestep  # noqa: E402

QWEN3_8B = {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False,
            "max_position_embeddings": 1 << 21}
SMOKE = {**gpu_train.SMOKE, "tie_word_embeddings": False}
IMPLS = ("longsft", "alst")
MSG = "@@gpu_vs_alst "
BUDGET_S = 500  # bench/gpu.sh vs_alst gives the step 540 s (a device call may run 600, the wheels take ~15)
TIME_SHARE = 0.6  # of the budget for the timed phase (what it leaves, the fit phase gets)
ALST = {"time": alst.Options(tiled_loss=True, offload_checkpoints=True),
        "fit": alst.Options(tiled_mlp=True, tiled_loss=True, offload_checkpoints=True)}


def run_args(shape: dict, seq: int, dtype: str, phase: str, layers: int | None = None) -> list[str]:
    """longsft's run keys for one row: the shape, ZeRO-3 with offload, and the phase's memory settings."""
    shape = {**shape, **({"num_hidden_layers": layers} if layers else {})}
    fit = phase == "fit"
    return [*(f"model.config.{k}={v}" for k, v in shape.items()), f"model.dtype={dtype}",
            "model.gradient_checkpointing=true", "model.loss_chunk_tokens=4096", "parallel.sp_size=1",
            "deepspeed.config=zero3_offload", "deepspeed.torch_adam=true", "optim.grad_accum=1",
            f"stages.0.seq_len={seq}", f"model.offload_activations={str(fit).lower()}",
            "model.sdpa_cudnn=true",  # one length per row, and ALST's rows run PyTorch's own choice in this process
            *(["model.mlp_tile_tokens=4096", "model.keep_attention=false"] if fit else [])]


def emit(kind: str, **kw) -> None:
    print(MSG + json.dumps({"kind": kind, **kw}, default=str), flush=True)


def host_peak_gib() -> float:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")) / 2**20


def host_free_gib() -> float:
    return next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemAvailable:")) / 2**20


def worker(spec: dict) -> None:
    """Every length of one (phase, implementation) in this process, on one engine; each row a message."""
    import dataclasses

    import torch

    from longsft.train.config.recipes import load_config
    from longsft.train.parallel import distributed

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    impl, phase, lengths = spec["impl"], spec["phase"], spec["lengths"]
    d = distributed.init(1)
    cfgs = [load_config("tiny", run_args(spec["shape"], s, spec["dtype"], phase, spec["layers"])) for s in lengths]
    t0 = time.perf_counter()
    if impl == "alst":  # the tiled loss's shards fixed by the longest length (ZeRO-3's trace stays valid)
        from longsft.train.model.build import build_hf_config

        options = dataclasses.replace(ALST[phase], loss_shards=alst.loss_shards(
            lengths[-1], build_hf_config(cfgs[-1].model).vocab_size))
        engine, mpu = alst.build(cfgs[-1], lengths[-1], 1, options)
        made = [None] * len(cfgs)
    else:  # the trainer's choices per length, the engine built keeping attention when any length keeps it
        made = [onestep.choices(c) for c in cfgs]
        keep = any(m.keep_attention for m in made)
        engine = onestep.zero3_engine(dataclasses.replace(cfgs[-1], model=dataclasses.replace(
            cfgs[-1].model, keep_attention=keep)), total_steps=100)
    emit("built", seconds=time.perf_counter() - t0)
    last = None  # (tokens, seconds of one forward and backward): the next row's time estimate
    warmups = 1 if phase == "time" else 0
    try:
        for seq, cfg, m in zip(lengths, cfgs, made):
            row = {"impl": impl, "phase": phase, "seq": seq, "layers": cfg.model.config["num_hidden_layers"]}
            if m is not None:
                row.update(keep_attention=m.keep_attention, planner_note=m.note)
            if last and spec["deadline"]:
                guess = last[1] * (seq / last[0]) ** 2 * (1 + warmups)
                left = spec["deadline"] - time.time()
                if guess > left:
                    emit("row", **row, skipped=f"time budget: about {guess:.0f} s needed, {left:.0f} s left")
                    break
            need = spec["host_gib_per_token"] * seq
            if phase == "fit" and need > host_free_gib() * 0.9:
                emit("row", **row, skipped=f"host memory: the offloaded inputs need {need:.0f} GiB, "
                                           f"{host_free_gib():.0f} GiB available")
                break
            full = onestep.one_sequence(cfg, seq, d)
            try:
                times = []
                for i in range(warmups + 1):
                    if cuda and i == warmups:
                        torch.cuda.reset_peak_memory_stats()
                    sync()
                    t = time.perf_counter()
                    if impl == "alst":
                        loss, _ = alst.step(engine, mpu, alst.shard(full, mpu), options, optimizer_step=False)
                    else:
                        engine.longsft_model_cfg = dataclasses.replace(cfg.model, keep_attention=m.keep_attention)
                        total, n = onestep.step(engine, cfg, full, d.attention, optimizer_step=False)
                        loss = total / n
                    sync()
                    times.append(time.perf_counter() - t)
                row.update(step_s=times[-1], warmup_s=times[0] if warmups else None, loss=loss,
                           peak_bytes=torch.cuda.max_memory_allocated() if cuda else None)
                last = (seq, times[-1])
                if impl == "alst" and options.offload_checkpoints:  # the offload ran (CPU: reached, skipped)
                    stats = row["offload_stats"] = engine.alst_offload_stats
                    if not stats["offloaded_tensors" if cuda else "skipped_marked_tensors"]:
                        row.update(failed=True, error="no checkpointed layer input reached DeepSpeed's offload")
            except torch.OutOfMemoryError:
                row["oom"] = True
            except Exception as e:  # a failed row is a result too
                row.update(failed=True, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])
            row["host_peak_gib"] = host_peak_gib()
            emit("row", **row)
            if row.get("oom") or row.get("failed"):
                break  # the longest that fits is found (or this implementation cannot go on)
            del full
            onestep.free_memory()
    finally:
        engine.destroy()
        distributed.shutdown()


def run_worker(spec: dict, env: dict, on_row) -> tuple[int | None, float | None]:
    """One worker process for ``spec``, killed at its deadline; ``on_row`` gets each row as it comes.
    Returns (exit status (None: killed), engine build seconds)."""
    proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, text=True, preexec_fn=gpu_train.die_with_parent)
    killed = threading.Event()

    def watchdog() -> None:
        if spec["deadline"] and proc.poll() is None:
            killed.set()
            proc.kill()

    timer = threading.Timer(max(1.0, spec["deadline"] + 10 - time.time()) if spec["deadline"] else 1e9, watchdog)
    timer.daemon = True
    timer.start()
    built = None
    for line in proc.stdout:
        if not line.startswith(MSG):
            print(line, end="", flush=True)
            continue
        msg = json.loads(line[len(MSG):])
        kind = msg.pop("kind")
        if kind == "built":
            built = msg["seconds"]
            print(f"{spec['phase']} {spec['impl']}: engine built in {built:.1f} s", flush=True)
        else:
            on_row(msg)
    timer.cancel()
    proc.wait()
    return (None if killed.is_set() else proc.returncode), built


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU and a tiny shape: check the script")
    ap.add_argument("--lengths", type=int, nargs="+", default=None, help="the timed phase's (32K 64K 100K)")
    ap.add_argument("--fit-start", type=int, default=None, help="the fit phase's first length (131072)")
    ap.add_argument("--fit-max", type=int, default=None, help="the fit phase's last length to try (2M)")
    ap.add_argument("--fit-layers", type=int, default=2)
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--phases", nargs="+", default=["time", "fit"], choices=["time", "fit"])
    ap.add_argument("--budget", type=float, default=None, help=f"seconds for everything (default {BUDGET_S})")
    ap.add_argument("--out", default=None, help="results: bench/results/OUT.json (gpu_vs_alst; --smoke: *_smoke)")
    a = ap.parse_args()
    if a.out is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", a.out):
        ap.error(f"--out {a.out!r}: a file name (letters, digits, '_', '.', '-'), written to bench/results/")
    t_start = time.time()
    from machine import describe, nominal_bf16_tflops, write_result

    shape, dtype = (SMOKE, "fp32") if a.smoke else (QWEN3_8B, "bf16")
    lengths = sorted(a.lengths or ([512, 1024] if a.smoke else [32768, 65536, 102400]))
    start, top = a.fit_start or (2048 if a.smoke else 131072), a.fit_max or (4608 if a.smoke else 1 << 21)
    fit = []
    while start <= top:
        fit.append(start)
        start = int(start * 1.5) // 1024 * 1024
    budget = a.budget if a.budget is not None else (None if a.smoke else BUDGET_S)
    env = onestep.rendezvous_env(**({"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""} if a.smoke else {}))
    machine = describe()
    nominal = nominal_bf16_tflops(machine.get("gpu", "")) if machine.get("gpu") else None
    bytes_per_token = shape["hidden_size"] * (2 if dtype == "bf16" else 4)  # one layer input, one token
    full_layers = shape["num_hidden_layers"]
    rows: list[dict] = []
    out = a.out or ("gpu_vs_alst_smoke" if a.smoke else "gpu_vs_alst")
    runs = [(p, i) for p in a.phases for i in a.impls]
    info = {"built_s": {}, "exit": {}}

    def save() -> None:
        write_result(out, {"benchmark": "gpu_vs_alst", "shape": shape, "dtype": dtype, "fit_layers": a.fit_layers,
                           "nominal_bf16_tflops": nominal, "budget_s": budget, "elapsed_s": time.time() - t_start,
                           "alst_options": {p: vars(o) for p, o in ALST.items()}, **info, "rows": rows,
                           "summary": summary(rows), "goals": {"time_ratio": 0.7, "memory_ratio": 1.0,
                                                               "longest_vs_alst": 1.0},
                           "machine": machine})

    def on_row(row: dict) -> None:
        finish(row, shape, dtype, nominal, bytes_per_token, full_layers)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
        save()

    for k, (phase, impl) in enumerate(runs):
        now = time.time()
        deadline = None
        if budget:  # what is left of the phase's share, split over its implementations still to run
            end = t_start + budget * (TIME_SHARE if phase == "time" and "fit" in a.phases else 1.0)
            deadline = now + max(0.0, end - now) / sum(1 for r in runs[k:] if r[0] == phase)
        spec = {"impl": impl, "phase": phase, "shape": shape, "dtype": dtype, "deadline": deadline,
                "lengths": lengths if phase == "time" else fit, "layers": a.fit_layers if phase == "fit" else None,
                # x2: the pinned-memory allocator rounds each block up to a power of two and keeps freed ones
                "host_gib_per_token": a.fit_layers * bytes_per_token / 2**30 * 2}
        print(f"== {phase} {impl}: {len(spec['lengths'])} lengths"
              + (f", {deadline - now:.0f} s" if deadline else ""), flush=True)
        status, built = run_worker(spec, env, on_row)
        info["built_s"][f"{phase}/{impl}"], info["exit"][f"{phase}/{impl}"] = built, status
        if status is None:
            rows.append({"impl": impl, "phase": phase, "skipped": "the worker ran past its deadline: killed"})
        save()
    print_table(rows, summary(rows))
    print(f"{time.time() - t_start:.1f} s in all")
    bad = [r for r in rows if r.get("failed")] or [s for s in info["exit"].values() if s not in (0, None)]
    sys.exit(1 if bad else 0)


def finish(row: dict, shape: dict, dtype: str, nominal: float | None, bytes_per_token: int, full_layers: int) -> None:
    """Throughput and MFU of a measured row; for longsft's, `longsft plan`'s estimate of its peak (the
    ``allocated`` total, no margins) for the row's choices; in the fit phase, the host memory the full
    depth's offloaded inputs would take."""
    if "step_s" in row and row["impl"] == "longsft":
        from longsft.train.config.recipes import load_config

        keys = [*run_args(shape, row["seq"], dtype, row["phase"], row["layers"]),
                f"model.keep_attention={str(row['keep_attention']).lower()}"]
        try:
            row["predicted_bytes"] = onestep.planned(load_config("tiny", keys))[1].allocated
            if row["peak_bytes"]:
                row["memory_error"] = row["predicted_bytes"] / row["peak_bytes"] - 1
        except Exception as e:  # (the measured figures stay)
            row["planner_error"] = f"{type(e).__name__}: {e}"
    if "step_s" in row:
        layered = {**shape, "num_hidden_layers": row["layers"]}
        row["tokens_per_s"] = row["seq"] / row["step_s"]
        row["tflops"] = gpu_train.model_flops(layered, row["seq"]) / row["step_s"] / 1e12
        row["mfu"] = row["tflops"] / nominal if nominal else None
    if row.get("phase") == "fit":
        row["full_depth_offload_gib"] = full_layers * row["seq"] * bytes_per_token / 2**30


def summary(rows: list[dict]) -> dict:
    """longsft / ALST per timed length (step time, peak memory, loss difference) and each one's longest."""
    got = {(r["impl"], r["phase"], r["seq"]): r for r in rows if "step_s" in r}
    out: dict = {"time": {}, "longest": {}}
    for (impl, phase, seq), r in got.items():
        other = got.get(("alst", phase, seq))
        if impl == "longsft" and phase == "time" and other:
            out["time"][seq] = {"time_ratio": r["step_s"] / other["step_s"],
                                "memory_ratio": (r["peak_bytes"] / other["peak_bytes"]
                                                 if r["peak_bytes"] and other["peak_bytes"] else None),
                                "loss_rel_diff": abs(r["loss"] - other["loss"]) / abs(other["loss"])}
        if phase == "fit":
            out["longest"][impl] = max(out["longest"].get(impl, 0), seq)
    if {"longsft", "alst"} <= out["longest"].keys():
        out["longest_vs_alst"] = out["longest"]["longsft"] / out["longest"]["alst"]
    return out


def print_table(rows: list[dict], summ: dict) -> None:
    print("\n| phase | impl | layers | tokens | s | tokens/s | MFU (data sheet) | peak GiB | planner | host peak GiB "
          "| loss |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "step_s" not in r:
            why = "OOM" if r.get("oom") else r.get("skipped") or r.get("error", "failed")
            print(f"| {r['phase']} | {r['impl']} | {r.get('layers', '')} | {r.get('seq', '')} | {why} | | | | | | |")
            continue
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        peak = f"{r['peak_bytes'] / 2**30:.1f}" if r.get("peak_bytes") else "-"
        plan = (f"{r['predicted_bytes'] / 2**30:.1f}" + (f" ({r['memory_error']:+.0%})" if "memory_error" in r else "")
                if r.get("predicted_bytes") else "-")
        print(f"| {r['phase']} | {r['impl']} | {r['layers']} | {r['seq']} | {r['step_s']:.2f} | {r['tokens_per_s']:.0f} "
              f"| {mfu} | {peak} | {plan} | {r['host_peak_gib']:.1f} | {r['loss']:.4f} |")
    for seq, s in summ["time"].items():
        mem = f"{s['memory_ratio']:.2f}" if s["memory_ratio"] is not None else "-"
        print(f"{seq} tokens: longsft / ALST time {s['time_ratio']:.2f} (goal <= 0.7), memory {mem} (goal <= 1.0), "
              f"losses differ by {s['loss_rel_diff']:.1e}")
    if summ["longest"]:
        print("longest that ran: " + ", ".join(f"{i} {n}" for i, n in summ["longest"].items()))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(json.loads(sys.argv[2]))
    else:
        main()
