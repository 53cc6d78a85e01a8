"""ConStory-Bench-style consistency checking of long generated stories: the checker (``longsft constory``'s
commands: :mod:`.constory_cli`; its metrics: :mod:`.constory_metrics`).

The checker has four stages, all with one judge model (any ``longsft eval`` backend, including a
longsft checkpoint): (1) category-guided extraction of contradiction-prone spans, one prompt per
category, the story shown as numbered paragraphs; (2) pairing of the extracted spans into
consistent / contradictory; (3) an evidence chain (reasoning, conclusion) per contradictory pair;
(4) a JSON report per story whose every quote carries exact character offsets, validated
(``story[start:end] == quote``).

Offsets come from the paragraph the judge cites: the quote is located inside that paragraph (not
with a search over the whole story, which finds the wrong occurrence of repeated text); a quote
that is not verbatim in its paragraph is rejected and the judge asked again. Stories longer than
``max_story_tokens`` are read in overlapping paragraph windows for extraction (nothing is cut).

Metrics (:func:`metrics`): every error counts (not subtypes-with-errors). Words: English and other
space-separated text by word tokens; Chinese (and Japanese) by characters, one word each, plus
any Latin words in between. CED = errors per 10,000 words per story, averaged per model. GRR =
per prompt, models ranked by Q = words / (1 + errors), best = 1, ties share the mean rank;
averaged per model.

Unjudged stories: a story the judge gave no valid answer for at some stage (after its re-asks), or
an empty story, is reported ``"judged": false`` and left out of CED and GRR (never counted as
consistent); ``check`` and ``metrics`` then exit 3 and name how many. The judge's valid answers are
cached, so rerunning ``check`` asks again only what failed. Generated stories are cached by a hash
of the whole request (model, backend, prompt text, generation settings): an edited prompt is
generated anew.

Defects of the reference implementation, fixed here: it counts subtypes-with-errors (we count
errors: one per contradicting statement), splits Chinese on whitespace (we count characters), drops
errors whose subtype key does not match its prompt table (one taxonomy table serves prompts and
validation; an unknown subtype is kept as "unspecified"), and recovers quote positions with a
search over the whole story (we locate quotes in the paragraph the judge cites)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from longsft.train.common.cache import AppendCache
from longsft.train.common.llm import answer_key, reask_json

# Five categories, 19 subtypes (our reading of the paper's taxonomy).
TAXONOMY = {
    "timeline_plot": ["absolute_time", "duration", "simultaneity", "causal_logic", "abandoned_plot"],
    "characterization": ["memory", "knowledge", "skill_power", "personality"],
    "world_setting": ["core_rule", "social_norm", "geography"],
    "factual_detail": ["appearance", "naming", "quantity", "object_state"],
    "narrative_style": ["perspective", "tone", "style"],
}


CATEGORY_TEXT = {
    "timeline_plot": "dates and calendar facts, durations, events said to happen at the same time, cause and effect, "
                     "plot threads set up",
    "characterization": "what characters remember, know, can do (skills, powers) and how they behave",
    "world_setting": "rules of the story world (magic, technology), social norms, places and distances",
    "factual_detail": "appearances, names, numbers and quantities, the state of objects",
    "narrative_style": "point of view and narrator, tone, style",
}


TASK_TYPES = ("generation", "continuation", "expansion", "completion")


EXTRACT = """You check a long story for consistency. Category: {category} ({what}); subtypes: {subtypes}.
List every statement in the story that establishes or uses a fact of this category and could contradict
another statement. Quote each one verbatim (a short exact span) and give the number of the paragraph it is in.
Reply with JSON only: {{"spans": [{{"paragraph": int, "quote": str, "subtype": str, "fact": str}}]}}

Story (numbered paragraphs):
{story}"""


PAIR = """Below are statements extracted from one story (category {category}). Find the pairs that contradict
each other (they cannot both be true in the story). Reply with JSON only:
{{"pairs": [{{"a": int, "b": int, "verdict": "contradictory" | "consistent", "subtype": str}}]}}

Statements:
{spans}"""


EVIDENCE = """Two passages from one story may contradict each other (category {category}, subtype {subtype}).
Passage A (paragraph {pa}): "{qa}"
Context A: {ca}
Passage B (paragraph {pb}): "{qb}"
Context B: {cb}
Reason step by step, then conclude. Reply with JSON only:
{{"reasoning": str, "conclusion": "error" | "no_error", "error_element": str}}"""


def paragraphs(story: str) -> list[tuple[int, int]]:
    """(start, end) character spans of the story's non-empty paragraphs (split at blank lines / newlines)."""
    return [(m.start(), m.end()) for m in re.finditer(r"[^\n]+(?:\n(?!\s*\n)[^\n]+)*", story) if m.group().strip()]


def locate(story: str, paras: list[tuple[int, int]], paragraph: int, quote: str) -> tuple[int, int] | None:
    """Exact offsets of ``quote`` inside paragraph ``paragraph`` (1-based), or None."""
    if not quote or not 1 <= paragraph <= len(paras):
        return None
    start, end = paras[paragraph - 1]
    i = story.find(quote, start, end)
    return (i, i + len(quote)) if i >= 0 else None


def count_words(text: str) -> int:
    """Space-separated words, plus one per CJK character (Chinese is not space-separated)."""
    cjk = len(re.findall(r"[\u3040-\u30ff\u3400-\u9fff\uf900-\ufaff]", text))
    latin = len(re.findall(r"[A-Za-z0-9]+(?:['’-][A-Za-z0-9]+)*", text))
    return cjk + latin


class Judge:
    """One backend, JSON answers validated and re-asked with the complaint (:func:`reask_json`); every
    valid answer cached."""

    def __init__(self, backend, cache: AppendCache, key_prefix: str, retries: int = 2):
        self.backend, self.cache, self.prefix, self.retries = backend, cache, key_prefix, retries
        self.failures: list[str] = []

    def ask(self, prompt: str, validate) -> dict | None:
        key = answer_key(self.prefix, prompt)
        hit = self.cache.get(key)
        if hit is not None:
            return hit["answer"]

        def reply(messages: list[dict]) -> str:
            g = self.backend().chat(messages)
            if g.error is not None:  # the backend gave up (after its own retries): asking again will not help
                raise _NoAnswer(g.error)
            return g.text

        try:
            obj, complaints = reask_json(reply, prompt, validate, self.retries)
        except _NoAnswer as e:
            obj, complaints = None, [str(e)]
        if obj is None:
            self.failures.append(complaints[-1])
            return None
        self.cache.put({"key": key, "answer": obj, "error": None})
        return obj


class _NoAnswer(Exception):
    pass


@dataclass
class Span:
    id: int
    category: str
    subtype: str
    paragraph: int
    quote: str
    start: int
    end: int
    fact: str


def check_story(story: str, judge: Judge, max_story_chars: int = 60_000) -> dict:
    """The four stages for one story; returns its report (errors with validated offsets)."""
    paras = paragraphs(story)
    spans: list[Span] = []
    for category, subtypes in TAXONOMY.items():
        for first, last in windows(paras, max_story_chars):
            numbered = "\n\n".join(f"[{k + 1}] {story[s:e]}" for k, (s, e) in enumerate(paras) if first <= k <= last)
            found: list[tuple] = []

            def valid(obj: dict) -> str | None:
                found.clear()
                if not isinstance(obj.get("spans"), list):
                    return '"spans" must be a list'
                for x in obj["spans"]:
                    if not isinstance(x, dict):
                        return "each span must be an object"
                    p, q = x.get("paragraph"), x.get("quote")
                    if not isinstance(p, int) or not isinstance(q, str):
                        return "each span needs an integer paragraph and a quote"
                    where = locate(story, paras, p, q)
                    if where is None:
                        return f"the quote {q[:60]!r} is not verbatim in paragraph {p}"
                    found.append((p, q, where, x.get("subtype") if x.get("subtype") in subtypes else "unspecified",
                                  str(x.get("fact", ""))))
                return None

            answer = judge.ask(EXTRACT.format(category=category, what=CATEGORY_TEXT[category],
                                              subtypes=", ".join(subtypes), story=numbered), valid)
            if answer is not None:
                valid(answer)  # re-derive offsets (cached answers too)
                for p, q, (s, e), sub, fact in found:
                    if not any(x.start == s and x.end == e and x.category == category for x in spans):
                        spans.append(Span(len(spans), category, sub, p, q, s, e, fact))
    errors = []
    for category, subtypes in TAXONOMY.items():
        mine = [x for x in spans if x.category == category]
        if len(mine) < 2:
            continue
        ids = {x.id for x in mine}

        def valid_pairs(obj: dict) -> str | None:
            if not isinstance(obj.get("pairs"), list):
                return '"pairs" must be a list'
            for p in obj["pairs"]:
                if not isinstance(p, dict) or p.get("a") not in ids or p.get("b") not in ids or p["a"] == p["b"]:
                    return f"each pair must name two different statement ids from {sorted(ids)}"
            return None

        listing = "\n".join(f"{x.id}: (paragraph {x.paragraph}) \"{x.quote}\" — {x.fact}" for x in mine)
        answer = judge.ask(PAIR.format(category=category, spans=listing), valid_pairs)
        for p in (answer or {}).get("pairs", []):
            if p.get("verdict") != "contradictory":
                continue
            a, b = sorted((spans[p["a"]], spans[p["b"]]), key=lambda x: x.start)
            subtype = p.get("subtype") if p.get("subtype") in subtypes else b.subtype  # never dropped
            ev = judge.ask(EVIDENCE.format(category=category, subtype=subtype, pa=a.paragraph, qa=a.quote,
                                           ca=_context(story, a), pb=b.paragraph, qb=b.quote, cb=_context(story, b)),
                           lambda o: None if o.get("conclusion") in ("error", "no_error")
                           else '"conclusion" must be "error" or "no_error"')
            if ev and ev["conclusion"] == "error" and not any(  # one error per contradicting statement
                    e["quote"]["start"] == b.start and e["category"] == category for e in errors):
                errors.append({"category": category, "subtype": subtype,
                               "quote": {"text": b.quote, "start": b.start, "end": b.end, "paragraph": b.paragraph},
                               "contradiction_pair": {"text": a.quote, "start": a.start, "end": a.end,
                                                      "paragraph": a.paragraph},
                               "reasoning": str(ev.get("reasoning", "")), "error_element": str(ev.get("error_element", ""))})
    for e in errors:  # stage 4: every offset must point at its quote
        for q in (e["quote"], e["contradiction_pair"]):
            if story[q["start"]:q["end"]] != q["text"]:
                raise RuntimeError(f"offsets {q['start']}:{q['end']} do not hold the quote {q['text']!r}")
    return {"words": count_words(story), "characters": len(story), "errors": errors, "n_errors": len(errors),
            "spans": [{"category": x.category, "subtype": x.subtype, "paragraph": x.paragraph, "text": x.quote,
                       "start": x.start, "end": x.end} for x in spans],
            "judge_failures": list(judge.failures), "judged": not judge.failures}


def windows(paras: list, max_chars: int) -> list[tuple[int, int]]:
    """Paragraph index ranges of at most ``max_chars`` characters, overlapping by one paragraph."""
    if not paras:
        return []
    out, first = [], 0
    while first < len(paras):
        last = first
        while last + 1 < len(paras) and paras[last + 1][1] - paras[first][0] <= max_chars:
            last += 1
        out.append((first, last))
        if last == len(paras) - 1:
            break
        first = max(first + 1, last)  # one paragraph of overlap
    return out


def _context(story: str, s: Span, width: int = 200) -> str:
    return story[max(0, s.start - width): s.end + width].replace("\n", " ")


def judged(report: dict) -> bool:
    """The judge answered every stage for this story (older reports: no judge failures)."""
    return bool(report.get("judged", not report.get("judge_failures")))
