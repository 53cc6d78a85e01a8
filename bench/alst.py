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


def build(cfg, seq: int, sp: int, options: Options):
    """(engine, mpu or None): ALST's engine for longsft's ``cfg`` (its model shape, dtype, seed and
    DeepSpeed config: ``build_ds_config`` of the first stage)."""
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
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.25's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    if options.tiled_mlp:
        tile_mlps(model)
    mpu = None
    if sp > 1:
        mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1, seq_length=seq,
                                                              seq_length_is_variable=True)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds, mpu=mpu)
    engine.hf_ds_config = hf_ds
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


def loss_sum(engine, batch: dict, options: Options):
    """(sum of this rank's target cross-entropies (fp32), its target count): two 0-d tensors."""
    import torch.nn.functional as F
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    targets = batch["shift_labels"]  # [1, seq]
    keep = targets != IGNORE
    model = engine.module
    if not options.tiled_loss:
        out = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"], logits_to_keep=keep,
                     use_cache=False)
        logits = out.logits.reshape(-1, out.logits.shape[-1]).float()
        return F.cross_entropy(logits, targets[keep], reduction="sum"), keep.sum()
    # the decoder and the head called apart, as ArcticTraining's SFT loss does (ZeRO-3's hooks are on
    # every module: each gathers its own weights)
    hidden = model.get_decoder()(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                 use_cache=False).last_hidden_state  # [1, seq, hidden]
    head = model.get_output_embeddings()

    def fn(module, x, y):  # x [tokens, hidden], y [tokens]
        return F.cross_entropy(module(x).float(), y, ignore_index=IGNORE, reduction="sum")

    shards = loss_shards(hidden.shape[1], model.config.vocab_size)
    loss = TiledFusedLogitsLoss.apply(fn, head, hidden, targets, None, shards, [head.weight], "sum")
    return loss, keep.sum()


def checkpoint_offload(options: Options):
    """The context a step's forward and backward run in: DeepSpeed's checkpoint-input offload, or none."""
    if not options.offload_checkpoints:
        return nullcontext()
    from deepspeed.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload

    return CheckpointHiddenStatesOffload()


def step(engine, mpu, batch: dict, options: Options, optimizer_step: bool = True) -> tuple[float, float | None]:
    """One step as ALST's tutorial takes it: each rank's loss sum all-gathered over the SP group and
    divided by the group's target count (one rank: its own). Returns (loss, gradient norm);
    ``optimizer_step=False``: forward and backward only, the gradients then dropped (norm None)."""
    import torch.distributed.nn.functional as dnnf

    with checkpoint_offload(options):
        total, n = loss_sum(engine, batch, options)
        if mpu is not None:
            group = mpu.get_sequence_parallel_group()
            total = sum(dnnf.all_gather(total, group=group))
            n = sum(dnnf.all_gather(n.float(), group=group))
        loss = total / n
        engine.backward(loss)
    if not optimizer_step:
        engine.optimizer.zero_grad(set_to_none=True)
        return loss.item(), None
    engine.step()
    return loss.item(), float(engine.get_global_grad_norm() or 0.0)
