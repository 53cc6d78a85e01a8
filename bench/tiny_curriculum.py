"""Wall time of the README's demo (`make demo`): the tiny curriculum on 2 ranks, then its resume.

    python bench/tiny_curriculum.py [--nproc 2] [--warm]

The first run is a fresh machine's (after `make install`): empty caches for torch extensions and
longsft (the tokenizer, token caches), unless ``--warm`` keeps this checkout's. Each stage's time is
split into training steps, validations and the rest from metrics.jsonl.

Prints a table and writes bench/results/tiny_curriculum.json (with the machine described).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from machine import describe, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run(run_dir: Path, nproc: int, env: dict) -> float:
    """Seconds of ``make demo`` (the README's command, with the Makefile's environment) into ``run_dir``."""
    t0 = time.time()
    subprocess.run(["make", "--no-print-directory", "demo", f"NPROC={nproc}",
                    f"ARGS=run_dir={run_dir} logging.progress=false"], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, env=dict(os.environ, PYTHONWARNINGS="ignore", **env))
    return time.time() - t0


def phases(run_dir: Path) -> dict:
    """Per stage: seconds in training steps and in validations (metrics.jsonl's records)."""
    out: dict = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        key = {"train": "train_s", "val": "validation_s"}.get(m.get("kind"))
        if key and m.get("stage"):
            seconds = m.get("step_time_s") if key == "train_s" else m.get("seconds")
            out.setdefault(m["stage"], {"train_s": 0.0, "validation_s": 0.0})[key] += float(seconds or 0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--warm", action="store_true", help="keep this checkout's caches (not a fresh machine)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "tiny"
        env = {} if args.warm else {"TORCH_EXTENSIONS_DIR": f"{tmp}/torch_extensions", "LONGSFT_CACHE": f"{tmp}/cache"}
        first = run(run_dir, args.nproc, env)
        again = run(run_dir, args.nproc, env)
        state = json.loads((run_dir / "state.json").read_text())
        split = phases(run_dir)
    stages = {name: {"seconds": round(s["seconds"], 1), "steps": s["steps_done"], **split.get(name, {}),
                     "best_balanced_accuracy": (s.get("best") or {}).get("balanced_accuracy"),
                     "best_mcc": (s.get("best") or {}).get("mcc")} for name, s in state["stages"].items()}
    result = {"benchmark": "tiny_curriculum", "nproc": args.nproc, "wall_s_first_run": round(first, 1),
              "wall_s_resume_run": round(again, 1), "fresh_caches": not args.warm, "goal_s": 240, "goal_resume_s": 10,
              "stages": stages, "machine": describe()}
    print(f"| run | wall time |\n|---|---:|\n| first (trains all stages) | {first:.0f} s |\n"
          f"| second (resumes: nothing left to do) | {again:.0f} s |\n")
    print("| stage | steps | seconds | of which steps | validation | best BA | best MCC |\n"
          "|---|---:|---:|---:|---:|---:|---:|")
    for name, s in stages.items():
        ba, mcc = s["best_balanced_accuracy"], s["best_mcc"]
        print(f"| {name} | {s['steps']} | {s['seconds']} | {s.get('train_s', 0):.1f} | {s.get('validation_s', 0):.1f} | "
              f"{'–' if ba is None else f'{ba:.3f}'} | {'–' if mcc is None else f'{mcc:.3f}'} |")
    write_result("tiny_curriculum", result)


if __name__ == "__main__":
    main()
