"""Sequence parallelism on CPU: per-rank peak memory and step time, sp=1 vs sp=2 (and 4).

    python bench/sp_scaling.py [--lengths 4096 8192 16384] [--sp 1 2 4] [--model KEY=VALUE ...]

One fresh torchrun job per (length, sp): the tiny recipe's model (fp32, gradient checkpointing),
one sequence of the given length with a 64-token answer, 1 warm-up + 3 timed forward/backward
steps with the `torch` backend (zigzag ring). ``--model`` overrides the tiny model's config
(e.g. a wider model with a small vocabulary, where activations rather than the embedding
gradient dominate). Memory is the rise of the peak RSS over the RSS before the first
full-length step, max over ranks. Ring efficiency = T(sp=1) / (sp * T(sp)) assumes a device per
rank; here all ranks share the machine's cores (each gets cores/sp threads), so the fair figure
is the same-cores ratio T(sp=1) / T(sp): 1.0 means the ring costs nothing extra.
Writes bench/results/sp_scaling.json.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))


def _rss_kib() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def worker(seq: int, out: str, model_overrides: list[str]) -> None:
    import torch

    from longsft.train.config.recipes import load_config
    from longsft.train.data.encoding import Encoded, Meta
    from longsft.train.model.build import build_model
    from longsft.train.model.loss import token_loss_sum
    from longsft.train.parallel import comm, distributed
    from longsft.train.training.step import make_batch

    sp = int(os.environ["WORLD_SIZE"])
    d = distributed.init(sp)
    cfg = load_config("tiny", [f"model.config.{o}" for o in model_overrides])
    model = build_model(cfg.model, sp_size=sp)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.model.config["vocab_size"], (seq,), generator=g).tolist()
    item = Encoded(Meta("b", "en", 4), ids, seq - 64)
    batch, _ = make_batch([item], 0, d)

    def step() -> None:
        with d.attention.active():
            loss, n = token_loss_sum(model, batch)
            (loss / n).backward()
        model.zero_grad(set_to_none=True)

    before = _rss_kib()
    step()  # warm-up: allocator, kernels
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    stats = comm.all_gather_objects({"step_s": sorted(times)[1], "peak_mib": peak / 1024})
    if d.is_main:
        Path(out).write_text(json.dumps({"seq": seq, "sp": sp, "step_s": max(s["step_s"] for s in stats),
                                         "peak_mib": max(s["peak_mib"] for s in stats)}))
    distributed.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--model", nargs="*", default=[], help="tiny model config overrides, KEY=VALUE")
    ap.add_argument("--out", default="sp_scaling.json")
    args = ap.parse_args()
    from machine import describe

    rows = []
    for seq in args.lengths:
        for sp in args.sp:
            out = ROOT / "bench" / "results" / f".sp_{seq}_{sp}.json"
            subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={sp}",
                            __file__, "--worker", str(seq), str(out), *args.model], cwd=ROOT, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env=dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // sp))))
            rows.append(json.loads(out.read_text()))
            out.unlink()
    base = {r["seq"]: r for r in rows if r["sp"] == 1}
    print("| tokens | sp | step s | peak MiB/rank | memory vs sp=1 | ring efficiency | same-cores ratio |\n"
          "|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        b = base.get(r["seq"])
        r["memory_ratio"] = r["peak_mib"] / b["peak_mib"] if b else None
        r["ring_efficiency"] = b["step_s"] / (r["sp"] * r["step_s"]) if b else None
        r["same_cores_ratio"] = b["step_s"] / r["step_s"] if b else None
        print(f"| {r['seq']} | {r['sp']} | {r['step_s']:.2f} | {r['peak_mib']:.0f} | "
              f"{r['memory_ratio']:.2f} | {r['ring_efficiency']:.2f} | {r['same_cores_ratio']:.2f} |")
    result = {"benchmark": "sp_scaling", "backend": "torch (zigzag ring)", "model_overrides": args.model, "rows": rows,
              "goal_memory_ratio_sp2": 0.6, "machine": describe()}
    path = ROOT / "bench" / "results" / args.out
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(int(sys.argv[2]), sys.argv[3], sys.argv[4:])
    else:
        main()
