"""Run folders restored from ``bench/gpu_learn.sh``'s state archive on a fresh GPU machine.

The archive keeps what a cut-off run measured (state, metrics, logs, evaluations, the data phases' JSONL)
but no weights and no checkpoints (too large to carry back). A training run restored from it says how far
it got and cannot go on from there: ``bench/learn.py`` and ``bench/table5_mini.py`` set such a run aside
and train it again, unless every evaluation it was trained for is already there (then its weights are no
longer needed).
"""

from __future__ import annotations

import sys
from pathlib import Path

WEIGHTS = ("*.safetensors", "*.pt", "*.bin")


def weightless(run: Path) -> bool:
    """``run`` has begun (a ``state.json``) but holds no weights or checkpoint files: restored from an
    archive. (A run just started, before its first checkpoint, also qualifies: it restarts at no cost.)"""
    return (run / "state.json").exists() and not any(next(run.rglob(p), None) for p in WEIGHTS)


def set_aside(path: Path, why: str) -> Path:
    """Rename ``path`` to ``<path>.restored[-N]`` (nothing deleted) and say so, and ``why``, on stderr; the
    new name."""
    n, dest = 0, path.with_name(path.name + ".restored")
    while dest.exists():
        n += 1
        dest = path.with_name(f"{path.name}.restored-{n}")
    path.rename(dest)
    print(f"{path}: set aside as {dest.name} ({why})", file=sys.stderr)
    return dest


def retrain(run: Path, evals: list[Path]) -> None:
    """Set ``run`` aside to train it again, and with it ``evals``, the evaluations of its models that
    exist (a rerun of one would resume the old weights' answers: they are keyed by the model's path)."""
    set_aside(run, "restored without weights: trained again")
    for ev in evals:
        if ev.exists():
            set_aside(ev, f"an evaluation of {run.name}'s weights before they were trained again")
