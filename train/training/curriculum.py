"""The curriculum: stages in order, each initialised from the previous stage's best model.

``state.json`` in the run directory records every stage (status, steps, best checkpoint and
its validation metrics). Re-running the same command resumes: finished stages are skipped,
an unfinished one continues from its last complete checkpoint.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from longsft.train.common.errors import ConfigError, same_on_every_rank
from longsft.train.common.io import atomic_write_json, atomic_write_text, read_text, say
from longsft.train.common.model_files import check_model_source
from longsft.train.config.backends import check_heads
from longsft.train.config.checks import validate
from longsft.train.config.loader import dump_yaml, to_dict
from longsft.train.config.schema import RunConfig
from longsft.train.data.token_cache import ensure_all
from longsft.train.datagen.sample_data import write_sample_data
from longsft.train.model.build import build_hf_config, build_tokenizer, check_attention_quirks
from longsft.train.parallel import comm, distributed
from longsft.train.training.preempt import StopRequests
from longsft.train.training.report import write_report
from longsft.train.training.rundir import check_run_dir, read_state
from longsft.train.training.tracker import Tracker
from longsft.train.training.trainer import StageTrainer


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
               "model.loss_chunk_tokens", "validation.whole_model_gb", "parallel.attention_kernel",
               "parallel.timeout_minutes")


def check_resolved_config(cfg: RunConfig) -> bool:
    """A resumed run must use the same resolved config (except logging). Rank 0 checks for every rank.

    Returns True when the run directory's config is to be replaced: it differs, but no optimizer
    step was ever completed there (a run that failed at the start takes the corrected config).
    """
    import yaml

    path = cfg.run_path / "config.yaml"
    if not path.exists():
        return False
    try:
        old = yaml.safe_load(read_text(path))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML ({e}); it records the run's config") from None
    if not isinstance(old, dict):
        raise ConfigError(f"{path}: not a longsft run config")
    now = to_dict(cfg)
    old.pop("logging", None), now.pop("logging", None)
    if old == now:
        return False
    defaults = to_dict(type(cfg)())
    diff = [(k, a, b) for k, a, b in _diff(old, now) if not (a is None and b == _at(defaults, k))]
    if not diff:  # only keys added since the run was made, at their defaults
        return False
    if all(k in MEMORY_ONLY for k, _, _ in diff):  # a resume may trade memory for time: the same training
        if comm.rank() == 0:
            say("resuming with " + "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in diff)
                + " (memory and speed settings only)")
        return False
    if not _trained(cfg):
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


def _trained(cfg: RunConfig) -> bool:
    """Did any optimizer step complete in this run directory (a checkpoint, a best model or counted steps)?"""
    run_dir = cfg.run_path
    if any(run_dir.glob("stages/*/ckpt/step_*")) or any(run_dir.glob("stages/*/best")):
        return True
    path = run_dir / "state.json"
    if not path.exists():
        return False
    return any(e.get("steps_done", 0) or e.get("best") for e in read_state(run_dir)["stages"].values())


def prepare_data(cfg: RunConfig, tokenizer) -> None:
    """``data.source: sample`` -> write the deterministic sample set into the run dir (once)."""
    if cfg.data.source != "sample":
        return
    out = cfg.run_path / "data"
    buckets = sorted({s.bucket for s in cfg.stages})
    if all((out / b / "validation.jsonl").exists() for b in buckets):
        return
    write_sample_data(out, tokenizer, buckets, cfg.data.sample_size, max(2, cfg.data.sample_size // 4),
                      cfg.data.seed)


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


def _lock_holder(run_dir) -> str:
    try:
        return (run_dir / ".lock").read_text().strip() or "unknown holder"
    except OSError:
        return "unknown holder"


def check_model(cfg: RunConfig) -> str:
    """Checks that need only the model's config (no weights): head counts against the SP backend.
    Returns the name of the block kernel sequence-parallel attention will run (:func:`attention_kernel`)."""
    m = cfg.model
    for key, value in (("model.path", m.path), ("model.tokenizer", m.tokenizer)):
        if not value or value == "qwen":
            continue
        # a missing path, an uncached hub id offline, a cut-off config.json, shard or GGUF: refused now, named
        check_model_source(value, m.gguf_file if key == "model.path" else None, key,
                           "weights" if key == "model.path" else None)
    try:
        hf = build_hf_config(m)
    except ConfigError:
        raise
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path={m.path}: cannot read its config.json ({e})") from None
    check_heads(cfg.parallel.sp_backend, cfg.parallel.sp_size, hf.num_attention_heads,
                getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads)
    check_attention_quirks(hf, cfg.parallel.sp_size, cfg.data.packing)
    import torch

    if m.loss_kernel == "liger" and getattr(hf, "final_logit_softcapping", None):
        raise ConfigError(f"model.loss_kernel=liger: this model caps its logits (final_logit_softcapping="
                          f"{hf.final_logit_softcapping}), which longsft does not pass to Liger's kernel; use "
                          "model.loss_kernel=torch (it applies the cap, chunked or not)")
    if m.loss_kernel == "liger" and not torch.cuda.is_available():
        raise ConfigError("model.loss_kernel=liger runs on CUDA GPUs only; use model.loss_kernel=torch "
                          "(with model.loss_chunk_tokens) on this machine")
    return attention_kernel(cfg, hf)


def attention_kernel(cfg: RunConfig, hf) -> str:
    """The fused kernel the ring's blocks (and Ulysses) run on this machine, by name; a forced
    ``parallel.attention_kernel`` that cannot run here fails now, before any model is built."""
    import torch

    from longsft.train.model.build import torch_dtype
    from longsft.train.parallel.kernels import block_kernel

    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return block_kernel(device, torch_dtype(cfg.model), cfg.parallel.attention_kernel, head_dim).name
    except ValueError as e:
        raise ConfigError(str(e)) from None


def run(cfg: RunConfig) -> dict:
    """Run (or resume) the whole curriculum; returns the final state."""
    validate(cfg)
    check_run_dir(cfg)
    kernel = check_model(cfg)
    d = distributed.init(cfg.parallel.sp_size, cfg.parallel.timeout_minutes * 60, cfg.parallel.sp_backend,
                         cfg.parallel.attention_kernel)
    try:
        state = _run(cfg, d, kernel)
    except BaseException:
        distributed.shutdown(failed=True)
        raise
    distributed.shutdown()
    return state


def _run(cfg: RunConfig, d: distributed.Dist, kernel: str) -> dict:
    """The curriculum on initialised process groups: data checked, run directory locked, stages run.
    ``kernel``: the attention block kernel's name, for the log."""
    if d.is_main and (hint := distributed.huge_pages_hint()):
        say(hint)
    if d.is_main:
        say(f"attention: parallel.sp_backend={cfg.parallel.sp_backend} over sp_size={cfg.parallel.sp_size}; "
            f"fused block kernel {kernel} (where the ring, Ulysses or kept attention runs)")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress bar is the one to read
    tokenizer = build_tokenizer(cfg.model)
    if cfg.data.source == "files":
        # every stage's data checked and tokenized (or found in the cache) before the run directory
        # is touched: a bad row fails every rank, before hours of training
        ensure_all(cfg, tokenizer, log=say if d.is_main else None)
    run_dir = cfg.run_path
    replace_config = comm.decided_by_rank_zero(lambda: check_resolved_config(cfg))  # a mismatch fails every rank
    d.barrier()
    lock = None
    if d.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = lock_run_dir(run_dir)
    holder = comm.broadcast_object(None if lock else _lock_holder(run_dir))
    if holder is not None:
        raise same_on_every_rank(ConfigError(f"{run_dir} is in use by another job ({holder}); wait for it or use "
                                             "another run_dir"))
    if d.is_main:
        if replace_config:  # the old config never completed a step: keep it beside, train the new one
            os.replace(run_dir / "config.yaml", run_dir / "config.yaml.untrained")
            (run_dir / "state.json").unlink(missing_ok=True)
            print(f"longsft: {run_dir} never completed a step with its config; training the new config "
                  "(the old one is in config.yaml.untrained)", file=sys.stderr, flush=True)
        if not (run_dir / "config.yaml").exists() or read_text(run_dir / "config.yaml") != dump_yaml(cfg):
            atomic_write_text(run_dir / "config.yaml", dump_yaml(cfg))  # (a resume's own memory settings)
    d.barrier()
    state = comm.decided_by_rank_zero(lambda: load_state(cfg))  # one view of which stages are done
    if d.is_main:
        prepare_data(cfg, tokenizer)
    d.barrier()
    if cfg.data.source == "sample":
        ensure_all(cfg, tokenizer, log=say if d.is_main else None)
    tracker = Tracker(run_dir, cfg.logging, d.is_main, to_dict(cfg))

    def save() -> None:
        if d.is_main:
            atomic_write_json(run_dir / "state.json", state)

    stop = StopRequests(run_dir, d.is_main)
    init_from = None
    t0 = time.time()
    try:
        for i, stage in enumerate(cfg.stages):
            entry = state["stages"][stage.name]
            if entry["status"] == "done":  # "failed" and "running" stages resume from their last checkpoint
                tracker.write(f"stage {stage.name}: done, skipping (best: {entry.get('best', {}).get('path')})")
            else:
                entry["init_from"] = init_from
                StageTrainer(cfg, i, d, tokenizer, tracker, entry, save, init_from, stop).run()
                if d.is_main:
                    write_report(run_dir, state)
            init_from = entry["best"]["path"]
    finally:
        stop.close()
    state["seconds_this_run"] = time.time() - t0
    save()
    if d.is_main:
        write_report(run_dir, state)
        tracker.write(f"done in {state['seconds_this_run']:.0f} s; report: {run_dir / 'report.md'}")
    tracker.close()
    d.barrier()
    if lock is not None:
        lock.close()
    return state
