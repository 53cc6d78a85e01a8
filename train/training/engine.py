"""The DeepSpeed engine (its JSON: :mod:`longsft.train.config.deepspeed`) and the LR schedule."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch

from longsft.train.config.schema import RunConfig
from longsft.train.model.loss import hold_whole_weight, register_fused_loss
from longsft.train.training.checkpoint import safe_loading


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

    offload = (ds_config.get("zero_optimization") or {}).get("offload_optimizer")
    params = (ds_config.get("optimizer") or {}).get("params") or {}
    if not offload or params.get("torch_adam") or os.environ.get("RANK", "0") != "0":
        return
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    if not any(root.glob("**/cpu_adam*.so")):
        print(f"longsft: building DeepSpeed's CPU Adam extension once (1-6 minutes; cached in {root})", flush=True)
