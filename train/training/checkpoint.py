"""Checkpoints: resumable DeepSpeed state (``last``) and the HF-format best model (``best``).

Resumable checkpoints live in ``<stage>/ckpt/step_NNNNNNN``; a tag is complete only when its
``manifest.json`` (written last, atomically, after every rank has finished writing) exists and
every file it lists has the recorded size. Others are deleted on resume, which then uses the
newest good one (``checkpoint.keep`` are kept, 2 by default). The best model is written to a temp
folder and swapped in (:func:`longsft.train.common.io.replace_dir`); its ``config.json`` is inference-ready
(``use_cache: true``) and every output gets the user's umask mode.

Trust: a checkpoint folder is data, never code. longsft's RNG state is a safetensors file; DeepSpeed's
``*.pt`` files are vetted (every rank scans every pickle) and loaded with ``weights_only=True``,
allowing only the few DeepSpeed types they hold (:func:`safe_loading`). A file naming anything else
is refused (DataError naming it) before any of it is unpickled.
"""

from __future__ import annotations

import contextlib
import functools
import json
import pickle
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from longsft.train.common.compat import supported, unsupported, zero3_full_state_dict
from longsft.train.common.errors import ConfigError, DataError
from longsft.train.common.io import atomic_write_json, recover_dir, replace_dir, share_mode

MANIFEST = "manifest.json"
RNG_FILE = "rng_rank{rank:05d}.safetensors"
LEGACY_RNG_FILE = "rng_rank{rank:05d}.pt"  # the format before RNG_FILE: a pickle, read with weights_only=True


def save_resume(engine, d, stage_dir: Path, step: int, trainer_state: dict, keep: int = 2) -> Path:
    """Save model+optimizer+scheduler shards, RNG and ``trainer_state``; keep the newest ``keep``; collective."""
    ckpt_dir = stage_dir / "ckpt"
    tag_dir = ckpt_dir / f"step_{step:07d}"
    engine.save_checkpoint(str(ckpt_dir), tag=tag_dir.name, save_latest=False)
    _save_rng(tag_dir / RNG_FILE.format(rank=d.rank))
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
    """Restore engine state and RNG from ``tag_dir``; returns its trainer_state.

    A file in ``tag_dir`` that could run code when unpickled is refused (DataError) on every rank,
    before anything is loaded; the folder is left as it is for inspection.
    """
    manifest = json.loads((tag_dir / MANIFEST).read_text())
    if manifest["world_size"] != d.world_size:
        raise ConfigError(f"{tag_dir} was saved with {manifest['world_size']} ranks, this job has "
                           f"{d.world_size}; resume with the same number of processes")
    vet(tag_dir)
    safe_loading(engine)
    try:
        path, _ = engine.load_checkpoint(str(tag_dir.parent), tag=tag_dir.name, load_optimizer_states=True,
                                         load_lr_scheduler_states=True)
    except DataError:
        raise
    except Exception as e:  # damage the size check cannot see (bit rot, a foreign file)
        raise RuntimeError(f"could not load checkpoint {tag_dir} ({e}); move that folder away to resume from the "
                           "one before it (or restart the stage when there is none)") from e
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint in {tag_dir}")
    _load_rng(tag_dir, d.rank)
    return manifest["trainer_state"]


# ---------------------------------------------------------------- loading pickles safely

def _refusal(path: Path, names: str) -> str:
    return (f"{path}: refused to load: its pickle names {names}, which no longsft/DeepSpeed checkpoint "
            f"holds (unpickling it could run code). Whoever can write to {path.parent} may have planted it; "
            "check the folder, then move it away to resume from the checkpoint before (or restart the stage)")


def safe_load(path: Path, allowed=(), map_location=None):
    """``torch.load(path, weights_only=True)``: tensors, containers, plain values and the ``allowed``
    types only; anything else is a DataError naming the file, and nothing of it runs."""
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        named = re.search(r"GLOBAL (\S+)", str(e))  # torch's wording varies between versions
        raise DataError(_refusal(Path(path), named[1] if named else "what weights_only loading refuses")) from None


def _deepspeed_types() -> tuple:
    """The non-tensor types in DeepSpeed 0.19's checkpoint files, found by scanning real ones
    (ZeRO-2/3, fp32/bf16, with and without offload); DynamicLossScaler is fp16's loss scaler."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address


def _numpy_types() -> tuple:
    """What the legacy RNG pickle holds besides tensors: numpy's MT19937 key (a uint32 array)."""
    core = getattr(np, "_core", None) or np.core
    return np.ndarray, np.dtype, core.multiarray._reconstruct, type(np.dtype(np.uint32))


def _allowed(path: Path) -> tuple:
    return _numpy_types() if path.name.startswith("rng_rank") else _deepspeed_types()


def vet(tag_dir: Path) -> None:
    """Refuse ``tag_dir`` if any pickle in it names a type outside the allowlist: a static scan of
    each ``*.pt`` file's pickle (no tensor data is read, nothing is unpickled). Every rank scans
    every rank's files, so all ranks refuse alike and rank 0 says why."""
    from torch.serialization import get_unsafe_globals_in_checkpoint

    for path in sorted(tag_dir.glob("*.pt")):
        try:
            with torch.serialization.safe_globals(list(_allowed(path))):
                bad = get_unsafe_globals_in_checkpoint(path)
        except (ValueError, RuntimeError):  # not a (readable) zip checkpoint: the weights_only load guards it
            continue
        if bad:
            raise DataError(_refusal(path, ", ".join(sorted(bad))))


@functools.cache
def _safe_engine_class():
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class SafeTorchCheckpointEngine(TorchCheckpointEngine):
        """DeepSpeed's torch.save/torch.load checkpoint engine, loading with ``weights_only=True``."""

        def load(self, path: str, map_location=None):
            return safe_load(Path(path), _deepspeed_types(), map_location)

    return TorchCheckpointEngine, SafeTorchCheckpointEngine


def safe_loading(engine) -> None:
    """Make ``engine.load_checkpoint`` unpickle nothing but tensors, plain data and DeepSpeed's own
    checkpoint types (:func:`_deepspeed_types`); idempotent.

    Supports DeepSpeed 0.19 (tested: 0.19.8). There, every file ``load_checkpoint`` reads for a ZeRO
    checkpoint (model states, optimizer states) goes through ``engine.checkpoint_engine.load``, which
    for the default TorchCheckpointEngine is ``torch.load(weights_only=False)``; this swaps in a
    subclass whose ``load`` is :func:`safe_load`. Other DeepSpeed versions, other checkpoint engines
    (``checkpoint.writer``, DataStates) and universal checkpoints (read by ``torch.load`` directly)
    are refused with a ConfigError.
    """

    base, safe = _safe_engine_class()
    if isinstance(engine.checkpoint_engine, safe):
        return
    if not supported("deepspeed"):
        raise unsupported("deepspeed", "longsft loads DeepSpeed checkpoints safely only where it knows their load "
                                       "paths and file contents")
    if type(engine.checkpoint_engine) is not base or engine.load_universal_checkpoint():
        raise ConfigError(f"DeepSpeed config: checkpoint engine {type(engine.checkpoint_engine).__name__}"
                          f"{' with load_universal' if engine.load_universal_checkpoint() else ''} is not supported; "
                          "longsft resumes only through DeepSpeed's default torch checkpoint engine (remove "
                          "\"checkpoint\" / \"datastates\" settings from the DeepSpeed config)")
    guarded = safe.__new__(safe)
    guarded.__dict__.update(engine.checkpoint_engine.__dict__)
    engine.checkpoint_engine = guarded


def export_hf(engine, tokenizer, d, out_dir: Path, extra: dict | None = None) -> None:
    """Write an HF-format model (``from_pretrained``-loadable) to ``out_dir``; collective.

    The folder is ready for inference: its config has ``use_cache: true`` (training keeps
    ``use_cache=False`` in memory), and its files get the user's umask mode (safetensors writes 0600).
    """
    if engine.zero_optimization_partition_weights():
        state = zero3_full_state_dict(engine)  # gathers on rank 0; every rank must call
    else:
        state = engine.module.state_dict() if d.is_main else None
    if d.is_main:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        with _use_cache(engine.module):
            engine.module.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if extra is not None:
            atomic_write_json(tmp / "longsft_metrics.json", extra)
        for p in (tmp, *tmp.rglob("*")):
            share_mode(p)
        replace_dir(tmp, out_dir)
    d.barrier()


@contextlib.contextmanager
def _use_cache(model):
    """Within: ``model``'s config and generation config say ``use_cache=True`` (what inference wants)."""
    configs = [c for c in (model.config, getattr(model, "generation_config", None)) if c is not None]
    saved = [c.use_cache for c in configs]
    for c in configs:
        c.use_cache = True
    try:
        yield
    finally:
        for c, v in zip(configs, saved):
            c.use_cache = v


def recover(stage_dir: Path, d) -> list[str]:
    """Repair an interrupted best-model swap (:func:`longsft.train.common.io.replace_dir`) and delete
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


# ---------------------------------------------------------------- RNG state (no pickle)

def _save_rng(path: Path) -> None:
    """Python, numpy, torch (and CUDA) RNG states as tensors + JSON metadata in a safetensors file."""
    from safetensors.torch import save_file

    version, words, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    tensors = {"python": torch.tensor(words, dtype=torch.int64), "numpy": torch.from_numpy(keys.astype(np.int64)),
               "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state()
    meta = {"python": json.dumps([version, gauss]),
            "numpy": json.dumps([name, int(pos), int(has_gauss), float(cached)])}
    save_file(tensors, str(path), metadata=meta)
    share_mode(path)


def _load_rng(tag_dir: Path, rank: int) -> None:
    """Restore this rank's RNG state from ``tag_dir`` (the safetensors file, or a legacy pickle read
    with ``weights_only=True``); a checkpoint without one resumes with the current state."""
    from safetensors import SafetensorError, safe_open

    path, legacy = tag_dir / RNG_FILE.format(rank=rank), tag_dir / LEGACY_RNG_FILE.format(rank=rank)
    try:
        if path.exists():
            with safe_open(str(path), "pt") as f:
                meta, t = f.metadata() or {}, {k: f.get_tensor(k) for k in f.keys()}
            version, gauss = json.loads(meta["python"])
            name, pos, has_gauss, cached = json.loads(meta["numpy"])
            states = ((version, tuple(t["python"].tolist()), gauss),
                      (name, t["numpy"].numpy().astype(np.uint32), pos, has_gauss, cached), t["torch"], t.get("cuda"))
        elif legacy.exists():
            path, t = legacy, safe_load(legacy, _numpy_types())
            states = (t["python"], t["numpy"], t["torch"], t.get("cuda"))
        else:
            return
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if states[3] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(states[3])
    except (SafetensorError, KeyError, ValueError, TypeError, AttributeError, RuntimeError) as e:
        raise DataError(f"{path}: unreadable RNG state ({type(e).__name__}: {e})") from None
