"""Where each token lives under sequence parallelism: the data path (no state; the SP group's context is
:class:`~longsft.train.parallel.context.SequenceParallel`).

:func:`shard_batch` takes a collated batch (labels already shifted, position_ids already built). It
pads the batch to a multiple of ``2 * sp_size`` and splits it in the zigzag layout. The sequence is
cut into ``2 * sp`` chunks, and SP rank ``r`` holds chunks ``r`` and ``2*sp - 1 - r``. This gives
every rank the same amount of causal attention work. ring-flash-attn's varlen ring for packed
documents wants contiguous shards instead (``SequenceParallel.layout``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from longsft.train.parallel.context import SequenceParallel


def zigzag_index(seq_len: int, sp_size: int, sp_rank: int) -> torch.Tensor:
    """Positions held by ``sp_rank``: chunks r and 2*sp-1-r of ``2*sp`` equal chunks. [seq_len / sp]"""
    c = seq_len // (2 * sp_size)
    first = torch.arange(sp_rank * c, (sp_rank + 1) * c)
    second = torch.arange((2 * sp_size - 1 - sp_rank) * c, (2 * sp_size - sp_rank) * c)
    return torch.cat([first, second])


def pad_multiple(setting: int | str, seq_len: int, sp_size: int, graph_per_shape: bool) -> int:
    """Tokens a micro-batch's length is rounded up to (``parallel.pad_multiple``), before its 2*sp split.

    ``auto``: where the attention kernel builds a graph for every new shape (cuDNN in the ring or Ulysses),
    1/64 of the stage's ``seq_len`` rounded up to a multiple of 16 * sp (each zigzag chunk a multiple of
    8 tokens): at most 64 lengths a stage (fewer where 16 * sp > seq_len / 64), and fewer pad tokens than
    the multiple on any batch; else 1.
    Padding goes at the end and has no targets; causal attention never lets a real token see it.
    """
    if setting != "auto":
        return max(1, int(setting))
    if not graph_per_shape:
        return 1
    unit = 16 * sp_size
    return -(-max(1, seq_len // 64) // unit) * unit


def shard_batch(batch: dict[str, torch.Tensor], sp: SequenceParallel, pad_id: int,
                packed: bool = False) -> dict[str, torch.Tensor]:
    """Pad ``[batch, seq]`` tensors to a multiple of 2*sp and keep this rank's part of them: its zigzag
    chunks, or its contiguous slice where ``sp.layout(packed)`` says so.

    Labels were shifted before this split (each position carries its own next-token target) and
    position_ids were built on the whole sequence, so RoPE and the loss need no communication.
    Padding goes at the end; causal attention never lets a real token see it, so the attention
    mask is dropped.
    """
    sp_size, sp_rank, layout = sp.size, sp.rank, sp.layout(packed)
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


def spans(doc_row: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of equal document ids (documents are contiguous in position order)."""
    change = (torch.nonzero(doc_row[1:] != doc_row[:-1]).flatten() + 1).tolist()
    bounds = [0, *change, doc_row.numel()]
    return list(zip(bounds[:-1], bounds[1:]))
