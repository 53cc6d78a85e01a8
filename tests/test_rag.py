"""The RAG baseline's arithmetic on real long text (红楼梦 1-5) and its two-tier decision rule."""

import json
import subprocess
import sys

import numpy as np
import pytest
from test_extend import hlm_units

from longsft.eval.eval_config import EvalConfig
from longsft.eval.harness import RagMethod
from longsft.eval.rag import HashingEmbedder, anchors, blocks, plan, radius, segments, windows
from longsft.train.data.schema import Sample


@pytest.fixture(scope="module")
def hlm():
    units = hlm_units()
    return "\n\n".join(u["text"] for u in units), "".join(u["summary"].replace(" ", "，") + "。" for u in units)


def test_blocks_are_exactly_3500_characters(hlm):
    text, _ = hlm
    bs = blocks(text)
    assert "".join(bs) == text and len(bs) == -(-len(text) // 3500)
    assert all(len(b) == 3500 for b in bs[:-1]) and 0 < len(bs[-1]) <= 3500


def test_segments_are_at_most_75_characters_and_cover_the_summary(hlm):
    _, summary = hlm
    ss = segments(summary)
    assert all(0 < len(s) <= 75 for s in ss) and "".join(ss) == summary
    assert all(s.endswith("。") for s in ss[:-1])  # cut at sentence ends when the piece holds one
    long = "x" * 200
    assert segments(long) == ["x" * 75, "x" * 75, "x" * 50]


def test_windows_radius_and_chronological_anchors(hlm):
    text, summary = hlm
    n = len(blocks(text))
    assert radius(n) == n // 3 - 1 and radius(2) == 0
    p = plan(text, summary, HashingEmbedder())
    a = [(lo + hi) // 2 for lo, hi in p.windows[:-1]]
    assert all(lo <= hi for lo, hi in p.windows) and p.windows[-1][1] == n - 1  # the last window runs to the end
    for (lo, hi), t in zip(p.windows, p.window_texts):
        assert t == "".join(blocks(text)[lo:hi + 1])
    assert a == sorted(a)
    # a verbatim quote of block 7 is anchored there; an earlier-looking segment never moves the anchor back
    sim = np.array([[0.1, 0.9, 0.2, 0.0], [0.8, 0.1, 0.3, 0.2], [0.0, 0.1, 0.2, 0.9]])
    assert anchors(sim, top_k=2) == [1, 2, 3]
    assert windows([1, 2, 3], 9) == [(0, 3), (0, 4), (1, 8)]
    bs = blocks(text)
    quote = bs[7][1000:1075]
    sims = HashingEmbedder().encode([quote]) @ HashingEmbedder().encode(bs).T
    assert int(np.argmax(sims[0])) == 7


@pytest.mark.parametrize("local, full, want_score", [
    (["1"], ["4"], 4),  # the full document does not confirm: not hallucinated
    (["1"], ["2"], 2),  # confirmed: hallucinated
    (["5", "3"], [], 3),  # every segment supported: the lowest score
    (["oops"], ["1"], 1),  # an invalid local answer escalates too
])
def test_two_tier_decision(local, full, want_score, tokenizer):
    from longsft.train.scoring.judgement import parse_judgement

    rag = RagMethod(EvalConfig(model="m", data="d"), HashingEmbedder(), tokenizer)
    answers = {"local": iter(local), "full": iter(full)}
    asked = []

    def generate(prompt):
        kind = "full" if "A. " * 3000 in prompt else "local"
        asked.append(kind)
        score = next(answers[kind])
        text = score if not score.isdigit() else json.dumps({"score": int(score), "reason": "r"})
        return {"prediction": text, "prompt_tokens": 1, "gen_tokens": 1, "error": None}

    summary = " ".join(f"Event {k} happened somewhere in the long story of the great house." for k in range(len(local)))
    s = Sample(id="x", language="en", article="A. " * 3000, summary=summary, gold_score=5, target="")
    assert len(segments(summary)) == len(local)
    prediction, recs = rag.predict(s, generate)
    assert parse_judgement(prediction).score == want_score
    assert asked.count("full") == len(full) and rag.escalated == len(full)


def test_rag_method_end_to_end_reports_the_token_saving(tiny_model_dir, sample_dir, tmp_path):
    out = tmp_path / "rag"
    r = subprocess.run([sys.executable, "-m", "longsft.launch.cli", "eval", f"model={tiny_model_dir('qwen3')}",
                        "tokenizer=qwen", f"data={sample_dir / '1k' / 'validation.jsonl'}", "method=rag",
                        "embedder=hashing", "max_new_tokens=8", "bootstrap=0", "progress=false", f"out={out}"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    e = json.loads((out / "eval.json").read_text())
    assert e["method"] == "rag" and e["rag"]["embedder"] == "hashing" and e["rag"]["segments"] >= e["n"]
    assert e["rag"]["input_token_saving"] == pytest.approx(1 - e["rag"]["input_tokens_rag"] / e["rag"]["input_tokens_direct"])
    preds = [json.loads(x) for x in (out / "predictions_r0.jsonl").read_text().splitlines()]
    assert all(p["generations"] >= 1 for p in preds)
