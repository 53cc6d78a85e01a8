"""Metrics out: console progress bar, ``metrics.jsonl`` in the run dir, optional wandb (offline by default).

Only rank 0 writes. Every record carries ``stage`` and ``step``; ``kind`` is ``train`` or ``val``.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

import torch

from longsft.train.config import LoggingConfig


def peak_memory_gb() -> float:
    """Peak accelerator memory if on GPU, else this process's peak RSS."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class Tracker:
    def __init__(self, run_dir: Path, cfg: LoggingConfig, enabled: bool, run_config: dict | None = None):
        self.enabled = enabled
        self.cfg = cfg
        self.path = run_dir / "metrics.jsonl"
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
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
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
                       f"loss={record.get('val_loss', float('nan')):.4f}")

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
        if self.wandb is not None:
            self.wandb.finish()


def _wandb_id(run_dir: Path) -> str:
    import hashlib

    return hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
