"""Does the decision's lean follow the last batches' majority? (issue 34, the plain sampler's label flips)

    python bench/batch_lean.py --train runs/learn_cf/data/counterfactual/512/train.jsonl \
        --results learn_cpu_counterfactual [--results ...]            (runs that ran: agreement)
    python bench/batch_lean.py --train FILE --seed 7 --batch 4 --steps 200 --every 40 --json NAME
                                                                        (a run still to come: the prediction)
    python bench/batch_lean.py --train FILE --results ... --prediction NAME   (that run, scored apart)

For each validation of a ``bench/learn.py`` run (one stage, one rank, a plain shuffle): the share of
hallucinated samples in the optimizer step just before it and in the last 3 steps, rebuilt with
longsft's own ``StepSampler`` from the run's seed and global batch, next to what the validation said
(the answers "hallucinated" of all, and the decision's mean log-odds where the run recorded it).

The rule tested: after a step with more hallucinated than faithful samples the answers lean
"hallucinated" (more say so than "faithful"), after one with fewer they lean "faithful"; a tied step predicts
nothing. Writes bench/results/<json>.json: every validation's row and, for runs with results, how many
predictions held; with --prediction, the run it was made for is checked to rebuild the same predictions and
its tally is given apart from the runs the rule was read off.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import NoReturn

from longsft.train.config.loader import parse_override
from longsft.train.data.batching import StepSampler
from longsft.train.scoring.metrics import gold_label

sys.path.insert(0, str(Path(__file__).parent))
from machine import write_result

RESULTS = Path(__file__).parent / "results"


def refuse(message: str) -> NoReturn:
    """Bad input: one line on stderr, exit 2 (as argparse's own errors)."""
    print(f"bench/batch_lean.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def shares(labels: list[int], seed: int, batch: int, steps: list[int], window: int) -> list[float]:
    """The hallucinated share of the ``window`` optimizer steps before each of ``steps`` (plain shuffle)."""
    sampler = StepSampler(len(labels), 1, 0, 1, batch, seed)
    out = []
    for v in steps:
        idx = [i for s in range(max(0, v - window), v) for i in sampler.global_indices(s)]
        out.append(sum(labels[i] for i in idx) / len(idx))
    return out


def predict(share: float) -> str | None:
    """The lean the rule predicts after a step with this hallucinated share (None: a tie)."""
    return None if share == 0.5 else "hallucinated" if share > 0.5 else "faithful"


def run_config(name: str, result: dict, n_rows: int) -> tuple[int, int, list[int]]:
    """(seed, global batch, validation steps) of a one-stage, one-rank learn.py results file whose training
    rows are the ``n_rows`` lines of --train in file order (no packing; nothing skipped, which the run's
    log line "N/N train samples (0 truncated, 0 skipped ...)" says and this does not check)."""
    if not isinstance(result, dict) or result.get("benchmark") != "learn" or "validation_curve" not in result:
        refuse(f"--results {name}: not a bench/learn.py results file (its 'benchmark' is 'learn')")
    if result.get("ranks") != 1:
        refuse("only one-rank runs (the rule rebuilds one rank's steps)")
    stages = {v.get("stage") for v in result["validation_curve"]}
    if len(stages) != 1:
        refuse(f"validations of {len(stages)} stages; the rule reads one stage's")
    keys = dict(parse_override(o) for o in result["overrides"] if not o.startswith("stages="))  # the last wins
    if keys.get("data.stratify") is True or keys.get("data.packing") is True:
        refuse("the run stratified or packed its steps; the rule needs a plain shuffle of one sample per row")
    if "optim.grad_accum" not in keys:  # the recipe's default is not read here: say it instead
        refuse("the run's overrides do not set optim.grad_accum")
    trained = result.get("data", {}).get("train", {}).get("512")
    if trained != n_rows:
        refuse(f"the run made {trained} training samples, --train has {n_rows}")
    seed = int(keys.get("seed", 42))  # recipes/smollm2_135m.yaml's seed and micro-batch
    batch = int(keys["optim.grad_accum"]) * int(keys.get("optim.micro_batch_size", 1))
    return seed, batch, [v["step"] for v in result["validation_curve"]]


def rows(labels: list[int], seed: int, batch: int, steps: list[int], curve: list[dict] | None) -> list[dict]:
    """One row per validation: the shares, the prediction and (with ``curve``) what happened."""
    last, last3 = shares(labels, seed, batch, steps, 1), shares(labels, seed, batch, steps, 3)
    out = []
    for i, step in enumerate(steps):
        row = {"step": step, "share_last_step": last[i], "share_last_3": round(last3[i], 3),
               "predicted_lean": predict(last[i])}
        if curve is not None:
            v = curve[i]
            a = v["answers"]
            row["answers_hallucinated"] = f"{a['hallucinated']}/{sum(a.values())}"
            row["lean"] = "hallucinated" if a["hallucinated"] > a["faithful"] else "faithful"  # invalid: neither
            if v.get("decision_log_odds") is not None:
                row["decision_log_odds"] = round(v["decision_log_odds"], 3)
            row["held"] = None if row["predicted_lean"] is None else row["predicted_lean"] == row["lean"]
        out.append(row)
    return out


def load(ap: argparse.ArgumentParser, flag: str, name: str) -> dict:
    """bench/results/<name>.json (a name, not a path)."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or not (RESULTS / f"{name}.json").is_file():
        ap.error(f"{flag} {name}: no bench/results/{name}.json")
    try:
        return json.loads((RESULTS / f"{name}.json").read_bytes().decode())
    except ValueError as e:  # not UTF-8, not JSON
        ap.error(f"{flag} {name}: bench/results/{name}.json is not JSON ({e})")


def pre_register(runs: dict, ran: list[str], prediction: dict, name: str) -> None:
    """Mark the one run of ``ran`` (the --results names in ``runs``) that ``prediction`` was made for, after
    checking that its steps rebuilt now predict what the prediction said.

    Refuses (one line, exit 2) when ``prediction`` is not one run's prediction (``--seed`` ... output: rows
    without outcomes), when no run or more than one has its seed and batch, or when the rebuilt rows differ
    (other data, sampler, validation steps)."""
    pruns = prediction.get("runs") if isinstance(prediction, dict) else None
    pred = next(iter(pruns.values())) if isinstance(pruns, dict) and len(pruns) == 1 else None
    if not (isinstance(pred, dict) and {"seed", "batch", "rows"} <= pred.keys() and isinstance(pred["rows"], list)
            and all(isinstance(r, dict) and "held" not in r and {"step", "predicted_lean"} <= r.keys()
                    for r in pred["rows"])):
        refuse(f"--prediction {name}: not a prediction (one run's rows, written by --seed/--batch/--steps/--every "
               "before that run trained)")
    match = [n for n in ran if (runs[n]["seed"], runs[n]["batch"]) == (pred["seed"], pred["batch"])]
    if len(match) != 1:
        refuse(f"--prediction {name} is for seed {pred['seed']}, batch {pred['batch']}; {len(match)} --results "
               "runs have them (one is needed)")
    now = [(r["step"], r["predicted_lean"]) for r in runs[match[0]]["rows"]]
    then = [(r["step"], r["predicted_lean"]) for r in pred["rows"]]
    if now != then:
        refuse(f"{match[0]}'s steps rebuilt now predict {now}, --prediction {name} said {then}: other data, "
               "sampler or validation steps")
    runs[match[0]]["pre_registered"] = True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", required=True, help="the run's training file (its 512 bucket's train.jsonl)")
    ap.add_argument("--results", action="append", default=[], help="a learn.py results name (bench/results/NAME.json)")
    ap.add_argument("--seed", type=int, help="a run still to come: its seed")
    ap.add_argument("--batch", type=int, help="... its global batch")
    ap.add_argument("--steps", type=int, help="... its optimizer steps")
    ap.add_argument("--every", type=int, help="... its validation interval")
    ap.add_argument("--prediction", help="a prediction made before a run trained (bench/results/NAME.json, written "
                    "with --seed ...): the --results run with its seed and batch is scored against it, apart from "
                    "the runs the rule was read off")
    ap.add_argument("--json", default="batch_lean", help="results name: bench/results/<name>.json")
    args = ap.parse_args()
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", args.json) or args.json.startswith("."):
        ap.error(f"--json {args.json!r}: a name, not a path (the file is bench/results/<name>.json)")
    path = Path(args.train)
    if not path.is_file():
        ap.error(f"--train {path}: no such file")
    labels = []
    for n, line in enumerate(open(path, "rb"), 1):
        try:
            labels.append(gold_label(float(json.loads(line.decode())["gold_score"])))
        except (ValueError, KeyError, TypeError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            refuse(f"{path}:{n}: not a JSON line with a gold_score ({e})")
    runs = {}
    for name in args.results:
        result = load(ap, "--results", name)
        seed, batch, steps = run_config(name, result, len(labels))
        runs[name] = {"seed": seed, "batch": batch,
                      "rows": rows(labels, seed, batch, steps, result["validation_curve"])}
    if args.seed is not None:
        if None in (args.batch, args.steps, args.every):
            ap.error("--seed needs --batch, --steps and --every")
        steps = list(range(args.every, args.steps + 1, args.every))
        runs[f"seed{args.seed}_batch{args.batch}"] = {"seed": args.seed, "batch": args.batch,
                                                       "rows": rows(labels, args.seed, args.batch, steps, None)}
    if not runs:
        ap.error("give --results NAME or --seed/--batch/--steps/--every")
    if args.prediction:
        pre_register(runs, args.results, load(ap, "--prediction", args.prediction), args.prediction)
    # the rule's record on the runs it was read off; a pre-registered run's is kept apart
    tested = [r["held"] for run in runs.values() if not run.get("pre_registered") for r in run["rows"]
              if r.get("held") is not None]
    print(f"{'run':42} {'step':>5} {'last':>5} {'last 3':>6}  predicted     answers   log-odds  held")
    for name, run in runs.items():
        for r in run["rows"]:
            print(f"{name:42} {r['step']:5d} {r['share_last_step']:5.2f} {r['share_last_3']:6.2f}  "
                  f"{str(r['predicted_lean']):12}  {r.get('answers_hallucinated', ''):>7}  "
                  f"{str(r.get('decision_log_odds', '')):>8}  {r.get('held', '')}")
    summary = {"predictions_tested": len(tested), "held": sum(tested)}
    if tested:
        print(f"the rule held {sum(tested)} of {len(tested)} times (ties predict nothing)"
              + (" on the runs it was read off" if args.prediction else ""))
    for name, run in runs.items():
        if run.get("pre_registered"):
            held = [r["held"] for r in run["rows"] if r["held"] is not None]
            summary["pre_registered"] = {"run": name, "prediction": args.prediction, "tested": len(held),
                                         "held": sum(held), "apart": "predictions_tested and held above count "
                                         "the other runs (the rule was read off them); this run's tally is here"}
            print(f"pre-registered ({args.prediction}): {name} held {sum(held)} of {len(held)}")
    write_result(args.json, {"benchmark": "batch_lean", "train": str(path), "rule": "lean follows the last "
                             "step's majority (the answers: more 'hallucinated' than 'faithful', or not); a tied step "
                             "predicts nothing", "runs": runs, **summary})


if __name__ == "__main__":
    main()
