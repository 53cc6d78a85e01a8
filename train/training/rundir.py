"""The run directory as files, without torch: what makes a folder a run, its lock, its ``state.json``, the
config it recorded and how a rerun's differs (one comparison: a finished run says so at once, a resume
may change memory settings only), and whether a curriculum has anything left to do there."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import yaml

from longsft.train.common.errors import ConfigError, DataError
from longsft.train.common.io import read_json, read_text, say
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
        if config_changes(recorded_config(cfg.run_path), cfg):
            return None
    except (OSError, ConfigError, DataError):
        return None
    stages = state["stages"]
    if list(stages) != [s.name for s in cfg.stages] or any(e["status"] != "done" for e in stages.values()):
        return None
    return state


def recorded_config(run_dir: Path) -> dict:
    """The config a run directory recorded (``config.yaml``) as a mapping; ConfigError when unreadable."""
    path = Path(run_dir) / "config.yaml"
    try:
        old = yaml.safe_load(read_text(path))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML ({e}); it records the run's config") from None
    if not isinstance(old, dict):
        raise ConfigError(f"{path}: not a longsft run config")
    return old


def config_changes(old: dict, cfg: RunConfig) -> list[tuple[str, Any, Any]]:
    """[(dotted key, recorded, now)] of every leaf that differs between a recorded config and ``cfg``; logging
    is no change, nor is a key added to the schema since the run was made, at its default."""
    now, old = to_dict(cfg), dict(old)
    old.pop("logging", None), now.pop("logging", None)
    if old == now:
        return []
    defaults = to_dict(type(cfg)())
    return [(k, a, b) for k, a, b in _diff(old, now) if not (a is None and b == _at(defaults, k))]


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


def load_state(cfg: RunConfig) -> dict:
    path = cfg.run_path / "state.json"
    if path.exists():
        state = read_state(cfg.run_path)
        names = [s.name for s in cfg.stages]
        if list(state["stages"]) != names:
            raise ConfigError(f"{path}: this run directory holds stages {list(state['stages'])}, the recipe has "
                              f"{names}; use a new run_dir or the original recipe")
        return state
    return {"recipe": cfg.recipe, "created": time.time(),
            "stages": {s.name: {"status": "pending", "steps_done": 0} for s in cfg.stages}}


# keys that change where memory goes, how long a step takes or how long ranks wait, never a loss or a
# gradient beyond kernel rounding (the SP and ZeRO-3 equality tests run them both ways): a run resumes with
# them changed, e.g. after running out of memory
MEMORY_ONLY = ("model.keep_attention", "model.offload_activations", "model.mlp_tile_tokens",
               "model.loss_chunk_tokens", "model.sdpa_cudnn", "validation.whole_model_gb",
               "parallel.attention_kernel", "parallel.pad_multiple", "parallel.timeout_minutes")


def check_resolved_config(cfg: RunConfig) -> bool:
    """A resumed run must use the same resolved config (except logging). Rank 0 checks for every rank.

    Returns True when the run directory's config is to be replaced: it differs, but no optimizer
    step was ever completed there (a run that failed at the start takes the corrected config).
    """
    path = cfg.run_path / "config.yaml"
    if not path.exists():
        return False
    diff = config_changes(recorded_config(cfg.run_path), cfg)
    if not diff:
        return False
    if all(k in MEMORY_ONLY for k, _, _ in diff):  # a resume may trade memory for time: the same training
        say("resuming with " + "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in diff)
            + " (memory and speed settings only)")
        return False
    if not trained(cfg):
        return True
    shown = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in diff[:6]) + ("; ..." if len(diff) > 6 else "")
    raise ConfigError(f"{path}: this run directory has trained with a different config ({shown}). To resume it, "
                      f"rerun with its config (`longsft train recipe={path}`); to train the new config, give a "
                      "new run_dir")


def _diff(old: Any, now: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """Leaf keys whose values differ: [(dotted key, old, new)]."""
    if isinstance(old, dict) and isinstance(now, dict):
        return [d for k in sorted(set(old) | set(now), key=str)
                for d in _diff(old.get(k), now.get(k), f"{prefix}{k}.")]
    return [] if old == now else [(prefix.rstrip("."), old, now)]


def _at(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def trained(cfg: RunConfig) -> bool:
    """Did any optimizer step complete in this run directory (a checkpoint, a best model or counted steps)?"""
    run_dir = cfg.run_path
    if any(run_dir.glob("stages/*/ckpt/step_*")) or any(run_dir.glob("stages/*/best")):
        return True
    path = run_dir / "state.json"
    if not path.exists():
        return False
    return any(e.get("steps_done", 0) or e.get("best") for e in read_state(run_dir)["stages"].values())


def lock_run_dir(run_dir):
    """Hold an exclusive lock on ``run_dir/.lock`` for the life of this process (None if taken).

    A kernel lock (flock), so a killed or preempted job never leaves a stale lock behind.
    """
    import fcntl
    import os
    import socket

    f = open(run_dir / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    f.seek(0)
    f.truncate()
    f.write(f"host={socket.gethostname()} pid={os.getpid()} slurm_job={os.environ.get('SLURM_JOB_ID', '-')}\n")
    f.flush()
    return f


def lock_holder(run_dir) -> str:
    try:
        return (run_dir / ".lock").read_text().strip() or "unknown holder"
    except OSError:
        return "unknown holder"
