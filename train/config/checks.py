"""Cross-field checks of a :class:`RunConfig` that need no model, data or processes."""

from __future__ import annotations

from typing import Any

from longsft.train.common.errors import ConfigError
from longsft.train.common.io import safe_name
from longsft.train.config.backends import check_backend
from longsft.train.config.schema import RunConfig


def validate(cfg: RunConfig) -> None:
    """Cross-field checks that need no model, data or processes."""
    if not cfg.stages:
        raise ConfigError(f"recipe {cfg.recipe!r} defines no stages")
    if cfg.model.path is None and cfg.model.config is None:
        raise ConfigError("model.path or model.config must be set")
    names = [s.name for s in cfg.stages]
    for i, s in enumerate(cfg.stages):
        if not s.name:
            raise ConfigError(f"stages.{i}.name must be set")
        if not s.bucket:
            raise ConfigError(f"stages.{i}.bucket must be set")
        safe_name(s.name, f"stages.{i}.name", ConfigError)  # each becomes a folder in the run directory
        safe_name(s.bucket, f"stages.{i}.bucket", ConfigError)
        if s.seq_len < 64:
            raise ConfigError(f"stages.{i}.seq_len={s.seq_len} is too small (>= 64)")
        if s.epochs <= 0 and s.max_steps <= 0:
            raise ConfigError(f"stages.{i}: epochs or max_steps must be positive")
        _bounds(s, f"stages.{i}.", epochs=(0, None), max_steps=(0, None), lr=(0, None),  # 0: a frozen hand-off
                every_steps=(0, None), save_every_steps=(0, None))
    o = cfg.optim
    _bounds(o, "optim.", lr=(0, None, False), weight_decay=(0, None), eps=(0, None, False), warmup_steps=(0, None),
            min_lr_ratio=(0, 1), max_grad_norm=(0, None))
    for j, beta in enumerate(o.betas):
        if not 0 <= beta < 1:
            raise ConfigError(f"optim.betas.{j}={beta} must be in [0, 1)")
    _bounds(cfg.validation, "validation.", every_steps=(0, None), max_samples=(0, None), max_new_tokens=(1, None),
            whole_model_gb=(0, None), batch_tokens=(-1, None))
    _bounds(cfg.logging, "logging.", log_every=(1, None))
    _bounds(cfg.data, "data.", sample_size=(1, None))
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ConfigError(f"stage names must be unique, repeated: {sorted(dup)}")
    if cfg.optim.micro_batch_size < 1 or cfg.optim.grad_accum < 1:
        raise ConfigError("optim.micro_batch_size and optim.grad_accum must be >= 1")
    if cfg.parallel.sp_size < 1:
        raise ConfigError("parallel.sp_size must be >= 1")
    _bounds(cfg.parallel, "parallel.", timeout_minutes=(1, None))
    if cfg.parallel.pad_multiple != "auto" and cfg.parallel.pad_multiple < 1:
        raise ConfigError(f"parallel.pad_multiple={cfg.parallel.pad_multiple} must be auto or >= 1 (1: no padding)")
    if cfg.model.loss_chunk_tokens < 0:
        raise ConfigError(f"model.loss_chunk_tokens={cfg.model.loss_chunk_tokens} must be >= 0 (0: no chunking)")
    if cfg.model.loss_kernel == "liger":
        import importlib.util

        if importlib.util.find_spec("liger_kernel") is None:
            raise ConfigError("model.loss_kernel=liger needs the liger-kernel package (GPU): pip install "
                              "liger-kernel, or model.loss_kernel=torch with model.loss_chunk_tokens")
    if cfg.model.mlp_tile_tokens < 0:
        raise ConfigError(f"model.mlp_tile_tokens={cfg.model.mlp_tile_tokens} must be >= 0 (0: no tiling)")
    if cfg.checkpoint.keep < 1:
        raise ConfigError(f"checkpoint.keep={cfg.checkpoint.keep} must be >= 1 (the last checkpoint is what resumes)")
    if cfg.parallel.sp_backend == "ring_flash_attn" and cfg.parallel.sp_size > 1 and cfg.model.dtype == "fp32":
        raise ConfigError("parallel.sp_backend=ring_flash_attn runs flash-attn kernels, which take bf16 (its fp32 "
                          "ring backward is wrong): set model.dtype=bf16, or parallel.sp_backend=torch for fp32")
    if cfg.data.stratify and cfg.data.packing:
        raise ConfigError("data.stratify=true needs data.packing=false: a packed row holds samples of both classes, "
                          "so a step's rows cannot be balanced by class")
    check_backend(cfg.parallel.sp_backend, cfg.parallel.sp_size)


def _bounds(obj: Any, prefix: str, **limits: tuple) -> None:
    """``key=(low, high[, low_inclusive])``: each set value within [low, high] (None: unbounded)."""
    for key, (low, high, *inclusive) in limits.items():
        value = getattr(obj, key)
        if value is None:
            continue
        closed = inclusive[0] if inclusive else True
        if (low is not None and (value < low if closed else value <= low)) or (high is not None and value > high):
            rng = f"{'>=' if closed else '>'} {low}" + (f" and <= {high}" if high is not None else "")
            raise ConfigError(f"{prefix}{key}={value} must be {rng}")
