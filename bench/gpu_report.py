"""One JSON for bench/gpu.sh: each step measured, failed, timed out or pending, with its figures.

    python bench/gpu_report.py STEPS.tsv [--tiny RUN_DIR ...]   (bench/gpu.sh runs it)
    python bench/gpu_report.py --pending "no GPU was lent"      (every step pending, and why)
    python bench/gpu_report.py [STEPS.tsv] --smoke              (the scripts' --smoke results files, as
                                                                 bash bench/gpu.sh --smoke runs it: a check of
                                                                 this script; writes gpu_smoke.json)

STEPS.tsv: one ``step<TAB>exit status<TAB>seconds`` line per step gpu.sh ran (exit status 124: the
step ran out of its time limit). Each step's own results file (``FILES``) is embedded, with a count
of its rows or checks that failed, were skipped for the step's time budget, or never ran; ``--tiny``
run directories (the tiny curriculum trained on the GPU) are summarised from their state.json and
metrics.jsonl into bench/results/gpu_tiny.json. Writes bench/results/gpu.json.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from machine import describe  # noqa: E402

RESULTS = Path(__file__).parent / "results"
STEPS = {
    "checks": "CUDA first contact: a CPU tensor refused by NCCL and comm.device() accepted, Liger with no answer "
              "rows, ring on one rank vs SDPA (bf16/fp16 flash with undefined cum_seq, fp32 memory-efficient kernel), "
              "loss-path memory with offloaded activations (last hidden state only); each check with its deadline",
    "tiny": "recipe=tiny end to end on the GPU (make demo's job, shortened), 1 rank: fp32, ZeRO-3 offload",
    "tiny_sp2": "the same on 2 ranks sharing each sequence (sp=2, the fp32 ring on the memory-efficient kernel); "
                "needs 2 GPUs",
    "attention": "the torch ring's forward+backward (one rank; the blocks of an 8-rank ring) vs one SDPA call on "
                 "the same tokens, bf16, 32K-128K: time, TFLOP/s, MFU against the data-sheet peak (goal >= 45%), error",
    "sdpa_shapes": "what a length not seen before costs: the model's own SDPA in training (SmolLM2 heads, 1K-2K) "
                   "and a masked prefill, with cuDNN allowed and kept out (model.sdpa_cudnn), and the ring's block "
                   "kernels at 16K: time over new lengths, then the same again",
    "loss": "Liger vs chunked vs naive loss, plain (one model) and under ZeRO-3 (one engine), untied head: values, "
            "gradients, memory",
    "train": "Qwen3-1.7B shape, ZeRO-3, one process and engine for 16K, 32K, 100K and 32K with offloaded activations, "
             "the planner's per-stage choices per row: tokens/s, MFU against the data-sheet and a measured peak, "
             "peak memory vs the planner",
    "overhead": "the fixed per-step cost of the training step at 16K (Qwen3-1.7B shape): plain PyTorch vs ZeRO-3 "
                "and its levers (module granularity, persistence, prefetch), with op, sync and collective counts",
    "validation": "the validation hook's generate() at 16K: the plain model, transformers' class with its weights, a "
                  "profile of 8 decode tokens, ZeRO-3 and ZeRO-3 offload through the hook's own path (a whole copy "
                  "when it fits) and partitioned, then 32K",
}
FILES = {"overhead": "step_overhead_gpu.json"}  # else gpu_<step>.json


def results_file(step: str, smoke: bool = False) -> Path:
    name = FILES.get(step, f"gpu_{step}.json")
    if smoke:
        name = name[: -len("_gpu.json")] + "_smoke.json" if name.endswith("_gpu.json") else \
            name[: -len(".json")] + "_smoke.json"
    return RESULTS / name


def tally(results: dict) -> dict:
    """How many rows (or checks) a results file holds, and how many failed, were skipped or never ran."""
    items = results.get("rows")
    if items is None and isinstance(results.get("checks"), dict):
        items = list(results["checks"].values())
    if not isinstance(items, list):
        return {}
    bad = lambda r: isinstance(r, dict) and (r.get("failed") or r.get("error") or r.get("oom")  # noqa: E731
                                             or r.get("pass") is False and not r.get("skipped"))
    return {"rows": len(items), "failed": sum(1 for r in items if bad(r)),
            "skipped": sum(1 for r in items if isinstance(r, dict) and r.get("skipped"))}


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
                     "first_loss": train[0]["loss"] if train else None,
                     "last_loss": train[-1]["loss"] if train else None,
                     "tokens_per_s": [m["tokens_per_s"] for m in train][-3:]})
    return {"benchmark": "gpu_tiny", "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("steps", nargs="?")
    ap.add_argument("--tiny", nargs="*", default=[])
    ap.add_argument("--pending", help="no run: every step pending, for this reason")
    ap.add_argument("--smoke", action="store_true", help="from the --smoke results files (gpu_smoke.json)")
    a = ap.parse_args()
    ran = {}
    if a.steps:
        for line in Path(a.steps).read_text().splitlines():
            name, rc, seconds = line.split("\t")
            ran[name] = (int(rc), float(seconds))
    elif a.smoke:  # every step whose smoke results exist, as if it had run and passed
        ran = {name: (0, 0.0) for name in STEPS if results_file(name, True).exists()}
    if a.tiny:
        (RESULTS / "gpu_tiny.json").write_text(json.dumps(summarise_tiny(a.tiny), indent=2) + "\n")
    report = {"benchmark": "gpu", "machine": None if a.pending else describe(), "steps": {}}
    for name, what in STEPS.items():
        entry = {"what": what}
        if a.pending or name not in ran:
            entry.update(status="pending", why=a.pending or "not run by this gpu.sh run")
        else:
            rc, seconds = ran[name]
            entry.update(status="measured" if rc == 0 else ("timed out" if rc in (124, 137) else "failed"),
                         exit_status=rc, seconds=seconds)
            path = results_file(name, a.smoke)
            if path.exists():
                try:
                    entry["results"] = json.loads(path.read_text())
                    entry.update(tally(entry["results"]))
                except json.JSONDecodeError as e:  # cut off while being written
                    entry["results_error"] = f"{path.name}: {e}"
            else:
                entry["results_error"] = f"{path.name} was not written"
        report["steps"][name] = entry
    out = RESULTS / ("gpu_smoke.json" if a.smoke else "gpu.json")
    out.write_text(json.dumps(report, indent=2) + "\n")
    print("\n| step | status | seconds | rows | failed | skipped |\n|---|---|---:|---:|---:|---:|")
    for name, e in report["steps"].items():
        print(f"| {name} | {e['status']} | {e.get('seconds', '-')} | {e.get('rows', '-')} | {e.get('failed', '-')} | "
              f"{e.get('skipped', '-')} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
