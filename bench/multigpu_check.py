"""The first thing to run on a new multi-GPU node: longsft's NCCL paths checked, in one command.

    python bench/multigpu_check.py            (a node of 2-8 GPUs, about 10 minutes at 8)
    python bench/multigpu_check.py --smoke    (CPU, gloo, 2 ranks, a tiny model: a check of this script)

Each part runs in a fresh ``torchrun`` of N ranks (N = 1, then 2, 4, 8 up to the node's GPUs); the
results go to bench/results/multigpu_check.json after each launch, so a run cut off keeps them:

1. **equality**: one ZeRO-3 optimizer step of a Qwen3-shaped model (bf16, 16K tokens, one sequence,
   the same seed) on one GPU, then split over ``sp = N`` ranks with the torch ring and with Ulysses:
   loss and gradient norm against one GPU's (relative tolerance 2e-2 in bf16, 1e-4 in fp32);
2. **nccl**: the device memory NCCL took outside PyTorch's allocator (``cudaMemGetInfo``) once the
   world's, DeepSpeed's, the SP and the DP communicators are up and have run a collective, per
   communicator, against the planner's ``nccl_gib_per_communicator`` budget (``longsft plan`` counts
   the communicators; on NVSwitch nodes NVLS buffers can exceed it: NCCL_NVLS_ENABLE=0 or
   ``--nccl-gib``);
3. **overlap**: a CUDA profiler trace of the torch ring's step at the largest N: the share of the
   ring's NCCL send/receive kernel time during which an attention kernel ran too (1.0: every transfer
   hidden behind compute); the trace is saved beside the results;
4. **validation**: one round of the validation hook (generation on a whole copy under ZeRO-3 where it
   fits, else on the partitioned model) for a large recipe's model shape at its real length (default
   Qwen3-8B, 8 prompts of 32K tokens over the ranks, random weights), timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
import onestep  # noqa: E402

SHAPE = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 8, "num_attention_heads": 16,
         "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True, "max_position_embeddings": 131072}
SMOKE = {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": True, "max_position_embeddings": 131072}
BACKENDS = ("torch", "ulysses")


def run_keys(smoke: bool, seq: int, sp: int) -> list[str]:
    shape = SMOKE if smoke else SHAPE
    return [*(f"model.config.{k}={v}" for k, v in shape.items()), f"model.dtype={'fp32' if smoke else 'bf16'}",
            f"parallel.sp_size={sp}", "deepspeed.config=zero3", "deepspeed.torch_adam=true", "optim.grad_accum=1",
            f"stages.0.seq_len={seq}", "model.loss_chunk_tokens=4096"]


def free_device_bytes() -> int | None:
    import torch

    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None


def nccl_memory(d, before: int | None) -> dict:
    """Device memory outside PyTorch's allocator taken since ``before`` (free bytes before the process
    group), once each of this rank's communicators has run a collective."""
    from deepspeed.utils import groups

    from longsft.train.parallel import comm

    touched = [None, groups._WORLD_GROUP, d.sp_group, d.dp_group]  # the world, DeepSpeed's clone, SP, DP
    for group in touched:
        comm.all_reduce([1.0], group=group)
    if before is None:
        return {}
    return {"communicators": len(touched), **device_outside_allocator(before, len(touched))}


def device_outside_allocator(before: int, communicators: int) -> dict:
    """Device memory taken since ``before`` (free bytes) that PyTorch's allocator does not hold: NCCL's."""
    import torch

    torch.cuda.synchronize()
    taken = before - free_device_bytes() - torch.cuda.memory_reserved()
    return {"nccl_mib": taken / 2**20, "mib_per_communicator": taken / 2**20 / communicators}


def overlap(prof) -> dict:
    """Share of the NCCL send/receive kernels' device time during which an attention kernel also ran."""
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start]
    comm = [(s, t) for n, s, t in kernels if "nccl" in n.lower() and ("sendrecv" in n.lower() or "send" in n.lower())]
    attn = sorted((s, t) for n, s, t in kernels
                  if any(w in n.lower() for w in ("flash", "cudnn", "fmha", "attention", "sdpa")))
    total = sum(t - s for s, t in comm)
    hidden = 0
    for s, t in comm:
        for a, b in attn:
            if a >= t:
                break
            hidden += max(0, min(t, b) - max(s, a))
    return {"nccl_p2p_us": total, "overlapped_us": hidden, "overlap": hidden / total if total else None}


def worker(a) -> None:
    """One torchrun launch: the equality step (each backend), NCCL memory, and at the largest N the
    profiled ring step and the validation round."""
    import torch

    from longsft.train.config.recipes import load_config
    from longsft.train.parallel import comm, distributed
    from longsft.train.parallel.attention import register

    n = int(os.environ["WORLD_SIZE"])
    before = None
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.zeros(1, device="cuda")  # the CUDA context first: what follows is NCCL's
        before = free_device_bytes()
    d = distributed.init(n)
    result = {"ranks": n, "nccl": nccl_memory(d, before), "steps": {}}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for backend in (BACKENDS if n > 1 else ("torch",)):
        attention = register(dataclasses.replace(d.sp, backend=backend))
        cfg = load_config("tiny", run_keys(a.smoke, a.seq, n) + [f"parallel.sp_backend={backend}"])
        batch = onestep.one_sequence(cfg, a.seq, d)
        engine = onestep.zero3_engine(cfg, total_steps=3, world_size=n)
        sync()
        t0 = time.perf_counter()
        loss_sum, _ = onestep.step(engine, cfg, batch, attention)
        sync()
        seconds = time.perf_counter() - t0
        row = {"loss": comm.all_reduce([loss_sum])[0] / onestep.ANSWER,
               "grad_norm": float(engine.get_global_grad_norm() or 0.0), "first_step_s": seconds}
        if backend == "torch" and a.profile and torch.cuda.is_available():
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                onestep.step(engine, cfg, batch, attention)
                sync()
            row["overlap"] = comm.all_gather_objects(overlap(prof))
            if d.is_main:
                prof.export_chrome_trace(str(Path(a.out).with_name("multigpu_ring_trace.json")))
        if before is not None:  # after a step: the ring's point-to-point transfers and ZeRO-3's collectives too
            row["nccl_after_step"] = device_outside_allocator(before, result["nccl"]["communicators"])
        result["steps"][backend] = row
        engine.destroy()
        del engine
    if a.validation and n > 1:
        result["validation"] = validation_round(a, d)
    if d.is_main:
        Path(a.out).write_text(json.dumps(result))
    distributed.shutdown()


def validation_round(a, d) -> dict:
    """The validation hook on ``a.val_items`` prompts of ``a.val_seq`` tokens for ``a.val_recipe``'s model
    shape (random weights, on the trainer's ZeRO-3 engine), timed on every rank."""
    import torch
    from transformers.integrations import HfDeepSpeedConfig

    from longsft.train.config.deepspeed import build_ds_config
    from longsft.train.config.recipes import load_config
    from longsft.train.data.encoding import Encoded, Meta
    from longsft.train.model.build import build_hf_config, build_model
    from longsft.train.training.engine import build_engine
    from longsft.train.training.validation import generate_judgements

    keys = [f"stages.0.seq_len={a.val_seq}", f"parallel.sp_size={d.dims.sp_size}", "deepspeed.torch_adam=true"]
    if a.smoke:
        keys += [f"model.config.{k}={v}" for k, v in SMOKE.items()] + ["model.dtype=fp32"]
        cfg = load_config("tiny", keys)
    else:  # the recipe's architecture from its shipped config, without its weights
        cfg = load_config(a.val_recipe, keys + ["model.path=null", "model.tokenizer=qwen",
                                                f"model.config={_shipped_config(a.val_recipe)}"])
    hf = build_hf_config(cfg.model)
    ds = build_ds_config(cfg, cfg.stages[0], d.world_size, hf.hidden_size)
    hf_ds = HfDeepSpeedConfig(ds)  # noqa: F841 (alive while the model is built: ZeRO-3 partitions it)
    model = build_model(cfg.model, seed=cfg.seed, sp_size=d.dims.sp_size)
    engine = build_engine(cfg, model, ds, total_steps=1)

    class Tok:  # generate_judgements reads these (no end-of-sequence token: every prompt generates its limit)
        pad_token_id, eos_token_id = 0, None

        @staticmethod
        def decode(ids, skip_special_tokens=True):
            return ""

    g = torch.Generator().manual_seed(0)
    items = [Encoded(Meta(f"v{i}", "en", 4), torch.randint(0, hf.vocab_size, (a.val_seq,), generator=g).tolist(),
                     a.val_seq) for i in range(a.val_items)]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    generate_judgements(engine, Tok, items, d, max_new_tokens=cfg.validation.max_new_tokens,
                        whole_model_gb=cfg.validation.whole_model_gb)
    sync()
    seconds = time.perf_counter() - t0
    engine.destroy()
    return {"recipe": "tiny" if a.smoke else a.val_recipe, "items": a.val_items, "prompt_tokens": a.val_seq,
            "max_new_tokens": cfg.validation.max_new_tokens, "seconds": seconds,
            "whole_model_gb": cfg.validation.whole_model_gb}


def _shipped_config(recipe: str) -> str:
    """The inline model config (YAML flow mapping) of ``recipe``'s model from recipes/models/."""
    from longsft.train.config.recipes import load_config

    name = load_config(recipe, []).model.path.rsplit("/", 1)[-1]
    return json.dumps(json.loads((ROOT / "recipes" / "models" / f"{name}.json").read_text()))


def launch(n: int, a, out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", __file__, "--worker",
           "--seq", str(a.seq), "--out", str(out), "--val-recipe", a.val_recipe, "--val-seq", str(a.val_seq),
           "--val-items", str(a.val_items)]
    cmd += ["--smoke"] * a.smoke + ["--profile"] * (n == a.most) + ["--validation"] * (n == a.most)
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // n)))
    if a.smoke:
        env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    t0 = time.time()
    limit = a.launch_timeout * (2 if n == a.most else 1)  # the last launch also profiles and validates
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as e:
        tail = ((e.stdout or b"") + (e.stderr or b"")).decode(errors="replace")[-3000:]
        return {"ranks": n, "error": f"timed out after {limit} s", "log_tail": tail, "seconds": time.time() - t0}
    if r.returncode:
        return {"ranks": n, "error": f"exit {r.returncode}", "log_tail": (r.stdout + r.stderr)[-3000:],
                "seconds": time.time() - t0}
    got = json.loads(out.read_text())
    out.unlink()
    return {**got, "seconds": time.time() - t0}


def judge(launches: list[dict], tol: float) -> dict:
    """Each backend's loss and gradient norm at sp = N against one rank's."""
    ref = next((x["steps"]["torch"] for x in launches if x.get("ranks") == 1 and "steps" in x), None)
    rows = []
    for x in launches:
        for backend, step in x.get("steps", {}).items():
            if x["ranks"] == 1 or ref is None:
                continue
            errs = {k: abs(step[k] - ref[k]) / abs(ref[k]) for k in ("loss", "grad_norm")}
            rows.append({"sp": x["ranks"], "backend": backend, **errs, "pass": max(errs.values()) <= tol})
    return {"tolerance": tol, "rows": rows, "pass": bool(rows) and all(r["pass"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, 2 ranks, a tiny model")
    ap.add_argument("--seq", type=int, default=None, help="tokens of the equality step (default 16384)")
    ap.add_argument("--val-recipe", default="qwen3_8b")
    ap.add_argument("--val-seq", type=int, default=None, help="validation prompt tokens (default 32768)")
    ap.add_argument("--val-items", type=int, default=8)
    ap.add_argument("--launch-timeout", type=int, default=150, help="seconds per launch (twice that for the last)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--validation", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.seq = a.seq or (512 if a.smoke else 16384)
    a.val_seq = a.val_seq or (256 if a.smoke else 32768)
    if a.smoke:
        a.val_items = min(a.val_items, 4)
    if a.worker:
        return worker(a)
    import torch
    from machine import describe

    gpus = torch.cuda.device_count()
    if not a.smoke and gpus < 2:
        sys.exit("bench/multigpu_check.py needs a node of 2 or more GPUs (or --smoke on CPU)")
    sizes = [1, 2] if a.smoke else [n for n in (1, 2, 4, 8) if n <= gpus]
    a.most = sizes[-1]
    name = "multigpu_check_smoke" if a.smoke else "multigpu_check"
    path = ROOT / "bench" / "results" / f"{name}.json"
    tol = 1e-4 if a.smoke else 2e-2
    launches: list[dict] = []
    for n in sizes:
        launches.append(launch(n, a, path.with_name(f".{name}_{n}.json")))
        print(json.dumps({k: v for k, v in launches[-1].items() if k != "log_tail"}), flush=True)
        path.write_text(json.dumps({"benchmark": "multigpu_check", "seq": a.seq, "launches": launches,
                                    "equality": judge(launches, tol), "machine": describe()}, indent=2) + "\n")
    verdict = judge(launches, tol)
    print("\n| sp | backend | loss rel. err | grad norm rel. err | pass |\n|---:|---|---:|---:|---|")
    for r in verdict["rows"]:
        print(f"| {r['sp']} | {r['backend']} | {r['loss']:.1e} | {r['grad_norm']:.1e} | {r['pass']} |")
    print(f"wrote {path}")
    sys.exit(0 if verdict["pass"] and not any("error" in x for x in launches) else 1)


if __name__ == "__main__":
    main()
