"""Checkpoints: resumable DeepSpeed state (``last``) and the HF-format best model (``best``).

Resumable checkpoints live in ``<stage>/ckpt/step_NNNNNNN``; a tag is complete only when its
``manifest.json`` (written last, atomically, after every rank has finished writing) exists.
Incomplete tags are ignored on resume and pruned on the next save. The best model is written
to a temp folder and swapped in (:func:`longsft.train.io.replace_dir`).
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


def save_resume(engine, d, stage_dir: Path, step: int, trainer_state: dict, keep: int = 1) -> Path:
    """Save model+optimizer+scheduler shards, RNG and ``trainer_state``; collective."""
    ckpt_dir = stage_dir / "ckpt"
    tag = f"step_{step:07d}"
    engine.save_checkpoint(str(ckpt_dir), tag=tag, save_latest=False)
    torch.save(_rng_state(), ckpt_dir / tag / f"rng_rank{d.rank:05d}.pt")
    d.barrier()
    if d.is_main:
        atomic_write_json(ckpt_dir / tag / MANIFEST, {"step": step, "time": time.time(), "world_size": d.world_size,
                                                      "trainer_state": trainer_state})
        complete = complete_tags(ckpt_dir)
        for old in ckpt_dir.glob("step_*"):
            if old.is_dir() and old.name != tag and (old not in complete[-keep:]):
                shutil.rmtree(old, ignore_errors=True)
    d.barrier()
    return ckpt_dir / tag


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


def complete_tags(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoint folders, oldest first."""
    tags = [p for p in ckpt_dir.glob("step_*") if (p / MANIFEST).exists()]
    return sorted(tags, key=lambda p: p.name)


def latest_resume(stage_dir: Path) -> Path | None:
    tags = complete_tags(stage_dir / "ckpt")
    return tags[-1] if tags else None


def load_resume(engine, d, tag_dir: Path) -> dict:
    """Restore engine state and RNG from ``tag_dir``; returns its trainer_state."""
    manifest = json.loads((tag_dir / MANIFEST).read_text())
    if manifest["world_size"] != d.world_size:
        raise ConfigError(f"{tag_dir} was saved with {manifest['world_size']} ranks, this job has "
                           f"{d.world_size}; resume with the same number of processes")
    path, _ = engine.load_checkpoint(str(tag_dir.parent), tag=tag_dir.name, load_optimizer_states=True,
                                     load_lr_scheduler_states=True)
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


def recover(stage_dir: Path, d) -> None:
    """Repair an interrupted best-model swap (see :func:`longsft.train.io.replace_dir`) and delete
    checkpoint folders without a manifest (a save cut short: crash, disk full), freeing their space."""
    if d.is_main:
        recover_dir(stage_dir / "best")
        complete = set(complete_tags(stage_dir / "ckpt"))
        for tag in (stage_dir / "ckpt").glob("step_*"):
            if tag.is_dir() and tag not in complete:
                shutil.rmtree(tag, ignore_errors=True)
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
