"""One curriculum stage: data, engine, training loop, validation hook, checkpoints."""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from longsft.train.common.errors import ConfigError, LongsftError, same_on_every_rank
from longsft.train.common.io import write_jsonl
from longsft.train.config.deepspeed import build_ds_config
from longsft.train.config.schema import RunConfig
from longsft.train.data.batching import StepSampler, pack
from longsft.train.data.cache_ready import stage_data
from longsft.train.data.encoding import EncodeStats
from longsft.train.data.token_cache import Split, stage_files
from longsft.train.model.build import attention_quirks, build_hf_config, build_model, keeps_attention, torch_dtype
from longsft.train.parallel import comm
from longsft.train.parallel.attention import uses_block_kernel
from longsft.train.parallel.distributed import Dist
from longsft.train.parallel.kernels import block_kernel
from longsft.train.parallel.layout import pad_multiple
from longsft.train.plan.choose import choose
from longsft.train.scoring.metrics import gold_label
from longsft.train.training import checkpoint
from longsft.train.training.engine import build_engine
from longsft.train.training.preempt import StopRequested, StopRequests
from longsft.train.training.step import n_targets, train_step
from longsft.train.training.tracker import Tracker, peak_memory_gb, reset_peak_memory
from longsft.train.training.validation import is_better, run_validation


class TrainingError(LongsftError, RuntimeError):
    """Training cannot go on (e.g. a non-finite loss); the run directory keeps the last good state. Exit 3."""

    exit_code = 3


class SaveError(TrainingError):
    """A checkpoint could not be written (disk full, quota...); raised by the rank that failed (said by it)."""

    this_rank_only = True


class StageTrainer:
    """Trains ``stage`` from ``init_from`` (HF folder or None) and keeps its best checkpoint.

    ``state`` is this stage's entry in ``state.json``; ``save_state`` persists it (rank 0). ``caches``: the
    token cache folder of each split, as the curriculum's one :func:`ensure_all` returned them (None: this
    stage's are ensured here).
    """

    def __init__(self, cfg: RunConfig, index: int, d: Dist, tokenizer, tracker: Tracker, state: dict,
                 save_state, init_from: str | None, stop: StopRequests | None = None,
                 caches: dict[Split, Path] | None = None):
        self.cfg, self.stage, self.d, self.tok = cfg, cfg.stages[index], d, tokenizer
        self.tracker, self.state, self.save_state, self.init_from = tracker, state, save_state, init_from
        self.stop, self.caches = stop, caches
        self.dir = cfg.run_path / "stages" / self.stage.name
        self.pad_id = tokenizer.pad_token_id

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        """Read and encode the stage's data, build the model and the DeepSpeed engine."""
        self._data()
        self._engine()

    def _data(self) -> None:
        """The stage's token caches (built once, memory-mapped); this rank reads only its batches' rows."""
        st, cfg = self.stage, self.cfg
        t0 = time.time()
        train, val = stage_data(cfg, st, self.tok, self.caches)
        self.train = pack(train.items, st.seq_len, cfg.data.packing)
        tstats, (self.val, vstats) = train.stats, ([], EncodeStats()) if val is None else val.first(
            cfg.validation.max_samples)
        train_path, val_path = stage_files(cfg, st)
        o = cfg.optim
        labels = [gold_label(row[0].meta.gold_score) for row in self.train] if cfg.data.stratify else None
        self.sampler = StepSampler(len(self.train), self.d.dims.dp_size, self.d.dp_rank, o.micro_batch_size,
                                   o.grad_accum, cfg.seed, labels)
        if self.sampler.steps_per_epoch == 0:
            raise ConfigError(f"stage {st.name!r}: {len(self.train)} usable samples in {train_path} "
                              f"(of {tstats.total}; {tstats.skipped} skipped as longer than {st.seq_len}) "
                              f"do not fill one global batch of {self.sampler.global_batch}")
        if st.validate and not self.val:
            raise ConfigError(f"stage {st.name!r}: no usable validation samples in {val_path}")
        spe = self.sampler.steps_per_epoch
        self.total_steps = st.max_steps if st.max_steps > 0 else max(1, round(st.epochs * spe))
        every = st.every_steps if st.every_steps is not None else cfg.validation.every_steps
        self.val_every = every if every > 0 else spe
        self.state.update(total_steps=self.total_steps, steps_per_epoch=spe,
                          data={"train": asdict(tstats), "validation": asdict(vstats),
                                "train_file": str(train_path), "validation_file": str(val_path)})
        packed = f" in {len(self.train)} packed rows" if cfg.data.packing else (
            " (classes stratified per step)" if self.sampler.labels is not None else "")
        self.tracker.write(f"stage {st.name}: {tstats.kept}/{tstats.total} train samples{packed} "
                           f"({tstats.truncated} truncated, {tstats.skipped} skipped; policy={st.overflow}), "
                           f"{len(self.val)} validation, {self.total_steps} steps of {self.sampler.global_batch}; data ready in "
                           f"{time.time() - t0:.1f} s (token cache {train.path.parent})")

    def _engine(self) -> None:
        from transformers.integrations import HfDeepSpeedConfig

        hf = build_hf_config(self.cfg.model, self.init_from)
        self.ds_config = build_ds_config(self.cfg, self.stage, self.d.world_size, hf.hidden_size)
        keep, hold = self._memory_plan()
        self.model_cfg = replace(self.cfg.model, keep_attention=keep)
        self.pad_to = self._pad_to(hf)
        # Alive while the model is built: ZeRO-3 partitions weights as they load.
        self._hf_ds = HfDeepSpeedConfig(self.ds_config)
        model = build_model(self.model_cfg, self.init_from, self.cfg.seed, self.d.dims.sp_size, self.cfg.data.packing)
        self.engine = build_engine(self.cfg, model, self.ds_config, self.total_steps, hold)

    def _pad_to(self, hf) -> tuple[int, int]:
        """(multiple, most tokens) of every micro-batch's length (``parallel.pad_multiple``): with ``auto``, a
        multiple only where the batch's attention runs the ring's or Ulysses's block kernel and that kernel
        builds a graph for every new shape (cuDNN), so that a stage of varied lengths builds a few; never past
        the stage's ``seq_len``. Chosen on rank 0 for every rank (the kernel depends on each one's GPU)."""
        choice = None
        if self.d.is_main:
            p, sp, packing = self.cfg.parallel, self.d.dims.sp_size, self.cfg.data.packing
            # (one rank: a position-dependent rope, fine there, would see padding raise its largest position)
            kept = keeps_attention(self.model_cfg, sp, packing) and not attention_quirks(hf)
            blocks = uses_block_kernel(sp, p.sp_backend, packing, kept)
            graphs = False
            if blocks and p.pad_multiple == "auto":
                head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
                graphs = block_kernel(self.d.device.type, torch_dtype(self.cfg.model), p.attention_kernel,
                                      head_dim).graph_per_shape
            multiple = pad_multiple(p.pad_multiple, self.stage.seq_len, sp, graphs)
            if multiple > 1:
                why = "cuDNN builds a graph for every new length" if p.pad_multiple == "auto" else "as asked"
                self.tracker.write(f"stage {self.stage.name}: each batch's length rounded up to a multiple of "
                                   f"{multiple} tokens, at most {self.stage.seq_len} (parallel.pad_multiple="
                                   f"{p.pad_multiple}: {why})")
            choice = multiple, self.stage.seq_len
        return comm.broadcast_object(choice)

    def _memory_plan(self) -> tuple[bool, bool]:
        """(keep the layers' attention, hold a tied head's weight through the backward): the planner's
        choices for this stage on this job's hardware (:func:`choose`), made on rank 0 for every rank."""
        choice = None
        if self.d.is_main:
            targets = self.cfg.optim.micro_batch_size * max(n_targets(row) for row in self.train)
            choice = choose(self.cfg, self.stage, self.d.world_size,
                                 int(os.environ.get("LOCAL_WORLD_SIZE", "1")), targets)
            self.tracker.write(f"stage {self.stage.name}: {choice.note}")
            choice = choice.keep_attention, choice.hold_tied_weight
        return comm.broadcast_object(choice)

    # ------------------------------------------------------------------ loop

    def run(self) -> dict:
        for note in checkpoint.recover(self.dir, self.d):
            self.tracker.write(f"stage {self.stage.name}: {note}")
        self.setup()
        step = 0
        # rank 0's view of the shared filesystem decides: each rank's own (NFS attribute caches) could
        # pick different steps after a fast requeue
        tag = comm.decided_by_rank_zero(lambda: checkpoint.latest_resume(self.dir))
        if tag is not None:
            ts = checkpoint.load_resume(self.engine, self.d, tag)
            step = ts["step"]
            self.state["best"] = ts.get("best")
            self.tracker.write(f"stage {self.stage.name}: resumed from {tag} at step {step}")
        self.state["status"] = "running"
        self.save_state()
        self.tracker.start_stage(self.stage.name, self.total_steps, step)
        start, start_step = time.time(), step
        while step < self.total_steps:
            rec = self.train_step(step)
            step += 1
            if not math.isfinite(rec["loss"]):  # the loss is all-reduced: every rank stops here together
                self.state["status"] = "failed"
                self.state["error"] = f"loss {rec['loss']} at step {step}"
                self.save_state()
                raise same_on_every_rank(TrainingError(
                    f"stage {self.stage.name}: loss is {rec['loss']} at step {step}; stopped. The last good checkpoint "
                    f"stays in {self.dir / 'ckpt'} (rerun resumes from it; lower the learning rate or check the data "
                    "first)"))
            if step % self.cfg.logging.log_every == 0 or step == self.total_steps:
                self.tracker.log(rec)
            validate = self.stage.validate and (step % self.val_every == 0 or step == self.total_steps)
            save = validate or step == self.total_steps or (
                self.stage.save_every_steps and step % self.stage.save_every_steps == 0)
            if validate:
                self._validate(step)
            stop = step < self.total_steps and self.stop is not None and self.stop.requested()
            if save or stop:
                self._save(step)
            if stop:
                self._stopped(step, start, start_step)
        self.tracker.end_stage()
        if not self.stage.validate:  # the last model is the stage's output
            checkpoint.export_hf(self.engine, self.tok, self.d, self.dir / "best", {"step": step})
            self.state["best"] = {"path": str(self.dir / "best"), "step": step}
        self.state.update(status="done", steps_done=step,
                          seconds=self.state.get("seconds", 0.0) + time.time() - start,
                          steps_this_run=step - start_step)
        self.save_state()
        if not self.cfg.checkpoint.keep_finished:
            checkpoint.drop_resume(self.dir, self.d)
        self._release()
        return self.state

    def _save(self, step: int) -> None:
        resume_state = {"step": step, "best": self.state.get("best")}
        try:
            tag = checkpoint.save_resume(self.engine, self.d, self.dir, step, resume_state, self.cfg.checkpoint.keep)
        except Exception as e:  # disk full, quota, I/O error: say so, and what is still there
            prev = checkpoint.latest_resume(self.dir)
            kept = (f"the previous checkpoint {prev} is intact and a rerun resumes from it" if prev else
                    "this stage has no earlier checkpoint; a rerun restarts it")
            why = checkpoint.describe_save_error(e, self.dir)
            raise SaveError(f"rank {self.d.rank}: stage {self.stage.name}: saving the checkpoint of step {step} failed "
                            f"({why}); {kept} (free space first)") from e
        self.state["steps_done"] = step
        self.state["last_checkpoint"] = str(tag)
        self.save_state()

    def _stopped(self, step: int, start: float, start_step: int) -> None:
        """A stop was requested and ``step`` is saved: record it and leave (the rerun resumes here)."""
        self.stop.consume()
        self.state.update(status="stopped", seconds=self.state.get("seconds", 0.0) + time.time() - start,
                          steps_this_run=step - start_step)
        self.save_state()
        self.tracker.end_stage()
        raise StopRequested(f"stage {self.stage.name}: stopped on request at step {step}/{self.total_steps}; "
                            f"checkpoint saved in {self.state['last_checkpoint']}. Run the same command to resume")

    def train_step(self, step: int, before_update=None) -> dict:
        """Global ``step`` (:func:`~longsft.train.training.step.train_step`) and its metrics record (on a GPU,
        ``memory_gb`` is this step's peak)."""
        reset_peak_memory()
        t0 = time.time()
        st = train_step(self.engine, self.train, self.sampler, step, self.d, self.pad_id, self.model_cfg,
                        self.cfg.data.packing, before_update, self.pad_to)
        dt = time.time() - t0
        grad_norm = self.engine.get_global_grad_norm()
        return {"kind": "train", "stage": self.stage.name, "step": step + 1, "loss": st.loss,
                "lr": self.engine.get_lr()[0], "grad_norm": None if grad_norm is None else float(grad_norm),
                "tokens": st.tokens, "tokens_per_s": st.tokens / dt, "step_time_s": dt,
                "memory_gb": peak_memory_gb()}

    def _validate(self, step: int) -> None:
        v, t0 = self.cfg.validation, time.time()
        reset_peak_memory()
        batch = v.batch_tokens if v.batch_tokens >= 0 else (self.stage.seq_len if self.d.device.type == "cuda" else 0)
        metrics, rows = run_validation(self.engine, self.tok, self.val, self.d, v.max_new_tokens, v.invalid_policy,
                                       v.loss, self.pad_id, self.cfg.model.loss_chunk_tokens,
                                       self.cfg.model.attn_implementation, v.whole_model_gb, batch, v.decision)
        metrics.update(kind="val", stage=self.stage.name, step=step, seconds=time.time() - t0,
                       memory_gb=peak_memory_gb())
        if self.d.is_main:
            write_jsonl(self.dir / "val" / f"step_{step:07d}.jsonl", rows)
        self.tracker.log(metrics)
        self.state.setdefault("validations", []).append({k: metrics[k] for k in (
            "step", "balanced_accuracy", "mcc", "invalid_rate", "val_loss", "decision_auc", "decision_log_odds")})
        if is_better(metrics, self.state.get("best")):
            checkpoint.export_hf(self.engine, self.tok, self.d, self.dir / "best", metrics)
            self.state["best"] = {"path": str(self.dir / "best"), **{k: metrics[k] for k in (
                "step", "balanced_accuracy", "mcc", "invalid_rate", "contradiction_rate", "val_loss", "decision_auc")}}
            self.tracker.write(f"[{self.stage.name} step {step}] new best (BA {metrics['balanced_accuracy']:.3f})")

    def _release(self) -> None:
        self.engine.destroy()
        del self.engine, self._hf_ds
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
