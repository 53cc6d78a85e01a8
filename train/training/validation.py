"""The validation hook: generate judgements, score them with the shared scorer, pick the best.

Every rank takes the same path: the validation set is split over all ranks (SP ranks included:
validation does not split sequences) and padded so each rank runs the same number of
``generate`` calls, and ``generate`` runs with ``synced_gpus`` so ZeRO-3's collective parameter
gathers stay in step. The predictions are gathered to every rank, so every rank computes identical
metrics and the same "is best" decision (no broadcast, no divergent branches, no hang).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from longsft.eval.scoring.metrics import Item, score_items
from longsft.train.data.batching import collate
from longsft.train.data.encoding import Encoded
from longsft.train.model.loss import token_loss_sum
from longsft.train.parallel.comm import all_gather_objects, all_reduce
from longsft.train.parallel.distributed import Dist


def _shard(items: list, d: Dist) -> list[tuple[int, bool]]:
    """(index, counts) for this rank; every rank gets the same number of items (dummies repeat item 0).

    Validation runs on whole, unsplit sequences, so the items are split over every rank of the job,
    the ranks of a sequence-parallel group included (they no longer repeat each other's items: an SP
    group validates sp_size times faster).
    """
    per_rank = math.ceil(len(items) / d.world_size)
    mine = list(range(d.rank, len(items), d.world_size))
    return [(i, True) for i in mine] + [(0, False)] * (per_rank - len(mine))


@torch.no_grad()
def generate_judgements(engine, tokenizer, items: list[Encoded], d: Dist, max_new_tokens: int) -> list[dict]:
    """Greedy judgements for ``items``; returns rows in ``longsft score`` format, on every rank."""
    model = engine.module
    model.eval()
    rows = []
    for i, real in _shard(items, d):
        e = items[i]
        ids = torch.from_numpy(np.asarray(e.input_ids[: e.prompt_len], dtype=np.int64))[None].to(d.device)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, use_cache=True, synced_gpus=d.world_size > 1,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        if real:
            s = e.meta
            rows.append({"id": s.id, "prediction": tokenizer.decode(out[0, e.prompt_len:], skip_special_tokens=True),
                         "gold_score": s.gold_score, "bucket": s.bucket, "language": s.language, "types": list(s.types)})
    model.train()
    gathered = [r for part in all_gather_objects(rows) for r in part]
    return sorted(gathered, key=lambda r: r["id"])


@torch.no_grad()
def validation_loss(engine, items: list[Encoded], d: Dist, pad_id: int, chunk_tokens: int = 0) -> float:
    """Teacher-forced token-mean loss over ``items`` (all ranks together)."""
    engine.module.eval()
    loss_sum, n_sum = 0.0, 0
    for i, real in _shard(items, d):
        batch = {k: v.to(d.device) for k, v in collate([items[i]], pad_id).items()}
        loss, n = token_loss_sum(engine, batch, chunk_tokens)
        if real:
            loss_sum, n_sum = loss_sum + loss.item(), n_sum + n
    engine.module.train()
    loss_sum, n_sum = all_reduce([loss_sum, n_sum])
    return loss_sum / n_sum if n_sum > 0 else float("nan")


def run_validation(engine, tokenizer, items: list[Encoded], d: Dist, max_new_tokens: int, policy: str,
                   with_loss: bool, pad_id: int, chunk_tokens: int = 0) -> tuple[dict, list[dict]]:
    """Judgements -> shared scorer metrics (+ validation loss). Identical result on every rank."""
    rows = generate_judgements(engine, tokenizer, items, d, max_new_tokens)
    scored = [Item(id=r["id"], prediction=r["prediction"], gold_score=r["gold_score"], bucket=r["bucket"],
                   language=r["language"], gold_types=tuple(r["types"])) for r in rows]
    result = score_items(scored, policy)
    metrics = {k: result[k] for k in ("balanced_accuracy", "mcc", "invalid_rate", "contradiction_rate", "n")}
    metrics["val_loss"] = validation_loss(engine, items, d, pad_id, chunk_tokens) if with_loss else float("nan")
    return metrics, rows


def is_better(new: dict, best: dict | None) -> bool:
    """Balanced Accuracy, then MCC, then lower validation loss."""
    if best is None:
        return True

    def key(m: dict) -> tuple:
        loss = m.get("val_loss")
        loss = float("inf") if loss is None or loss != loss else loss
        return (round(m["balanced_accuracy"], 12), round(m["mcc"], 12), -loss)

    return key(new) > key(best)
