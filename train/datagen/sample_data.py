"""Deterministic offline sample data in the longsft schema (zh + en, faithful + hallucinated).

Each sample is a small synthetic "novel": key facts (who went where with how many, who met
whom, who is whose relative) embedded in filler narration, sized to a token range with the real
tokenizer. The summary restates the facts in order; hallucinated summaries carry one edit
(gold score 2) or three edits (score 1), faithful ones score 4-5. The edits are the offline ERHG
rule engine's, of the canonical types, or (``edits="counterfactual"``) a fact's slot redrawn from the
story's own values, which leaves the summary alone no clue (:mod:`~longsft.train.datagen.counterfactual`).
Used by the ``tiny`` recipe and the tests; ``longsft data sample`` writes it anywhere.
"""

from __future__ import annotations

import random
from pathlib import Path

from longsft.train.common.errors import DataError
from longsft.train.common.io import check_output_dir, write_jsonl
from longsft.train.data.prompts import render_target
from longsft.train.datagen import counterfactual
from longsft.train.datagen.erhg import RuleEngine, perturb
from longsft.train.scoring.judgement import TYPES

# bucket -> (min, max) article tokens. Tiny stages use seq_len 512/1024/2048/4096; the upper
# ends overshoot slightly on purpose so the overflow policy is exercised.
EDITS = ("erhg", "counterfactual")  # how hallucinated summaries are made (make_sample)
SAMPLE_BUCKETS = {"512": (120, 260), "1k": (400, 720), "2k": (900, 1650), "4k": (2000, 3650)}

_NAMES = {"en": ["Arthur", "Beatrice", "Cedric", "Dorothea", "Edmund", "Florence", "Gideon", "Harriet"],
          "zh": ["林远", "苏晴", "陈默", "赵雪", "周怀安", "沈若水", "顾长风", "韩青"]}
_PLACES = {"en": ["Ravenford", "the mill at Ashby", "Kingsbridge", "the northern pass", "Larkhill"],
           "zh": ["青州", "落雁城", "白石渡", "北关", "柳家庄"]}
_RELS = {"en": ["brother", "father", "uncle", "cousin"], "zh": ["哥哥", "父亲", "叔叔", "表兄"]}
_FACT = {
    "en": {"march": "{a} led {n} soldiers to {p}.", "meet": "{a} met {b} at {p} and agreed to help {b}.",
           "refuse": "{a} met {b} at {p} and refused to help {b}.", "rel": "{a} is the {r} of {b}.",
           "event": "{a} burned the bridge at {p}.", "fab": "{a} secretly sold the family estate to a stranger.",
           "cause": "Because {b} fell ill, {a} led {n} soldiers to {p}."},
    "zh": {"march": "{a}率领{n}名士兵前往{p}。", "meet": "{a}在{p}遇见了{b}，并答应帮助{b}。",
           "refuse": "{a}在{p}遇见了{b}，却拒绝帮助{b}。", "rel": "{a}是{b}的{r}。",
           "event": "{a}烧毁了{p}的桥。", "fab": "{a}暗中把家族的庄园卖给了一个陌生人。",
           "cause": "因为{b}病倒了，{a}率领{n}名士兵前往{p}。"},
}
_FILLER = {
    "en": ["The wind moved across the fields while {a} watched the road.", "Rain fell on {p} for three days.",
           "{a} said little at supper and went to bed early.", "Nobody in {p} spoke of the old quarrel.",
           "The servants lit the lamps as evening came.", "{a} remembered the winter when the river froze.",
           "Letters arrived from the city, but {a} did not open them.", "The market at {p} was crowded."],
    "zh": ["风吹过田野，{a}静静地望着远方的道路。", "{p}一连下了三天的雨。", "晚饭时{a}很少说话，早早便睡下了。",
           "{p}的人谁也不再提起那场旧怨。", "天色渐晚，仆人们点起了灯。", "{a}想起了那年河水结冰的冬天。",
           "城里寄来了几封信，{a}却一封也没有拆。", "{p}的集市上人来人往。"],
}
_REASON = {"en": ("The summary is consistent with the original text.", "The summary contradicts the original text."),
           "zh": ("摘要与原文一致。", "摘要与原文不符。")}


def _facts(rng: random.Random, lang: str) -> tuple[dict, list[tuple[str, dict]]]:
    names = rng.sample(_NAMES[lang], 4)
    places = rng.sample(_PLACES[lang], 3)
    world = {"names": names, "places": places}
    facts = [("march", {"a": names[0], "n": rng.choice([300, 500, 2000, 7000]), "p": places[0]}),
             ("meet", {"a": names[1], "b": names[2], "p": places[1]}),
             ("rel", {"a": names[3], "b": names[0], "r": rng.choice(_RELS[lang])}),
             ("march", {"a": names[2], "n": rng.choice([40, 60, 800, 9000]), "p": places[2]})]
    return world, facts


def _say(lang: str, kind: str, f: dict) -> str:
    return _FACT[lang][kind].format(**f)


def _erhg(rng: random.Random, lang: str, article: str, summary: str, n: int) -> tuple[str, list[str]]:
    """``summary`` with ``n`` edits of distinct types by :class:`longsft.train.datagen.erhg.RuleEngine`."""
    sample = {"language": lang, "article": article, "summary": summary}
    for _ in range(32):  # a type that finds no sentence to edit is drawn again
        result = perturb(sample, rng.sample(TYPES, n), RuleEngine(rng), rng)
        if not isinstance(result, str):
            return result[0], sorted({e.type for e in result[1]})
    raise RuntimeError(f"no {n}-type ERHG edit applies to the summary {summary!r}")


def make_sample(rng: random.Random, lang: str, bucket: str, tokenizer, sid: str, split: str,
                hallucinated: bool | None = None, edits: str = "erhg") -> dict:
    """One sample; ``hallucinated`` None draws it (half the time), else says which to make. ``edits``:
    ``erhg`` (the rule engine's edits) or ``counterfactual`` (a fact's slot redrawn from the story's own
    values, every slot drawn on its own: :mod:`~longsft.train.datagen.counterfactual`)."""
    if edits not in EDITS:
        raise DataError(f"edits={edits!r}: one of {', '.join(EDITS)}")
    lo, hi = SAMPLE_BUCKETS[bucket]
    if edits == "counterfactual":
        story = counterfactual.Story(rng.sample(_NAMES[lang], 4), rng.sample(_PLACES[lang], 3), _RELS[lang])
        world, facts = {"names": story.names, "places": story.places}, counterfactual.facts(rng, story)
    else:
        world, facts = _facts(rng, lang)
    target = rng.randint(lo, hi)
    sep = " " if lang == "en" else ""
    fact_text = [_say(lang, k, f) for k, f in facts]
    paragraphs, n_tokens, fi = [], 0, 0
    fact_every = max(1, target // (len(facts) * 60))  # spread the facts through the text
    while n_tokens < target or fi < len(facts):
        sents = [rng.choice(_FILLER[lang]).format(a=rng.choice(world["names"]), p=rng.choice(world["places"]))
                 for _ in range(rng.randint(2, 4))]
        if fi < len(facts) and (len(paragraphs) % fact_every == 0 or n_tokens >= target):
            sents.insert(rng.randrange(len(sents) + 1), fact_text[fi])
            fi += 1
        para = sep.join(sents)
        paragraphs.append(para)
        n_tokens += len(tokenizer.encode(para, add_special_tokens=False)) + 1
    article, summary = "\n".join(paragraphs), sep.join(fact_text)
    roll = rng.random()
    if hallucinated is not None:  # the same draw, mapped onto the chosen half: 60% one edit, 40% three
        roll = 0.5 + roll / 2 if hallucinated else roll / 2
    if roll < 0.5:
        score, types = rng.choice([4, 5]), []
    elif edits == "counterfactual":  # one or three facts, one slot each
        n = 1 if roll < 0.8 else 3
        sents, types = counterfactual.hallucinate(rng, story, facts, n, lambda k, f: _say(lang, k, f), article)
        summary, score = sep.join(sents), 2 if n == 1 else 1
    else:  # the offline ERHG engine makes the hallucinated summaries (one or three one-sentence edits)
        summary, types = _erhg(rng, lang, article, summary, 1 if roll < 0.8 else 3)
        score = 2 if len(types) == 1 else 1
    reason = _REASON[lang][0 if score >= 3 else 1]
    return {"id": sid, "language": lang, "article": article, "summary": summary,
            "gold_score": score, "types": types, "reason": reason, "bucket": bucket, "source": "sample",
            "split": split, "output": render_target(lang, score, types, reason)}


def write_sample_data(out_dir: str | Path, tokenizer, buckets: list[str], n_per_language: int = 16,
                      n_validation: int = 4, seed: int = 42, languages: list[str] | tuple[str, ...] = ("zh", "en"),
                      n_test: int = 0, balanced: bool = False, edits: str = "erhg") -> dict[str, dict[str, Path]]:
    """Write ``<out>/<bucket>/{train,validation[,test]}.jsonl``; identical for identical arguments.
    Each sample has its own article, so the splits share none. ``balanced``: alternately faithful and
    hallucinated within each split and language (exactly half when the count is even). ``edits``: how
    hallucinated summaries are made (:func:`make_sample`). Every argument is checked before anything is
    written."""
    check_output_dir(out_dir)
    if edits not in EDITS:
        raise DataError(f"--edits {edits}: one of {', '.join(EDITS)}")
    for bucket in buckets:
        if bucket not in SAMPLE_BUCKETS:
            raise DataError(f"bucket {bucket!r}: the sample set has no such bucket; known: {', '.join(SAMPLE_BUCKETS)}")
    if not buckets or len(set(buckets)) != len(buckets):
        raise DataError(f"--buckets {','.join(buckets)}: give each bucket once, at least one")
    if not languages or len(set(languages)) != len(languages) or set(languages) - set(_NAMES):
        raise DataError(f"--languages {','.join(languages)}: give each of {', '.join(_NAMES)} at most once, at least one")
    for flag, n, low in (("--n", n_per_language, 1), ("--n-validation", n_validation, 1), ("--n-test", n_test, 0)):
        if n < low:
            raise DataError(f"{flag} {n}: must be at least {low} (samples per language and bucket)")
    out = {}
    for bucket in buckets:
        paths = {}
        for split, n in (("train", n_per_language), ("validation", n_validation), ("test", n_test)):
            if not n:
                continue
            rng = random.Random(f"{seed}/{bucket}/{split}")
            recs = [make_sample(rng, lang, bucket, tokenizer, f"{bucket}-{split}-{lang}-{i:04d}", split,
                                bool(i % 2) if balanced else None, edits)
                    for i in range(n) for lang in languages]
            paths[split] = Path(out_dir) / bucket / f"{split}.jsonl"
            write_jsonl(paths[split], recs)
        out[bucket] = paths
    return out


def synthetic_book(rng: random.Random, book: str, lang: str, n_units: int, unit_chars: tuple[int, int]) -> list[dict]:
    """Units of an offline "book" for ``longsft data extend``: filler prose with one fact per
    paragraph, the unit's summary being its facts. ``unit_chars``: (min, max) characters per unit."""
    world, _ = _facts(rng, lang)
    sep = " " if lang == "en" else ""
    units = []
    for u in range(1, n_units + 1):
        target, paragraphs, facts, size = rng.randint(*unit_chars), [], [], 0
        while size < target:
            kind, f = rng.choice(_facts(rng, lang)[1])
            fact = _say(lang, kind, f)
            sents = [rng.choice(_FILLER[lang]).format(a=rng.choice(world["names"]), p=rng.choice(world["places"]))
                     for _ in range(rng.randint(3, 6))]
            sents.insert(rng.randrange(len(sents) + 1), fact)
            facts.append(fact)
            paragraphs.append(sep.join(sents))
            size += len(paragraphs[-1]) + 1
        units.append({"book": book, "unit": u, "language": lang, "text": "\n".join(paragraphs),
                      "summary": sep.join(facts[:3])})
    return units
