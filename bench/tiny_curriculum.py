"""Wall time of the README's demo (`make demo`): the tiny curriculum on 2 ranks, then its resume.

    python bench/tiny_curriculum.py [--nproc 2]

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


def run(run_dir: Path, nproc: int) -> float:
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                    str(ROOT / "launch" / "curriculum.py"), "recipe=tiny", f"run_dir={run_dir}",
                    "logging.progress=false"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   env=dict(os.environ, PYTHONWARNINGS="ignore"))
    return time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "tiny"
        first = run(run_dir, args.nproc)
        again = run(run_dir, args.nproc)
        state = json.loads((run_dir / "state.json").read_text())
    stages = {name: {"seconds": round(s["seconds"], 1), "steps": s["steps_done"],
                     "best_balanced_accuracy": (s.get("best") or {}).get("balanced_accuracy"),
                     "best_mcc": (s.get("best") or {}).get("mcc")} for name, s in state["stages"].items()}
    result = {"benchmark": "tiny_curriculum", "nproc": args.nproc, "wall_s_first_run": round(first, 1),
              "wall_s_resume_run": round(again, 1), "goal_s": 600, "stages": stages, "machine": describe()}
    print(f"| run | wall time |\n|---|---:|\n| first (trains all stages) | {first:.0f} s |\n"
          f"| second (resumes: nothing left to do) | {again:.0f} s |\n")
    print("| stage | steps | seconds | best BA | best MCC |\n|---|---:|---:|---:|---:|")
    for name, s in stages.items():
        ba, mcc = s["best_balanced_accuracy"], s["best_mcc"]
        print(f"| {name} | {s['steps']} | {s['seconds']} | {'–' if ba is None else f'{ba:.3f}'} | "
              f"{'–' if mcc is None else f'{mcc:.3f}'} |")
    write_result("tiny_curriculum", result)


if __name__ == "__main__":
    main()
