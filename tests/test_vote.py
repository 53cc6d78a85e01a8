"""`longsft vote`: the majority-vote ensemble over eval runs, scored like any run (against sklearn)."""

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT

from longsft.train.scoring.metrics import labels
from longsft.train.scoring.score import load_predictions

CLI = [sys.executable, "-m", "longsft.launch.cli"]


def cli(*args):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)


def _run(root, name, answers, gold, policy="wrong", ids=None):
    """An eval run whose answer per item is 'h' (score 2, types), 'f' (score 5) or 'x' (invalid text)."""
    run = root / name
    run.mkdir()
    text = {"h": json.dumps({"reason": "r", "score": 2, "hallucination_types": ["Entity"]}),
            "f": json.dumps({"score": 5, "reason": "r"}), "x": "I cannot tell."}
    recs = [{"id": i, "gold_score": g, "bucket": "512", "language": "en", "types": ["entity"] if g <= 2 else [],
             "prediction": text[a]} for i, a, g in zip(ids or [f"s{k}" for k in range(len(gold))], answers, gold)]
    (run / "predictions_r0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "eval.json").write_text(json.dumps({"name": name, "invalid_policy": policy, "repeats": 1, "prompt": "end",
                                               "data": "test.jsonl", "generation": {"prompt_tokens": 10,
                                                                                    "gen_tokens": 2, "failed": 0}}))
    return run


@pytest.mark.parametrize("policy", ["wrong", "hallucinated", "faithful"])
def test_vote_is_the_majority_of_the_members_read_by_the_scorers_invalid_policy(tmp_path, policy):
    from sklearn.metrics import balanced_accuracy_score, matthews_corrcoef

    rng = np.random.default_rng(1)
    gold = [int(g) for g in rng.choice([1, 2, 4, 5], 120)]
    runs = [_run(tmp_path, f"m{k}", rng.choice(list("hhffx"), 120), gold, policy) for k in range(3)]
    out = tmp_path / "vote"
    r = cli("vote", *map(str, runs), "--out", str(out), "--bootstrap", "100")
    assert r.returncode == 0, r.stderr
    t = [int(g <= 2) for g in gold]
    # each member's label exactly as the scorer reads it, then two of three
    member = [labels(load_predictions(run / "predictions_r0.jsonl"), policy)[1] for run in runs]
    expected = [int(sum(v) >= 2) for v in zip(*member)]
    got = labels(load_predictions(out / "predictions_r0.jsonl"), policy)[1]
    assert got == expected and 0 < sum(expected) < 120
    summary = json.loads((out / "eval.json").read_text())
    assert summary["scores"][0]["invalid_rate"] == 0  # the ensemble always answers
    assert summary["scores"][0]["balanced_accuracy"] == pytest.approx(balanced_accuracy_score(t, expected), abs=1e-12)
    assert summary["scores"][0]["mcc"] == pytest.approx(matthews_corrcoef(t, expected), abs=1e-12)
    assert summary["n"] == 120 and summary["generation"]["prompt_tokens"] == 30
    if policy == "wrong":  # an invalid answer votes against the gold label: invalid members are all wrong
        (tmp_path / "x").mkdir()
        x = [_run(tmp_path / "x", f"x{k}", ["x"] * 120, gold) for k in range(3)]
        assert cli("vote", *map(str, x), "--out", str(tmp_path / "vx")).returncode == 0
        assert json.loads((tmp_path / "vx" / "eval.json").read_text())["scores"][0]["balanced_accuracy"] == 0


def test_the_vote_is_an_eval_run_that_report_and_compare_read(tmp_path):
    gold = [1, 4] * 30
    right = ["h", "f"] * 30
    wrong = ["f", "h"] * 30
    runs = [_run(tmp_path, "a", right, gold), _run(tmp_path, "b", right[:40] + wrong[40:], gold),
            _run(tmp_path, "c", wrong[:20] + right[20:], gold)]
    out = tmp_path / "v"
    assert cli("vote", *map(str, runs), "--out", str(out), "--name", "v3").returncode == 0
    preds = [json.loads(x) for x in (out / "predictions_r0.jsonl").read_text().splitlines()]
    assert [p["votes"] for p in preds[:2]] == [2, 1]  # item 0 (gold 1): a, b right; item 1 (gold 4): only c wrong
    assert json.loads(preds[0]["prediction"]) == {"reason": "majority vote: 2 of 3 members say hallucinated",
                                                  "score": 2, "hallucination_types": ["entity"]}
    assert json.loads((out / "eval.json").read_text())["scores"][0]["balanced_accuracy"] == 1.0  # each a minority
    r = cli("report", str(out), "--compare", str(runs[1]), str(out))
    assert r.returncode == 0, r.stderr
    assert "| v3 |" in r.stdout and "v3 − b (60 shared items" in r.stdout
    assert cli("vote", *map(str, runs), "--out", str(out), "--name", "v3").returncode == 0  # the same vote again


def test_bad_votes_are_refused_before_anything_is_written(tmp_path):
    gold = [1, 4, 5]
    a, b, c, d = (_run(tmp_path, n, "hff", gold) for n in "abcd")
    other = _run(tmp_path, "other", "hff", gold, ids=["s0", "s1", "zz"])
    lenient = _run(tmp_path, "lenient", "hff", gold, policy="faithful")
    garbled = _run(tmp_path, "garbled", "hff", gold)
    (garbled / "eval.json").write_text("[1, 2]")
    cases = [((a, b), "an odd number, at least 3"), ((a, b, c, d), "an odd number"),
             ((a, b, b), "given twice"), ((a, b, other), "not the same items"),
             ((a, b, lenient), "score invalid answers differently"),
             ((a, b, tmp_path / "nothing"), "not an evaluation run"),
             ((a, b, garbled), "not a longsft evaluation summary")]
    for runs, message in cases:
        out = tmp_path / "out"
        r = cli("vote", *map(str, runs), "--out", str(out))
        assert r.returncode == 2 and message in r.stderr, (runs, r.stderr)
        assert not out.exists()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    r = cli("vote", str(a), str(b), str(c), "--out", str(tmp_path / "busy"))
    assert r.returncode == 2 and "holds something else" in r.stderr
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    r = cli("vote", str(a), str(b), str(c), "--name", "../up")
    assert r.returncode == 2 and "not a plain name" in r.stderr
