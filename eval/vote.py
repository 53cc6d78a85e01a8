"""``longsft vote RUN RUN RUN``: the paper's majority-vote ensemble over existing evaluation runs.

An item is hallucinated when a majority of the members say so (two of three). Each member's answer is
read as the scorer reads it: a valid judgement by its score (<= 2: hallucinated), an invalid one by
the runs' ``invalid_policy`` (``wrong``: the opposite of the gold label). Nothing is generated: the
members' ``predictions_r<k>.jsonl`` are the input, and every member must hold the same items.

The output is an evaluation run like any other (``config.json``, ``predictions_r<k>.jsonl``,
``scores_r<k>.json``, ``eval.json``), so ``longsft report`` tables it and ``--compare`` pairs it. Its
prediction per item is a judgement JSON: the median score of the members on the winning side (2 or
4 when only invalid answers took that side), and the hallucination types any of them named.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from longsft.eval.harness import score_repeats
from longsft.train.common.errors import ConfigError, DataError
from longsft.train.common.helpfmt import DefaultsHelp
from longsft.train.common.io import atomic_write_json, check_output_dir, read_json, safe_name
from longsft.train.scoring.judgement import parse_judgement
from longsft.train.scoring.metrics import gold_label, predicted_label
from longsft.train.scoring.score import load_predictions


def _member(run: Path) -> tuple[dict, list[dict[str, object]]]:
    """A member's eval.json and, per repeat, its predictions by id."""
    if not (run / "eval.json").is_file():
        raise DataError(f"{run}: not an evaluation run (no eval.json; run longsft eval first)")
    summary = read_json(run / "eval.json", "evaluation summary")
    n = summary.get("repeats", 1) if isinstance(summary, dict) else None
    if not isinstance(summary, dict) or not isinstance(summary.get("name", ""), str) or isinstance(n, bool) \
            or not isinstance(n, int) or n < 1:
        raise DataError(f"{run / 'eval.json'}: not a longsft evaluation summary (an object with a name and "
                        "repeats >= 1)")
    summary.setdefault("name", run.name)
    repeats = []
    for r in range(n):
        path = run / f"predictions_r{r}.jsonl"
        if not path.is_file():
            raise DataError(f"{path}: missing (the evaluation did not finish; rerun it to resume)")
        repeats.append({it.id: it for it in load_predictions(path)})
    return summary, repeats


def vote(items: list, policy: str) -> tuple[str, int]:
    """Members' predictions of one item (``Item`` each) -> (the ensemble's judgement JSON, votes for
    hallucinated)."""
    gold = gold_label(items[0].gold_score)
    judgements = [parse_judgement(it.prediction) for it in items]
    said = [predicted_label(j, gold, policy) for j in judgements]
    votes = sum(said)
    hallucinated = 2 * votes > len(items)
    side = [j for j, s in zip(judgements, said) if j.valid and s == hallucinated]
    score = statistics.median_low([j.score for j in side]) if side else (2 if hallucinated else 4)
    reason = f"majority vote: {votes} of {len(items)} members say hallucinated"
    if not hallucinated:
        return json.dumps({"score": score, "reason": reason}), votes
    types = list(dict.fromkeys(t for j in side for t in j.types))
    return json.dumps({"reason": reason, "score": score, "hallucination_types": types}), votes


def run_vote(runs: list[Path], out: Path, name: str, bootstrap: int = 2000, seed: int = 0) -> dict:
    """Write the ensemble of ``runs`` to ``out`` (checked before anything is written)."""
    if len(runs) < 3 or len(runs) % 2 == 0:
        raise ConfigError(f"longsft vote: {len(runs)} runs given; a majority needs an odd number, at least 3")
    if len(set(map(Path.resolve, runs))) != len(runs):
        raise ConfigError("longsft vote: a run is given twice; each member votes once")
    members = [_member(r) for r in runs]
    policies = {s.get("invalid_policy", "wrong") for s, _ in members}
    if len(policies) != 1:
        raise ConfigError(f"longsft vote: the runs score invalid answers differently ({sorted(policies)}); "
                          "evaluate them with one invalid_policy")
    policy = policies.pop()
    n_repeats = min(len(reps) for _, reps in members)
    ids = list(members[0][1][0])
    for run, (_, reps) in zip(runs, members):
        for r in range(n_repeats):
            if set(reps[r]) != set(ids):
                missing, extra = len(set(ids) - set(reps[r])), len(set(reps[r]) - set(ids))
                raise DataError(f"{run}/predictions_r{r}.jsonl: not the same items as {runs[0]} ({missing} missing, "
                                f"{extra} others); the members must be evaluated on the same data")
            for i in ids:
                if reps[r][i].gold_score != members[0][1][0][i].gold_score:
                    raise DataError(f"{run}/predictions_r{r}.jsonl: item {i!r} has gold_score "
                                    f"{reps[r][i].gold_score}, {members[0][1][0][i].gold_score} in {runs[0]}")
    _check_out(out, runs)
    per_repeat = []
    for r in range(n_repeats):
        rows = []
        for i in ids:
            items = [reps[r][i] for _, reps in members]
            prediction, votes = vote(items, policy)
            first = items[0]
            rows.append({"id": i, "prediction": prediction, "gold_score": first.gold_score, "bucket": first.bucket,
                         "language": first.language, "types": list(first.gold_types), "error": None, "votes": votes,
                         "prompt_tokens": 0, "gen_tokens": 0, "generations": 0})
        per_repeat.append(rows)
    out.mkdir(parents=True, exist_ok=True)
    config = {"method": "vote", "members": [str(r.resolve()) for r in runs], "invalid_policy": policy,
              "bootstrap": bootstrap, "seed": seed}
    atomic_write_json(out / "config.json", config)
    repeats, mean = score_repeats(out, per_repeat, policy, bootstrap, seed)
    gen = {k: sum(int((s.get("generation") or {}).get(k, 0)) for s, _ in members)
           for k in ("prompt_tokens", "gen_tokens", "failed")}  # the members' own generations, all repeats
    summary = {"name": name, "out": str(out), "model": "vote(" + ", ".join(s["name"] for s, _ in members) + ")",
               "backend": "vote", "method": "vote", "prompt": members[0][0].get("prompt"),
               "data": members[0][0].get("data"), "invalid_policy": policy, "n": len(ids), "repeats": n_repeats,
               "mean": mean, "scores": repeats, "generation": gen, "rag": None, "members": config["members"]}
    atomic_write_json(out / "eval.json", summary)
    return summary


def _check_out(out: Path, runs: list[Path]) -> None:
    """``out`` is new, empty, or this same vote (rewritten: it is computed, not generated)."""
    check_output_dir(out)
    if not out.exists() or not any(out.iterdir()):
        return
    old = out / "config.json"
    config = read_json(old) if old.is_file() else None
    same = isinstance(config, dict) and config.get("members") == [str(r.resolve()) for r in runs]
    if not same:
        raise ConfigError(f"--out {out}: holds something else (not this vote); give another --out, or delete it")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="longsft vote", description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                                 formatter_class=DefaultsHelp)
    ap.add_argument("runs", nargs="+", help="evaluation run folders (an odd number, at least 3)")
    ap.add_argument("--out", help="output folder (default: runs/eval/<name>)")
    ap.add_argument("--name", help="the run's name in reports (default: vote-<member>-<member>-...)")
    ap.add_argument("--bootstrap", type=int, default=2000, help="replicates for 95%% CIs (0: none)")
    ap.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    args = ap.parse_args(argv)
    if args.bootstrap < 0:
        raise ConfigError(f"--bootstrap {args.bootstrap}: replicates must be >= 0 (0: no intervals)")
    runs = [Path(r) for r in args.runs]
    name = safe_name(args.name or "vote-" + "-".join(r.resolve().name for r in runs),
                     "--name" if args.name else "the default name (from the run folders; give --name)", ConfigError)
    summary = run_vote(runs, Path(args.out or f"runs/eval/{name}"), name, args.bootstrap, args.seed)
    m = summary["scores"][0]
    print(f"{summary['name']}: {summary['n']} items x {summary['repeats']} repeat(s) (those all members have), "
          f"BA {m['balanced_accuracy']:.3f} MCC {m['mcc']:.3f} (first repeat)\nwrote {summary['out']}")
    return 0
