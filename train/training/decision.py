"""Where the model decides: the answer token at which the two classes part, and its log-odds there.

The task's answers of the two classes share their first tokens (``{"``) and part at one:
``score`` (faithful) or ``reason`` (hallucinated, :func:`~longsft.train.data.prompts.render_target`).
Every later token follows from that one, so the model's log-odds of the hallucinated key over the
faithful one, read teacher-forced after the prompt and the shared tokens, is its decision as a number.
Over the validation items its ROC AUC says whether the model ranks the items right even while greedy
decoding gives all of them one label (a lean that a few hundred steps do not wash out; issue 34), and
the mean says which way it leans and how far. The keys are read from the items' own encoded answers,
so any answer format whose classes part at one token has the metric; one that does not has None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from longsft.train.data.encoding import Encoded
from longsft.train.scoring.metrics import gold_label, roc_auc


@dataclass(frozen=True)
class DecisionKey:
    """Where the answers part: after ``offset`` shared answer tokens, ``faithful`` or ``hallucinated``
    (token ids)."""

    offset: int
    faithful: int
    hallucinated: int


def decision_key(items: Sequence[Encoded]) -> DecisionKey | None:
    """Where the faithful and the hallucinated answers of ``items`` part (all languages: the answer's
    JSON keys are the same words in each).

    None without both classes, or when the answers do not all share the same tokens up to one point
    and then the same key per class (free-form or translated answers: no single decision token).
    """
    answers: tuple[list, list] = ([], [])  # (faithful, hallucinated)
    for e in items:
        answers[gold_label(e.meta.gold_score)].append([int(t) for t in e.input_ids[e.prompt_len:]])
    faithful, hallucinated = answers
    if not faithful or not hallucinated:
        return None
    f, h = faithful[0], hallucinated[0]
    k = 0
    while k < min(len(f), len(h)) and f[k] == h[k]:
        k += 1
    if k == min(len(f), len(h)):
        return None
    if any(a[:k + 1] != f[:k + 1] for a in faithful) or any(a[:k + 1] != h[:k + 1] for a in hallucinated):
        return None
    return DecisionKey(k, f[k], h[k])


def decision_metrics(items: Sequence[Encoded], log_odds: Sequence[float] | None) -> dict:
    """``decision_auc``: ROC AUC of the log-odds for the hallucinated class (scikit-learn's
    ``roc_auc_score``); ``decision_log_odds``: their mean (> 0: the model leans "hallucinated").
    Both None without log-odds (no decision key) or, for the AUC, without both classes."""
    if log_odds is None or not items:
        return {"decision_auc": None, "decision_log_odds": None}
    gold = [gold_label(e.meta.gold_score) for e in items]
    return {"decision_auc": roc_auc(gold, log_odds), "decision_log_odds": sum(log_odds) / len(log_odds)}
