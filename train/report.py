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


def _plots(run_dir: Path, records: list[dict], stages: list[str]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    (run_dir / "plots").mkdir(exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4))
    offset = 0
    for name in stages:
        tr = sorted((r for r in records if r["stage"] == name and r["kind"] == "train"), key=lambda r: r["step"])
        if tr:
            ax.plot([offset + r["step"] for r in tr], [r["loss"] for r in tr], label=name)
            offset += tr[-1]["step"]
    ax.set(xlabel="optimizer step (cumulative)", ylabel="train loss", title="Training loss by stage")
    if ax.lines:
        ax.legend()
    fig.tight_layout()
    out.append(run_dir / "plots" / "loss.png")
    fig.savefig(out[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    for name in stages:
        va = sorted((r for r in records if r["stage"] == name and r["kind"] == "val"), key=lambda r: r["step"])
        if va:
            ax.plot([r["step"] for r in va], [r["balanced_accuracy"] for r in va], marker="o", label=name)
    ax.set(xlabel="step within stage", ylabel="validation balanced accuracy", title="Validation BA", ylim=(0, 1))
    if ax.lines:
        ax.legend()
    fig.tight_layout()
    out.append(run_dir / "plots" / "val_ba.png")
    fig.savefig(out[-1], dpi=100)
    plt.close(fig)
    return out
