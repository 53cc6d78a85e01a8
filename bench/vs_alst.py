"""longsft against DeepSpeed's Arctic Long Sequence Training (ALST), side by side on CPU.

    python bench/vs_alst.py [--lengths 16384 32768] [--rounds 3] [--impls torch ulysses alst] [--smoke]

One torchrun job of 2 ranks per length (one thread each: the machine's 2 cores), one process group,
one sequence with a 64-token answer split over both ranks (sp=2), the same model, seed and
DeepSpeed config (ZeRO-3 with parameter and optimizer offload, DeepSpeed's CPU Adam, activation
checkpointing per decoder layer, fp32). Each implementation gets its own engine built from the same
seed; one warm-up step each, then ``--rounds`` interleaved rounds (the order rotates every round), so
the machine's noise falls on all of them alike.

- ``torch`` / ``ulysses``: longsft's own step (``bench/onestep.py``: ``token_loss_sum`` +
  ``backward_scale``, as the trainer takes it) with ``parallel.sp_backend`` set to either;
  ``+keep``: with ``model.keep_attention=true`` (the layers' recompute reuses their attention).
- ``alst``: DeepSpeed 0.19's ALST wired as its tutorial shows (``bench/alst.py``): ``UlyssesSPAttentionHF``
  over transformers' ``sdpa``, the batch sharded by ``UlyssesSPDataLoaderAdapter``, and the loss
  all-gathered over the SP group weighted by each rank's target count. Its LM head runs on the
  answer positions only (``logits_to_keep``), as longsft's does: a plain ``outputs.loss`` would
  compute ``[tokens, vocab]`` logits for the whole prompt, which is not the comparison of interest.
  ``--alst-tiled-mlp`` adds its ``TiledMLP`` (compare with longsft's ``model.mlp_tile_tokens``).
  On one GPU, with ALST's tiled loss and checkpoint offload: ``bench/gpu_vs_alst.py``.

Per step: wall seconds and CPU seconds (summed over ranks: steadier on a shared machine) and
per-rank peak memory, the rise of VmHWM (reset through /proc/self/clear_refs before the step)
over the RSS before it, max over ranks, with ``MALLOC_MMAP_THRESHOLD_=65536`` so freed tensors
leave the RSS. The first step's loss and gradient norm of every implementation must agree (they
start from the same weights): the comparison is of the same computation. ``--sp1`` also runs
longsft on one rank (the same model and length, the machine's 2 threads) for the sp=2 / sp=1
per-rank memory ratio. Writes bench/results/vs_alst.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
import alst  # noqa: E402
import onestep  # noqa: E402

# hidden 512, 4 layers, Qwen3 layout with its real vocabulary (tied): GQA 8 query / 2 KV heads
WIDE = ["hidden_size=512", "intermediate_size=1536", "num_hidden_layers=4", "num_attention_heads=8",
        "num_key_value_heads=2", "head_dim=64", "max_position_embeddings=131072"]
COMMON = ["parallel.sp_size=2", "optim.grad_accum=1", "deepspeed.config=zero3_offload", "deepspeed.torch_adam=false",
          "model.gradient_checkpointing=true", "model.dtype=fp32"]
IMPLS = ("torch", "ulysses", "torch+keep", "ulysses+keep", "alst")  # +keep: model.keep_attention=true


def _kib(key: str) -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key + ":"))


class Measured:
    """One step's wall time, CPU time and peak RSS rise (KiB) of this process."""

    def __enter__(self):
        open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
        self.rss, self.wall, self.cpu = _kib("VmRSS"), time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu
        self.peak_kib = _kib("VmHWM") - self.rss


def worker(args) -> None:
    import dataclasses

    import torch

    from longsft.train.config.recipes import load_config
    from longsft.train.data.batching import collate
    from longsft.train.data.encoding import Encoded, Meta
    from longsft.train.model.build import build_hf_config
    from longsft.train.parallel import comm, distributed
    from longsft.train.parallel.attention import register

    sp = int(os.environ["WORLD_SIZE"])
    cfg = load_config("tiny", [*COMMON, f"parallel.sp_size={sp}", f"stages.0.seq_len={args.seq}",
                               *(f"model.config.{o}" for o in args.model), *args.longsft])
    d = distributed.init(sp, sp_backend="torch")
    vocab = build_hf_config(cfg.model).vocab_size
    ids = torch.randint(0, vocab, (args.seq,), generator=torch.Generator().manual_seed(0)).tolist()
    item = Encoded(Meta("b", "en", 4), ids, args.seq - onestep.ANSWER)
    full = collate([item], 0)
    impls = [i for i in args.impls if sp > 1 or i in ("torch", "torch+keep")]  # one rank: the ring's single block
    engines, batches, cfgs = {}, {}, {}
    for impl in impls:
        if impl == "alst":
            engines[impl] = alst.build(cfg, args.seq, sp, alst.Options(tiled_mlp=args.alst_tiled_mlp))
            batches[impl] = alst.shard(full, engines[impl][1])
        else:
            cfgs[impl] = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, keep_attention="+keep" in impl))
            engines[impl] = onestep.zero3_engine(cfgs[impl], total_steps=args.rounds + 1, world_size=sp)
            batches[impl] = onestep.one_sequence(cfg, args.seq, d)

    def run(impl: str) -> dict:
        attention = register(dataclasses.replace(d.sp, backend=impl.split("+")[0])) if impl != "alst" else None
        with Measured() as m:
            if impl == "alst":
                loss, norm = alst.step(*engines[impl], batches[impl], alst.Options(tiled_mlp=args.alst_tiled_mlp))
            else:
                engine = engines[impl]
                loss_sum, _ = onestep.step(engine, cfgs[impl], batches[impl], attention)  # its loss: this rank's sum
                norm = float(engine.get_global_grad_norm() or 0.0)
                loss = comm.all_reduce([loss_sum])[0] / onestep.ANSWER
        return {"wall": m.wall, "cpu": m.cpu, "peak_mib": m.peak_kib / 1024, "loss": loss, "grad_norm": norm}

    first = {impl: run(impl) for impl in impls}  # warm-up: Adam's moments, kernels, allocator
    rows = {impl: [] for impl in impls}
    for r in range(args.rounds):
        order = impls[r % len(impls):] + impls[:r % len(impls)]
        for impl in order:
            rows[impl].append(run(impl))
    stats = comm.all_gather_objects({"first": first, "rows": rows})
    if d.is_main:
        out = {}
        for impl in impls:
            steps = [[s["rows"][impl][k] for s in stats] for k in range(args.rounds)]  # [round][rank]
            out[impl] = {"wall": [max(x["wall"] for x in st) for st in steps],
                         "cpu": [sum(x["cpu"] for x in st) for st in steps],
                         "peak_mib": max(x["peak_mib"] for st in steps for x in st),
                         "peak_mib_per_rank": [max(st[k]["peak_mib"] for st in steps) for k in range(sp)],
                         "first_loss": first[impl]["loss"], "first_grad_norm": first[impl]["grad_norm"]}
        ref = out[impls[0]]
        for impl, r in out.items():  # the same weights, the same sequence: the same loss and gradients
            for key in ("first_loss", "first_grad_norm"):
                if abs(r[key] - ref[key]) > 1e-4 * abs(ref[key]):
                    raise SystemExit(f"{impl} {key} {r[key]} differs from {impls[0]}'s {ref[key]}: not the same step")
        # what longsft's defaults do in this run (model.keep_attention=auto; the tied weight's hold), as the
        # trainer decides them (plan.choose) on this machine
        made = onestep.choices(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, keep_attention="auto")),
                               sp)
        Path(args.out).write_text(json.dumps({"seq": args.seq, "sp": sp, "impls": out, "defaults": {
            "keep_attention": made.keep_attention, "hold_tied_weight": made.hold_tied_weight, "note": made.note}}))
    else:
        onestep.choices(cfg, sp)  # (a broadcast from rank 0)
    distributed.shutdown()


def _job(seq: int, nproc: int, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", __file__, "--worker",
           "--seq", str(seq), "--rounds", str(args.rounds), "--out", str(out), "--impls", *args.impls,
           "--model", *args.model]
    if args.longsft:
        cmd += ["--longsft", *args.longsft]
    if args.alst_tiled_mlp:
        cmd.append("--alst-tiled-mlp")
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc)), MALLOC_MMAP_THRESHOLD_="65536",
               DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR",
                                                                         str(ROOT / ".cache" / "torch_extensions")))
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        sys.exit(f"job seq={seq} nproc={nproc} failed (rc {rc}); its output:\n{log.read_text()[-4000:]}")
    log.unlink()
    result = json.loads(out.read_text())
    out.unlink()
    return result


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--model", nargs="*", default=WIDE, help="model config overrides KEY=VALUE (default: hidden 512 x 4)")
    ap.add_argument("--longsft", nargs="*", default=[], help="extra longsft run keys KEY=VALUE, e.g. model.mlp_tile_tokens=2048")
    ap.add_argument("--alst-tiled-mlp", action="store_true", help="ALST with its TiledMLP")
    ap.add_argument("--sp1", action="store_true", help="also longsft on one rank: the sp=2 / sp=1 memory ratio")
    ap.add_argument("--smoke", action="store_true", help="a check of this script: the tiny model, 1K tokens, 1 round")
    ap.add_argument("--out", default="vs_alst")
    args = ap.parse_args()
    if args.smoke:
        args.lengths, args.rounds, args.model, args.out = [1024], 1, [], "vs_alst_smoke"
    from machine import write_result

    results = []
    for seq in args.lengths:
        tmp = ROOT / "bench" / "results" / f".vs_alst_{seq}.json"
        row = _job(seq, 2, args, tmp)
        if args.sp1:  # longsft on one rank, attention recomputed and kept
            one = _job(seq, 1, args, tmp)["impls"]
            row["sp1"], row["sp1+keep"] = one["torch"], one.get("torch+keep")
        results.append(row)
        _report(results)
    write_result(args.out, {"benchmark": "vs_alst", "model_overrides": args.model, "longsft_overrides": args.longsft,
                            "alst_tiled_mlp": args.alst_tiled_mlp, "rounds": args.rounds, "common": COMMON,
                            "goals": {"time_ratio": 0.85, "memory_ratio": 0.8, "sp2_over_sp1_memory": 0.6},
                            "rows": results})


def _report(results: list[dict]) -> None:
    print("\n| tokens | impl | wall s/step | CPU s/step | peak MiB/rank | time / ALST (wall, CPU) | memory / ALST "
          "| first loss | first grad norm |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in results:
        alst = row["impls"].get("alst")
        for impl, r in row["impls"].items():
            if alst and impl != "alst":
                r["time_ratio"] = [a / b for a, b in zip(r["wall"], alst["wall"])]
                r["cpu_ratio"] = [a / b for a, b in zip(r["cpu"], alst["cpu"])]
                r["memory_ratio"] = r["peak_mib"] / alst["peak_mib"]
                vs = (f"{statistics.median(r['time_ratio']):.2f} [{min(r['time_ratio']):.2f}-{max(r['time_ratio']):.2f}], "
                      f"{statistics.median(r['cpu_ratio']):.2f}")
                mem = f"{r['memory_ratio']:.2f}"
            else:
                vs = mem = "–"
            print(f"| {row['seq']} | {impl} | {_med(r['wall'])} | {_med(r['cpu'])} | {r['peak_mib']:.0f} | {vs} | {mem} "
                  f"| {r['first_loss']:.6f} | {r['first_grad_norm']:.6f} |")
        if "sp1" in row:  # longsft's sp=2 over its own sp=1 with the same attention setting (kept or not)
            one = {i: row["sp1+keep" if i.endswith("+keep") and row.get("sp1+keep") else "sp1"]
                   for i in row["impls"] if i != "alst"}
            row["sp2_over_sp1_memory"] = {i: row["impls"][i]["peak_mib"] / r["peak_mib"] for i, r in one.items()}
            for name in ("sp1", "sp1+keep"):
                if row.get(name):
                    r = row[name]
                    print(f"| {row['seq']} | torch{name[3:]} sp=1 | {_med(r['wall'])} | {_med(r['cpu'])} | "
                          f"{r['peak_mib']:.0f} | | | {r['first_loss']:.6f} | {r['first_grad_norm']:.6f} |")
            print(f"| {row['seq']} | sp=2 / sp=1 memory | " + ", ".join(
                f"{i} {v:.2f}" for i, v in row["sp2_over_sp1_memory"].items()) + " | | | | | | |")
        if "defaults" in row:
            print(f"| {row['seq']} | longsft's defaults here | {row['defaults']['note']} | | | | | | |")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        ap = argparse.ArgumentParser()
        ap.add_argument("--worker", action="store_true")
        ap.add_argument("--seq", type=int)
        ap.add_argument("--rounds", type=int)
        ap.add_argument("--out")
        ap.add_argument("--impls", nargs="+")
        ap.add_argument("--model", nargs="*", default=[])
        ap.add_argument("--longsft", nargs="*", default=[])
        ap.add_argument("--alst-tiled-mlp", action="store_true")
        worker(ap.parse_args())
    else:
        main()
