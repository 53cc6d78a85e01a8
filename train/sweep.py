"""Sweep files: one training run per line, for SLURM array jobs (``launch/slurm/array.sbatch``).

A line is a task name followed by ``key=value`` overrides (shell quoting; ``#`` starts a comment)::

    # name         overrides
    mma_only       data.train_file=data/mma_only/{bucket}/train.jsonl
    mma_erhg       data.train_file=data/full/{bucket}/train.jsonl optim.lr=1e-5

Array index ``i`` is the ``i``-th task line (comments and blank lines do not count). Arguments
common to every task (``recipe=...``) come first, so a line overrides them. Task ``name`` trains in
``<root>/<name>`` unless its line sets ``run_dir``.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from .config import ConfigError, RunConfig

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class SweepTask:
    index: int
    name: str
    overrides: tuple[str, ...]
    line: int


def load_sweep(path: str | Path) -> list[SweepTask]:
    """Parse and check the syntax of every line; errors name ``path:line``."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"sweep file {path}: {e.strerror}") from None
    tasks: list[SweepTask] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        try:
            tokens = shlex.split(raw, comments=True)
        except ValueError as e:
            raise ConfigError(f"{path}:{lineno}: {e} (shell quoting)") from None
        if not tokens:
            continue
        name, overrides = tokens[0], tokens[1:]
        if "=" in name or not NAME.match(name):
            raise ConfigError(f"{path}:{lineno}: a line starts with the task name (letters, digits, _ . -), "
                              f"then key=value overrides; got {name!r}")
        if name in seen:
            raise ConfigError(f"{path}:{lineno}: task name {name!r} is also on line {seen[name]}")
        bad = [t for t in overrides if "=" not in t]
        if bad:
            raise ConfigError(f"{path}:{lineno}: {bad[0]!r} is not key=value")
        seen[name] = lineno
        tasks.append(SweepTask(len(tasks), name, tuple(overrides), lineno))
    if not tasks:
        raise ConfigError(f"sweep file {path}: no task lines")
    return tasks


def task_args(task: SweepTask, root: str | Path, common: list[str]) -> list[str]:
    """``recipe=``/overrides for one task: the common ones, the line's, and its run directory."""
    args = [*common, *task.overrides]
    if not any(a.startswith("run_dir=") for a in args):
        args.append(f"run_dir={Path(root) / task.name}")
    return args


def check_sweep(path: str | Path, root: str | Path, common: list[str]) -> list[tuple[SweepTask, RunConfig]]:
    """Resolve and validate every task's config (before anything is submitted)."""
    from .cli import parse_run_args

    out, dirs = [], {}
    for task in load_sweep(path):
        try:
            cfg = parse_run_args(task_args(task, root, common))
        except ConfigError as e:
            raise ConfigError(f"{path}:{task.line} (task {task.name}): {e}") from None
        run_dir = str(cfg.run_path.resolve())
        if run_dir in dirs:
            raise ConfigError(f"{path}:{task.line}: task {task.name} trains in {run_dir}, as task {dirs[run_dir]} "
                              "does; give each task its own run_dir")
        dirs[run_dir] = task.name
        out.append((task, cfg))
    return out
