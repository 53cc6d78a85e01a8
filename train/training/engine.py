"""DeepSpeed: config files with every ``auto`` filled from the recipe, engine, LR schedule."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import torch

from longsft.train.common.errors import ConfigError
from longsft.train.config import RunConfig, StageConfig
from longsft.train.model.loss import hold_whole_weight, register_fused_loss
from longsft.train.training.checkpoint import safe_loading

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
        have = _get(ds, key)
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
        zero.setdefault(key, {"device": "cpu", "pin_memory": torch.cuda.is_available()})
    else:
        zero.pop(key, None)


def _get(d: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


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


def lr_lambda(kind: str, total_steps: int, warmup: int = 0, min_ratio: float = 0.0):
    """LR multiplier per optimizer step: linear warmup, then cosine/linear/constant."""

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if kind == "cosine" else 1 - progress
        return min_ratio + (1 - min_ratio) * decay

    return f


def build_engine(cfg: RunConfig, model, ds_config: dict, total_steps: int, hold_tied_weight: bool = False):
    """``deepspeed.initialize`` with our LR schedule (stepped by DeepSpeed each optimizer step); its
    checkpoints load with ``weights_only=True`` (an unsupported DeepSpeed fails here, before training).
    ``hold_tied_weight``: the planner's choice for a deferred tied head (:func:`hold_whole_weight`)."""
    import deepspeed

    o = cfg.optim
    sched = lambda opt: torch.optim.lr_scheduler.LambdaLR(  # noqa: E731
        opt, lr_lambda(o.scheduler, total_steps, o.warmup_steps, o.min_lr_ratio))
    _say_if_building_cpu_adam(ds_config)
    if cfg.deepspeed.layer_hooks and (ds_config.get("zero_optimization") or {}).get("stage") == 3:
        whole_layers(model)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=copy.deepcopy(ds_config), lr_scheduler=sched)
    register_fused_loss(engine.module)  # model.loss_kernel=liger: the head weight, now surely partitioned
    hold_whole_weight(engine.module, hold_tied_weight)
    safe_loading(engine)
    return engine


def whole_layers(model) -> int:
    """Make each decoder layer a ZeRO-3 leaf module (before ``deepspeed.initialize``): its weights are
    gathered by one hook as the layer starts (forward, and backward with its recompute) and released as
    it ends, instead of by a hook on each of its linears and norms. Returns the number of layers."""
    from deepspeed.utils import set_z3_leaf_modules

    layers = model.get_decoder().layers
    set_z3_leaf_modules(model, list({type(layer) for layer in layers}))
    return len(layers)


def _say_if_building_cpu_adam(ds_config: dict) -> None:
    """DeepSpeed JIT-builds its CPU Adam the first time (minutes, silently): say so on rank 0."""
    import os
    from pathlib import Path

    offload = (ds_config.get("zero_optimization") or {}).get("offload_optimizer")
    params = (ds_config.get("optimizer") or {}).get("params") or {}
    if not offload or params.get("torch_adam") or os.environ.get("RANK", "0") != "0":
        return
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    if not any(root.glob("**/cpu_adam*.so")):
        print(f"longsft: building DeepSpeed's CPU Adam extension once (1-6 minutes; cached in {root})", flush=True)
