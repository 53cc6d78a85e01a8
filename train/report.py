"""``report.md`` for a run directory: stage table, timings, and PNG plots (loss, validation BA)."""

from __future__ import annotations

from pathlib import Path

from .io import atomic_write_text
from .tracker import read_metrics


def _dedupe(records: list[dict]) -> list[dict]:
    """A resumed run re-logs steps after its last checkpoint: keep the newest record per step."""
    seen: dict[tuple, dict] = {}
    for r in records:
        seen[(r["stage"], r["kind"], r["step"])] = r
    return list(seen.values())


def _fmt(x, spec: str = ".3f") -> str:
    return "–" if x is None or x != x else format(x, spec)


def write_report(run_dir: Path, state: dict) -> None:
    records = _dedupe(read_metrics(run_dir))
    plots = _plots(run_dir, records, list(state["stages"]))
    lines = [f"# longsft run: {state['recipe']}", "",
             "| stage | status | steps | best step | BA | MCC | invalid | val loss | train samples (trunc/skip) | time |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    total = 0.0
    for name, s in state["stages"].items():
        b = s.get("best") or {}
        data = s.get("data", {}).get("train", {})
        total += s.get("seconds", 0.0)
        lines.append(
            f"| {name} | {s['status']} | {s.get('steps_done', 0)}/{s.get('total_steps', '?')} | {b.get('step', '–')} | "
            f"{_fmt(b.get('balanced_accuracy'))} | {_fmt(b.get('mcc'))} | {_fmt(b.get('invalid_rate'), '.1%')} | "
            f"{_fmt(b.get('val_loss'), '.4f')} | {data.get('kept', '?')} ({data.get('truncated', 0)}/"
            f"{data.get('skipped', 0)}) | {s.get('seconds', 0.0):.0f} s |")
    lines += ["", f"Training time (all stages, summed over runs): {total:.0f} s."]
    if "seconds_this_run" in state:
        lines.append(f"Wall time of the latest invocation: {state['seconds_this_run']:.0f} s.")
    lines += ["", "Best checkpoints (HF format, `AutoModelForCausalLM.from_pretrained`):", ""]
    lines += [f"- {n}: `{s['best']['path']}`" for n, s in state["stages"].items() if s.get("best")]
    lines += ["", "BA/MCC: shared scorer (`longsft.eval`), invalid outputs counted as wrong unless the recipe "
              "says otherwise; best = highest BA, then MCC, then lowest validation loss.", ""]
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
