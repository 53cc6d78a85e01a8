"""Percentile bootstrap confidence intervals for BA / MCC, and the paired bootstrap for comparing
two systems on the same items (LongNovel Table 5 needs the paired one).

Resampling is stratified by the gold label (each class is resampled within itself), so every
replicate keeps the test set's class balance and BA stays defined.

BA and MCC depend on a replicate only through its confusion counts, so replicates are drawn as
counts: resampling the ``n_c`` items of gold class ``c`` with replacement puts a multinomial number
of them in each prediction pattern (one system: predicted 0/1; two systems: the four (a, b)
pairs). That is the same distribution as drawing ``[replicates, items]`` indices, at a cost that
does not grow with the number of items (100,000 items x 2,000 replicates in milliseconds).
tests/test_bootstrap.py checks the per-replicate metrics against scikit-learn on the item sets the
counts describe, the count draws against the laws of index resampling (a chi-square fit, the paired
moments), and each interval against the stated percentiles of its replicates.
"""

from __future__ import annotations

import numpy as np


def replicate_counts(y_true: np.ndarray, preds: list[np.ndarray], n: int, seed: int) -> dict[str, np.ndarray]:
    """Confusion counts ``tp, fn, tn, fp`` as [systems, n] arrays over ``n`` stratified replicates."""
    rng = np.random.default_rng(seed)
    P = np.stack([np.asarray(p, dtype=np.int64) for p in preds])  # [systems, items]
    bits = 2 ** np.arange(len(P))[:, None]
    out = {k: np.zeros((len(P), n)) for k in ("tp", "fn", "tn", "fp")}
    for label in (1, 0):
        members = y_true == label
        size = int(members.sum())
        if size == 0:
            continue
        codes = (P[:, members] * bits).sum(0)  # each item's prediction pattern across the systems
        freq = np.bincount(codes, minlength=2 ** len(P)) / size
        draws = rng.multinomial(size, freq, size=n)  # [n, patterns]
        for s in range(len(P)):
            said_yes = draws[:, (np.arange(2 ** len(P)) >> s) & 1 == 1].sum(1)
            out["tp" if label else "fp"][s] = said_yes
            out["fn" if label else "tn"][s] = size - said_yes
    return out


def from_counts(tp, tn, fp, fn) -> dict[str, np.ndarray]:
    """BA and MCC from confusion counts (arrays), with scikit-learn's conventions."""
    tp, tn, fp, fn = (np.asarray(x, dtype=float) for x in (tp, tn, fp, fn))
    with np.errstate(invalid="ignore", divide="ignore"):
        pos, neg = tp + fn, tn + fp
        rec_pos, rec_neg = np.where(pos > 0, tp / pos, np.nan), np.where(neg > 0, tn / neg, np.nan)
        ba = np.nanmean(np.stack([rec_pos, rec_neg]), axis=0)
        denom = np.sqrt((tp + fp) * pos * neg * (tn + fn))
        mcc = np.where(denom > 0, (tp * tn - fp * fn) / denom, 0.0)
    return {"balanced_accuracy": ba, "mcc": mcc}


def _replicates(t: np.ndarray, preds: list[np.ndarray], n: int, seed: int) -> list[dict[str, np.ndarray]]:
    """Per system: {metric: [n] values over the same resampled item sets}."""
    c = replicate_counts(t, preds, n, seed)
    return [from_counts(c["tp"][s], c["tn"][s], c["fp"][s], c["fn"][s]) for s in range(len(preds))]


def _metrics(t: np.ndarray, p: np.ndarray) -> dict[str, np.ndarray]:
    """BA and MCC per row of [n, items] label matrices."""
    return from_counts(((t == 1) & (p == 1)).sum(1), ((t == 0) & (p == 0)).sum(1), ((t == 0) & (p == 1)).sum(1),
                       ((t == 1) & (p == 0)).sum(1))


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
