"""The sequence-parallel context, passed explicitly: who this rank attends with, and one forward's state.

:class:`SequenceParallel` is made once by :func:`~longsft.train.parallel.distributed.init` and held on
``Dist.sp``; the data path (:func:`~longsft.train.parallel.layout.shard_batch`) and the registered attention
function (:class:`~longsft.train.parallel.attention.SPAttention`) are given it. :class:`Forward` is what
``SPAttention.active()`` opens for one forward (and its backward): the batch's packed documents, whether
attention is kept for the checkpoint's recompute, and what was kept. Nothing here is module-global.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from longsft.train.parallel.layout import spans


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's sequence-parallel group: ``ranks`` (global ranks, in SP order; empty: one rank, no
    group), ``rank`` (this rank's index among them), the process ``group``, the backend
    (``parallel.sp_backend``) and the CUDA block kernel choice (``parallel.attention_kernel``)."""

    group: object = None
    ranks: tuple[int, ...] = ()
    rank: int = 0
    backend: str = "torch"
    kernel: str = "auto"

    @property
    def size(self) -> int:
        return max(1, len(self.ranks))

    def layout(self, packed: bool) -> str:
        """How sequences are split for this backend: ``zigzag``, or ``contiguous`` for ring-flash-attn's
        llama3 varlen ring on packed documents (it wants each rank's slice in position order)."""
        return "contiguous" if packed and self.backend == "ring_flash_attn" and self.size > 1 else "zigzag"


ONE_RANK = SequenceParallel()


class Documents:
    """The packed documents of one batch, and what the layers derive from them once per batch (every
    layer asks; each derivation syncs with the host or communicates).

    ``ids`` [b, s_local]: each token's document (equal ids are contiguous in position order)."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids
        self._spans: list[list[tuple[int, int]]] | None = None
        self.whole_spans: list[list[tuple[int, int]]] | None = None  # spans in the SP group's whole rows
        self.varlen: list[tuple] | None = None  # ring-flash-attn's per-row llama3 cu_seqlens plans
        self.ring_pieces: tuple | None = None  # the torch ring's pieces per step, for kernels without masks

    @property
    def spans(self) -> list[list[tuple[int, int]]]:
        """[start, end) of each document, per row of ``ids``."""
        if self._spans is None:
            self._spans = [spans(row) for row in self.ids]
        return self._spans


@dataclass
class Forward:
    """One forward of the model under :meth:`SPAttention.active`, and its backward.

    ``docs``: the batch's packed documents (None: unpacked). ``keep_attention``: the layers are
    checkpointed and each one's attention output is kept for its recompute (``kept``: attention module
    -> what its forward computed, until the recompute takes it)."""

    sp: SequenceParallel
    docs: Documents | None = None
    keep_attention: bool = False
    kept: dict = field(default_factory=dict)
