"""DeepSpeed's JSON: the file ``deepspeed.config`` names, every ``"auto"`` filled from the recipe and every
value the recipe owns checked against it (the planner and the trainer build it the same way)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from longsft.train.common.errors import ConfigError
from longsft.train.config.loader import get_path
from longsft.train.config.schema import RunConfig, StageConfig

DS_DIR = Path(__file__).resolve().parents[2] / "ds_configs"
# DeepSpeed keys that change its process groups and so its batch size and gradient averaging
# (deepspeed/__init__.py builds a mesh from them; runtime/config.py divides the batch by them)
OWNED_BY_LONGSFT = ("sequence_parallel_size", "data_parallel_size")


def ds_config_path(name: str) -> Path:
    p = Path(name)
    if p.suffix == ".json":
        if not p.exists():
            raise ConfigError(f"deepspeed.config: file not found: {p}")
        return p
    p = DS_DIR / f"{name}.json"
    if not p.exists():
        known = sorted(q.stem for q in DS_DIR.glob("*.json"))
        raise ConfigError(f"deepspeed.config: unknown DeepSpeed config {name!r}; known: {', '.join(known)}")
    return p


def build_ds_config(cfg: RunConfig, stage: StageConfig, world_size: int, hidden_size: int) -> dict:
    """Load the JSON named by ``deepspeed.config`` and fill/check it against the recipe."""
    path = ds_config_path(cfg.deepspeed.config)
    try:
        ds = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    for key in OWNED_BY_LONGSFT:
        if key in ds:
            raise ConfigError(f"{path}: {key!r} is longsft's to set (parallel.sp_size; the data-parallel size is the "
                              "world size / sp_size): DeepSpeed would then size its batch and average gradients over "
                              "other ranks than longsft's loss normalisation does. Remove it from the JSON")
    o = cfg.optim
    zero = ds.setdefault("zero_optimization", {"stage": 0})
    stage_n = zero.get("stage", 0)
    _toggle_offload(zero, "offload_optimizer", cfg.deepspeed.offload_optimizer)
    _toggle_offload(zero, "offload_param", cfg.deepspeed.offload_param)
    if "offload_param" in zero and stage_n != 3:
        raise ConfigError(f"{path}: offload_param needs ZeRO stage 3 (stage is {stage_n})")
    values = {
        "train_micro_batch_size_per_gpu": o.micro_batch_size,
        "gradient_accumulation_steps": o.grad_accum,
        "train_batch_size": o.micro_batch_size * o.grad_accum * world_size,
        "gradient_clipping": o.max_grad_norm,
        "bf16.enabled": cfg.model.dtype == "bf16",
        "fp16.enabled": False,
        "optimizer.params.lr": stage.lr if stage.lr is not None else o.lr,
        "optimizer.params.betas": list(o.betas),
        "optimizer.params.eps": o.eps,
        "optimizer.params.weight_decay": o.weight_decay,
        "zero_optimization.reduce_bucket_size": hidden_size * hidden_size,
        "zero_optimization.allgather_bucket_size": max(hidden_size * hidden_size, 5 * 10**7),
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "zero_optimization.stage3_param_persistence_threshold": 10 * hidden_size,
    }
    _fill(ds, values, path)
    checked = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "bf16.enabled")
    for key in checked:
        have = get_path(ds, key)
        if have is not None and have != values[key]:
            raise ConfigError(f"{path}: {key}={have!r} disagrees with the recipe ({values[key]!r}); "
                              "set it to \"auto\" or change the recipe")
    if cfg.deepspeed.torch_adam:
        ds.setdefault("optimizer", {"type": "AdamW", "params": {}}).setdefault("params", {})["torch_adam"] = True
    return ds


def _toggle_offload(zero: dict, key: str, want: bool | None) -> None:
    if want is None:
        return
    if want:
        import torch  # here only: building the JSON (the planner, tests) needs no torch otherwise

        zero.setdefault(key, {"device": "cpu", "pin_memory": torch.cuda.is_available()})
    else:
        zero.pop(key, None)


def _fill(node: Any, values: dict, path: Path, prefix: str = "") -> None:
    """Replace every ``"auto"`` with its value; an ``auto`` we cannot fill is an error."""
    if not isinstance(node, dict):
        return
    for k, v in node.items():
        key = f"{prefix}{k}"
        if v == "auto":
            if key not in values:
                raise ConfigError(f"{path}: cannot fill \"auto\" for {key!r}; give a value")
            node[k] = values[key]
        elif isinstance(v, dict):
            _fill(v, values, path, key + ".")
