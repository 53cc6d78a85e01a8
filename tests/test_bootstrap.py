"""Bootstrap CIs: reproducible with a seed; per-replicate metrics equal scikit-learn on the item sets
the replicate counts describe; the count draws have the index-resampling laws (chi-square, moments);
intervals are exactly the stated percentiles of the replicates."""

import numpy as np
import pytest
from sklearn.metrics import balanced_accuracy_score, matthews_corrcoef

from longsft.train.scoring.bootstrap import bootstrap_ci, from_counts, paired_bootstrap, replicate_counts


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


def _binomial_fit(x: np.ndarray, trials: int, share: float) -> float:
    """Chi-square p-value of the sample ``x`` against Binomial(trials, share) (bins of >= 20 expected)."""
    from scipy.stats import binom, chisquare

    k = np.arange(trials + 1)
    expected = binom.pmf(k, trials, share) * len(x)
    observed = np.bincount(x.astype(int), minlength=trials + 1)[: trials + 1]
    if observed.sum() < len(x):  # draws beyond the support: not this distribution at all
        return 0.0
    edges = [0]  # merge neighbouring values until each bin expects >= 20
    acc = 0.0
    for i, e in enumerate(expected):
        acc += e
        if acc >= 20:
            edges.append(i + 1)
            acc = 0.0
    edges[-1] = trials + 1
    obs = np.add.reduceat(observed, edges[:-1])
    exp = np.add.reduceat(expected, edges[:-1])
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def test_replicate_counts_follow_the_index_resampling_distribution():
    """Resampling the n_c items of gold class c with replacement, the number a system predicts positive
    is Binomial(n_c, its positive share in c), and B - A of two systems is N01 - N10 of a multinomial.
    The count draws must have exactly these laws (a chi-square fit over 200,000 replicates), and the
    fit rejects a shifted law and one of the same mean with another spread."""
    t, p = _data(n=600, acc=0.7)
    c = replicate_counts(t, [p], 200_000, seed=5)
    for label, key in ((1, "tp"), (0, "fp")):
        size, share = int((t == label).sum()), float(p[t == label].mean())
        assert _binomial_fit(c[key][0], size, share) > 1e-3, key
        assert _binomial_fit(c[key][0], size, share + 0.01) < 1e-6  # a shifted law is rejected
        assert _binomial_fit(c[key][0], 2 * size, share / 2) < 1e-6  # so is the same mean with another spread
    b = np.where(np.random.default_rng(9).random(len(t)) < 0.8, p, 1 - p)
    c2 = replicate_counts(t, [p, b], 200_000, seed=6)
    pos = t == 1
    f01, f10 = float(((p == 0) & (b == 1))[pos].mean()), float(((p == 1) & (b == 0))[pos].mean())
    size = int(pos.sum())
    d = c2["tp"][1] - c2["tp"][0]
    mean, var = size * (f01 - f10), size * (f01 + f10 - (f01 - f10) ** 2)
    assert d.mean() == pytest.approx(mean, abs=5 * np.sqrt(var / len(d)))
    assert d.var() == pytest.approx(var, rel=0.02)  # the pairing: independent resamples would add both variances


def test_intervals_are_the_stated_percentiles_of_the_replicates():
    """The labelled level is the level: 95% is the 2.5th and 97.5th percentile of these replicates, exactly."""
    from longsft.train.scoring.bootstrap import _replicates

    t, p = _data(acc=0.7)
    (reps,) = _replicates(t, [p], 4000, seed=1)
    ci = bootstrap_ci(t, p, n=4000, seed=1)
    for key, v in reps.items():
        assert [ci[key]["low"], ci[key]["high"]] == pytest.approx(np.percentile(v, [2.5, 97.5]), abs=1e-12)
    assert bootstrap_ci(t, p, n=4000, seed=1, level=0.93) != ci
    b = np.where(np.random.default_rng(3).random(len(t)) < 0.8, t, 1 - t)
    ra, rb = _replicates(t, [p, b], 4000, seed=2)
    res = paired_bootstrap(t, p, b, n=4000, seed=2)
    for key in ra:
        diff = rb[key] - ra[key]
        assert [res[key]["low"], res[key]["high"]] == pytest.approx(np.percentile(diff, [2.5, 97.5]), abs=1e-12)
        assert res[key]["p_value"] == min(1.0, 2 * min((diff <= 0).mean(), (diff >= 0).mean()))


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
