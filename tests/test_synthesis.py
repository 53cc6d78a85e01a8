"""Hallucination synthesis: ERHG (offline rules and an LLM engine) and MMA, against real text and a
local OpenAI-compatible server started by the tests."""

import difflib
import json
import random
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field

import pytest
from conftest import record_writes
from llm_server import Server
from test_extend import hlm_units

from longsft.train.common.llm import Endpoint, EndpointError, Reply
from longsft.train.datagen.erhg import RuleEngine, generate, sentences
from longsft.train.datagen.erhg import run as run_erhg
from longsft.train.datagen.extend import build, parse_buckets
from longsft.train.datagen.mma import run as run_mma
from longsft.train.datagen.sample_data import synthetic_book


@pytest.fixture(scope="module")
def faithful(tmp_path_factory, tokenizer):
    """Faithful samples from `data extend`: 红楼梦 chapters (one chapter per window) and English books."""
    units = [dict(u, summary=u["summary"].replace(" ", "。") + "。") for u in hlm_units()]  # the couplet: 2 sentences
    for b in range(3):
        units += synthetic_book(random.Random(b), f"en{b}", "en", 12, (3000, 6000))
    d = tmp_path_factory.mktemp("faithful")
    (d / "units.jsonl").write_text("".join(json.dumps(u, ensure_ascii=False) + "\n" for u in units), encoding="utf-8")
    build(d / "units.jsonl", d / "out", parse_buckets("s=1500:9000"), tokenizer)
    path = d / "out" / "s" / "samples.jsonl"
    return path, [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]


@dataclass(frozen=True)
class Scripted(Endpoint):
    """An endpoint whose replies are a script, no server (the messages asked recorded in ``asked``)."""

    replies: list = field(default_factory=list)
    asked: list = field(default_factory=list)

    def chat(self, messages, max_tokens=None):
        self.asked.append(messages)
        return Reply(self.replies.pop(0), 1, 1)


def _changed(parent: dict, child: dict) -> list[tuple]:
    a, b = sentences(parent["summary"], parent["language"]), sentences(child["summary"], child["language"])
    return [op for op in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes() if op[0] != "equal"]


def test_offline_edits_are_one_sentence_each_and_balanced(faithful, tmp_path):
    path, parents = faithful
    stats = run_erhg(str(path), str(tmp_path / "erhg.jsonl"), RuleEngine(random.Random(0)), multi=0.3, seed=0)
    outs = [json.loads(x) for x in (tmp_path / "erhg.jsonl").read_text(encoding="utf-8").splitlines()]
    by_id = {p["id"]: p for p in parents}
    assert stats["outputs"] == len(outs) >= 0.9 * len(parents)
    assert {p["language"] for p in parents if f"{p['id']}-erhg" in {o["id"] for o in outs}} == {"zh", "en"}
    for o in outs:
        parent = by_id[o["parent"]]
        n = len(o["edits"])
        assert o["gold_score"] == (2 if n == 1 else 1) and n in (1, 3) and len(o["types"]) == n
        ops = _changed(parent, o)
        # each edit is one replaced or one inserted sentence, found by a plain diff
        assert sum(max(i2 - i1, j2 - j1) for _, i1, i2, j1, j2 in ops) == n, (o["id"], ops)
        after = sentences(o["summary"], o["language"])
        for e in o["edits"]:
            assert after[e["index"]] == e["after"] and e["before"] != e["after"]
            if e["before"] is not None:
                assert e["before"] in sentences(parent["summary"], parent["language"])
        assert o["article"] == parent["article"] and o["source"] == "erhg"
    counts = Counter(t for o in outs for t in o["types"])
    assert set(counts) == {"entity", "numerical", "relation", "inversion", "event", "temporal", "causal",
                           "fabrication"}
    assert max(counts.values()) <= 2 * min(counts.values()), counts  # balanced over the eight types


def test_offline_engine_is_deterministic(faithful):
    _, parents = faithful
    a, _ = generate(parents[:20], RuleEngine(random.Random(5)), [1] * 20, seed=5)
    b, _ = generate(parents[:20], RuleEngine(random.Random(5)), [1] * 20, seed=5)
    assert a == b


def test_entity_edit_swaps_in_an_entity_of_the_article(faithful):
    _, parents = faithful
    zh = [p for p in parents if p["language"] == "zh"]
    outs, _ = generate(zh, RuleEngine(random.Random(0)), [1] * len(zh), seed=1)
    for o in outs:
        for e in o["edits"]:
            if e["type"] == "entity":
                added = set(e["after"]) - set(e["before"])
                assert added and all(ch in o["article"] for ch in added)


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


def test_llm_engine_validates_retries_and_reports(faithful, server, tmp_path):
    _, parents = faithful
    en = [p for p in parents if p["language"] == "en"][:6]
    en[0] = dict(en[0], summary="XYZZY is all this summary says.")  # the model never answers this one
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in en))
    out = tmp_path / "erhg.jsonl"
    r = subprocess.run([sys.executable, "-m", "longsft.launch.cli", "data", "erhg", str(src), "--out", str(out),
                        "--engine", "llm", "--endpoint", f"editor@{server.url}", "--multi", "0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    outs = [json.loads(x) for x in out.read_text().splitlines()]
    problems = [json.loads(x) for x in (tmp_path / "erhg.jsonl.problems.jsonl").read_text().splitlines()]
    assert [p["id"] for p in problems] == [en[0]["id"]] and "no valid answer after 4 tries" in problems[0]["problem"]
    assert len(outs) == 5
    for o in outs:
        (e,) = o["edits"]
        assert e["after"].endswith("(edited).") or e["after"] == "A masked rider burned the granary at midnight."
    calls = server.requests["editor"]
    # every accepted edit took two calls (the first reply is malformed); rerunning asks nothing again
    r = subprocess.run(r.args, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and server.requests["editor"] - calls == 8 * 4  # only the hopeless prompts again


def test_mma_judges_arbiter_and_disagreement_stats(server, tmp_path):
    src = tmp_path / "articles.jsonl"
    src.write_text("".join(json.dumps({"id": f"a{i}", "language": "en", "article": f"STORY-{i} text.",
                                       "summary": "-", "gold_score": 5, "bucket": "16k"}) + "\n" for i in range(3)))
    ep = lambda m: Endpoint(m, server.url)
    stats = run_mma(str(src), str(tmp_path / "mma.jsonl"), [ep("gen-good"), ep("gen-bad")],
                    [ep("judge-a"), ep("judge-b")], ep("arbiter"))
    outs = {o["id"]: o for o in map(json.loads, (tmp_path / "mma.jsonl").read_text().splitlines())}
    good, bad = outs["a0-mma-gen-good"], outs["a0-mma-gen-bad"]
    assert good["gold_score"] == 4 and not good["arbitrated"] and good["types"] == []  # 5 and 4 agree: floor 4.5
    assert bad["gold_score"] == 2 and bad["arbitrated"] and bad["types"] == ["fabrication"]  # 1 vs 4: arbiter
    assert stats["label_agreement"] == 0.5 and stats["arbitrated"] == 3 and stats["arbiter_sided"] == {"a": 3}
    assert stats["mean_score_gap"] == pytest.approx((1 + 3) / 2)
    assert stats["judge_labels"] == {"FF": 3, "HF": 3} and stats["unjudged"] == {"a": 0, "b": 0}
    before = sum(server.requests.values())
    run_mma(str(src), str(tmp_path / "mma.jsonl"), [ep("gen-good"), ep("gen-bad")], [ep("judge-a"), ep("judge-b")],
            ep("arbiter"))
    assert sum(server.requests.values()) == before  # resumed from the answer cache
    # three articles at once (each answer taking a while, so they overlap at the server): the same
    # samples, in the same order, and the same statistics; an endpoint that refuses stops the run
    slow = Server(delay=0.05)
    try:
        at = lambda m: Endpoint(m, slow.url)  # noqa: E731
        again = run_mma(str(src), str(tmp_path / "mma3.jsonl"), [at("gen-good"), at("gen-bad")],
                        [at("judge-a"), at("judge-b")], at("arbiter"), concurrency=3)
        assert again == stats and (tmp_path / "mma3.jsonl").read_text() == (tmp_path / "mma.jsonl").read_text()
        assert slow.most_in_flight >= 2
        with pytest.raises(EndpointError, match="no-such-model"):
            run_mma(str(src), str(tmp_path / "mma4.jsonl"), [at("gen-good")], [at("judge-a"), at("no-such-model")],
                    at("arbiter"), concurrency=3)
    finally:
        slow.close()


def test_mma_writes_its_samples_last(server, tmp_path, monkeypatch):
    """bench/table5_mini.py resumes by the samples file: it is written after the problems and statistics, so
    a run cut off before it makes the MMA data again rather than report none."""
    import longsft.train.datagen.mma as mma

    order = record_writes(monkeypatch, mma)
    src = tmp_path / "articles.jsonl"
    src.write_text(json.dumps({"id": "a0", "language": "en", "article": "STORY-0 text.", "summary": "-",
                               "gold_score": 5, "bucket": "16k"}) + "\n")
    ep = lambda m: Endpoint(m, server.url)  # noqa: E731
    run_mma(str(src), str(tmp_path / "mma.jsonl"), [ep("gen-good")], [ep("judge-a"), ep("judge-b")], ep("arbiter"))
    assert order[-1] == str(tmp_path / "mma.jsonl") and str(tmp_path / "mma.jsonl.stats.json") in order


def test_mma_asks_both_judges_and_counts_each_ones_failures(tmp_path):
    """A judge that never gives a score drops the summary (a problem naming it), but the other judge is
    still asked, and the stats count the unjudged summaries per judge."""
    src = tmp_path / "articles.jsonl"
    src.write_text("".join(json.dumps({"id": f"a{i}", "language": "en", "article": f"STORY-{i} text."}) + "\n"
                           for i in range(2)))
    replies = {"gen": '{"summary": "A faithful account."}', "ja": "Hmm.", "jb": '{"score": 4, "reason": "ok"}'}
    s = Server(lambda body: (200, {}, replies[body["model"]]))
    try:
        ep = lambda m: Endpoint(m, s.url)  # noqa: E731
        stats = run_mma(str(src), str(tmp_path / "mma.jsonl"), [ep("gen")], [ep("ja"), ep("jb")], ep("jb"),
                        retries=1)
        assert stats["summaries"] == 0 and stats["unjudged"] == {"a": 2, "b": 0}
        assert s.requests["ja"] == 4 and s.requests["jb"] == 2  # 2 tries each for A; B asked all the same
        problems = [json.loads(x) for x in (tmp_path / "mma.jsonl.problems.jsonl").read_text().splitlines()]
        assert len(problems) == 2 and all(p["problem"].startswith(f"ja@{s.url}: no judgement") for p in problems)
    finally:
        s.close()


def test_mma_needs_two_judges(tmp_path):
    r = subprocess.run([sys.executable, "-m", "longsft.launch.cli", "data", "mma", str(tmp_path / "x.jsonl"), "--out",
                        str(tmp_path / "o.jsonl"), "--generator", "g@http://h:1/v1", "--judge", "j@http://h:1/v1",
                        "--arbiter", "a@http://h:1/v1"], capture_output=True, text=True)
    assert r.returncode == 2 and "needs exactly two judges, got 1" in r.stderr
    r = subprocess.run(r.args[:-4] + ["--judge", "j@http://h:1/v1#temp=1", "--judge", "j@http://h:1/v1",
                                      "--arbiter", "a@http://h:1/v1"], capture_output=True, text=True)
    assert r.returncode == 2 and "'j@http://h:1/v1#temp=1': unknown option 'temp=1'" in r.stderr, r.stderr


def test_mma_takes_a_prose_summary_as_the_summary(tmp_path):
    """A generator that answers in prose (a small model) gives its text as the summary; a JSON answer its
    "summary"; an empty one is re-asked and then dropped; answers are cached."""
    from longsft.train.common.cache import AppendCache
    from longsft.train.common.llm import LLMError
    from longsft.train.datagen.mma import ask_summary

    asked = []
    gen = Scripted("m", "http://x/v1", replies=["  The knight rides north. ", '{"summary": "He rides."}', "", " "],
                   asked=asked)
    cache = AppendCache(str(tmp_path / "c.jsonl"))
    assert ask_summary(gen, "p1", 1, cache).strip() == "The knight rides north."
    assert ask_summary(gen, "p2", 1, cache) == "He rides."
    with pytest.raises(LLMError, match="empty summary after 2 tries"):
        ask_summary(gen, "p3", 1, cache)
    assert ask_summary(gen, "p1", 1, cache).strip() == "The knight rides north." and len(asked) == 4  # cached


def test_mma_reads_judgements_with_the_shared_scorers_parser(tmp_path):
    """A judge that states its score in prose (a small model) is read as evaluation reads the trained models
    (JSON, or a score in the text); a reply without an integer score is re-asked, then dropped; cached."""
    from longsft.train.common.cache import AppendCache
    from longsft.train.common.llm import LLMError
    from longsft.train.datagen.mma import ask_judgement

    asked = []
    judge = Scripted("j", "http://x/v1", replies=["The summary invents a duel. Score: 1",
                                                  '{"score": 4, "reason": "faithful"}', "no idea", "Score: 2.5",
                                                  "I cannot tell."], asked=asked)
    cache = AppendCache(str(tmp_path / "c.jsonl"))
    first = ask_judgement(judge, "p1", 1, cache)
    assert first["score"] == 1 and "invents a duel" in first["reason"]
    assert ask_judgement(judge, "p2", 1, cache) == {"score": 4, "reason": "faithful", "hallucination_types": []}
    with pytest.raises(LLMError, match="no judgement .* in 2 replies: no score in the reply; the score 2.5 is not an"):
        ask_judgement(judge, "p3", 1, cache)  # nothing, then a score that is not an integer
    # the re-ask carries the judge's own reply and the complaint with the format: a new question
    assert [m["role"] for m in asked[3]] == ["user", "assistant", "user"] and asked[3][1]["content"] == "no idea"
    assert "no score in the reply" in asked[3][2]["content"] and '"score": <an integer 0-5>' in asked[3][2]["content"]
    with pytest.raises(LLMError):
        ask_judgement(judge, "p4", 0, cache)
    assert ask_judgement(judge, "p1", 1, cache) == first and len(asked) == 5  # cached


def _names(summary: str, lang: str) -> list[str]:
    """The sample set's names in ``summary``, in order of mention."""
    import re

    from longsft.train.datagen.sample_data import _NAMES

    return [m.group() for m in re.finditer("|".join(map(re.escape, _NAMES[lang])), summary)]


def _who(summary: str, lang: str) -> list:
    """Features of who the summary names where, across its sentences: for each pair of the first 8 name
    slots (in order of mention), whether they hold the same name, and how many distinct names it has."""
    names = _names(summary, lang)[:8]
    names += [None] * (8 - len(names))
    same = [int(a is not None and a == b) for i, a in enumerate(names) for b in names[i + 1:]]
    return same + [int(len(set(names) - {None}) == k) for k in range(1, 6)]


def _summary_only_auc(d, lang: str) -> float:
    """Test ROC AUC of a classifier of the summary alone (no article), fitted on train: its words (1-3
    grams) and who it names where (a shared name across facts, the number of names)."""
    from scipy.sparse import csr_matrix, hstack
    from sklearn.feature_extraction.text import CountVectorizer
    from sklearn.linear_model import LogisticRegressionCV
    from sklearn.metrics import roc_auc_score

    rows = {s: [json.loads(x) for x in (d / "512" / f"{s}.jsonl").read_text(encoding="utf-8").splitlines()]
            for s in ("train", "test")}
    vec = CountVectorizer(token_pattern=r"[A-Za-z]+|\d+" if lang == "en" else r"\S", ngram_range=(1, 3), binary=True)
    vec.fit([r["summary"] for r in rows["train"]])

    def x(split):
        texts = [r["summary"] for r in rows[split]]
        return hstack([vec.transform(texts), csr_matrix([_who(t, lang) for t in texts])]).tocsr()

    clf = LogisticRegressionCV(Cs=6, cv=5, max_iter=3000).fit(x("train"), [r["gold_score"] <= 2 for r in rows["train"]])
    p = clf.predict_proba(x("test"))[:, 1]
    return roc_auc_score([r["gold_score"] <= 2 for r in rows["test"]], p)


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_counterfactual_sample_set_leaves_the_summary_alone_no_clue(tmp_path, tokenizer, lang):
    """The rule engine's edits mark the summary itself (a summary-only classifier finds them); the
    counterfactual ones do not: the same classifier is at chance, and every hallucinated summary
    differs from what the article states in its edited facts only."""
    from longsft.train.datagen.sample_data import write_sample_data

    auc = {}
    for edits in ("erhg", "counterfactual"):
        d = tmp_path / edits
        write_sample_data(d, tokenizer, ["512"], 600, 1, languages=[lang], n_test=400, balanced=True, edits=edits)
        auc[edits] = _summary_only_auc(d, lang)
    # (0.50 en, 0.55 zh; a fixed who-is-whose-relative pattern left in the facts scores 0.63 in en)
    assert auc["erhg"] > 0.85 and auc["counterfactual"] < 0.6, auc
    sep = " " if lang == "en" else ""
    rows = [json.loads(x) for x in (d / "512" / "test.jsonl").read_text(encoding="utf-8").splitlines()]
    for r in rows:
        said = [s + ("." if lang == "en" else "。") for s in r["summary"].rstrip(".。").split("." + sep if lang == "en"
                                                                                        else "。")]
        stated = [s in r["article"] for s in said]
        assert len(said) == 4, r["summary"]
        assert sum(not x for x in stated) == {5: 0, 4: 0, 2: 1, 1: 3}[r["gold_score"]], r
        assert (r["gold_score"] <= 2) == bool(r["types"]) and set(r["types"]) <= {"entity", "numerical", "relation",
                                                                                 "inversion"}
        who = _names(r["summary"], lang)  # march: a; help: a, b, b; rel: a, b; march: a
        assert len(who) == 7 and who[1] != who[2] == who[3] and who[4] != who[5], r["summary"]
    assert Counter(r["gold_score"] <= 2 for r in rows) == {True: 200, False: 200}


def test_sample_set_refuses_an_unknown_edit_kind(tmp_path, tokenizer):
    from longsft.train.common.errors import DataError
    from longsft.train.datagen.sample_data import write_sample_data

    with pytest.raises(DataError, match="--edits llm: one of erhg, counterfactual"):
        write_sample_data(tmp_path / "x", tokenizer, ["512"], 2, 1, edits="llm")
    assert not (tmp_path / "x").exists()
