"""A finished ``bench/learn.py`` run tested again on a fresh held-out set drawn with another seed.

    python bench/retest.py --run runs/learn_e2 --seed 2026 [--test 400] [--gpu] [--json learn_cpu_retest]

learn.py's test set is drawn with the training data's seed (42), and the CPU runs chose among their
settings (stratified steps, learning rate, epochs) by looking at it. This draws ``--test`` new items
(``longsft data sample --seed S``: the same generator, English, balanced, the run's kind of edits),
checks that none shares an article or a summary-and-article pair with the run's training or validation
files, and evaluates the base model and the run's final best checkpoint on them with ``longsft eval``
(the paper's prompt, temperature 0). Then ``longsft report --compare``'s paired bootstrap: final − base
with invalid answers counted as the runs' own policy, and read as each fixed label in both runs (so a
gain in answer format alone counts for nothing), against issue 34's goal: the final BA's 95% interval
above 0.55 and ΔBA ≥ +0.10 at p < 0.01 on ≥ 400 items.

``--test`` defaults to the run's own test size; ``--gpu`` evaluates in bf16, as ``learn.py --gpu`` does
(``bench/gpu_learn.sh`` runs it after ``learn.py --gpu`` there, seed 2026: the CPU runs' fresh items).
Writes ``bench/results/<json>.json`` after every phase and resumes: a rerun skips what is done (and needs
no weights once both evaluations are there: a run restored from ``gpu_learn.sh``'s archive).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))
from machine import bad_result_name  # noqa: E402  (no torch: the refusals below stay instant)

ROOT = Path(__file__).resolve().parents[1]
TRAINING_SEED = 42  # learn.py's data (longsft data sample's default seed)
GOAL = {"test_ba_ci_low_above": 0.55, "d_ba_invalid_as_fixed_label": 0.10, "p": 0.01, "n": 400}


def refuse(why: str) -> None:
    """Bad input: one line on stderr, exit 2, nothing written."""
    print(f"bench/retest.py: {why}", file=sys.stderr)
    sys.exit(2)


def trained(run: Path) -> tuple[Path, str]:
    """(the final best checkpoint, the kind of edits) of learn.py's working folder ``run``, or a refusal."""
    state_file, config_file = run / "run" / "state.json", run / "run" / "config.yaml"
    if not state_file.is_file() or not config_file.is_file():
        refuse(f"{run}: not a bench/learn.py working folder (no run/state.json and run/config.yaml)")
    try:  # (UnicodeDecodeError is a ValueError)
        stages = json.loads(state_file.read_text()).get("stages") or {}
        config = yaml.safe_load(config_file.read_text()) or {}
        unfinished = [n for n, st in stages.items() if st["status"] != "done"]
        train_file = str((config.get("data") or {}).get("train_file", ""))
    except (ValueError, yaml.YAMLError, AttributeError, KeyError, TypeError) as e:
        why = (str(e).splitlines() or [""])[0]
        refuse(f"{run / 'run'}: its state.json or config.yaml is not what learn.py writes ({type(e).__name__}: {why})")
    if not stages or unfinished:
        refuse(f"{state_file}: stage(s) {', '.join(unfinished) or '(none)'} not done; finish the run first")
    # where learn.py reads it too (state.json's own path names the machine it trained on)
    best = run / "run" / "stages" / list(stages)[-1] / "best"
    parents = Path(train_file).parents  # learn.py's <out>/data/<edits>/{bucket}/train.jsonl
    edits = parents[1].name if len(parents) > 1 else ""
    if edits not in ("counterfactual", "erhg"):
        refuse(f"{config_file}: data.train_file {train_file} is not under learn.py's data/<edits>/ folder")
    return best, edits


def folder(learn_out: Path, seed: int, n: int, gpu: bool) -> Path:
    """Where a retest of ``learn_out`` keeps its data and evaluations: one per seed, size and evaluation
    dtype (so that a rerun with other settings never resumes another's answers)."""
    return learn_out / "retest" / f"seed{seed}_n{n}{'_bf16' if gpu else ''}"


def fingerprints(paths: list[Path]) -> tuple[set[str], set[str]]:
    """Hashes of every article, and of every (article, summary) pair, in ``paths`` (JSONL)."""
    articles, pairs = set(), set()
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                articles.add(hashlib.sha256(r["article"].encode()).hexdigest())
                pairs.add(hashlib.sha256((r["article"] + "\0" + r["summary"]).encode()).hexdigest())
    return articles, pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="a finished bench/learn.py working folder (e.g. runs/learn_e2)")
    ap.add_argument("--seed", type=int, required=True, help=f"the new test set's seed (not {TRAINING_SEED})")
    ap.add_argument("--test", type=int, default=None, help="held-out items, balanced (default: the run's test size)")
    ap.add_argument("--gpu", action="store_true", help="evaluate in bf16 (learn.py --gpu's evaluations)")
    ap.add_argument("--model", default=None, help="the base model (default: learn.py's GGUF file)")
    ap.add_argument("--json", default=None,
                    help="results name: bench/results/<name>.json (learn_cpu_retest; --gpu learn_gpu_retest)")
    ap.add_argument("--note", default="", help="what this run is, for the results file's note")
    args = ap.parse_args()
    if args.seed == TRAINING_SEED:
        refuse(f"--seed {args.seed}: the training data's seed; its test items are the ones the run was chosen on")
    args.json = args.json or ("learn_gpu_retest" if args.gpu else "learn_cpu_retest")
    if bad_result_name(args.json):
        refuse(bad_result_name(args.json))
    run = (ROOT / args.run).resolve()
    best, edits = trained(run)
    seen = sorted((run / "data" / edits).glob("*/*.jsonl"))
    if not (run / "data" / edits / "512" / "train.jsonl").is_file():
        refuse(f"{run / 'data' / edits}: the run's data are not there (a restored run: learn.py makes them again), "
               f"so its articles cannot be kept out of the test")
    if args.test is None:
        own = run / "data" / edits / "512" / "test.jsonl"
        if not own.is_file():
            refuse(f"{own}: no test set to take the size from; give --test")
        args.test = sum(1 for line in own.read_text().splitlines() if line.strip())
    if args.test < 2 or args.test % 2:
        refuse(f"--test {args.test}: an even number, at least 2 (half faithful, half hallucinated)")
    out = folder(run, args.seed, args.test, args.gpu)
    if not (out / "eval" / "final" / "eval.json").is_file() and not next(best.glob("*.safetensors"), None):
        refuse(f"{best}: the final stage's best checkpoint has no weights")
    # learn.py imports torch: only after the refusals above, which so take no time
    from learn import CLI, MODEL, delta, evaluate, sh
    from machine import describe, write_result
    from wall import count_cut_off, write_wall

    args.model = args.model or MODEL
    eval_keys = ["dtype=bf16"] if args.gpu else []
    out.mkdir(parents=True, exist_ok=True)
    log = out / "log.txt"
    wall_file = out / "wall.json"
    wall = json.loads(wall_file.read_text()) if wall_file.exists() else {}
    machine = describe()
    record: dict = {"benchmark": "learn_retest", "complete": False, "run": str(Path(args.run)),
                    "checkpoint": str(best.relative_to(run)),
                    "base_model": args.model, "data": {"seed": args.seed, "test": args.test, "languages": ["en"],
                                                       "balanced": True, "edits": edits},
                    "eval_settings": eval_keys,
                    "goal": GOAL, "machine": machine,
                    "note": " ".join(filter(None, [__doc__.splitlines()[0].replace("``", ""), args.note]))}

    last = {"end": time.time()}  # the last phase's end: a phase stopped by SIGTERM counts in wall_s.cut_off
    count_cut_off(wall_file, lambda: last["end"])

    def phase(name: str, seconds: float) -> None:
        last["end"] = time.time()
        if seconds:
            wall[name] = round(wall.get(name, 0) + seconds, 1)
            write_wall(wall_file, wall)
        record["wall_s"] = dict(wall)
        record["wall_s_total"] = round(sum(wall.values()), 1)
        write_result(args.json, record, quiet=True)

    data = out / "data"
    test = data / "512" / "test.jsonl"
    if not test.exists():
        phase("data", sh([*CLI, "data", "sample", "--out", str(data), "--languages", "en", "--balanced", "--buckets",
                          "512", "--n", "1", "--n-validation", "1", "--n-test", str(args.test), "--seed",
                          str(args.seed), "--tokenizer", args.model, "--edits", edits], log))
    seen_articles, seen_pairs = fingerprints(seen)
    new_articles, new_pairs = fingerprints([test])
    # the file's hash: the same items wherever it is drawn (the generator sizes articles with the tokenizer)
    record["data"]["test_sha256"] = hashlib.sha256(test.read_bytes()).hexdigest()
    record["overlap_with_training_data"] = {"files": [str(p.relative_to(run)) for p in seen],
                                            "articles_checked": len(seen_articles),
                                            "articles": len(new_articles & seen_articles),
                                            "article_summary_pairs": len(new_pairs & seen_pairs)}
    if new_articles & seen_articles:
        sys.exit(f"bench/retest.py: {len(new_articles & seen_articles)} test article(s) of {test} are in the "
                 f"run's data; choose another --seed")
    ev = out / "eval"
    phase("eval_base", evaluate(args.model, test, ev / "base", log, eval_keys))
    phase("eval_final", evaluate(str(best), test, ev / "final", log, eval_keys))
    scores = {k: json.loads((ev / k / "eval.json").read_text()) for k in ("base", "final")}
    record["test"] = {k: {"balanced_accuracy": e["scores"][0]["balanced_accuracy"], "mcc": e["scores"][0]["mcc"],
                          "ci": e["scores"][0].get("ci"), "invalid_rate": e["scores"][0]["invalid_rate"], "n": e["n"]}
                      for k, e in scores.items()}
    record["final_minus_base"] = {policy or "own": delta(ev / "base", ev / "final", policy)
                                  for policy in (None, "faithful", "hallucinated")}
    fixed = [record["final_minus_base"][p] for p in ("faithful", "hallucinated")]
    final = record["test"]["final"]
    low = ((final["ci"] or {}).get("balanced_accuracy") or {}).get("low", float("nan"))
    record["goal_met"] = {
        "test_ba_ci_low_above": low > GOAL["test_ba_ci_low_above"],
        "d_ba_invalid_as_fixed_label": all(d["d_ba_diff"] >= GOAL["d_ba_invalid_as_fixed_label"]
                                           and d["d_ba_p_value"] < GOAL["p"] for d in fixed),
        "n": final["n"] >= GOAL["n"]}
    record["complete"] = True
    phase("done", 0.0)
    lines = ["| model | BA [95% CI] | MCC | invalid |", "|---|---|---:|---:|"]
    for k, m in record["test"].items():
        ci = (m["ci"] or {}).get("balanced_accuracy") or {"low": float("nan"), "high": float("nan")}
        lines.append(f"| {k} | {m['balanced_accuracy']:.3f} [{ci['low']:.3f}, {ci['high']:.3f}] | {m['mcc']:.3f} | "
                     f"{m['invalid_rate']:.1%} |")
    for policy, d in record["final_minus_base"].items():
        lines.append(f"\nfinal − base, invalid as {policy}: ΔBA {d['d_ba_diff']:+.3f} [{d['d_ba_low']:+.3f}, "
                     f"{d['d_ba_high']:+.3f}], p {d['d_ba_p_value']:.3f}")
    lines.append(f"\ngoal met: {record['goal_met']}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
