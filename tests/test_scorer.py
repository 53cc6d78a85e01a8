"""The shared scorer: parser cases from the paper's failure modes, metric parity with scikit-learn."""

import json
import random
import subprocess
import sys

import pytest
from sklearn.metrics import balanced_accuracy_score, matthews_corrcoef, roc_auc_score

from longsft.train.scoring.judgement import normalize_type, parse_judgement
from longsft.train.scoring.metrics import Item, binary_metrics, roc_auc, score_items

LONGSFT = [sys.executable, "-m", "longsft.launch.cli"]

CASES = [
    ('{"score": 4, "reason": "ok"}', 4, []),
    ('<think>The summary seems wrong... score 1?</think>\n{"score": 5, "reason": "fine"}', 5, []),
    ('reasoning...</think>{"reason": "x", "score": 2, "hallucination_types": ["Entity"]}', 2, ["entity"]),
    ('```json\n{"reason": "r", "score": 1, "hallucination_types": ["时间线乱序", "Causal Chain Fabrication"]}\n```', 1,
     ["temporal", "causal"]),
    ('```\n{"score": 3, "reason": "ok"}\n```', 3, []),
    ('Here is my judgement: {"score": 3, "reason": "ok"} Hope this helps!', 3, []),
    ('{"reason": "a", "score": 2}\n{"reason": "a", "score": 2}\n{"reason": "a", "sc', 2, []),
    ('{"reason": "the summary swaps names", "score": 1, "hallucination_ty', 1, []),
    ('｛“reason”：“人物错误”，“score”：2，“hallucination_types”：［“实体”］｝', 2, ["entity"]),
    ('{{"score": 4, "reason": "copied template braces"}}', 4, []),
    ("{'score': '5', 'reason': 'single quotes'}", 5, []),
    ('{"score": "2", "reason": "string score", "hallucination_types": "Ent, Num"}', 2, ["entity", "numerical"]),
    ('{"score": 3.0, "reason": "float"}', 3, []),
    ("score: 2/5", 2, []),
    ("评分：2分", 2, []),
    ("Score = 3", 3, []),
    ('{"score": 9, "reason": "out of range"}', None, []),
    ('{"score": -1}', None, []),
    ("The summary describes the war between two kingdoms and the hero's return.", None, []),
    ("", None, []),
    ('{"score": 5}{"score": 2, "reason": "second thoughts", "hallucination_types": ["Fictional Event"]}', 2,
     ["fabrication"]),
]


@pytest.mark.parametrize("text, score, types", CASES)
def test_parser_cases(text, score, types):
    j = parse_judgement(text)
    assert j.score == score
    assert j.types == types
    assert j.valid == (score is not None)


def test_contradiction_is_classified_by_score():
    j = parse_judgement('{"score": 3, "reason": "event error", "hallucination_types": ["Event"]}')
    assert j.hallucinated is False and j.contradiction


@pytest.mark.parametrize("name, canon", [("Timeline Disruption", "temporal"), ("Tmp", "temporal"),
                                         ("反向陈述", "inversion"), ("logical inversion", "inversion"),
                                         ("Event Hallucination", "event"), ("虚构事件", "fabrication"),
                                         ("event fabrication", "fabrication"), ("Numeric", "numerical"),
                                         ("关系", "relation"), ("nonsense", None)])
def test_type_names_normalise(name, canon):
    assert normalize_type(name) == canon


def _items(n, seed, invalid_frac=0.1):
    rng = random.Random(seed)
    items = []
    for i in range(n):
        gold = rng.randint(0, 5)
        r = rng.random()
        pred = "garbage" if r < invalid_frac else json.dumps({"score": rng.randint(0, 5), "reason": "x"})
        items.append(Item(str(i), pred, gold, bucket=rng.choice(["16k", "32k", "100k"]), language=rng.choice(["zh", "en"])))
    return items


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("policy", ["wrong", "hallucinated", "faithful"])
def test_metrics_equal_sklearn(seed, policy):
    items = _items(300, seed)
    result = score_items(items, policy)
    y_true = [int(it.gold_score <= 2) for it in items]
    y_pred = []
    for it, t in zip(items, y_true):
        j = parse_judgement(it.prediction)
        if j.valid:
            y_pred.append(int(j.score <= 2))
        else:
            y_pred.append({"wrong": 1 - t, "hallucinated": 1, "faithful": 0}[policy])
    assert result["balanced_accuracy"] == pytest.approx(balanced_accuracy_score(y_true, y_pred), abs=1e-12)
    assert result["mcc"] == pytest.approx(matthews_corrcoef(y_true, y_pred), abs=1e-12)
    assert result["n"] == 300
    assert result["invalid_rate"] == pytest.approx(sum(it.prediction == "garbage" for it in items) / 300)
    for bucket, m in result["by_bucket"].items():
        idx = [i for i, it in enumerate(items) if it.bucket == bucket]
        assert m["balanced_accuracy"] == pytest.approx(
            balanced_accuracy_score([y_true[i] for i in idx], [y_pred[i] for i in idx]), abs=1e-12)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("y_true, y_pred", [
    ([1, 0, 1, 0], [1, 1, 1, 1]),      # one class never predicted: MCC 0, BA 0.5
    ([1, 0, 1, 0], [0, 1, 0, 1]),      # every prediction inverted: MCC -1, BA 0
    ([1, 0, 1, 0], [1, 0, 1, 0]),
    ([1, 1, 1, 1], [1, 0, 1, 1]),      # one gold class only
])
def test_metric_edge_cases_equal_sklearn(y_true, y_pred):
    m = binary_metrics(y_true, y_pred)
    assert m["balanced_accuracy"] == pytest.approx(balanced_accuracy_score(y_true, y_pred))
    assert m["mcc"] == pytest.approx(matthews_corrcoef(y_true, y_pred))


@pytest.mark.parametrize("seed", range(4))
def test_roc_auc_equals_sklearn_ties_included(seed):
    rng = random.Random(seed)
    y = [rng.randint(0, 1) for _ in range(40)]
    scores = [rng.choice([-1.0, 0.0, 0.5, 2.0]) if seed % 2 else rng.gauss(0, 1) for _ in y]  # odd seeds: many ties
    assert roc_auc(y, scores) == pytest.approx(roc_auc_score(y, scores))
    assert roc_auc([1, 1], [0.1, 0.2]) is None and roc_auc([0, 1], [0.2, 0.1]) == 0.0
    assert roc_auc([0, 1], [float("nan"), 0.1]) is None  # scikit-learn raises: no made-up ranking


def test_type_recall():
    items = [Item("a", '{"reason": "r", "score": 1, "hallucination_types": ["Entity"]}', 1, gold_types=("entity",)),
             Item("b", '{"reason": "r", "score": 2, "hallucination_types": ["Event"]}', 2, gold_types=("entity",)),
             Item("c", '{"score": 5, "reason": "r"}', 2, gold_types=("temporal",))]
    t = score_items(items)["by_type"]
    assert t["entity"] == {"n": 2, "detection_recall": 1.0, "type_recall": 0.5}
    assert t["temporal"] == {"n": 1, "detection_recall": 0.0, "type_recall": 0.0}


def test_score_cli(tmp_path):
    preds = tmp_path / "p.jsonl"
    rows = [{"id": "1", "prediction": '{"score": 1, "reason": "x"}', "gold_score": 1, "bucket": "16k", "language": "zh"},
            {"id": "2", "prediction": '{"score": 4, "reason": "x"}', "gold_score": 5, "bucket": "16k", "language": "en"},
            {"id": "3", "prediction": "no idea", "gold_score": 0, "bucket": "32k", "language": "en"}]
    preds.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    r = subprocess.run([*LONGSFT, "score", str(preds), "--out", str(tmp_path / "s.json")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "s.json").read_text())
    assert out["n"] == 3 and out["invalid_rate"] == pytest.approx(1 / 3)
    assert {"balanced_accuracy", "mcc", "invalid_rate", "n"} <= set(out)
    assert out["ci"]["balanced_accuracy"]["low"] <= out["balanced_accuracy"] <= out["ci"]["balanced_accuracy"]["high"]
    assert "| all | 3 |" in r.stdout


def test_score_cli_bad_line(tmp_path):
    preds = tmp_path / "p.jsonl"
    preds.write_text('{"id": "1", "prediction": "x", "gold_score": 1}\n{"id": 2, "prediction": \n')
    r = subprocess.run([*LONGSFT, "score", str(preds)], capture_output=True, text=True)
    assert r.returncode == 2 and f"{preds}:2: malformed JSON" in r.stderr
