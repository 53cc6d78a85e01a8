"""The planner's answers: every stage of a recipe on some hardware (``longsft plan``), the memory choices
the trainer takes per stage on this job (:func:`choose`), and advice for a stage that does not fit.

    longsft plan recipe=qwen3_32b [key=value ...] [--gpus-per-node 8] [--nodes 1] [--gpu-gib 80]"""

from __future__ import annotations

from dataclasses import dataclass

from longsft.train.common.errors import ConfigError
from longsft.train.config.loader import with_changes
from longsft.train.config.schema import RunConfig, StageConfig
from longsft.train.model.build import keeps_attention
from longsft.train.plan.cost import Estimate, estimate
from longsft.train.plan.hardware import GIB, Hardware, this_job
from longsft.train.plan.shape import Shape
from longsft.train.plan.trace import model_shape


@dataclass
class Choices:
    """What a run does at one stage, as the planner decides it on the job's hardware (:func:`choose`)."""

    keep_attention: bool  # the layers' recompute reuses their attention (``model.keep_attention``)
    hold_tied_weight: bool  # a tied head's weight stays whole through the decoder layers' backward
    note: str  # one line for the log


def choose(cfg: RunConfig, stage: StageConfig, world: int, local_world: int, targets: int) -> Choices:
    """``stage``'s choices on this job's hardware (:func:`this_job`), ``targets`` loss rows per rank and
    micro-step: ``model.keep_attention=auto`` keeps where the stage fits with it, a deferred tied head's
    weight is held where that costs no peak memory. Without a plan (not ZeRO-3, say), ``auto`` keeps
    nothing and the weight is released. Call it on one rank and hand the result to the others."""
    auto = " (auto)" if cfg.model.keep_attention == "auto" else ""
    hw = this_job(world, local_world)
    try:
        shape = model_shape(cfg)
        est = estimate(cfg, stage, shape, hw, targets)
    except Exception as e:  # (ConfigError: a model it cannot trace, say) never a crash on rank 0 alone
        why = str(e) if isinstance(e, ConfigError) else f"the planner failed: {type(e).__name__}: {e}"
        keep = keeps_attention(cfg.model, cfg.parallel.sp_size, cfg.data.packing)  # (auto: False)
        return Choices(keep, False, f"no memory plan ({(why.splitlines() or [''])[0]}); keep_attention "
                                    f"{'on' if keep else 'off'}{auto}")
    where = f"{hw.gpu_gib:.1f} GiB per {'GPU' if hw.cuda else 'rank (host memory available)'}"
    held = f", tied head weight {'held' if est.hold_tied_weight else 'released'} in the backward" if shape.tied else ""
    return Choices(est.keep_attention, est.hold_tied_weight,
                   f"planned peak {est.total / GIB:.2f} GiB of {where}; keep_attention "
                   f"{'on' if est.keep_attention else 'off'}{auto}{held}")


def plan(cfg: RunConfig, hw: Hardware, targets: int | None = None) -> tuple[Shape, list[Estimate]]:
    shape = model_shape(cfg)
    return shape, [estimate(cfg, s, shape, hw, targets) for s in cfg.stages]


def advice(cfg: RunConfig, stage: StageConfig, shape: Shape, hw: Hardware, targets: int | None = None) -> list[str]:
    """Changes (``key=value``) that make a stage fit that does not; each one checked by re-estimating."""
    tries: list[dict] = []
    for sp in (2, 4, 8, 16, 32, 64):
        if sp > cfg.parallel.sp_size and hw.world % sp == 0 and \
                (cfg.parallel.sp_backend != "ulysses" or shape.heads % sp == 0):
            tries.append({"parallel.sp_size": sp})
    if not cfg.model.gradient_checkpointing:
        tries.append({"model.gradient_checkpointing": True})
    if cfg.model.keep_attention is True:
        tries.append({"model.keep_attention": False})
    tries += [{"deepspeed.offload_optimizer": True}, {"deepspeed.offload_param": True},
              {"model.offload_activations": True}]
    if not cfg.model.loss_chunk_tokens or cfg.model.loss_chunk_tokens > 1024:
        tries.append({"model.loss_chunk_tokens": 1024})
    if not cfg.model.mlp_tile_tokens:
        tries.append({"model.mlp_tile_tokens": 4096})
    tries.append({"deepspeed.offload_optimizer": True, "deepspeed.offload_param": True,
                  "model.offload_activations": True})
    now = estimate(cfg, stage, shape, hw, targets).total
    out = []
    for change in tries:
        trial = with_changes(cfg, change)
        est = estimate(trial, stage, shape, hw, targets)
        if est.fits and est.total < now:
            words = " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in change.items())
            out.append(f"{words} (-> {est.total / GIB:.1f} GiB)")
    return out
