"""Where each token lives under sequence parallelism: the SP group's state and the data path.

:func:`shard_batch` takes a collated batch (labels already shifted, position_ids already built). It
pads the batch to a multiple of ``2 * sp_size`` and splits it in the zigzag layout. The sequence is
cut into ``2 * sp`` chunks, and SP rank ``r`` holds chunks ``r`` and ``2*sp - 1 - r``. This gives
every rank the same amount of causal attention work. ring-flash-attn's varlen ring for packed
documents wants contiguous shards instead (:func:`layout`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class _State:
    backend: str = "torch"
    kernel: str = "auto"  # parallel.attention_kernel: the CUDA block kernel (kernels.choose)
    group: object = None
    size: int = 1
    rank: int = 0
    ranks: tuple[int, ...] = ()
    active: bool = False
    doc_ids: torch.Tensor | None = None  # [batch, s_local] when documents are packed
    varlen: tuple = (None, None)  # (doc_ids, per-row llama3 cu_seqlens plans) of the current batch
    doc_spans: tuple = (None, None)  # (doc_ids, each row's document spans) of the current batch (row_spans)
    gathered_docs: tuple = (None, None)  # (local doc_ids, the SP group's, in gathered order): Ulysses, per batch
    keep_attention: bool = False  # model.keep_attention with gradient checkpointing (attention.active)
    kept: dict = field(default_factory=dict)  # attention module -> what its forward computed, until recomputed


SP = _State()


# --------------------------------------------------------------------------- data


def zigzag_index(seq_len: int, sp_size: int, sp_rank: int) -> torch.Tensor:
    """Positions held by ``sp_rank``: chunks r and 2*sp-1-r of ``2*sp`` equal chunks. [seq_len / sp]"""
    c = seq_len // (2 * sp_size)
    first = torch.arange(sp_rank * c, (sp_rank + 1) * c)
    second = torch.arange((2 * sp_size - 1 - sp_rank) * c, (2 * sp_size - sp_rank) * c)
    return torch.cat([first, second])


def shard_batch(batch: dict[str, torch.Tensor], sp_size: int, sp_rank: int, pad_id: int,
                layout: str = "zigzag") -> dict[str, torch.Tensor]:
    """Pad ``[batch, seq]`` tensors to a multiple of 2*sp and keep this rank's zigzag part (or, with
    ``layout="contiguous"``, its contiguous slice).

    Labels were shifted before this split (each position carries its own next-token target) and
    position_ids were built on the whole sequence, so RoPE and the loss need no communication.
    Padding goes at the end; causal attention never lets a real token see it, so the attention
    mask is dropped.
    """
    if sp_size == 1:
        return batch
    n = batch["input_ids"].shape[1]
    target = -(-n // (2 * sp_size)) * (2 * sp_size)
    fill = {"input_ids": pad_id, "shift_labels": -100, "attention_mask": 0, "doc_ids": -1}
    out = {}
    c = target // sp_size
    idx = zigzag_index(target, sp_size, sp_rank) if layout == "zigzag" else torch.arange(sp_rank * c, (sp_rank + 1) * c)
    for key, t in batch.items():
        if target > n:
            if key == "position_ids":
                extra = t[:, -1:] + torch.arange(1, target - n + 1)
            else:
                extra = torch.full((t.shape[0], target - n), fill[key], dtype=t.dtype)
            t = torch.cat([t, extra], dim=1)
        out[key] = t[:, idx]
    out.pop("attention_mask")
    return out


def layout(packed: bool) -> str:
    """How :func:`shard_batch` splits sequences for the active backend: ``zigzag`` or ``contiguous``
    (ring-flash-attn's llama3 varlen ring for packed documents wants each rank's slice in order)."""
    return "contiguous" if packed and SP.backend == "ring_flash_attn" and SP.size > 1 else "zigzag"


def row_spans(doc_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """:func:`spans` of each row of ``doc_ids`` [b, s], computed once per batch (every layer asks; each
    computation syncs with the host) and kept on :data:`SP` until the next batch's ``doc_ids``."""
    if SP.doc_spans[0] is not doc_ids:
        SP.doc_spans = (doc_ids, [spans(row) for row in doc_ids])
    return SP.doc_spans[1]


def spans(doc_row: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of equal document ids (documents are contiguous in position order)."""
    change = (torch.nonzero(doc_row[1:] != doc_row[:-1]).flatten() + 1).tolist()
    bounds = [0, *change, doc_row.numel()]
    return list(zip(bounds[:-1], bounds[1:]))
