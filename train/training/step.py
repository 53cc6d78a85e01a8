"""One optimizer step: the trainer runs it, and the "equals one process" tests run the trainer.

The loss of a step is the token mean over its whole global batch (every data-parallel rank, every
micro-step): this rank's micro-steps each back-propagate ``local sum * backward_scale``, where the
scale divides by the global target count ``N`` (see :mod:`longsft.train.model.loss`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from longsft.train.config.schema import ModelConfig
from longsft.train.data.batching import Row, StepSampler, collate
from longsft.train.model.build import keeps_attention
from longsft.train.model.loss import backward_scale, token_loss_sum
from longsft.train.parallel import comm
from longsft.train.parallel.distributed import Dist
from longsft.train.parallel.layout import shard_batch


def n_targets(row: Row) -> int:
    """Loss tokens of one row: a document's answer tokens (collate shifts labels per document, so a
    document's first token is never a target)."""
    return sum(len(e.input_ids) - max(e.prompt_len, 1) for e in row)


def make_batch(rows: list[Row], pad_id: int, d: Dist, packing: bool = False, pad_to: tuple[int, int] = (1, 0)
               ) -> tuple[dict[str, torch.Tensor], int]:
    """Collate ``rows`` and keep this rank's part of the sequence; returns (batch, real tokens).

    ``doc_ids`` stays in the batch only for packed rows (for ``d.attention.active``). ``pad_to``:
    (multiple, most tokens): the length rounded up to a multiple, not past the stage's ``seq_len``
    (:func:`~longsft.train.parallel.layout.pad_multiple`; 0: no bound).
    """
    batch = collate(rows, pad_id, pad_to[0], pad_to[1] or None)
    tokens = int(batch["attention_mask"].sum())
    if not packing:
        batch.pop("doc_ids")
    batch = shard_batch(batch, d.sp, pad_id, packing)
    return {k: v.to(d.device) for k, v in batch.items()}, tokens


@dataclass
class StepStats:
    loss: float  # token mean over the global batch
    tokens: int  # real (unpadded) tokens of the global batch
    targets: list[int]  # this rank's loss tokens per micro-step


def train_step(engine, rows: list[Row], sampler: StepSampler, step: int, d: Dist, pad_id: int,
               model_cfg: ModelConfig, packing: bool,
               before_update: Callable[[object, list[int]], None] | None = None,
               pad_to: tuple[int, int] = (1, 0)) -> StepStats:
    """Forward and backward of every micro-step of global ``step``, then DeepSpeed's update.

    ``before_update(engine, targets)`` runs after the last backward, while the step's reduced
    gradients are still there (the tests read them). ``pad_to``: as :func:`make_batch` takes it.
    """
    micro = sampler.step(step)
    n_global = sum(n_targets(rows[i]) for i in sampler.global_indices(step))
    if n_global == 0:  # encoding keeps every sample's answer: a step without one is a bug, not a zero loss
        raise RuntimeError(f"step {step + 1}: no answer token in its {sampler.global_batch} samples")
    assert len(micro) == engine.gradient_accumulation_steps(), (len(micro), engine.gradient_accumulation_steps())
    scale = backward_scale(n_global, engine.dp_world_size, len(micro))
    loss_sum, tokens, targets = None, 0, []
    for k, idx in enumerate(micro):
        batch, n_tokens = make_batch([rows[i] for i in idx], pad_id, d, packing, pad_to)
        keep = keeps_attention(model_cfg, d.sp.size, packing)
        with d.attention.active(doc_ids=batch.pop("doc_ids", None), keep_attention=keep):
            loss, n = token_loss_sum(engine, batch, model_cfg.loss_chunk_tokens, model_cfg.offload_activations,
                                     model_cfg.loss_kernel)
            engine.backward(loss * scale)
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()  # read once, after the last
        tokens += n_tokens
        targets.append(n)
        if k == len(micro) - 1 and before_update is not None:
            before_update(engine, targets)
        engine.step()
    # sp ranks hold disjoint tokens of the same samples: their losses add up, their token counts must not
    loss_total, tokens_total = comm.all_reduce([float(loss_sum), tokens if d.sp_rank == 0 else 0])
    return StepStats(loss_total / n_global, int(tokens_total), targets)
