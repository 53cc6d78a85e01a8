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
chunk inside its forward (the weight's accumulated in fp32) and hands them over in its backward.
It runs as a module of the model (:class:`FusedHeadLoss`, attached by ``build_model``) with the
head weight registered as its external parameter: ZeRO-3 gathers the weight for that module's
forward *and* again for its backward, where the weight's full gradient is accumulated (gathering it
around the forward call alone leaves a 0-element partition there: "size of tensor a (0) must match").
Every rank calls it once per micro-step, one ignored row where it has no target (Liger's chunking
divides by zero for none), because the gathers are collectives.
A head tied to the input embedding (``build_model`` attaches it when the model allows:
:func:`~longsft.train.model.tied_head.deferrable`) runs as the same kind of module with the
``tied`` kind: :class:`~longsft.train.model.tied_head.HeadCrossEntropy` in chunks of
``loss_chunk_tokens`` (all targets at once for 0), whose weight gradient the embedding's backward
adds, so no dense head gradient is alive while the decoder layers run their backward.
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

from longsft.train.data.encoding import IGNORE
from longsft.train.model.layers import EXTENT
from longsft.train.model.tied_head import Deferred, HeadCrossEntropy, defer_into_embedding
from longsft.train.parallel import comm


def _selects_hidden_states() -> bool:
    try:
        from transformers.utils.output_capturing import selected_hidden_states  # noqa: F401
    except ImportError:
        return False
    return True


# Only the last hidden state: ``output_hidden_states=True`` keeps every layer's output ([batch, seq,
# hidden] each) alive until the loss is done, which on GPUs defeats ``model.offload_activations``.
# Selecting by index needs transformers >= 5.24; older versions get all of them (correct, more memory).
LAST_HIDDEN_STATE: list[int] | bool = [-1] if _selects_hidden_states() else True


def token_loss_sum(model, batch: dict[str, torch.Tensor], chunk_tokens: int = 0,
                   offload_activations: bool = False, kernel: str = "torch") -> tuple[torch.Tensor, int]:
    """Sum of token cross-entropies (fp32) and the number of target tokens in ``batch``.

    batch: input_ids, position_ids, shift_labels (+ attention_mask unless sequence-sharded) — [batch, seq].
    ``model``: an HF causal LM or a DeepSpeed engine wrapping one. A collective (one small all-reduce):
    every rank calls it equally often.
    """
    targets = batch["shift_labels"]
    keep = targets != IGNORE  # [batch, seq]
    where = keep.nonzero(as_tuple=True)  # the target positions (the step's one host sync for them)
    n = where[0].numel()
    base = getattr(model, "module", model)
    # One all-reduce per micro-step for what every rank's ZeRO-3 gathers depend on: the most tokens (MLP
    # tiles) and targets (loss chunks) of any rank, read by this forward and by the backward's recompute
    most_tokens, most_targets = (int(v) for v in comm.all_reduce([keep.shape[1], n], "max", dtype=torch.int64))
    extent = getattr(base, EXTENT, None)
    if extent is not None:
        extent.tokens, extent.targets = most_tokens, most_targets
    kw = dict(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
              position_ids=batch["position_ids"], use_cache=False)
    saved = torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()) if offload_activations \
        else nullcontext()
    fused = getattr(base, FUSED_LOSS, None)
    tied = fused if kernel == "torch" and getattr(fused, "kind", None) == "tied" else None  # attach_fused_loss
    with saved:
        if chunk_tokens <= 0 and kernel == "torch" and tied is None:
            out = model(**kw, logits_to_keep=keep)
            logits = out.logits.reshape(-1, out.logits.shape[-1]).float()  # [n_targets, vocab]
            loss = F.cross_entropy(logits, targets[keep], reduction="sum")
        else:
            out = model(**kw, logits_to_keep=torch.zeros_like(keep), output_hidden_states=LAST_HIDDEN_STATE)
            hidden = out.hidden_states[-1][where]  # [n_targets, hidden]: the final (normed) hidden states
            if kernel == "liger":
                loss = fused_head_loss(base)(hidden, targets[where])
            elif tied is not None:
                loss = tied(hidden, targets[where], chunk_tokens, most_targets)
            else:
                loss = chunked_cross_entropy(base.get_output_embeddings(), hidden, targets[where], chunk_tokens,
                                             logit_softcap(base), most_targets)
    return loss, n


def logit_softcap(model) -> float | None:
    """The cap the model's own forward puts on its logits (Gemma-2: ``final_logit_softcapping``), or None."""
    return getattr(getattr(model, "config", None), "final_logit_softcapping", None) or None


def chunked_cross_entropy(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                          chunk: int, softcap: float | None = None, most: int | None = None) -> torch.Tensor:
    """sum CE(head(hidden), targets) computed ``chunk`` rows at a time; hidden [n, H], targets [n].

    ``softcap``: logits become ``softcap * tanh(logits / softcap)`` first, as the model's forward does.
    ``most``: the most targets of any rank (None: asked of the ranks here).
    """

    def part(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        logits = head(h).float()  # [chunk, vocab]
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        return F.cross_entropy(logits, t, reduction="sum")

    n = hidden.shape[0]
    # Every rank calls the head equally often (empty chunks where it has fewer targets): under ZeRO-3
    # each call all-gathers the partitioned weight, a collective that must match across the world.
    most = comm.max_over_ranks(n) if most is None else most
    total = hidden.new_zeros((), dtype=torch.float32)
    for k in range(max(1, -(-most // chunk))):
        i = k * chunk
        total = total + checkpoint(part, hidden[i:i + chunk], targets[i:i + chunk], use_reentrant=False)
    return total


FUSED_LOSS = "longsft_fused_head_loss"  # the attribute build_model gives the model for a HeadLoss


class FusedHeadLoss(torch.nn.Module):
    """sum CE(head(hidden), targets); hidden [n, H], targets [n]. ``kind``:

    - ``liger``: Liger's fused linear cross-entropy (``model.loss_kernel=liger``, GPU);
    - ``tied``: :class:`~longsft.train.model.tied_head.HeadCrossEntropy`, for a head tied to the
      input embedding: no ``[V, H]`` gradient during the backward, the embedding's backward adds it.

    A module of the model without parameters of its own: the head weight stays the LM head's (its
    name and checkpoints unchanged). Under ZeRO-3, for ``liger`` it is this module's external
    parameter, gathered for this module's forward and for its backward (where Liger hands over its
    gradient); ``tied`` gathers it itself for its forward (and for its backward
    only when it recomputes its logit gradients), so it is not held through the decoder layers' backward.
    """

    def __init__(self, head: torch.nn.Linear, kind: str = "liger"):
        super().__init__()
        self._head = (head,)  # a tuple: not a submodule, so the head is not registered twice
        self.kind = kind
        if kind == "liger":
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            # fp32 accumulation of the weight gradient over Liger's chunks (its default is the weight dtype)
            self.kernel = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, reduction="sum",
                                                           accum_dtype=torch.float32)
        else:
            self.deferred = Deferred()

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor, chunk: int = 0, most: int | None = None) -> torch.Tensor:
        """``most``: the most targets of any rank (``tied``; None: asked of the ranks)."""
        weight = self._head[0].weight
        if self.kind == "liger" and hasattr(weight, "ds_id") and id(weight) not in getattr(self, "_external_params", {}):
            raise RuntimeError("the fused loss's head weight is partitioned by ZeRO-3 but not registered with it "
                               "(register_fused_loss after deepspeed.initialize)")
        if self.kind == "tied":
            return HeadCrossEntropy.apply(hidden, weight, targets, chunk if chunk > 0 else max(1, hidden.shape[0]),
                                          self.deferred, most)
        if hidden.shape[0] == 0:  # Liger divides by zero for no rows: one ignored row (loss 0, zero gradients)
            hidden = torch.cat([hidden, hidden.new_zeros(1, hidden.shape[1])])
            targets = torch.cat([targets, targets.new_full((1,), IGNORE)])
        return self.kernel(weight, hidden, targets).float()


def attach_fused_loss(model, kind: str = "liger") -> None:
    """Give ``model`` its :class:`FusedHeadLoss` (before ``deepspeed.initialize``, which hooks every
    module); ``tied`` also makes the input embedding's backward take the head's deferred gradient."""
    fused = FusedHeadLoss(model.get_output_embeddings(), kind)
    model.add_module(FUSED_LOSS, fused)
    if kind == "tied":
        defer_into_embedding(model, fused.deferred)
    register_fused_loss(model)


def register_fused_loss(model) -> None:
    """Once ZeRO-3 has partitioned the head weight (at load under ``HfDeepSpeedConfig``, or by
    ``deepspeed.initialize``): make it the fused loss module's external parameter, gathered for that
    module's forward and backward. Idempotent; nothing without the module or without ZeRO-3."""
    fused = getattr(model, FUSED_LOSS, None)
    weight = model.get_output_embeddings().weight
    if fused is not None and fused.kind == "liger" and hasattr(weight, "ds_id") and \
            id(weight) not in getattr(fused, "_external_params", {}):
        import deepspeed

        deepspeed.zero.register_external_parameter(fused, weight)


def fused_head_loss(model) -> FusedHeadLoss:
    fused = getattr(model, FUSED_LOSS, None)
    if fused is None or fused.kind != "liger":
        raise RuntimeError("model.loss_kernel=liger needs the model built with it (build_model attaches the fused "
                           "loss module before DeepSpeed hooks the model)")
    return fused


def backward_scale(n_global_tokens: int, dp_world_size: int, grad_accum: int) -> float:
    """Multiplier turning a local token-loss sum into DeepSpeed's expected micro-step loss."""
    return dp_world_size * grad_accum / max(1, n_global_tokens)


def hold_whole_weight(model, hold: bool) -> None:
    """Whether the tied weight stays whole from the head's backward to the embedding's (no second gather
    for the embedding's backward) or is partitioned after the head (its memory free for the decoder
    layers' backward). The planner decides (``Estimate.hold_tied_weight``); the same on every rank."""
    fused = getattr(model, FUSED_LOSS, None)
    if fused is not None and fused.kind == "tied":
        fused.deferred.hold = hold
