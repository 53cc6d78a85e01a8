"""Shared scorer throughput: parse + metrics + per-slice bootstrap CIs on 100,000 synthetic predictions.

    python bench/scorer.py [--n 100000]

Predictions mix clean JSON, fenced/think-block/full-width/truncated outputs, plain-text scores and
garbage. Writes bench/results/scorer.json. Goal (issue 5): under 10 s on this CPU.
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
ROOT = Path(__file__).resolve().parents[1]

TEMPLATES = ['{{"score": {s}, "reason": "ok"}}', '<think>hmm</think>```json\n{{"reason": "r", "score": {s}, '
             '"hallucination_types": ["Entity"]}}\n```', '｛“reason”：“错”，“score”：{s}｝', 'Score = {s}',
             '{{"reason": "truncated", "score": {s}, "hallucination_ty', "no judgement at all"]


def main() -> None:
    from longsft.eval.metrics import Item, score_items
    from machine import describe

    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100_000)
    args = ap.parse_args()
    rng = random.Random(0)
    items = [Item(str(i), rng.choice(TEMPLATES).format(s=rng.randint(0, 5)), rng.randint(0, 5),
                  bucket=rng.choice(["16k", "32k", "64k", "100k"]), language=rng.choice(["zh", "en"]))
             for i in range(args.n)]
    t0 = time.perf_counter()
    score_items(items)
    t_plain = time.perf_counter() - t0
    t0 = time.perf_counter()
    score_items(items, bootstrap=2000)
    t_boot = time.perf_counter() - t0
    print(f"| predictions | score s | score + 2000-replicate CIs (7 slices) s |\n|---:|---:|---:|\n"
          f"| {args.n} | {t_plain:.2f} | {t_boot:.2f} |")
    out = ROOT / "bench" / "results" / "scorer.json"
    out.write_text(json.dumps({"benchmark": "scorer", "n": args.n, "score_s": t_plain, "score_with_ci_s": t_boot,
                               "goal_s": 10, "machine": describe()}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
