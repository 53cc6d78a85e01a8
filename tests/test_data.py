"""Data schema, prompt rendering, answer-only labels, overflow policy, bad input."""

import json

import pytest

from longsft.train.common.errors import DataError
from longsft.train.data.batching import StepSampler, collate, pack
from longsft.train.data.encoding import IGNORE, Encoded, Meta, encode, prompt_ids
from longsft.train.data.prompts import render_prompt
from longsft.train.data.schema import load_samples

REC = {"id": "x1", "language": "en", "article": "Arthur led 300 soldiers to Ravenford. " * 5,
       "summary": "Arthur led 300 soldiers to Ravenford.", "gold_score": 2, "types": ["Numeric"],
       "reason": "wrong number"}


def write(path, recs):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in recs))
    return path


def test_released_schema_is_accepted(tmp_path):
    rec = {"id": "r1", "language": "zh", "article": "原文内容。", "summary": "摘要内容。",
           "instruction": "请判断摘要是否存在幻觉。", "input": "原文内容。\n摘要：摘要内容。",
           "output": '{"reason": "人物错误", "score": 1, "hallucination_types": ["实体", "事件"]}'}
    s = load_samples(write(tmp_path / "d.jsonl", [rec]))[0]
    assert s.gold_score == 1 and s.types == ["entity", "event"] and s.target == rec["output"]
    assert render_prompt(s).startswith("请判断摘要是否存在幻觉。")


def test_rich_schema_renders_paper_target(tmp_path):
    s = load_samples(write(tmp_path / "d.jsonl", [REC]))[0]
    assert json.loads(s.target) == {"reason": "wrong number", "score": 2, "hallucination_types": ["Numeric"]}
    ok = load_samples(write(tmp_path / "e.jsonl", [dict(REC, gold_score=4, types=[])]))[0]
    assert json.loads(ok.target) == {"score": 4, "reason": "wrong number"}


@pytest.mark.parametrize("variant", ["end", "begin", "cot"])
def test_prompt_variants(tmp_path, variant):
    s = load_samples(write(tmp_path / "d.jsonl", [REC]))[0]
    p = render_prompt(s, variant)
    a, b = p.index("Original text:"), p.index("Summary:")
    assert (a < b) == (variant != "begin")
    assert ("step by step" in p) == (variant == "cot")


def test_answer_only_labels(tmp_path, tokenizer):
    s = load_samples(write(tmp_path / "d.jsonl", [REC]))[0]
    e = encode(s, tokenizer, 4096)
    p = prompt_ids(tokenizer, render_prompt(s))
    assert e.input_ids[: len(p)] == p and e.prompt_len == len(p)
    assert all(x == IGNORE for x in e.labels[: e.prompt_len])
    answer = [x for x in e.labels if x != IGNORE]
    assert tokenizer.decode(answer).startswith(s.target)
    assert tokenizer.eos_token_id in answer  # the model learns to stop


def test_collate_shifts_labels_before_any_split(tmp_path, tokenizer):
    s = load_samples(write(tmp_path / "d.jsonl", [REC]))[0]
    e = encode(s, tokenizer, 4096)
    b = collate([e], tokenizer.pad_token_id, pad_to_multiple=8)
    n = b["input_ids"].shape[1]
    assert n % 8 == 0 and n >= len(e.input_ids)
    assert b["shift_labels"][0, : len(e.labels) - 1].tolist() == e.labels[1:]
    assert (b["shift_labels"][0, len(e.labels) - 1:] == IGNORE).all()
    assert b["attention_mask"][0].sum() == len(e.input_ids)


def test_overflow_truncates_article_middle_or_skips(tmp_path, tokenizer):
    long = dict(REC, article=" ".join(f"Sentence number {i} of the long novel." for i in range(600)))
    s = load_samples(write(tmp_path / "d.jsonl", [long]))[0]
    e = encode(s, tokenizer, 1024, overflow="truncate")
    assert e.truncated and len(e.input_ids) <= 1024
    text = tokenizer.decode(e.input_ids[: e.prompt_len])
    assert "Sentence number 0 " in text and "Sentence number 599 " in text  # head and tail kept
    assert "Sentence number 300 " not in text and "middle of the text omitted" in text
    assert s.summary in text  # the summary is never cut
    assert encode(s, tokenizer, 1024, overflow="skip") is None


@pytest.mark.parametrize("line, needle", [
    ('{"id": "a", "language": "en", "article": "x", "summary": "y", "gold_score": 3', ":2: malformed JSON"),
    ('{"id": "a", "language": "en", "article": "x", "gold_score": 3}', ":2: missing field 'summary'"),
    ('{"id": "a", "language": "fr", "article": "x", "summary": "y", "gold_score": 3}', ":2: unknown language 'fr'"),
    ('{"id": "a", "language": "en", "article": "x", "summary": "y", "gold_score": 7}', ":2: gold_score must be"),
    ('{"id": "a", "language": "en", "article": "x", "summary": "y"}', ":2: needs 'gold_score' or 'output'"),
    ('{"id": "a", "language": "en", "article": "x", "summary": "y", "output": "no json"}', ":2: field 'output'"),
    ('{"id": "x1", "language": "en", "article": "x", "summary": "y", "gold_score": 3}', ":2: duplicate id 'x1'"),
    ('[1, 2]', ":2: expected a JSON object"),
])
def test_bad_input_names_file_and_line(tmp_path, line, needle):
    path = write(tmp_path / "bad.jsonl", [REC, line])
    with pytest.raises(DataError) as e:
        load_samples(path)
    assert f"{path}{needle}" in str(e.value)


def test_step_sampler_partitions_each_step_and_is_deterministic():
    n, dp, micro, accum = 23, 2, 2, 2
    samplers = [StepSampler(n, dp, r, micro, accum, seed=7) for r in range(dp)]
    assert samplers[0].steps_per_epoch == 23 // 8
    for step in range(6):
        parts = [sum(s.step(step), []) for s in samplers]
        assert sorted(parts[0] + parts[1]) == sorted(samplers[0].global_indices(step))
        assert not set(parts[0]) & set(parts[1])
    again = StepSampler(n, dp, 0, micro, accum, seed=7)
    assert again.step(4) == samplers[0].step(4)
    # each epoch covers distinct samples
    epoch0 = sum((samplers[0].global_indices(s) for s in range(2)), [])
    assert len(set(epoch0)) == len(epoch0)


@pytest.mark.parametrize("n_hallucinated, n, micro, accum", [(40, 80, 2, 2), (30, 120, 2, 2), (13, 37, 1, 3)])
def test_stratified_steps_hold_the_classes_in_the_datas_proportion(n_hallucinated, n, micro, accum):
    """data.stratify: each step's samples hold the floor or the ceiling of each class's share of the global
    batch (balanced data in even batches: exactly half each, where a plain shuffle's steps are not) in a
    shuffled order (not the dealing's alternation), each epoch is still a permutation of its own, the
    map stays deterministic (resume), and the plain shuffle is unchanged without labels."""
    import math
    import random

    labels = [1] * n_hallucinated + [0] * (n - n_hallucinated)
    random.Random(3).shuffle(labels)
    plain, stratified = (StepSampler(n, 2, 0, micro, accum, 7, lab) for lab in (None, labels))
    batch = 2 * micro * accum
    assert stratified.global_batch == batch
    share = batch * n_hallucinated / n

    def counts(sampler):
        return [sum(labels[i] for i in sampler.global_indices(s)) for s in range(2 * sampler.steps_per_epoch)]

    assert set(counts(stratified)) <= {math.floor(share), math.ceil(share)}
    alternating = [s for s in range(stratified.steps_per_epoch)
                   if all(labels[a] != labels[b] for a, b in zip(stratified.global_indices(s), stratified.global_indices(s)[1:]))]
    assert len(alternating) < stratified.steps_per_epoch / 2
    if share == batch / 2:
        assert set(counts(stratified)) == {batch // 2} != set(counts(plain))
    for epoch in range(2):
        seen = sum((stratified.global_indices(epoch * stratified.steps_per_epoch + s)
                    for s in range(stratified.steps_per_epoch)), [])
        assert len(set(seen)) == len(seen) == stratified.steps_per_epoch * batch
    assert stratified.global_indices(1) != stratified.global_indices(1 + stratified.steps_per_epoch)
    again = StepSampler(n, 2, 1, micro, accum, 7, labels)
    assert again.global_indices(3) == stratified.global_indices(3)
    old = list(range(n))
    random.Random(7 * 1_000_003).shuffle(old)  # the plain sampler's epoch 0, as before the option existed
    assert plain.global_indices(0) == old[:batch]


def test_stratify_refuses_packing():
    from longsft.train.common.errors import ConfigError
    from longsft.train.config.checks import validate
    from longsft.train.config.recipes import load_config

    validate(load_config("tiny", ["data.stratify=true"]))
    with pytest.raises(ConfigError, match="data.stratify=true needs data.packing=false"):
        validate(load_config("tiny", ["data.stratify=true", "data.packing=true"]))


def _enc(name, n, answer):
    return Encoded(Meta(name, "en", 4), list(range(1, n + 1)), n - answer)


def test_pack_first_fit_decreasing_is_deterministic_and_bounded():
    items = [_enc(f"s{i}", n, 2) for i, n in enumerate([7, 3, 5, 2, 6, 4])]
    rows = pack(items, 10, True)
    assert all(sum(len(e.input_ids) for e in r) <= 10 for r in rows)
    assert sorted(e.meta.id for r in rows for e in r) == sorted(e.meta.id for e in items)
    assert [[e.meta.id for e in r] for r in rows] == [[e.meta.id for e in r] for r in pack(items[::-1], 10, True)]
    assert len(rows) == 3
    assert pack(items, 10, False) == [[e] for e in items]


def test_collate_packed_row_keeps_documents_apart():
    a, b = _enc("a", 5, 2), _enc("b", 4, 3)
    batch = collate([[a, b]], pad_id=0, pad_to_multiple=4)
    assert batch["input_ids"].shape == (1, 12)
    assert batch["position_ids"][0, :9].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert batch["doc_ids"][0].tolist() == [0] * 5 + [1] * 4 + [-1] * 3
    # a's last token must not learn to predict b's first token
    assert batch["shift_labels"][0, :9].tolist() == a.labels[1:] + [IGNORE] + b.labels[1:] + [IGNORE]
    assert batch["attention_mask"][0].sum() == 9
