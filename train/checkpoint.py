"""Checkpoints: resumable DeepSpeed state (``last``) and the HF-format best model (``best``).

Resumable checkpoints live in ``<stage>/ckpt/step_NNNNNNN``; a tag is complete only when its
``manifest.json`` (written last, atomically, after every rank has finished writing) exists and
every file it lists has the recorded size. Others are deleted on resume, which then uses the
newest good one (``checkpoint.keep`` are kept, 2 by default). The best model is written to a temp
folder and swapped in (:func:`longsft.train.io.replace_dir`).
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from .config import ConfigError
from .io import atomic_write_json, recover_dir, replace_dir

MANIFEST = "manifest.json"


def save_resume(engine, d, stage_dir: Path, step: int, trainer_state: dict, keep: int = 2) -> Path:
    """Save model+optimizer+scheduler shards, RNG and ``trainer_state``; keep the newest ``keep``; collective."""
    ckpt_dir = stage_dir / "ckpt"
    tag_dir = ckpt_dir / f"step_{step:07d}"
    engine.save_checkpoint(str(ckpt_dir), tag=tag_dir.name, save_latest=False)
    torch.save(_rng_state(), tag_dir / f"rng_rank{d.rank:05d}.pt")
    d.barrier()
    if d.is_main:
        files = {p.name: p.stat().st_size for p in sorted(tag_dir.iterdir()) if p.name != MANIFEST}
        atomic_write_json(tag_dir / MANIFEST, {"step": step, "time": time.time(), "world_size": d.world_size,
                                               "files": files, "trainer_state": trainer_state})
        good = complete_tags(ckpt_dir)
        for old in ckpt_dir.glob("step_*"):
            if old.is_dir() and old != tag_dir and old not in good[-keep:]:
                shutil.rmtree(old, ignore_errors=True)
    d.barrier()
    return tag_dir


def describe_save_error(e: Exception, where: Path) -> str:
    """``e`` as a user should read it: torch reports a full disk as e.g. "unexpected pos 576 vs 534"."""
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return str(e)
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename or where}"
    if free < 64 * 2**20:
        return f"no space left on device: {free / 2**20:.0f} MiB free in {where} ({e})"
    return f"{e} ({free / 2**30:.1f} GiB free in {where})"


def damage(tag_dir: Path) -> str | None:
    """Why ``tag_dir`` cannot be resumed from, or None. Checks what the manifest lists (names, sizes)."""
    path = tag_dir / MANIFEST
    if not path.exists():
        return "no manifest: the save was cut short"
    try:
        files = json.loads(path.read_text()).get("files", {})
    except ValueError:
        return "unreadable manifest"
    for name, size in files.items():
        f = tag_dir / name
        if not f.exists():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {size}"
    return None


def complete_tags(ckpt_dir: Path) -> list[Path]:
    """Checkpoint folders that can be resumed from, oldest first."""
    return sorted((p for p in ckpt_dir.glob("step_*") if p.is_dir() and damage(p) is None), key=lambda p: p.name)


def latest_resume(stage_dir: Path) -> Path | None:
    tags = complete_tags(stage_dir / "ckpt")
    return tags[-1] if tags else None


def load_resume(engine, d, tag_dir: Path) -> dict:
    """Restore engine state and RNG from ``tag_dir``; returns its trainer_state."""
    manifest = json.loads((tag_dir / MANIFEST).read_text())
    if manifest["world_size"] != d.world_size:
        raise ConfigError(f"{tag_dir} was saved with {manifest['world_size']} ranks, this job has "
                           f"{d.world_size}; resume with the same number of processes")
    try:
        path, _ = engine.load_checkpoint(str(tag_dir.parent), tag=tag_dir.name, load_optimizer_states=True,
                                         load_lr_scheduler_states=True)
    except Exception as e:  # damage the size check cannot see (bit rot, a foreign file)
        raise RuntimeError(f"could not load checkpoint {tag_dir} ({e}); move that folder away to resume from the "
                           "one before it (or restart the stage when there is none)") from e
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint in {tag_dir}")
    rng = tag_dir / f"rng_rank{d.rank:05d}.pt"
    if rng.exists():
        _set_rng_state(torch.load(rng, weights_only=False))
    return manifest["trainer_state"]


def export_hf(engine, tokenizer, d, out_dir: Path, extra: dict | None = None) -> None:
    """Write an HF-format model (``from_pretrained``-loadable) to ``out_dir``; collective."""
    if engine.zero_optimization_partition_weights():
        state = engine._zero3_consolidated_16bit_state_dict()  # gathers on rank 0; every rank must call
    else:
        state = engine.module.state_dict() if d.is_main else None
    if d.is_main:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        engine.module.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if extra is not None:
            atomic_write_json(tmp / "longsft_metrics.json", extra)
        replace_dir(tmp, out_dir)
    d.barrier()


def recover(stage_dir: Path, d) -> list[str]:
    """Repair an interrupted best-model swap (:func:`longsft.train.io.replace_dir`) and delete
    checkpoint folders that cannot be resumed from (a save cut short by a crash or a full disk,
    a truncated file), freeing their space; collective. Returns what was deleted and why (rank 0)."""
    notes = []
    if d.is_main:
        recover_dir(stage_dir / "best")
        for tag in sorted((stage_dir / "ckpt").glob("step_*")):
            why = damage(tag) if tag.is_dir() else None
            if why:
                shutil.rmtree(tag, ignore_errors=True)
                notes.append(f"deleted damaged checkpoint {tag} ({why})")
    d.barrier()
    return notes


def drop_resume(stage_dir: Path, d) -> None:
    """Delete a finished stage's resumable checkpoints (its output is the best model); collective."""
    if d.is_main:
        shutil.rmtree(stage_dir / "ckpt", ignore_errors=True)
    d.barrier()


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
