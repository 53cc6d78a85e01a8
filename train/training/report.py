"""``report.md`` for a run directory: stage table, timings, and PNG plots (loss, validation BA)."""

from __future__ import annotations

from pathlib import Path

from longsft.train.common.errors import ConfigError
from longsft.train.common.io import atomic_write_json, atomic_write_text
from longsft.train.scoring.metrics import score_items
from longsft.train.scoring.score import load_predictions
from longsft.train.training.rundir import read_state
from longsft.train.training.tracker import latest_metrics


def _fmt(x, spec: str = ".3f") -> str:
    return "–" if x is None or x != x else format(x, spec)


def write_report(run_dir: Path, state: dict) -> None:
    records = latest_metrics(run_dir)
    plots = _plots(run_dir, records, list(state["stages"]))
    lines = [f"# longsft run: {state['recipe']}", "",
             "| stage | status | steps | best step | BA | MCC | invalid | decision AUC | val loss | train samples (trunc/skip) | time |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    total = 0.0
    for name, s in state["stages"].items():
        b = s.get("best") or {}
        data = s.get("data", {}).get("train", {})
        total += s.get("seconds", 0.0)
        lines.append(
            f"| {name} | {s['status']} | {s.get('steps_done', 0)}/{s.get('total_steps', '?')} | {b.get('step', '–')} | "
            f"{_fmt(b.get('balanced_accuracy'))} | {_fmt(b.get('mcc'))} | {_fmt(b.get('invalid_rate'), '.1%')} | "
            f"{_fmt(b.get('decision_auc'))} | "
            f"{_fmt(b.get('val_loss'), '.4f')} | {data.get('kept', '?')} ({data.get('truncated', 0)}/"
            f"{data.get('skipped', 0)}) | {s.get('seconds', 0.0):.0f} s |")
    lines += ["", f"Training time (all stages, summed over runs): {total:.0f} s."]
    if "seconds_this_run" in state:
        lines.append(f"Wall time of the latest invocation: {state['seconds_this_run']:.0f} s.")
    lines += ["", "Best checkpoints (HF format, `AutoModelForCausalLM.from_pretrained`):", ""]
    lines += [f"- {n}: `{s['best']['path']}`" for n, s in state["stages"].items() if s.get("best")]
    lines += ["", "BA/MCC: shared scorer (`longsft.eval`), invalid outputs counted as wrong unless the recipe "
              "says otherwise; best = highest BA, then MCC, then the decision token's log-odds AUC, then lowest "
              "validation loss.", ""]
    lines += [f"![{p.stem}]({p.relative_to(run_dir)})" for p in plots]
    atomic_write_text(run_dir / "report.md", "\n".join(lines) + "\n")


def _series(records: list[dict], stage: str, kind: str) -> list[dict]:
    return sorted((r for r in records if r["stage"] == stage and r["kind"] == kind), key=lambda r: r["step"])


def _plots(run_dir: Path, records: list[dict], stages: list[str]) -> list[Path]:
    """plots/loss.png (train loss, stages end to end) and plots/val_ba.png (validation BA per stage)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (run_dir / "plots").mkdir(exist_ok=True)
    offsets, offset = {}, 0
    for name in stages:
        offsets[name] = offset
        tr = _series(records, name, "train")
        offset += tr[-1]["step"] if tr else 0
    specs = [("loss.png", "train", "loss", True, "optimizer step (cumulative)", "train loss",
              "Training loss by stage", None),
             ("val_ba.png", "val", "balanced_accuracy", False, "step within stage",
              "validation balanced accuracy", "Validation BA", (0, 1))]
    out = []
    for fname, kind, key, cumulative, xlabel, ylabel, title, ylim in specs:
        fig, ax = plt.subplots(figsize=(8, 4))
        for name in stages:
            rs = _series(records, name, kind)
            if rs:
                x = [r["step"] + (offsets[name] if cumulative else 0) for r in rs]
                ax.plot(x, [r[key] for r in rs], marker=None if cumulative else "o", label=name)
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
        if ylim:
            ax.set_ylim(*ylim)
        if ax.lines:
            ax.legend()
        fig.tight_layout()
        out.append(run_dir / "plots" / fname)
        fig.savefig(out[-1], dpi=100)
        plt.close(fig)
    return out


# ---------------------------------------------------------------- run status and aggregation


def status_table(state: dict) -> str:
    lines = [f"recipe {state['recipe']}", "stage\tstatus\tsteps\tbest step\tBA"]
    for name, s in state["stages"].items():
        b = s.get("best") or {}
        lines.append(f"{name}\t{s['status']}\t{s.get('steps_done', 0)}/{s.get('total_steps', '?')}\t"
                     f"{b.get('step', '-')}\t{_fmt(b.get('balanced_accuracy'))}")
    return "\n".join(lines)


def find_runs(dirs: list[str | Path]) -> list[Path]:
    """Run directories among ``dirs``: each one itself, or its subfolders that are runs (a sweep root)."""
    runs = []
    for d in map(Path, dirs):
        if (d / "state.json").exists():
            runs.append(d)
        else:
            found = sorted(p.parent for p in d.glob("*/state.json"))
            if not found:
                raise ConfigError(f"{d}: neither a run directory nor a folder of run directories (no state.json)")
            runs += found
    return runs


def summarize_run(run_dir: Path, bootstrap: int = 0) -> dict:
    """The run's last stage that has a best model: its validation metrics, with CIs when asked."""
    import yaml

    state = read_state(run_dir)
    stages = state["stages"]
    row = {"run": run_dir.name, "path": str(run_dir), "recipe": state["recipe"],
           "stages_done": sum(s["status"] == "done" for s in stages.values()), "stages": len(stages),
           "status": "done" if all(s["status"] == "done" for s in stages.values()) else next(
               f"{n}: {s['status']}" for n, s in stages.items() if s["status"] != "done"),
           "train_seconds": sum(s.get("seconds", 0.0) for s in stages.values())}
    scored = [(n, s) for n, s in stages.items() if (s.get("best") or {}).get("balanced_accuracy") is not None]
    if not scored:
        return row
    name, s = scored[-1]
    row.update(stage=name, step=s["best"]["step"], balanced_accuracy=s["best"]["balanced_accuracy"],
               mcc=s["best"]["mcc"], invalid_rate=s["best"].get("invalid_rate"))
    preds = run_dir / "stages" / name / "val" / f"step_{s['best']['step']:07d}.jsonl"
    if bootstrap and preds.exists():
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").exists() else {}
        policy = (cfg.get("validation") or {}).get("invalid_policy", "wrong")
        m = score_items(load_predictions(preds), policy, bootstrap)
        row.update(n=m["n"], ci=m["ci"])
    return row


def aggregate(dirs: list[str | Path], out: str | Path | None = None, bootstrap: int = 2000) -> str:
    """Markdown table of many runs (e.g. a sweep's tasks); also written to ``out``/report.{md,json}."""
    if bootstrap < 0:
        raise ConfigError(f"--bootstrap {bootstrap}: replicates must be >= 0 (0: no intervals)")
    if out is not None and (Path(out) / "state.json").exists():
        raise ConfigError(f"--out {out} is a run directory: its report.md is the run's own; give another folder")
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise ConfigError(f"--out {out} is a file; give a folder")
    rows = [summarize_run(r, bootstrap) for r in find_runs(dirs)]

    def cell(r: dict, key: str) -> str:
        if key not in r:
            return "–"
        ci = r.get("ci", {}).get(key)
        return _fmt(r[key]) + (f" [{ci['low']:.3f}, {ci['high']:.3f}]" if ci else "")

    lines = ["| run | recipe | status | stages | stage (best step) | n | BA [95% CI] | MCC [95% CI] | invalid | time |",
             "|---|---|---|---:|---|---:|---|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['recipe']} | {r['status']} | {r['stages_done']}/{r['stages']} | "
                     f"{r.get('stage', '–')} ({r.get('step', '–')}) | {r.get('n', '–')} | {cell(r, 'balanced_accuracy')} | "
                     f"{cell(r, 'mcc')} | {_fmt(r.get('invalid_rate'), '.1%')} | {r['train_seconds']:.0f} s |")
    table = "\n".join(lines)
    if out is not None:
        out = Path(out)
        atomic_write_text(out / "report.md", "# longsft runs\n\n" + table + "\n\nBA/MCC: the last scored stage's best "
                          "validation checkpoint; CIs: stratified percentile bootstrap of its predictions.\n")
        atomic_write_json(out / "report.json", rows)
    return table
