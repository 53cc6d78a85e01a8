"""The run directory as files, without torch: what makes a folder a run, its ``state.json``, and
whether a curriculum has anything left to do there (a rerun of a finished one returns at once)."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from longsft.train.common.errors import ConfigError, DataError
from longsft.train.common.io import read_json, read_text
from longsft.train.config.loader import to_dict
from longsft.train.config.schema import RunConfig

RUN_MARKERS = ("config.yaml", "state.json")  # a folder holding one of these is a longsft run directory
# what longsft puts there before the run starts: lock, stop request, submit folder, the sample set that
# `longsft data prepare` writes for data.source=sample, and the folder for NCCL's flight-recorder dumps
# (launch/slurm/curriculum.sbatch)
PRE_RUN = {".lock", "STOP", "submit", "data", "nccl_traces"}


def check_run_dir(cfg: RunConfig) -> None:
    """``run_dir`` is new, empty or a longsft run directory: never write into someone else's folder."""
    path = cfg.run_path
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run_dir={path} is a file, not a folder")
    if not path.is_dir() or any((path / m).exists() for m in RUN_MARKERS):
        return
    present = sorted(p.name for p in path.iterdir() if p.name not in PRE_RUN)
    if present:
        shown = ", ".join(present[:5]) + (", ..." if len(present) > 5 else "")
        raise ConfigError(f"run_dir={path} exists and is not a longsft run directory (it holds {shown}); "
                          "give a new or empty folder")


def read_state(run_dir: str | Path) -> dict:
    """``run_dir/state.json``, checked enough to be used: a cut-off or foreign file is a DataError."""
    path = Path(run_dir) / "state.json"
    if not path.exists():
        raise ConfigError(f"{run_dir}: not a run directory (no state.json)")
    state = read_json(path, "state file")
    stages = state.get("stages") if isinstance(state, dict) else None
    if not isinstance(stages, dict) or not all(isinstance(v, dict) and "status" in v for v in stages.values()):
        raise DataError(f"{path}: not a longsft state file (no 'stages' mapping of stage entries)")
    state.setdefault("recipe", "?")
    return state


def finished(cfg: RunConfig) -> dict | None:
    """The run directory's state if every stage of ``cfg`` is done there with this very config (logging
    aside), else None: then the curriculum proper decides (resume, refuse, or say what is wrong)."""
    try:
        state = read_state(cfg.run_path)
        old = yaml.safe_load(read_text(cfg.run_path / "config.yaml"))
    except (OSError, ConfigError, DataError, yaml.YAMLError):
        return None
    now = to_dict(cfg)
    if not isinstance(old, dict):
        return None
    old.pop("logging", None), now.pop("logging", None)
    if old != now:
        return None
    stages = state["stages"]
    if list(stages) != [s.name for s in cfg.stages] or any(e["status"] != "done" for e in stages.values()):
        return None
    return state


def say_finished(cfg: RunConfig) -> bool:
    """Rank 0 says each stage is done, as the curriculum would, if :func:`finished`; nothing is written."""
    state = finished(cfg)
    if state is None:
        return False
    if os.environ.get("RANK", "0") == "0":
        for name, entry in state["stages"].items():
            print(f"stage {name}: done, skipping (best: {(entry.get('best') or {}).get('path')})")
        print(f"done: every stage had finished; report: {cfg.run_path / 'report.md'}", flush=True)
    return True
