"""Sweep files: one training run per line, for SLURM array jobs (``launch/slurm/array.sbatch``).

A line is a task name followed by ``key=value`` overrides (shell quoting; ``#`` starts a comment)::

    # name         overrides
    mma_only       data.train_file=data/mma_only/{bucket}/train.jsonl
    mma_erhg       data.train_file=data/full/{bucket}/train.jsonl optim.lr=1e-5

Array index ``i`` is the ``i``-th task line (comments and blank lines do not count). Arguments
common to every task (``recipe=...``) come first, so a line overrides them. Task ``name`` trains in
``<root>/<name>`` unless its line sets ``run_dir``. An evaluation sweep (``--command eval``) takes
``longsft eval`` arguments per line and writes to ``out=<root>/<name>``.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from longsft.eval.eval_config import parse_eval_args
from longsft.train.common.errors import ConfigError, DataError
from longsft.train.common.io import read_text
from longsft.train.config.recipes import parse_run_args

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
        text = read_text(path)
    except DataError as e:
        raise ConfigError(f"sweep file {e}") from None
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


# per command: the key that names a task's output folder, and how its config is resolved
OUTPUT_KEY = {"train": "run_dir", "eval": "out"}


def task_args(task: SweepTask, root: str | Path, common: list[str], command: str = "train") -> list[str]:
    """Arguments for one task: the common ones, the line's, and its output folder."""
    args = [*common, *task.overrides]
    key = OUTPUT_KEY[command]
    if not any(a.startswith(f"{key}=") for a in args):
        args.append(f"{key}={Path(root) / task.name}")
    if command == "eval" and not any(a.startswith("name=") for a in args):
        args.append(f"name={task.name}")  # the row name in `longsft report`
    return args


def _resolve(command: str, args: list[str]) -> tuple[object, Path]:
    if command == "eval":
        cfg = parse_eval_args(args)
        return cfg, cfg.out_path
    cfg = parse_run_args(args)
    return cfg, cfg.run_path


def check_sweep(path: str | Path, root: str | Path, common: list[str],
                command: str = "train") -> list[tuple[SweepTask, object]]:
    """Resolve and validate every task's config (before anything is submitted)."""
    out, dirs = [], {}
    for task in load_sweep(path):
        try:
            cfg, where = _resolve(command, task_args(task, root, common, command))
        except ConfigError as e:
            raise ConfigError(f"{path}:{task.line} (task {task.name}): {e}") from None
        run_dir = str(where.resolve())
        if run_dir in dirs:
            raise ConfigError(f"{path}:{task.line}: task {task.name} writes to {run_dir}, as task {dirs[run_dir]} "
                              f"does; give each task its own {OUTPUT_KEY[command]}")
        dirs[run_dir] = task.name
        out.append((task, cfg))
    return out
