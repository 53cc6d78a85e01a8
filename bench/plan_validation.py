"""The memory planner against measured peaks on CPU: tiny and ~100M-parameter Qwen3 models.

    python bench/plan_validation.py [--lengths 1024 4096 8192 16384] [--models tiny m100]

One fresh process per (model, settings, length) runs the real training step (DeepSpeed ZeRO-3 on
one rank, gloo, DeepSpeed's CPU Adam; chunked loss, checkpointing) for three optimizer steps on one
sequence with a 64-token answer. Measured: the peak RSS (VmHWM, reset through
/proc/self/clear_refs after imports and process-group start) minus the RSS at that moment.
Predicted: ``longsft plan``'s CPU terms for one GPU (no CUDA margins or flash workspace), plus the host terms,
since on CPU "device" and host are the same memory. Writes bench/results/plan_validation.json.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
import onestep  # noqa: E402

# ~100M parameters: Qwen3 layout, the real vocabulary (tied), 8 layers of width 512
M100 = ["model.config.hidden_size=512", "model.config.intermediate_size=1536", "model.config.num_hidden_layers=8",
        "model.config.num_attention_heads=8", "model.config.num_key_value_heads=2", "model.config.head_dim=64"]
MODELS = {"tiny": [], "m100": M100}
SETTINGS = {  # name -> overrides on the tiny recipe
    "zero3": ["deepspeed.config=zero3"],
    "zero3_offload": ["deepspeed.config=zero3_offload"],
    "zero3_offload_tiled": ["deepspeed.config=zero3_offload", "model.mlp_tile_tokens=1024"],
}
COMMON = ["parallel.sp_size=1", "optim.grad_accum=1", "deepspeed.torch_adam=false", "model.loss_chunk_tokens=1024"]
ANSWER = onestep.ANSWER


def _status_kib(key: str) -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key + ":"))


def worker(seq: int, out: str, overrides: list[str]) -> None:
    from longsft.train.config.recipes import load_config
    from longsft.train.parallel import distributed

    cfg = load_config("tiny", [*overrides, f"stages.0.seq_len={seq}"])
    d = distributed.init(1)
    batch = onestep.one_sequence(cfg, seq, d)
    open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    engine = onestep.zero3_engine(cfg, total_steps=3)
    for _ in range(3):  # the peak of a step after the first (Adam's moments exist from the first on)
        onestep.step(engine, cfg, batch, d.attention)
    peak = _status_kib("VmHWM") - before
    Path(out).write_text(json.dumps({"measured_bytes": peak * 1024}))
    distributed.shutdown()


def predict(overrides: list[str], seq: int) -> dict:
    from longsft.train.config.recipes import load_config

    cfg = load_config("tiny", [*overrides, f"stages.0.seq_len={seq}"])
    shape, est = onestep.planned(cfg, cuda=False)
    return {"params": shape.params, "terms_bytes": est.terms, "host_bytes": est.host_per_node,
            "predicted_bytes": est.total + est.host_per_node}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS))
    ap.add_argument("--out", default=None, help="results file (default bench/results/plan_validation.json)")
    args = ap.parse_args()
    from machine import write_result

    rows = []
    # large tensors from mmap, returned on free: RSS follows live tensors instead of malloc's heap
    env = onestep.rendezvous_env(DS_ACCELERATOR="cpu", MALLOC_MMAP_THRESHOLD_="65536")
    tmp = Path(tempfile.mkdtemp())
    for model in args.models:
        for setting in args.settings:
            overrides = [*COMMON, *MODELS[model], *SETTINGS[setting]]
            for seq in args.lengths:
                out = tmp / f"{model}_{setting}_{seq}.json"
                subprocess.run([sys.executable, __file__, "--worker", str(seq), str(out), *overrides], cwd=ROOT,
                               check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                row = {"model": model, "setting": setting, "seq": seq, **predict(overrides, seq),
                       **json.loads(out.read_text())}
                out.unlink()
                row["error"] = row["predicted_bytes"] / row["measured_bytes"] - 1
                rows.append(row)
                print(f"{model:5s} {setting:14s} {seq:6d}  predicted {row['predicted_bytes'] / 2**20:8.0f} MiB  "
                      f"measured {row['measured_bytes'] / 2**20:8.0f} MiB  error {row['error']:+.1%}", flush=True)
    print("\n| model | params | ZeRO-3 | tokens | predicted MiB | measured MiB | error |\n|---|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['params'] / 1e6:.0f}M | {r['setting']} | {r['seq']} | "
              f"{r['predicted_bytes'] / 2**20:.0f} | {r['measured_bytes'] / 2**20:.0f} | {r['error']:+.1%} |")
    worst = max(abs(r["error"]) for r in rows)
    print(f"\nworst |error|: {worst:.1%}")
    result = {"benchmark": "plan_validation", "answer_tokens": ANSWER, "common": COMMON, "rows": rows,
              "worst_abs_error": worst}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    else:
        write_result("plan_validation", result)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(int(sys.argv[2]), sys.argv[3], sys.argv[4:])
    else:
        main()
