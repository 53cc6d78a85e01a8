"""Shared scorer throughput: parse + metrics + per-slice bootstrap CIs on 100,000 synthetic predictions.

    python bench/scorer.py [--n 100000]

Predictions mix clean JSON, fenced/think-block/full-width/truncated outputs, plain-text scores and
garbage. Also times what a user runs: an eval run scored and written (with CIs) and its Table 4
report (CSV, PNG), and the paired comparison of two such runs. Writes bench/results/scorer.json. Goal (issue 5): under 10 s.
"""

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

TEMPLATES = ['{{"score": {s}, "reason": "ok"}}', '<think>hmm</think>```json\n{{"reason": "r", "score": {s}, '
             '"hallucination_types": ["Entity"]}}\n```', '｛“reason”：“错”，“score”：{s}｝', 'Score = {s}',
             '{{"reason": "truncated", "score": {s}, "hallucination_ty', "no judgement at all"]


def main() -> None:
    from machine import write_result

    from longsft.train.scoring.metrics import Item, score_items

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
    # the whole path a user runs: score two eval runs (files written), Table 4 report, paired comparison
    from longsft.eval.eval_config import EvalConfig
    from longsft.eval.harness import eval_summary
    from longsft.eval.report import compare, eval_tables

    with tempfile.TemporaryDirectory() as tmp:
        runs, times = [], []
        for name in ("a", "b"):
            t0 = time.perf_counter()
            cfg = EvalConfig(model=name, data="synthetic", name=name, out=f"{tmp}/{{name}}", progress=False)
            rows = [{"id": it.id, "prediction": rng.choice(TEMPLATES).format(s=rng.randint(0, 5)),
                     "gold_score": it.gold_score, "bucket": it.bucket, "language": it.language, "types": [],
                     "error": None, "prompt_tokens": 0, "gen_tokens": 0} for it in items]
            eval_summary(cfg, len(rows), [rows], None)
            runs.append(Path(tmp) / name)
            eval_tables(runs[-1:], Path(tmp) / f"report_{name}")
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        compare(runs[0], runs[1])
        t_compare = time.perf_counter() - t0
    t_report = times[0]
    print(f"| predictions | score s | score + 2000-replicate CIs (7 slices) s | one eval run scored, written and "
          f"reported (Table 4, CSV, PNG) s | paired comparison of two runs s |\n|---:|---:|---:|---:|---:|\n"
          f"| {args.n} | {t_plain:.2f} | {t_boot:.2f} | {t_report:.2f} | {t_compare:.2f} |")
    write_result("scorer", {"benchmark": "scorer", "n": args.n, "score_s": t_plain, "score_with_ci_s": t_boot,
                            "scored_and_reported_s": t_report, "paired_compare_s": t_compare, "goal_s": 10})


if __name__ == "__main__":
    main()
