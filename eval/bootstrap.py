"""Percentile bootstrap confidence intervals for BA / MCC, and the paired bootstrap for comparing
two systems on the same items (LongNovel Table 5 needs the paired one).

Resampling is stratified by the gold label (each class is resampled within itself), so every
replicate keeps the test set's class balance and BA stays defined. Vectorised: ``n`` replicates
are one ``[n, items]`` index matrix, and the metrics come from confusion counts per replicate.
"""

from __future__ import annotations

import numpy as np


def _indices(y_true: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """[n, len(y_true)] resampled item indices, stratified by gold label."""
    cols = []
    for label in np.unique(y_true):
        members = np.flatnonzero(y_true == label)
        cols.append(members[rng.integers(0, len(members), size=(n, len(members)))])
    return np.concatenate(cols, axis=1)


def index_chunks(y_true: np.ndarray, n: int, rng: np.random.Generator, chunk: int = 256):
    """The ``n`` replicates' index matrices, ``chunk`` replicates at a time."""
    for start in range(0, n, chunk):
        yield _indices(y_true, min(chunk, n - start), rng)


def _replicates(t: np.ndarray, preds: list[np.ndarray], n: int, seed: int) -> list[dict[str, np.ndarray]]:
    """Per system: {metric: [n] values over the same resampled item sets}."""
    parts: list[list[dict]] = [[] for _ in preds]
    for idx in index_chunks(t, n, np.random.default_rng(seed)):
        for j, p in enumerate(preds):
            parts[j].append(_metrics(t[idx], p[idx]))
    return [{k: np.concatenate([m[k] for m in ms]) for k in ms[0]} for ms in parts]


def _metrics(t: np.ndarray, p: np.ndarray) -> dict[str, np.ndarray]:
    """BA and MCC per row of [n, items] label matrices (scikit-learn's conventions)."""
    tp = ((t == 1) & (p == 1)).sum(1).astype(float)
    tn = ((t == 0) & (p == 0)).sum(1).astype(float)
    fp = ((t == 0) & (p == 1)).sum(1).astype(float)
    fn = ((t == 1) & (p == 0)).sum(1).astype(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        pos, neg = tp + fn, tn + fp
        rec_pos, rec_neg = np.where(pos > 0, tp / pos, np.nan), np.where(neg > 0, tn / neg, np.nan)
        ba = np.nanmean(np.stack([rec_pos, rec_neg]), axis=0)
        denom = np.sqrt((tp + fp) * pos * neg * (tn + fn))
        mcc = np.where(denom > 0, (tp * tn - fp * fn) / denom, 0.0)
    return {"balanced_accuracy": ba, "mcc": mcc}


def bootstrap_ci(y_true, y_pred, n: int = 2000, seed: int = 0, level: float = 0.95) -> dict[str, dict]:
    """{metric: {"low", "high"}} percentile intervals from ``n`` stratified replicates."""
    t, p = np.asarray(y_true), np.asarray(y_pred)
    (reps,) = _replicates(t, [p], n, seed)
    q = [(1 - level) / 2 * 100, (1 + level) / 2 * 100]
    return {k: dict(zip(("low", "high"), np.percentile(v, q).tolist())) for k, v in reps.items()}


def paired_bootstrap(y_true, pred_a, pred_b, n: int = 2000, seed: int = 0, level: float = 0.95) -> dict[str, dict]:
    """B - A per metric on the same resampled items: observed difference, interval, two-sided p-value."""
    t, a, b = np.asarray(y_true), np.asarray(pred_a), np.asarray(pred_b)
    ra, rb = _replicates(t, [a, b], n, seed)
    obs_a, obs_b = _metrics(t[None], a[None]), _metrics(t[None], b[None])
    q = [(1 - level) / 2 * 100, (1 + level) / 2 * 100]
    out = {}
    for k in ra:
        diff = rb[k] - ra[k]
        # share of replicates on the far side of zero, doubled; 1.0 when the systems never differ
        p = 1.0 if np.all(diff == 0) else min(1.0, 2 * min((diff <= 0).mean(), (diff >= 0).mean()))
        low, high = np.percentile(diff, q).tolist()
        out[k] = {"diff": float(obs_b[k][0] - obs_a[k][0]), "low": low, "high": high, "p_value": float(p)}
    return out
