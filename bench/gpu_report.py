"""One JSON for bench/gpu.sh: each step measured, failed or pending, with its figures.

    python bench/gpu_report.py STEPS.tsv [--tiny RUN_DIR ...]   (bench/gpu.sh runs it)
    python bench/gpu_report.py --pending "no GPU was lent"      (every step pending, and why)

STEPS.tsv: one ``step<TAB>exit status<TAB>seconds`` line per step gpu.sh ran. Each step's own
results file (bench/results/gpu_<step>.json) is embedded; ``--tiny`` run directories (the tiny
curriculum trained on the GPU) are summarised from their state.json and metrics.jsonl into
bench/results/gpu_tiny.json. Writes bench/results/gpu.json.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from machine import describe  # noqa: E402

RESULTS = Path(__file__).parent / "results"
STEPS = {
    "checks": "CUDA first contact: ring on one rank vs SDPA (bf16/fp16 flash with undefined cum_seq, fp32 "
              "memory-efficient kernel), a CPU tensor refused by NCCL and comm.device() accepted, Liger with no "
              "answer rows, loss-path memory with offloaded activations (last hidden state only)",
    "tiny": "recipe=tiny end to end on the GPU (make demo's job, shortened), 1 rank: fp32, ZeRO-3 offload",
    "tiny_sp2": "the same on 2 ranks sharing each sequence (sp=2, the fp32 ring on the memory-efficient kernel); "
                "needs 2 GPUs",
    "attention": "the torch ring's forward+backward (one rank; the blocks of an 8-rank ring) vs one SDPA call on "
                 "the same tokens, bf16, 32K-128K: time, TFLOP/s, MFU against the data-sheet peak (goal >= 45%), error",
    "loss": "Liger vs chunked vs naive loss, plain and under ZeRO-3 (untied head): values, gradients, memory",
    "train": "Qwen3-1.7B shape, ZeRO-3, 16K-100K tokens: tokens/s, MFU against the data-sheet and a measured peak, "
             "peak memory vs the planner (and with offloaded activations)",
    "validation": "the validation hook's generate(): prefill time and decode tokens/s, plain, ZeRO-3, ZeRO-3 offload",
}


def summarise_tiny(run_dirs: list[str]) -> dict:
    runs = []
    for run in map(Path, run_dirs):
        state = run / "state.json"
        if not state.exists():
            runs.append({"run_dir": str(run), "finished": False})
            continue
        stages = json.loads(state.read_text())["stages"]
        metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        train = [m for m in metrics if m["kind"] == "train"]
        runs.append({"run_dir": str(run), "finished": all(s["status"] == "done" for s in stages.values()),
                     "stages": {k: {"status": s["status"], "steps_done": s.get("steps_done"),
                                    "best": s.get("best")} for k, s in stages.items()},
                     "first_loss": train[0]["loss"] if train else None, "last_loss": train[-1]["loss"] if train else None,
                     "tokens_per_s": [m["tokens_per_s"] for m in train][-3:]})
    return {"benchmark": "gpu_tiny", "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("steps", nargs="?")
    ap.add_argument("--tiny", nargs="*", default=[])
    ap.add_argument("--pending", help="no run: every step pending, for this reason")
    a = ap.parse_args()
    ran = {}
    if a.steps:
        for line in Path(a.steps).read_text().splitlines():
            name, rc, seconds = line.split("\t")
            ran[name] = (int(rc), float(seconds))
    if a.tiny:
        (RESULTS / "gpu_tiny.json").write_text(json.dumps(summarise_tiny(a.tiny), indent=2) + "\n")
    report = {"benchmark": "gpu", "machine": None if a.pending else describe(), "steps": {}}
    for name, what in STEPS.items():
        entry = {"what": what}
        if a.pending or name not in ran:
            entry.update(status="pending", why=a.pending or "not run by this gpu.sh run")
        else:
            rc, seconds = ran[name]
            entry.update(status="measured" if rc == 0 else ("timed out" if rc == 124 else "failed"), exit_status=rc,
                         seconds=seconds)
            path = RESULTS / f"gpu_{name}.json"
            if path.exists():
                entry["results"] = json.loads(path.read_text())
        report["steps"][name] = entry
    out = RESULTS / "gpu.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print("\n| step | status | seconds |\n|---|---|---:|")
    for name, entry in report["steps"].items():
        print(f"| {name} | {entry['status']} | {entry.get('seconds', '-')} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
