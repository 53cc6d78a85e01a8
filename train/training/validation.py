"""The validation hook: generate judgements, score them with the shared scorer, pick the best.

The validation set is split over all ranks (SP ranks included: validation does not split
sequences). Under ZeRO-3 each rank generates on a whole copy of the model when its weights fit in
``validation.whole_model_gb`` (:func:`whole_copy`, TRL's "gather for generation"): no collective
per token. Otherwise the ranks are padded to the same number of ``generate`` calls, run with
``synced_gpus`` so ZeRO-3's collective parameter gathers stay in step. The predictions are gathered
to every rank, so every rank computes identical metrics and the same "is best" decision (no
broadcast, no divergent branches, no hang).
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch

from longsft.train.common.compat import full_shape
from longsft.train.data.batching import collate
from longsft.train.data.encoding import Encoded
from longsft.train.model.generate import batches, generate_many
from longsft.train.model.loss import LAST_HIDDEN_STATE, logit_softcap, token_loss_sum
from longsft.train.parallel import comm
from longsft.train.parallel.comm import all_gather_objects, all_reduce
from longsft.train.parallel.distributed import Dist
from longsft.train.scoring.metrics import Item, score_items
from longsft.train.training.decision import DecisionKey, decision_key, decision_metrics


def _shard(items: list, d: Dist, padded: bool = True) -> list[tuple[int, bool]]:
    """(index, counts) for this rank; ``padded``: every rank gets the same number of items (dummies
    repeat item 0), for calls that are collectives.

    Validation runs on whole, unsplit sequences, so the items are split over every rank of the job,
    the ranks of a sequence-parallel group included (they no longer repeat each other's items: an SP
    group validates sp_size times faster).
    """
    per_rank = math.ceil(len(items) / d.world_size)
    mine = list(range(d.rank, len(items), d.world_size))
    return [(i, True) for i in mine] + [(0, False)] * (per_rank - len(mine) if padded else 0)


def weight_gb(model) -> float:
    """The model's parameters whole, in GB (also while ZeRO-3 holds only a partition)."""
    return sum(full_shape(p).numel() * p.element_size() for p in model.parameters()) / 1e9


def whole_copy(model, attn: str, device: torch.device):
    """A plain copy of ZeRO-3 partitioned ``model`` on this rank, each weight gathered in turn (a
    collective: every rank calls it); attention ``attn`` (the model's own, not the sequence-parallel
    one), eval mode, on ``device``. Costs the model's weights once more on this rank while it lives."""
    import deepspeed
    from transformers.initialization import no_init_weights

    config = copy.deepcopy(model.config)
    config._attn_implementation = attn
    dtype = next(model.parameters()).dtype
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with no_init_weights(), torch.device(device):
            twin = type(model)(config)  # the class itself: from_config would partition it (HfDeepSpeedConfig is live)
    finally:
        torch.set_default_dtype(saved)
    twin.tie_weights()  # the class's constructor leaves a tied head untied
    mine = dict(twin.named_parameters())
    theirs = dict(model.named_parameters())  # tied weights appear once, in both
    if mine.keys() != theirs.keys():
        raise RuntimeError(f"validation: the model's copy has other parameters ({sorted(mine.keys() ^ theirs.keys())})")
    for name, p in theirs.items():
        with deepspeed.zero.GatheredParameters([p]):
            mine[name].data.copy_(p.data)
    for name, b in model.named_buffers():
        twin.get_buffer(name).copy_(b)
    if getattr(model, "generation_config", None) is not None:  # a checkpoint's own generation defaults
        twin.generation_config = copy.deepcopy(model.generation_config)
    return twin.eval()


@contextlib.contextmanager
def generation_model(engine, attn: str, whole_model_gb: float, device: torch.device):
    """``(model, synced)`` to generate with: a whole copy (:func:`whole_copy`) when the engine's model
    is ZeRO-3 partitioned and fits in ``whole_model_gb``, else the engine's model; ``synced``: its
    forward is a collective (ZeRO-3 gathers), so every rank must call it as often as the others."""
    model = engine.module
    zero3 = engine.zero_optimization_partition_weights()
    if zero3 and weight_gb(model) <= whole_model_gb:
        yield whole_copy(model, attn, device), False
        return
    model.eval()
    try:
        yield model, zero3
    finally:
        model.train()


@torch.no_grad()
def generate_judgements(engine, tokenizer, items: list[Encoded], d: Dist, max_new_tokens: int,
                        attn: str = "sdpa", whole_model_gb: float = 0.0, batch_tokens: int = 0) -> list[dict]:
    """Greedy judgements for ``items``; returns rows in ``longsft score`` format, on every rank.
    ``batch_tokens`` > 0: this rank's items generated together in left-padded batches of that many tokens
    (:func:`~longsft.train.model.generate.generate_many`; ranks in step make as many calls as the rank
    with the most batches)."""
    with generation_model(engine, attn, whole_model_gb, d.device) as (model, synced):
        mine = _shard(items, d, padded=synced)
        prompts = [[int(t) for t in items[i].input_ids[: items[i].prompt_len]] for i, _ in mine]
        synced = synced and d.world_size > 1
        calls = len(batches([len(p) for p in prompts], batch_tokens, max_new_tokens))
        outs = generate_many(model, prompts, max_new_tokens, tokenizer.pad_token_id, tokenizer.eos_token_id,
                             batch_tokens, d.device, synced, comm.max_over_ranks(calls) if synced else 0)
    rows = []
    for (i, real), new in zip(mine, outs):
        if real:
            s, text = items[i].meta, tokenizer.decode(new, skip_special_tokens=True)
            rows.append({"id": s.id, "prediction": text, "gold_score": s.gold_score, "bucket": s.bucket,
                         "language": s.language, "types": list(s.types)})
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


def key_rows(model, key: DecisionKey) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM head's weight rows (and bias) of the hallucinated and the faithful key, fp32: [2, hidden]
    ([2]). Under ZeRO-3 the head is gathered for it: a collective, every rank calls it."""
    head = model.get_output_embeddings()
    params = [p for p in (head.weight, getattr(head, "bias", None)) if p is not None]
    rows = [key.hallucinated, key.faithful]
    whole = contextlib.nullcontext()
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        whole = deepspeed.zero.GatheredParameters(params)
    with whole:
        w = head.weight[rows].float().clone()
        b = head.bias[rows].float().clone() if getattr(head, "bias", None) is not None else None
    return w, b


@torch.no_grad()
def decision_log_odds(engine, items: list[Encoded], key: DecisionKey, d: Dist, pad_id: int) -> list[float]:
    """log p(hallucinated key) - log p(faithful key) for each item (:mod:`~longsft.train.training.decision`),
    in ``items``' order, on every rank: one forward per item over its prompt and the answer tokens both
    classes share (ranks padded to the same count: under ZeRO-3 each forward is a collective). The two
    logits are the final hidden state times the head's two rows in fp32: bf16 logits of magnitude 16-32
    lie 0.125 apart, as coarse as the log-odds being ranked."""
    model = engine.module
    w, b = key_rows(model, key)
    cap = logit_softcap(model)
    model.eval()
    mine = []
    try:
        for i, real in _shard(items, d):
            e = items[i]
            head = Encoded(e.meta, e.input_ids[:e.prompt_len + key.offset], e.prompt_len)
            batch = {k: v.to(d.device) for k, v in collate([head], pad_id).items()}
            ids = batch["input_ids"]
            out = model(input_ids=ids, attention_mask=batch["attention_mask"], position_ids=batch["position_ids"],
                        use_cache=False, logits_to_keep=torch.zeros_like(ids, dtype=torch.bool),
                        output_hidden_states=LAST_HIDDEN_STATE)
            z = w @ out.hidden_states[-1][0, -1].float()  # [2]: the two keys' logits
            z = z + b if b is not None else z
            z = cap * torch.tanh(z / cap) if cap else z
            if real:
                mine.append((i, float(z[0] - z[1])))
    finally:
        model.train()
    odds = dict(pair for part in all_gather_objects(mine) for pair in part)
    return [odds[i] for i in range(len(items))]


def run_validation(engine, tokenizer, items: list[Encoded], d: Dist, max_new_tokens: int, policy: str,
                   with_loss: bool, pad_id: int, chunk_tokens: int = 0, attn: str = "sdpa",
                   whole_model_gb: float = 0.0, batch_tokens: int = 0, decision: bool = False) -> tuple[dict, list[dict]]:
    """Judgements -> shared scorer metrics (+ validation loss; + ``decision``: the decision token's
    log-odds AUC and mean, None where the answers have no one decision token). Identical on every rank."""
    rows = generate_judgements(engine, tokenizer, items, d, max_new_tokens, attn, whole_model_gb, batch_tokens)
    scored = [Item(id=r["id"], prediction=r["prediction"], gold_score=r["gold_score"], bucket=r["bucket"],
                   language=r["language"], gold_types=tuple(r["types"])) for r in rows]
    result = score_items(scored, policy)
    metrics = {k: result[k] for k in ("balanced_accuracy", "mcc", "invalid_rate", "contradiction_rate", "n")}
    metrics["val_loss"] = validation_loss(engine, items, d, pad_id, chunk_tokens) if with_loss else float("nan")
    key = decision_key(items) if decision else None
    metrics.update(decision_metrics(items, decision_log_odds(engine, items, key, d, pad_id) if key else None))
    return metrics, rows


def is_better(new: dict, best: dict | None) -> bool:
    """Balanced Accuracy, then MCC, then the decision's AUC (how well the model ranks the items while
    its answers tie: a constant answer ties every other at BA 0.5, MCC 0), then lower validation loss."""
    if best is None:
        return True

    def auc(m: dict) -> float | None:
        a = m.get("decision_auc", "absent")
        return None if a == "absent" else float("-inf") if a is None or a != a else round(a, 12)

    def key(m: dict, with_auc: bool) -> tuple:
        loss = m.get("val_loss")
        loss = float("inf") if loss is None or loss != loss else loss
        return (round(m["balanced_accuracy"], 12), round(m["mcc"], 12), *([auc(m)] if with_auc else []), -loss)

    # a best kept before the metric existed (a resumed older run) has none: compare without it
    with_auc = auc(new) is not None and auc(best) is not None
    return key(new, with_auc) > key(best, with_auc)
