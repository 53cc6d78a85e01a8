"""The curriculum: stages in order, each initialised from the previous stage's best model.

``state.json`` in the run directory records every stage (status, steps, best checkpoint and
its validation metrics). Re-running the same command resumes: finished stages are skipped,
an unfinished one continues from its last complete checkpoint.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from longsft.train.common.cpu_features import bf16_hint, fast_bf16
from longsft.train.common.errors import ConfigError, same_on_every_rank
from longsft.train.common.io import atomic_write_json, atomic_write_text, read_text, say
from longsft.train.config.checks import validate
from longsft.train.config.loader import dump_yaml, to_dict
from longsft.train.config.schema import RunConfig
from longsft.train.data.cache_ready import ensure_all
from longsft.train.model.build import build_tokenizer
from longsft.train.model.sdpa import describe as describe_sdpa
from longsft.train.parallel import comm, distributed
from longsft.train.training.preempt import StopRequests
from longsft.train.training.preflight import check_model, prepare_data
from longsft.train.training.report import write_report
from longsft.train.training.rundir import check_resolved_config, check_run_dir, load_state, lock_holder, lock_run_dir
from longsft.train.training.tracker import Tracker
from longsft.train.training.trainer import StageTrainer


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
    if d.is_main and (hint := bf16_hint(cfg.model.dtype == "bf16", torch.cuda.is_available(), fast_bf16(),
                                        "model.dtype")):
        say(hint)
    if d.is_main:
        say(f"attention: parallel.sp_backend={cfg.parallel.sp_backend} over sp_size={cfg.parallel.sp_size}; "
            f"fused block kernel {kernel} (where the ring, Ulysses or kept attention runs); elsewhere "
            f"{describe_sdpa(cfg.model.sdpa_cudnn)}")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress bar is the one to read
    tokenizer = build_tokenizer(cfg.model)
    caches = None  # every split's token cache, ensured once for the whole curriculum and handed to each stage
    if cfg.data.source == "files":
        # every stage's data checked and tokenized (or found in the cache) before the run directory
        # is touched: a bad row fails every rank, before hours of training
        caches = ensure_all(cfg, tokenizer, log=say if d.is_main else None)
    run_dir = cfg.run_path
    replace_config = comm.decided_by_rank_zero(lambda: check_resolved_config(cfg))  # a mismatch fails every rank
    d.barrier()
    lock = None
    if d.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = lock_run_dir(run_dir)
    holder = comm.broadcast_object(None if lock else lock_holder(run_dir))
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
    if cfg.data.source == "sample":  # written into the run directory just above
        caches = ensure_all(cfg, tokenizer, log=say if d.is_main else None)
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
                StageTrainer(cfg, i, d, tokenizer, tracker, entry, save, init_from, stop, caches).run()
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
