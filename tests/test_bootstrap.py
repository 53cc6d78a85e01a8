"""Bootstrap CIs: reproducible with a seed, equal to a direct per-replicate computation."""

import numpy as np
import pytest
from sklearn.metrics import balanced_accuracy_score, matthews_corrcoef

from longsft.eval.bootstrap import bootstrap_ci, index_chunks, paired_bootstrap


def _data(n=600, seed=1, acc=0.75):
    rng = np.random.default_rng(seed)
    t = rng.integers(0, 2, n)
    p = np.where(rng.random(n) < acc, t, 1 - t)
    return t, p


def test_reproducible_with_a_seed():
    t, p = _data()
    assert bootstrap_ci(t, p, n=500, seed=3) == bootstrap_ci(t, p, n=500, seed=3)
    assert bootstrap_ci(t, p, n=500, seed=3) != bootstrap_ci(t, p, n=500, seed=4)


def test_equals_direct_computation():
    t, p = _data()
    n, seed = 300, 11
    idx = np.concatenate(list(index_chunks(t, n, np.random.default_rng(seed))))
    ba = [balanced_accuracy_score(t[i], p[i]) for i in idx]
    mcc = [matthews_corrcoef(t[i], p[i]) for i in idx]
    ci = bootstrap_ci(t, p, n=n, seed=seed)
    assert ci["balanced_accuracy"]["low"] == pytest.approx(np.percentile(ba, 2.5))
    assert ci["balanced_accuracy"]["high"] == pytest.approx(np.percentile(ba, 97.5))
    assert ci["mcc"]["low"] == pytest.approx(np.percentile(mcc, 2.5))
    # stratified: every replicate keeps the class counts
    assert all((t[i] == 1).sum() == (t == 1).sum() for i in idx)


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
