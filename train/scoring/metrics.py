"""The shared scorer: judgements + gold scores -> Balanced Accuracy, MCC and breakdowns.

Positive class = hallucinated (gold score <= 2). Invalid outputs stay in the denominator; how
they count is the ``invalid_policy``:

- ``wrong`` (default): an invalid output is scored as the opposite of the gold label;
- ``hallucinated`` / ``faithful``: an invalid output is read as that label (a fixed guess).

BA and MCC equal scikit-learn's ``balanced_accuracy_score`` and ``matthews_corrcoef`` on the
resulting labels (tests/test_scorer.py checks it).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Literal, Sequence

from longsft.train.scoring.bootstrap import bootstrap_ci
from longsft.train.scoring.judgement import TYPES, Judgement, parse_judgement

InvalidPolicy = Literal["wrong", "hallucinated", "faithful"]


@dataclass
class Item:
    """One scored prediction. ``gold_types`` are canonical type names (may be empty)."""

    id: str
    prediction: str
    gold_score: int
    bucket: str | None = None
    language: str | None = None
    gold_types: tuple[str, ...] = ()


def gold_label(score: float) -> int:
    """1 = hallucinated (score <= 2), 0 = faithful."""
    return int(score < 3)


def predicted_label(j: Judgement, gold: int, policy: InvalidPolicy = "wrong") -> int:
    if j.valid:
        return int(j.hallucinated)
    if policy == "wrong":
        return 1 - gold
    return int(policy == "hallucinated")


def binary_metrics(y_true: list[int], y_pred: list[int]) -> dict[str, float]:
    """Balanced Accuracy and MCC with scikit-learn's conventions (no sklearn import at run time)."""
    tp = sum(1 for t, p in zip(y_true, y_pred) if t == 1 and p == 1)
    tn = sum(1 for t, p in zip(y_true, y_pred) if t == 0 and p == 0)
    fp = sum(1 for t, p in zip(y_true, y_pred) if t == 0 and p == 1)
    fn = sum(1 for t, p in zip(y_true, y_pred) if t == 1 and p == 0)
    recalls = [tp / (tp + fn)] if tp + fn else []
    recalls += [tn / (tn + fp)] if tn + fp else []
    ba = sum(recalls) / len(recalls) if recalls else float("nan")
    denom = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    mcc = (tp * tn - fp * fn) / denom if denom else 0.0
    return {"balanced_accuracy": ba, "mcc": mcc, "tp": tp, "tn": tn, "fp": fp, "fn": fn}


def roc_auc(y_true: Sequence[int], scores: Sequence[float]) -> float | None:
    """Area under the ROC curve of ``scores`` for class 1 (scikit-learn's ``roc_auc_score``: tied
    scores count half), as the Mann-Whitney statistic over average ranks; None without both classes or
    with a score that is not a finite number (scikit-learn raises there)."""
    pos = sum(1 for t in y_true if t == 1)
    neg = len(y_true) - pos
    if pos == 0 or neg == 0 or not all(math.isfinite(s) for s in scores):
        return None
    order = sorted(range(len(scores)), key=lambda i: scores[i])
    ranks = [0.0] * len(scores)
    i = 0
    while i < len(order):  # a run of tied scores shares the mean of its ranks (1-based)
        j = i
        while j + 1 < len(order) and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    rank_sum = sum(r for r, t in zip(ranks, y_true) if t == 1)
    return (rank_sum - pos * (pos + 1) / 2) / (pos * neg)


def labels(items: Iterable[Item], policy: InvalidPolicy = "wrong") -> tuple[list[int], list[int]]:
    """(gold, predicted) binary labels, 1 = hallucinated; invalid outputs per ``policy``."""
    gold = [gold_label(it.gold_score) for it in items]
    pred = [predicted_label(parse_judgement(it.prediction), g, policy) for it, g in zip(items, gold)]
    return gold, pred


def bucket_order(name: str) -> tuple:
    """Sort '2k' < '16k' < '100k' numerically, anything else alphabetically after."""
    digits = "".join(ch for ch in name if ch.isdigit())
    return (0, int(digits), name) if digits else (1, 0, name)


def score_items(items: Iterable[Item], policy: InvalidPolicy = "wrong", bootstrap: int = 0, seed: int = 0) -> dict:
    """Overall metrics plus per-bucket, per-language and per-type breakdowns.

    Returns a JSON-ready dict with at least ``balanced_accuracy``, ``mcc``, ``invalid_rate``,
    ``contradiction_rate`` and ``n``; with ``bootstrap > 0`` also ``ci`` (95 % stratified
    percentile intervals of BA and MCC) overall and per bucket/language.
    """
    rows = []
    for it in items:
        j = parse_judgement(it.prediction)
        gold = gold_label(it.gold_score)
        rows.append((it, j, gold, predicted_label(j, gold, policy)))
    result = _summary(rows, bootstrap, seed)
    result["invalid_policy"] = policy
    for name, key in (("by_bucket", lambda it: it.bucket), ("by_language", lambda it: it.language)):
        groups: dict[str, list] = defaultdict(list)
        for r in rows:
            if key(r[0]) is not None:
                groups[str(key(r[0]))].append(r)
        result[name] = {k: _summary(v, bootstrap, seed)
                        for k, v in sorted(groups.items(), key=lambda kv: bucket_order(kv[0]))}
    result["by_type"] = _type_recall(rows)
    return result


def _summary(rows: list, bootstrap: int = 0, seed: int = 0) -> dict:
    m = binary_metrics([r[2] for r in rows], [r[3] for r in rows])
    if bootstrap and rows:
        m["ci"] = bootstrap_ci([r[2] for r in rows], [r[3] for r in rows], n=bootstrap, seed=seed)
    n = len(rows)
    m["n"] = n
    m["invalid_rate"] = sum(1 for r in rows if not r[1].valid) / n if n else 0.0
    m["contradiction_rate"] = sum(1 for r in rows if r[1].contradiction) / n if n else 0.0
    m["accuracy"] = sum(1 for r in rows if r[2] == r[3]) / n if n else float("nan")
    return m


def _type_recall(rows: list) -> dict:
    """Per gold type: detection recall (flagged hallucinated) and type-match recall (type named)."""
    out = {}
    for t in TYPES:
        with_t = [r for r in rows if t in r[0].gold_types]
        if not with_t:
            continue
        out[t] = {
            "n": len(with_t),
            "detection_recall": sum(r[3] for r in with_t) / len(with_t),
            "type_recall": sum(1 for r in with_t if r[1].valid and t in r[1].types) / len(with_t),
        }
    return out
