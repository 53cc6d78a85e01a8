"""DeepSpeed's Arctic Long Sequence Training (ALST) path, wired as its tutorial and ArcticTraining wire
it, for the side-by-side benchmarks (``vs_alst.py`` on CPU ranks, ``gpu_vs_alst.py`` on one GPU).

transformers' own model (``from_config`` under ``HfDeepSpeedConfig``: from the same seed, the same
weights as longsft's ``build_model``; none of longsft's layer or loss changes), non-reentrant gradient
checkpointing as the HF Trainer enables it, ``sdpa`` attention. With sp > 1, ``UlyssesSPAttentionHF``
over it (its ``mpu`` passed to ``deepspeed.initialize``) and the batch sharded by
``UlyssesSPDataLoaderAdapter``; on one rank, attention as it is (ArcticTraining's sp=1 recipes).
:class:`Options` adds ALST's memory features one by one:

- ``tiled_mlp``: DeepSpeed's ``TiledMLP`` on each decoder MLP (shards as its docstring sizes them);
- ``tiled_loss``: the head and cross-entropy through ``TiledFusedLogitsLoss`` over every position,
  prompt labels masked (-100), in shards of about 1 GiB of fp32 logits, as ArcticTraining sizes them;
  without it the head runs on the target positions only (``logits_to_keep``), as longsft's does;
- ``offload_checkpoints``: each checkpointed layer's input copied to pinned host memory on a side
  stream during the forward (``CheckpointHiddenStatesOffload``; DeepSpeed skips it on CPU).

Two departures from ArcticTraining's code, each to give ALST its intended behaviour under ZeRO-3 (see
:func:`bind_tiled_loss` and :class:`CheckpointMarks`): the tiled loss runs as the model's forward
through the engine, and the checkpointed inputs are marked after ZeRO-3's hooks.
"""

from __future__ import annotations

import math
import os
from contextlib import nullcontext
from dataclasses import dataclass

IGNORE = -100


@dataclass(frozen=True)
class Options:
    tiled_mlp: bool = False
    tiled_loss: bool = False
    offload_checkpoints: bool = False
    loss_shards: int = 0  # the tiled loss's shards at every length (0: ArcticTraining's rule at build's seq)


def build(cfg, seq: int, sp: int, options: Options):
    """(engine, mpu or None): ALST's engine for longsft's ``cfg`` (its model shape, dtype, seed and
    DeepSpeed config: ``build_ds_config`` of the first stage); ``options.loss_shards`` fixed for every
    length (0: ArcticTraining's rule at ``seq``)."""
    import deepspeed
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from longsft.train.config.deepspeed import build_ds_config
    from longsft.train.model.build import build_hf_config, torch_dtype

    hf = build_hf_config(cfg.model)
    # with an mpu, or sequence_parallel_size in the config (zero.Init), DeepSpeed counts the batch over
    # data-parallel ranks only (world / sp)
    ds = build_ds_config(cfg, cfg.stages[0], int(os.environ.get("WORLD_SIZE", "1")) // sp, hf.hidden_size)
    if sp > 1:
        ds["sequence_parallel_size"] = sp
    hf_ds = HfDeepSpeedConfig(ds)  # alive while the model is built: ZeRO-3 partitions as it loads
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(hf, dtype=torch_dtype(cfg.model), attn_implementation="sdpa")
    model.train()
    kw = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # newer transformers' name for it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    if options.tiled_mlp:
        tile_mlps(model)
    mpu = None
    if sp > 1:
        mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1, seq_length=seq,
                                                              seq_length_is_variable=True)
    if options.tiled_loss:
        bind_tiled_loss(model, options.loss_shards or loss_shards(seq, hf.vocab_size))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds, mpu=mpu)
    engine.hf_ds_config = hf_ds
    if options.offload_checkpoints:
        engine.alst_marks = CheckpointMarks()
        mark_checkpoint_inputs(model, engine.alst_marks)
    return engine, mpu


def tile_mlps(model) -> None:
    """DeepSpeed's ``TiledMLP`` on each decoder MLP: ceil(tokens / hidden) shards, its docstring's rule."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    for layer in model.get_decoder().layers:
        mlp = layer.mlp

        def forward(x, mlp=mlp, whole=type(mlp).forward):  # x [batch, seq, hidden]
            shards = max(1, -(-x.shape[1] // x.shape[2]))
            return TiledMLP.apply(whole, mlp, x, shards, list(mlp.parameters()))

        mlp.forward = forward


def shard(full: dict, mpu) -> dict:
    """This rank's part of one unshifted-label batch (``full``: input_ids, position_ids, shift_labels
    [1, seq]), as ``UlyssesSPDataLoaderAdapter`` makes it (contiguous shards, pre-shifted labels); on one
    rank (no ``mpu``), the batch itself."""
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    if mpu is None:
        return {k: full[k] for k in ("input_ids", "position_ids", "shift_labels")}
    labels = torch.cat([full["shift_labels"].new_full((1, 1), IGNORE), full["shift_labels"][:, :-1]], dim=1)
    sample = {"input_ids": full["input_ids"], "position_ids": full["position_ids"], "labels": labels}
    loader = torch.utils.data.DataLoader([sample], batch_size=None)
    adapter = UlyssesSPDataLoaderAdapter(loader, sp_rank=mpu.get_sequence_parallel_rank(),
                                         sp_group=mpu.get_sequence_parallel_group(),
                                         sp_world_size=mpu.get_sequence_parallel_world_size(), device="cpu")
    return next(adapter)  # every rank hands in the same sample: the first of its sp shards is this rank's


def loss_shards(seq: int, vocab: int) -> int:
    """ArcticTraining's tiled-loss shard count: about 1 GiB of fp32 logits per shard."""
    return max(1, math.ceil(seq * vocab * 4 / 2**30))


class CheckpointMarks:
    """The checkpoint-offload context of the step in progress (None between steps).

    DeepSpeed's own marker notes each decoder layer's input before the layer's hooks run; ZeRO-3's
    forward pre-hook then hands the layer a new tensor (its backward hook's output), so the tensor the
    checkpoint saves is never the marked one and nothing is offloaded. :func:`mark_checkpoint_inputs`
    marks the input after ZeRO-3's hooks instead: the one the checkpoint saves."""

    def __init__(self):
        self.context = None


def mark_checkpoint_inputs(model, marks: CheckpointMarks) -> None:
    """A forward pre-hook on each decoder layer, registered after ``deepspeed.initialize`` (so it runs
    after ZeRO-3's): the layer's input as the checkpoint will save it, marked for offload."""
    import torch

    def hook(module, args):
        if marks.context is not None and args and torch.is_tensor(args[0]) and module.training \
                and torch.is_grad_enabled():
            marks.context.mark(args[0])

    for layer in model.get_decoder().layers:
        layer.register_forward_pre_hook(hook)


def bind_tiled_loss(model, shards: int) -> None:
    """ArcticTraining's SFT loss as the model's forward (``(input_ids, position_ids, shift_labels, scale) ->
    sum of target cross-entropies x scale``): the decoder's last hidden state [1, seq, hidden], then the
    head and cross-entropy through ``TiledFusedLogitsLoss`` in ``shards`` pieces over every position.

    Called through the engine, so that ZeRO-3's root-module hooks run: the one that starts each step's
    parameter trace is on the root (calling the decoder directly, as ArcticTraining does, leaves the
    trace unrecorded: no prefetch, every weight fetched again on each use, the 1.2 GB head once per
    shard). ``scale`` (1 / the step's target count) is applied inside: the tiled loss computes the head's
    weight gradient in its forward with an incoming gradient of 1 and rescales only its input's gradient
    in the backward, so a division after it would leave that weight gradient unscaled. A fixed shard
    count keeps the module order, and so ZeRO-3's recorded trace, the same from one length to the next."""
    import torch.nn.functional as F
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    decoder, head = model.get_decoder(), model.get_output_embeddings()

    def forward(input_ids, position_ids, shift_labels, scale: float):
        hidden = decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state

        def fn(module, x, y):  # x [tokens, hidden], y [tokens]
            return F.cross_entropy(module(x).float(), y, ignore_index=IGNORE, reduction="sum") * scale

        return TiledFusedLogitsLoss.apply(fn, head, hidden, shift_labels, None, shards, [head.weight], "sum")

    model.forward = forward


def loss_sum(engine, batch: dict, options: Options, scale: float):
    """This rank's sum of target cross-entropies (fp32, 0-d) times ``scale``."""
    import torch.nn.functional as F

    targets = batch["shift_labels"]  # [1, seq]
    if options.tiled_loss:
        return engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"], shift_labels=targets,
                      scale=scale)
    keep = targets != IGNORE
    out = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"], logits_to_keep=keep,
                 use_cache=False)
    logits = out.logits.reshape(-1, out.logits.shape[-1]).float()
    return F.cross_entropy(logits, targets[keep], reduction="sum") * scale


def checkpoint_offload(options: Options):
    """The context a step's forward and backward run in: DeepSpeed's checkpoint-input offload, or none."""
    if not options.offload_checkpoints:
        return nullcontext()
    from deepspeed.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload

    return CheckpointHiddenStatesOffload()


def step(engine, mpu, batch: dict, options: Options, optimizer_step: bool = True) -> tuple[float, float | None]:
    """One step as ALST's tutorial takes it: the SP group's target count first, each rank's loss sum
    divided by it, all-gathered and added (one rank: its own). Returns (loss, gradient norm);
    ``optimizer_step=False``: forward and backward only, the gradients then dropped (norm None). With
    ``offload_checkpoints`` the offload context's counts are left in ``engine.alst_offload_stats``."""
    import torch.distributed.nn.functional as dnnf

    n = (batch["shift_labels"] != IGNORE).sum()
    if mpu is not None:  # (the tutorial's all-gather of the counts, as ALST's users write it)
        group = mpu.get_sequence_parallel_group()
        n = sum(dnnf.all_gather(n.float(), group=group))
    context = checkpoint_offload(options)
    marks = getattr(engine, "alst_marks", None)
    with context:
        if marks is not None:
            marks.context = context
        try:
            loss = loss_sum(engine, batch, options, 1.0 / n.item())
            if mpu is not None:
                loss = sum(dnnf.all_gather(loss, group=group))
            engine.backward(loss)
        finally:
            if marks is not None:
                marks.context = None
    if options.offload_checkpoints:
        engine.alst_offload_stats = vars(context.stats).copy()
    if not optimizer_step:
        engine.optimizer.zero_grad(set_to_none=True)
        return loss.item(), None
    engine.step()
    return loss.item(), float(engine.get_global_grad_norm() or 0.0)
