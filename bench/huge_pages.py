"""Steps of the tiny recipe with glibc's default 4 KiB pages vs huge pages (``GLIBC_TUNABLES``).

    python bench/huge_pages.py [--steps 24] [--rounds 2] [--nproc 2]

On a CPU every step's large tensors (the tied embedding's ``[vocab, hidden]`` gradient, ZeRO-3's
flat buffers) are fresh ``mmap``s that glibc returns when they are freed, so each 4 KiB page is a
fault the next step pays again. With ``glibc.malloc.hugetlb=1`` glibc asks for transparent huge
pages on those mappings (the kernel's ``madvise`` mode): 512 times fewer faults.

Runs the demo's warmup stage (512 tokens, 2 ranks, ZeRO-3 + offload) for ``--steps`` steps each way,
alternating, ``--rounds`` times; the first 4 steps of each run are not counted. Also times one
fresh 78 MB ``torch.zeros`` (the tiny model's embedding gradient) each way. Prints a table and
writes bench/results/huge_pages.json.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from machine import describe, write_result  # noqa: E402

from longsft.train.parallel.distributed import HUGE_PAGES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SKIP = 4  # first steps: allocator and DeepSpeed warm-up

ALLOC = """
import resource, time, torch
torch.set_num_threads(1)
torch.zeros(151936, 128)
r0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
for _ in range(20):
    torch.zeros(151936, 128)
print((time.perf_counter() - t0) / 20 * 1e3, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / 20)
"""


def env_for(huge: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    return {**env, "GLIBC_TUNABLES": HUGE_PAGES} if huge else env


def alloc(huge: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", ALLOC], env=env_for(huge), check=True, capture_output=True, text=True)
    ms, faults = map(float, out.stdout.split())
    return {"ms": ms, "page_faults": faults}


def warmup_steps(huge: bool, steps: int, nproc: int, tmp: Path) -> dict:
    run_dir = tmp / f"run_{int(huge)}"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                    str(ROOT / "launch" / "curriculum.py"), "recipe=tiny", f"parallel.sp_size={nproc}",
                    f"run_dir={run_dir}", "logging.progress=false",
                    f'stages=[{{name: warmup_512, bucket: "512", seq_len: 512, max_steps: {steps}, validate: false}}]'],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env=dict(env_for(huge), PYTHONWARNINGS="ignore"))
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r.get("kind") == "train"]
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    return {"step_s": [r["step_time_s"] for r in recs[SKIP:]], "peak_gib": max(r["memory_gb"] for r in recs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    mode = thp.read_text().strip() if thp.exists() else None
    runs = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for huge in (False, True):
                runs[huge].append(warmup_steps(huge, args.steps, args.nproc, Path(tmp)))
    rows = {}
    for huge, name in ((False, "4k_pages"), (True, "huge_pages")):
        steps = [s for r in runs[huge] for s in r["step_s"]]
        rows[name] = {"step_s_median": statistics.median(steps), "step_s_min": min(steps), "steps_counted": len(steps),
                      "peak_gib_per_rank": max(r["peak_gib"] for r in runs[huge]), "zeros_78mb": alloc(huge)}
    ratio = rows["huge_pages"]["step_s_median"] / rows["4k_pages"]["step_s_median"]
    print("| pages | s/step (median) | min | peak GiB (rank 0) | fresh 78 MB zeros, ms | its page faults |\n"
          "|---|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        z = r["zeros_78mb"]
        print(f"| {name} | {r['step_s_median']:.3f} | {r['step_s_min']:.3f} | {r['peak_gib_per_rank']:.2f} | "
              f"{z['ms']:.1f} | {z['page_faults']:.0f} |")
    print(f"\nhuge / 4 KiB pages, s/step: {ratio:.2f} (transparent huge pages: {mode})")
    write_result("huge_pages", {"benchmark": "huge_pages", "setting": f"GLIBC_TUNABLES={HUGE_PAGES}",
                                "stage": "tiny recipe warmup_512", "nproc": args.nproc, "steps": args.steps,
                                "rounds": args.rounds, "transparent_hugepage": mode, "rows": rows,
                                "step_ratio_huge_over_4k": ratio, "machine": describe()})


if __name__ == "__main__":
    main()
