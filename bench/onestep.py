"""Shared by the memory and throughput benchmarks: one sequence through longsft's own ZeRO-3 step.

The engine, loss and data path are the trainer's (``build_ds_config``, ``build_engine``,
``make_batch``, ``token_loss_sum``); only the data is synthetic: one sequence of ``seq`` random
tokens whose last ``answer`` tokens are the targets.
"""

import dataclasses
import os
import socket

ANSWER = 64


def rendezvous_env(**extra: str) -> dict:
    """Environment for a one-rank process group on a free local port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                LOCAL_RANK="0", **extra)


def one_sequence(cfg, seq: int, d, answer: int = ANSWER) -> dict:
    """One sequence of ``seq`` random token ids, the last ``answer`` of them targets, as a batch."""
    import torch

    from longsft.train.data.encoding import Encoded, Meta
    from longsft.train.model.build import build_hf_config
    from longsft.train.training.step import make_batch

    vocab = build_hf_config(cfg.model).vocab_size
    ids = torch.randint(0, vocab, (seq,), generator=torch.Generator().manual_seed(0)).tolist()
    item = Encoded(Meta("b", "en", 4), ids, seq - answer)
    return make_batch([item], 0, d)[0]


def zero3_engine(cfg, total_steps: int, world_size: int = 1):
    """The trainer's DeepSpeed engine for ``cfg`` on ``world_size`` ranks, its model built as the trainer
    builds it (``parallel.sp_size``'s attention; the HF config object kept alive with the engine)."""
    from transformers.integrations import HfDeepSpeedConfig

    from longsft.train.config.deepspeed import build_ds_config
    from longsft.train.model.build import build_hf_config, build_model
    from longsft.train.training.engine import build_engine

    ds = build_ds_config(cfg, cfg.stages[0], world_size, build_hf_config(cfg.model).hidden_size)
    made = choices(cfg, world_size)
    m = dataclasses.replace(cfg.model, keep_attention=made.keep_attention)  # auto resolved, as the trainer does
    hf_ds = HfDeepSpeedConfig(ds)  # alive while the model is built: ZeRO-3 partitions as it loads
    model = build_model(m, seed=cfg.seed, sp_size=cfg.parallel.sp_size, packing=cfg.data.packing)
    engine = build_engine(cfg, model, ds, total_steps, made.hold_tied_weight)
    engine.hf_ds_config, engine.longsft_model_cfg, engine.longsft_choices = hf_ds, m, made
    return engine


def choices(cfg, world_size: int = 1, answer: int = ANSWER):
    """The trainer's per-stage choices (``choose``, made on rank 0) for ``cfg``'s first stage."""
    from longsft.train.parallel import comm
    from longsft.train.plan.choose import choose

    made = choose(cfg, cfg.stages[0], world_size, world_size, answer) if comm.rank() == 0 else None
    return comm.broadcast_object(made)


def step(engine, cfg, batch, attention, optimizer_step: bool = True) -> tuple[float, int]:
    """One optimizer step (grad_accum 1) exactly as the trainer takes it, its forward inside ``attention``'s
    ``active()`` (``d.attention``: the registered SP attention entry); returns this rank's (loss sum,
    targets). On several ranks the batch is one sequence split over them (an SP group, dp = 1).
    ``optimizer_step=False``: forward and backward only, the gradients then dropped."""
    from longsft.train.model.build import keeps_attention
    from longsft.train.model.loss import backward_scale, token_loss_sum
    from longsft.train.parallel import comm

    m = engine.longsft_model_cfg  # as zero3_engine resolved it
    with attention.active(keep_attention=keeps_attention(m, cfg.parallel.sp_size, cfg.data.packing)):
        loss, n = token_loss_sum(engine, batch, m.loss_chunk_tokens, m.offload_activations, m.loss_kernel)
        n_global = comm.all_reduce([n])[0] if comm.active() else n
        engine.backward(loss * backward_scale(n_global, engine.dp_world_size, 1))
    if optimizer_step:
        engine.step()
    else:
        engine.optimizer.zero_grad(set_to_none=True)
    return float(loss), n


def planned(cfg, answer: int = ANSWER, cuda: bool = True):
    """(model shape, ``longsft plan``'s estimate of ``cfg``'s first stage on one GPU; compare its
    ``allocated`` (the total without margins) with ``max_memory_allocated``; ``cuda=False``: the CPU terms)."""
    from longsft.train.plan.cost import estimate
    from longsft.train.plan.hardware import Hardware
    from longsft.train.plan.trace import model_shape

    shape = model_shape(cfg)
    return shape, estimate(cfg, cfg.stages[0], shape, Hardware(gpus_per_node=1, cuda=cuda), targets=answer)


def free_memory() -> None:
    """What a row left behind: Python's garbage collected and, on a GPU, the allocator's cache emptied."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
