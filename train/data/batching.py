"""Rows and batches: packing samples end to end, collation to tensors, and the resumable step sampler."""

from __future__ import annotations

import random
from typing import Sequence

import numpy as np
import torch

from longsft.train.data.encoding import IGNORE, Encoded

# --------------------------------------------------------------------------- batching


Row = list[Encoded]  # one batch row: a single sample, or several packed end to end


def pack(items: list[Encoded], seq_len: int, enabled: bool) -> list[Row]:
    """Group samples into rows of at most ``seq_len`` tokens (first-fit decreasing, deterministic).

    Without packing every row holds one sample. Packed documents never see each other: they get
    their own position ids and document ids, and attention is masked per document.
    """
    if not enabled:
        return [[e] for e in items]
    rows: list[Row] = []
    space: list[int] = []
    for e in sorted(items, key=lambda e: (-len(e.input_ids), e.meta.id)):
        n = len(e.input_ids)
        j = next((i for i, free in enumerate(space) if free >= n), None)
        if j is None:
            rows.append([e])
            space.append(seq_len - n)
        else:
            rows[j].append(e)
            space[j] -= n
    return rows


def collate(rows: list[Row | Encoded], pad_id: int, pad_to_multiple: int = 1,
            max_len: int | None = None) -> dict[str, torch.Tensor]:
    """Right-pad rows to a common length: the longest row's, rounded up to ``pad_to_multiple`` but not past
    ``max_len`` (where the longest row is shorter). Labels are shifted here, before any sequence split, and
    per document: ``shift_labels[b, t]`` is the target of position ``t`` (IGNORE at a document's
    last token and on padding). Position ids restart at 0 for each packed document.

    Returns input_ids, attention_mask, position_ids, shift_labels, doc_ids (-1 on padding): [batch, seq].
    """
    rows = [r if isinstance(r, list) else [r] for r in rows]
    longest = max(sum(len(e.input_ids) for e in r) for r in rows)
    n = -(-longest // pad_to_multiple) * pad_to_multiple
    n = max(longest, min(n, max_len)) if max_len else n
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    shift = torch.full((len(rows), n), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    docs = torch.full((len(rows), n), -1, dtype=torch.long)
    pos = torch.arange(n).repeat(len(rows), 1)
    for i, row in enumerate(rows):
        t = 0
        for j, e in enumerate(row):
            k = len(e.input_ids)
            ids[i, t:t + k] = torch.from_numpy(np.asarray(e.input_ids, dtype=np.int64))
            start = t + max(e.prompt_len, 1)  # the first answer token is the target of position start - 1
            shift[i, start - 1:t + k - 1] = ids[i, start:t + k]
            pos[i, t:t + k] = torch.arange(k)
            docs[i, t:t + k] = j
            t += k
        mask[i, :t] = 1
        pos[i, t:] = torch.arange(t, n) if len(row) == 1 else torch.arange(n - t)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "shift_labels": shift, "doc_ids": docs}


def stratified_order(labels: Sequence[int], batch: int, rng: random.Random) -> list[int]:
    """A permutation of ``range(len(labels))`` in which every aligned run of ``batch`` indices holds each
    label in the whole set's proportion, as near as whole counts allow: with two labels each run holds
    the floor or the ceiling of a label's share (a label's running deficit stays in (-1/2, 1/2]; classes
    of equal size in even batches: exactly half each). Each label's indices in a shuffled order, dealt
    out to the label furthest behind its share so far (ties: the smaller label), then each run shuffled
    (which rank and micro-batch gets which item stays random)."""
    by_label: dict[int, list[int]] = {}
    for i, y in enumerate(labels):
        by_label.setdefault(y, []).append(i)
    names = sorted(by_label)
    for y in names:
        rng.shuffle(by_label[y])
    n, taken, order = len(labels), dict.fromkeys(names, 0), []
    for t in range(1, n + 1):  # the deficits sum to 1 > 0 and an exhausted label's is <= 0: never picked
        y = max(names, key=lambda y: t * len(by_label[y]) / n - taken[y])
        order.append(by_label[y][taken[y]])
        taken[y] += 1
    for start in range(0, n, batch):
        run = order[start:start + batch]
        rng.shuffle(run)
        order[start:start + batch] = run
    return order


class StepSampler:
    """Deterministic map from optimizer step -> this rank's micro-batches.

    Each epoch is a seeded permutation; a global step takes ``dp_size * micro * accum`` samples
    (the tail that does not fill a step is dropped, so every rank sees the same number of
    batches). Resuming at step ``s`` needs nothing but ``s``. With ``labels`` (one per row: the
    class, ``data.stratify``) each step's samples hold the classes in the data's proportion
    (:func:`stratified_order`); without, a plain shuffle.
    """

    def __init__(self, n: int, dp_size: int, dp_rank: int, micro: int, accum: int, seed: int,
                 labels: Sequence[int] | None = None):
        self.n, self.dp_size, self.dp_rank, self.micro, self.accum, self.seed = n, dp_size, dp_rank, micro, accum, seed
        self.global_batch = dp_size * micro * accum
        self.steps_per_epoch = n // self.global_batch
        if labels is not None and len(labels) != n:
            raise ValueError(f"StepSampler: {len(labels)} labels for {n} rows")
        self.labels = labels
        self._epoch: tuple[int, list[int]] | None = None  # (epoch, its order): made once per epoch, not per step

    def order(self, epoch: int) -> list[int]:
        """The epoch's sample order: a function of (seed, epoch, labels) only."""
        if self._epoch is None or self._epoch[0] != epoch:
            rng = random.Random(self.seed * 1_000_003 + epoch)
            if self.labels is not None:
                perm = stratified_order(self.labels, self.global_batch, rng)
            else:
                perm = list(range(self.n))
                rng.shuffle(perm)
            self._epoch = (epoch, perm)
        return self._epoch[1]

    def global_indices(self, step: int) -> list[int]:
        """Every sample index of global ``step``, all ranks together."""
        epoch, pos = divmod(step, self.steps_per_epoch)
        return self.order(epoch)[pos * self.global_batch:(pos + 1) * self.global_batch]

    def step(self, step: int) -> list[list[int]]:
        """Indices for ``accum`` micro-batches of this rank at global ``step``."""
        mine = self.global_indices(step)[self.dp_rank::self.dp_size]
        return [mine[i * self.micro:(i + 1) * self.micro] for i in range(self.accum)]
