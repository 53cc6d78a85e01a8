"""Sequence-parallel attention: one sequence split over the ``sp_size`` ranks of an SP group.

This module is the attention-registry entry. It is registered in transformers' attention registry
under ``longsft_sp`` (no transformers function is patched). Inside :func:`active`, each attention
layer gets this rank's zigzag shard of q/k/v ([b, h, s_local, d]). It hands them to the configured
backend:

- ``torch``: :mod:`.ring`, the zigzag ring on PyTorch's fused kernels (:mod:`.kernels`);
- ``ring_flash_attn``: :mod:`.ring_flash`, ring-flash-attn on flash-attn's kernels (GPU);
- ``ulysses``: :mod:`.ulysses`, head-splitting all-to-all.

Outside :func:`active` (e.g. ``generate`` in validation) it is plain SDPA over an unsplit sequence.
How sequences are split is in :mod:`.layout`; which backend can run here is in :mod:`.backends`.
"""

from __future__ import annotations

import contextlib

import torch

from longsft.train.common.compat import in_backward
from longsft.train.parallel.layout import SP
from longsft.train.parallel.ring import zigzag_ring
from longsft.train.parallel.ring_flash import ring_flash_attention, ring_flash_module
from longsft.train.parallel.ulysses import per_document_attention, ulysses

ATTN_NAME = "longsft_sp"


def setup(group, ranks: list[int], rank: int, backend: str = "torch", kernel: str = "auto") -> None:
    """Remember this rank's SP group, backend and CUDA block kernel choice (``parallel.attention_kernel``),
    and register the attention function (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    SP.group, SP.ranks, SP.size, SP.rank = group, tuple(ranks), len(ranks), ranks.index(rank)
    SP.backend, SP.kernel = backend, kernel
    if backend == "ring_flash_attn" and len(ranks) > 1:
        ring_flash_module()  # import now: a broken install fails here, not in the first forward
    AttentionInterface.register(ATTN_NAME, sp_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, sp_mask)


def forget_groups() -> None:
    """Let go of the SP group (its process groups are destroyed): one rank, no group, until :func:`setup`."""
    SP.group, SP.ranks, SP.size, SP.rank = None, (), 1, 0


@contextlib.contextmanager
def active(enabled: bool = True, doc_ids: torch.Tensor | None = None, keep_attention: bool = False):
    """Inside: attention layers expect zigzag-sharded sequences (and, with ``doc_ids``, packed
    documents that must not see each other). ``keep_attention``: the layers are checkpointed, and
    what each one's attention computed is kept for its recompute (``model.keep_attention``; on one
    rank too, through the ring's single block); wrap one forward and its backward."""
    prev = SP.active, SP.doc_ids, SP.keep_attention
    SP.active = enabled and (SP.size > 1 or doc_ids is not None or keep_attention)
    SP.doc_ids, SP.keep_attention = doc_ids, keep_attention
    SP.doc_spans = SP.gathered_docs = (None, None)  # made again from this batch's doc_ids, once
    SP.kept.clear()
    try:
        yield
    finally:
        SP.active, SP.doc_ids, SP.keep_attention = prev
        SP.doc_spans = SP.gathered_docs = (None, None)
        SP.kept.clear()


def sp_mask(**kwargs):
    """The attention mask transformers builds for ``longsft_sp``: none while :func:`active` (the ring,
    Ulysses and per-document attention take positions from the layout and documents from ``doc_ids``;
    the zigzag position jumps would otherwise make transformers build a [b, 1, s_local, s_local] mask
    for packed sequences that nothing reads), SDPA's otherwise (the unsplit fallback, e.g. generation)."""
    from transformers.masking_utils import sdpa_mask

    return None if SP.active else sdpa_mask(**kwargs)


def sp_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                         scaling: float | None = None, **kwargs):
    """transformers attention interface: query [b, h, s, d] -> output [b, s, h, d], no weights."""
    if not SP.active:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout:
        raise ValueError("sequence-parallel attention does not support attention dropout")
    for quirk in ("sliding_window", "softcap"):  # what the layer asks for and the ring would not do
        if kwargs.get(quirk):
            raise ValueError(f"{type(module).__name__} asks for {quirk}={kwargs[quirk]}, which longsft's sequence-"
                             "parallel and packed attention do not apply (the start-up check should have said so)")
    if SP.size == 1 and SP.doc_ids is not None:  # packed documents on one rank
        out = per_document_attention(query, key, value, scaling, SP.doc_ids)
    else:  # (one rank: the ring's single block, for keep_attention)
        out = _attend(module, BACKENDS.get(SP.backend, zigzag_ring) if SP.size > 1 else zigzag_ring, query, key,
                      value, scaling)
    return out.transpose(1, 2).contiguous(), None


def _ring_flash(q, k, v, scale, doc_ids, kept=None):
    return ring_flash_attention(q, k, v, scale, doc_ids), None  # its kernels' state is not ours to keep


BACKENDS = {"torch": zigzag_ring, "ulysses": ulysses, "ring_flash_attn": _ring_flash}


def _attend(module, attend, q, k, v, scale):
    """One layer's sequence-parallel attention. With :attr:`SP.keep_attention` (gradient checkpointing),
    what its forward computed is kept for the checkpoint's recompute of the layer, which then runs
    neither the attention kernels nor their communication again."""
    if not (SP.keep_attention and torch.is_grad_enabled()):
        return attend(q, k, v, scale, SP.doc_ids)[0]
    if in_backward():  # the checkpoint recomputing this layer inside the backward
        return attend(q, k, v, scale, SP.doc_ids, kept=SP.kept.pop(module, None))[0]
    out, kept = attend(q, k, v, scale, SP.doc_ids)
    if kept is not None:
        SP.kept[module] = kept
    return out
