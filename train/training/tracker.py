"""Metrics out: console progress bar, ``metrics.jsonl`` in the run dir, optional wandb (offline by default).

Only rank 0 writes. Every record carries ``stage`` and ``step``; ``kind`` is ``train`` or ``val``.
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

import torch

from longsft.train.common.io import JsonlLog, iter_jsonl
from longsft.train.config.schema import LoggingConfig


def peak_memory_gb() -> float:
    """GPU: the peak of allocated memory since :func:`reset_peak_memory` (a step's, a validation round's);
    CPU: this process's peak RSS (which no reset lowers)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def reset_peak_memory() -> None:
    """Start a new peak for :func:`peak_memory_gb` on the GPU (else the process's whole life: earlier
    stages, validation's generation), as torchtitan's memory monitor does per logging step."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


class Tracker:
    def __init__(self, run_dir: Path, cfg: LoggingConfig, enabled: bool, run_config: dict | None = None):
        self.enabled = enabled
        self.cfg = cfg
        self.metrics = JsonlLog(run_dir / "metrics.jsonl")
        self.bar = None
        self.wandb = None
        if enabled and cfg.wandb and cfg.wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.wandb = wandb.init(project=cfg.wandb_project, dir=str(run_dir), mode=cfg.wandb_mode,
                                    config=run_config, name=run_dir.name, resume="allow", id=_wandb_id(run_dir))

    def start_stage(self, name: str, total: int, done: int) -> None:
        if self.enabled and self.cfg.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, desc=f"stage {name}", unit="step", dynamic_ncols=True,
                            file=sys.stdout, mininterval=1.0)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.metrics.write(record)
        if self.wandb is not None:
            prefix = f"{record['stage']}/{record['kind']}/"
            self.wandb.log({prefix + k: v for k, v in record.items() if isinstance(v, (int, float))})
        if record["kind"] == "train" and self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                                 tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
        elif record["kind"] == "val":
            self.write(f"[{record['stage']} step {record['step']}] val BA={record['balanced_accuracy']:.3f} "
                       f"MCC={record['mcc']:.3f} invalid={record['invalid_rate']:.1%} "
                       f"loss={record.get('val_loss', float('nan')):.4f}"
                       + _decision(record.get("decision_auc"), record.get("decision_log_odds")))

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def end_stage(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close(self) -> None:
        self.end_stage()
        self.metrics.close()
        if self.wandb is not None:
            self.wandb.finish()


def _wandb_id(run_dir: Path) -> str:
    import hashlib

    return hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]


def read_metrics(run_dir: Path) -> list[dict]:
    """``metrics.jsonl`` of a run (a line cut off by a crash skipped)."""
    return [rec for _, rec in iter_jsonl(run_dir / "metrics.jsonl", log=True)]


def latest_metrics(run_dir: Path) -> list[dict]:
    """:func:`read_metrics` with one record per (stage, kind, step), the newest: a resumed run re-logs the
    steps after its last checkpoint. In first-logged order."""
    seen: dict[tuple, dict] = {}
    for r in read_metrics(run_dir):
        seen[(r["stage"], r["kind"], r["step"])] = r
    return list(seen.values())


def _decision(auc: float | None, lean: float | None) -> str:
    """`` decision AUC=0.696 lean=+0.28`` for the log line, or nothing where there is none."""
    return "" if auc is None or lean is None else f" decision AUC={auc:.3f} lean={lean:+.2f}"
