"""Token-level cross-entropy on answer tokens only, normalised over the global batch.

The LM head runs only on positions that have a target (``logits_to_keep`` as a boolean mask),
so a 100K-token prompt never materialises ``[tokens, vocab]`` logits for the prompt part.

Normalisation: the loss of one optimizer step is ``sum(token losses) / N`` where ``N`` counts
target tokens over all ranks and all gradient-accumulation micro-steps. DeepSpeed divides the
backward loss by ``grad_accum`` and averages gradients over its ``dp_world_size`` ranks, so
each micro-step back-propagates ``local_sum * dp_world_size * grad_accum / N``; the resulting
gradient is exactly that of the global mean.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .data import IGNORE


def token_loss_sum(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Sum of token cross-entropies (fp32) and the number of target tokens in ``batch``.

    batch: input_ids, position_ids, shift_labels (+ attention_mask unless sequence-sharded) — [batch, seq].
    """
    targets = batch["shift_labels"]
    keep = targets != IGNORE  # [batch, seq]
    out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                position_ids=batch["position_ids"], logits_to_keep=keep, use_cache=False)
    logits = out.logits.reshape(-1, out.logits.shape[-1]).float()  # [n_targets, vocab]
    loss = F.cross_entropy(logits, targets[keep], reduction="sum")
    return loss, int(keep.sum())


def backward_scale(n_global_tokens: int, dp_world_size: int, grad_accum: int) -> float:
    """Multiplier turning a local token-loss sum into DeepSpeed's expected micro-step loss."""
    return dp_world_size * grad_accum / max(1, n_global_tokens)
