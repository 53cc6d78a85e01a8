"""Bootstrap CIs: reproducible with a seed; per-replicate metrics equal scikit-learn on the item sets
the replicate counts describe; intervals equal an index-resampling reference up to sampling noise."""

import numpy as np
import pytest
from sklearn.metrics import balanced_accuracy_score, matthews_corrcoef

from longsft.eval.scoring.bootstrap import bootstrap_ci, from_counts, paired_bootstrap, replicate_counts


def _data(n=600, seed=1, acc=0.75):
    rng = np.random.default_rng(seed)
    t = rng.integers(0, 2, n)
    p = np.where(rng.random(n) < acc, t, 1 - t)
    return t, p


def test_reproducible_with_a_seed():
    t, p = _data()
    assert bootstrap_ci(t, p, n=500, seed=3) == bootstrap_ci(t, p, n=500, seed=3)
    assert bootstrap_ci(t, p, n=500, seed=3) != bootstrap_ci(t, p, n=500, seed=4)


def test_replicate_metrics_equal_sklearn_on_the_items_they_describe():
    t, p = _data()
    a = np.where(np.random.default_rng(9).random(len(t)) < 0.5, p, 1 - p)
    c = replicate_counts(t, [p, a], 50, seed=11)
    for s in range(2):
        m = from_counts(c["tp"][s], c["tn"][s], c["fp"][s], c["fn"][s])
        for r in range(50):
            tp, tn, fp, fn = (int(c[k][s, r]) for k in ("tp", "tn", "fp", "fn"))
            assert tp + fn == (t == 1).sum() and tn + fp == (t == 0).sum()  # stratified: class counts kept
            yt = np.array([1] * (tp + fn) + [0] * (tn + fp))
            yp = np.array([1] * tp + [0] * fn + [0] * tn + [1] * fp)
            assert m["balanced_accuracy"][r] == pytest.approx(balanced_accuracy_score(yt, yp))
            assert m["mcc"][r] == pytest.approx(matthews_corrcoef(yt, yp))


def test_intervals_equal_an_index_resampling_reference():
    t, p = _data(acc=0.7)
    rng = np.random.default_rng(0)
    pos, neg = np.flatnonzero(t == 1), np.flatnonzero(t == 0)
    ba, mcc = [], []
    for _ in range(4000):  # the textbook stratified bootstrap: resample item indices within each class
        i = np.concatenate([rng.choice(pos, len(pos)), rng.choice(neg, len(neg))])
        ba.append(balanced_accuracy_score(t[i], p[i]))
        mcc.append(matthews_corrcoef(t[i], p[i]))
    ci = bootstrap_ci(t, p, n=4000, seed=1)
    for key, ref in (("balanced_accuracy", ba), ("mcc", mcc)):
        assert ci[key]["low"] == pytest.approx(np.percentile(ref, 2.5), abs=0.008)
        assert ci[key]["high"] == pytest.approx(np.percentile(ref, 97.5), abs=0.008)


def test_interval_width_matches_the_expected_scale():
    t, p = _data(n=600, acc=0.7)
    ci = bootstrap_ci(t, p, n=2000)["balanced_accuracy"]
    assert 0.05 < ci["high"] - ci["low"] < 0.09  # shared/notes/eval.md: about +-3.6 points at 600 items
    assert ci["low"] < balanced_accuracy_score(t, p) < ci["high"]


def test_paired_bootstrap():
    t, a = _data(seed=2, acc=0.6)
    same = paired_bootstrap(t, a, a, n=500)
    assert same["balanced_accuracy"]["diff"] == 0 and same["balanced_accuracy"]["p_value"] == 1.0
    better = np.where(np.random.default_rng(5).random(len(t)) < 0.9, t, 1 - t)
    res = paired_bootstrap(t, a, better, n=2000)["balanced_accuracy"]
    assert res["diff"] == pytest.approx(balanced_accuracy_score(t, better) - balanced_accuracy_score(t, a))
    assert res["low"] > 0 and res["p_value"] < 0.01
