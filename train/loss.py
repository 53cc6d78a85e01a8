"""Token-level cross-entropy on answer tokens only, normalised over the global batch.

The LM head runs only on positions that have a target (``logits_to_keep`` as a boolean mask),
so a 100K-token prompt never materialises ``[tokens, vocab]`` logits for the prompt part. With
``model.loss_chunk_tokens`` > 0 the target positions themselves go through the LM head and the
cross-entropy ``chunk`` tokens at a time, each chunk checkpointed (its logits are freed after the
forward and recomputed in the backward): peak loss memory is one chunk's ``[chunk, vocab]``
logits and their gradient, whatever the number of targets. The LM head is called as a module, so
ZeRO-3 gathers its (partitioned) weight for every call, forward and recompute alike; every rank
makes the same number of calls.
``model.loss_kernel=liger`` hands the target positions' hidden states and the head weight to
Liger's fused linear cross-entropy (GPU), which computes the weight and input gradients chunk by
chunk inside its forward. Under ZeRO-3 the partitioned head weight is gathered around that call
(the gradient is already computed when it is re-partitioned).
``model.offload_activations`` keeps the tensors saved for backward (with gradient checkpointing:
each layer's input) in CPU memory during the forward.

Normalisation: the loss of one optimizer step is ``sum(token losses) / N`` where ``N`` counts
target tokens over all ranks and all gradient-accumulation micro-steps. DeepSpeed divides the
backward loss by ``grad_accum`` and averages gradients over its ``dp_world_size`` ranks, so
each micro-step back-propagates ``local_sum * dp_world_size * grad_accum / N``; the resulting
gradient is exactly that of the global mean.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .data import IGNORE


def token_loss_sum(model, batch: dict[str, torch.Tensor], chunk_tokens: int = 0,
                   offload_activations: bool = False, kernel: str = "torch") -> tuple[torch.Tensor, int]:
    """Sum of token cross-entropies (fp32) and the number of target tokens in ``batch``.

    batch: input_ids, position_ids, shift_labels (+ attention_mask unless sequence-sharded) — [batch, seq].
    ``model``: an HF causal LM or a DeepSpeed engine wrapping one.
    """
    targets = batch["shift_labels"]
    keep = targets != IGNORE  # [batch, seq]
    kw = dict(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
              position_ids=batch["position_ids"], use_cache=False)
    saved = torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()) if offload_activations \
        else nullcontext()
    with saved:
        if chunk_tokens <= 0 and kernel == "torch":
            out = model(**kw, logits_to_keep=keep)
            logits = out.logits.reshape(-1, out.logits.shape[-1]).float()  # [n_targets, vocab]
            loss = F.cross_entropy(logits, targets[keep], reduction="sum")
        else:
            out = model(**kw, logits_to_keep=torch.zeros_like(keep), output_hidden_states=True)
            hidden = out.hidden_states[-1][keep]  # [n_targets, hidden]: the final (normed) hidden states
            head = getattr(model, "module", model).get_output_embeddings()
            if kernel == "liger":
                loss = liger_cross_entropy(head, hidden, targets[keep])
            else:
                loss = chunked_cross_entropy(head, hidden, targets[keep], chunk_tokens)
    return loss, int(keep.sum())


def chunked_cross_entropy(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                          chunk: int) -> torch.Tensor:
    """sum CE(head(hidden), targets) computed ``chunk`` rows at a time; hidden [n, H], targets [n]."""

    def part(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(head(h).float(), t, reduction="sum")

    n = hidden.shape[0]
    # Every rank calls the head equally often (empty chunks where it has fewer targets): under ZeRO-3
    # each call all-gathers the partitioned weight, a collective that must match across the world.
    most = torch.tensor([n], device=hidden.device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
    total = hidden.new_zeros((), dtype=torch.float32)
    for k in range(max(1, -(-int(most.item()) // chunk))):
        i = k * chunk
        total = total + checkpoint(part, hidden[i:i + chunk], targets[i:i + chunk], use_reentrant=False)
    return total


def liger_cross_entropy(head: torch.nn.Linear, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """sum CE(head(hidden), targets) by Liger's fused kernel; hidden [n, H], targets [n] (GPU only)."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    gathered = nullcontext()
    if hasattr(head.weight, "ds_id"):  # ZeRO-3: every rank gathers (a collective), whatever its n
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters([head.weight], modifier_rank=None)
    with gathered:
        return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, reduction="sum")(
            head.weight, hidden, targets).float()


def backward_scale(n_global_tokens: int, dp_world_size: int, grad_accum: int) -> float:
    """Multiplier turning a local token-loss sum into DeepSpeed's expected micro-step loss."""
    return dp_world_size * grad_accum / max(1, n_global_tokens)
