"""Sequence-parallel attention: one sequence split over the ranks of an SP group.

:class:`SPAttention` is the attention-registry entry, bound to one
:class:`~longsft.train.parallel.context.SequenceParallel` (:func:`register` puts its methods in
transformers' registry under ``longsft_sp``; no transformers function is patched). Inside its
:meth:`~SPAttention.active`, each attention layer gets this rank's zigzag shard of q/k/v
([b, h, s_local, d]) and hands them to the configured backend:

- ``torch``: :mod:`.ring`, the zigzag ring on PyTorch's fused kernels (:mod:`.kernels`);
- ``ring_flash_attn``: :mod:`.ring_flash`, ring-flash-attn on flash-attn's kernels (GPU);
- ``ulysses``: :mod:`.ulysses`, head-splitting all-to-all.

Outside ``active()`` (e.g. ``generate`` in validation) it is plain SDPA over an unsplit sequence.
How sequences are split is in :mod:`.layout`; which backend can run here is in
:mod:`longsft.train.config.backends`.
"""

from __future__ import annotations

import contextlib

import torch

from longsft.train.common.compat import in_backward
from longsft.train.parallel.context import ONE_RANK, Documents, Forward, SequenceParallel
from longsft.train.parallel.ring import zigzag_ring
from longsft.train.parallel.ring_flash import ring_flash_attention, ring_flash_module
from longsft.train.parallel.ulysses import per_document_attention, ulysses

ATTN_NAME = "longsft_sp"


def _ring(q, k, v, scale, fwd: Forward, kept=None):
    return zigzag_ring(q, k, v, scale, fwd.docs, kept=kept, sp=fwd.sp)


def _ulysses(q, k, v, scale, fwd: Forward, kept=None):
    return ulysses(q, k, v, scale, fwd.docs, kept, sp=fwd.sp)


def _ring_flash(q, k, v, scale, fwd: Forward, kept=None):
    return ring_flash_attention(fwd.sp, q, k, v, scale, fwd.docs), None  # its kernels' state is not ours to keep


# backend -> attend(q, k, v, scale, forward, kept) -> (out [b, h, s_local, d], what a recompute may reuse)
BACKENDS = {"torch": _ring, "ulysses": _ulysses, "ring_flash_attn": _ring_flash}


def uses_block_kernel(sp_size: int, sp_backend: str, packing: bool, kept_on_one_rank: bool) -> bool:
    """Whether a training forward's attention runs longsft's fused block kernels (:mod:`.kernels`): the
    torch ring, Ulysses on unpacked rows, or the ring's single block on one rank that keeps attention
    (``kept_on_one_rank``: the model built with this entry for it). Not ring-flash-attn (flash-attn's
    kernels) nor per-document SDPA (packed rows on one rank, and Ulysses's packed rows)."""
    if sp_size == 1:
        return kept_on_one_rank and not packing
    return sp_backend == "torch" or (sp_backend == "ulysses" and not packing)


class SPAttention:
    """The attention function transformers calls (:meth:`forward`, :meth:`mask`), bound to ``sp``.

    ``current``: the :class:`Forward` that :meth:`active` opened (None outside: plain SDPA)."""

    def __init__(self, sp: SequenceParallel = ONE_RANK):
        self.sp = sp
        self.current: Forward | None = None

    @contextlib.contextmanager
    def active(self, enabled: bool = True, doc_ids: torch.Tensor | None = None, keep_attention: bool = False):
        """Inside: attention layers expect sharded sequences (and, with ``doc_ids`` [b, s_local], packed
        documents that must not see each other). ``keep_attention``: the layers are checkpointed, and
        what each one's attention computed is kept for its recompute (``model.keep_attention``; on one
        rank too, through the ring's single block); wrap one forward and its backward. Yields the
        :class:`Forward` (None where nothing needs it: one rank, unpacked, nothing kept)."""
        prev = self.current
        on = enabled and (self.sp.size > 1 or doc_ids is not None or keep_attention)
        self.current = Forward(self.sp, None if doc_ids is None else Documents(doc_ids), keep_attention) if on else None
        try:
            yield self.current
        finally:
            self.current = prev

    def mask(self, **kwargs):
        """The attention mask transformers builds for ``longsft_sp``: none while :meth:`active` (the ring,
        Ulysses and per-document attention take positions from the layout and documents from ``doc_ids``;
        the zigzag position jumps would otherwise make transformers build a [b, 1, s_local, s_local] mask
        for packed sequences that nothing reads), SDPA's otherwise (the unsplit fallback, e.g. generation)."""
        from transformers.masking_utils import sdpa_mask

        return None if self.current is not None else sdpa_mask(**kwargs)

    def forward(self, module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                **kwargs):
        """transformers attention interface: query [b, h, s, d] -> output [b, s, h, d], no weights."""
        fwd = self.current
        if fwd is None:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                          **kwargs)
        if dropout:
            raise ValueError("sequence-parallel attention does not support attention dropout")
        for quirk in ("sliding_window", "softcap"):  # what the layer asks for and the ring would not do
            if kwargs.get(quirk):
                raise ValueError(f"{type(module).__name__} asks for {quirk}={kwargs[quirk]}, which longsft's sequence-"
                                 "parallel and packed attention do not apply (the start-up check should have said so)")
        if fwd.sp.size == 1 and fwd.docs is not None:  # packed documents on one rank
            out = per_document_attention(query, key, value, scaling, fwd.docs.spans)
        else:  # (one rank: the ring's single block, for keep_attention)
            out = attend_layer(fwd, module, BACKENDS[fwd.sp.backend] if fwd.sp.size > 1 else _ring, query, key, value,
                               scaling)
        return out.transpose(1, 2).contiguous(), None


def attend_layer(fwd: Forward, module, attend, q, k, v, scale):
    """One layer's sequence-parallel attention. With ``fwd.keep_attention`` (gradient checkpointing),
    what its forward computed is kept for the checkpoint's recompute of the layer, which then runs
    neither the attention kernels nor their communication again."""
    if not (fwd.keep_attention and torch.is_grad_enabled()):
        return attend(q, k, v, scale, fwd)[0]
    if in_backward():  # the checkpoint recomputing this layer inside the backward
        return attend(q, k, v, scale, fwd, fwd.kept.pop(module, None))[0]
    out, kept = attend(q, k, v, scale, fwd)
    if kept is not None:
        fwd.kept[module] = kept
    return out


def register(sp: SequenceParallel) -> SPAttention:
    """A :class:`SPAttention` for ``sp``, registered in transformers' attention and mask registries under
    :data:`ATTN_NAME` (the entry a model built by ``build_model`` names); the previous one is replaced."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if sp.backend == "ring_flash_attn" and sp.size > 1:
        ring_flash_module()  # import now: a broken install fails here, not in the first forward
    entry = SPAttention(sp)
    AttentionInterface.register(ATTN_NAME, entry.forward)
    AttentionMaskInterface.register(ATTN_NAME, entry.mask)
    return entry
