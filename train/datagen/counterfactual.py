"""Counterfactual summaries for the offline sample set: hallucinations only the article can reveal.

The rule engine's edits (:class:`~longsft.train.datagen.erhg.RuleEngine`) leave marks in the summary
itself: a number no faithful summary has (``2n + k``), an inserted "not", a fixed clause ("Because X fell
ill"). On the sample set a bag-of-words classifier of the summary alone separates them (test AUC 0.93,
``bench/decision_probe.py``), so a model can score well there without reading the article. Here every
slot of a fact (who, where, how many, which relation, agreed or refused) is drawn independently from
the story's own values, and a hallucination redraws one slot from the same values: the summary alone
has the same distribution in both classes, and only its disagreement with the article tells them apart.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# how many soldiers, per march fact: the faithful value and its counterfactuals come from one set
NUMBERS = ([300, 500, 2000, 7000], [40, 60, 800, 9000])
KINDS = ("march", "help", "rel", "march")  # the four facts of a story, in order
EDITS = {"march": ("entity", "numerical"), "help": ("entity", "inversion"), "rel": ("entity", "relation")}


@dataclass(frozen=True)
class Story:
    """A story's values: its people, places and relations (the slots' choices)."""

    names: list[str]
    places: list[str]
    rels: list[str]


def facts(rng: random.Random, story: Story) -> list[tuple[str, dict]]:
    """Four facts, each slot drawn on its own: [(template kind, slots)] (kinds of ``sample_data._FACT``)."""
    out, marches = [], 0
    for kind in KINDS:
        if kind == "march":
            out.append(("march", {"a": rng.choice(story.names), "n": rng.choice(NUMBERS[marches]),
                                  "p": rng.choice(story.places)}))
            marches += 1
        elif kind == "help":
            a, b = rng.sample(story.names, 2)
            out.append((rng.choice(["meet", "refuse"]), {"a": a, "b": b, "p": rng.choice(story.places)}))
        else:
            a, b = rng.sample(story.names, 2)
            out.append(("rel", {"a": a, "b": b, "r": rng.choice(story.rels)}))
    return out


def _redraw(rng: random.Random, values: list, old, avoid=()) -> object:
    return rng.choice([v for v in values if v != old and v not in avoid])


def edit(rng: random.Random, story: Story, fact: tuple[str, dict], index: int, kind: str) -> tuple[str, dict]:
    """``fact`` (the ``index``-th of the story) with one slot redrawn as ``kind`` (one of its ``EDITS``)."""
    template, slots = fact
    slots = dict(slots)
    if kind == "numerical":
        slots["n"] = _redraw(rng, NUMBERS[0 if index == 0 else 1], slots["n"])
    elif kind == "inversion":
        template = "refuse" if template == "meet" else "meet"
    elif kind == "relation":
        slots["r"] = _redraw(rng, story.rels, slots["r"])
    elif "p" in slots and rng.random() < 0.5:  # entity: the place, or one of the people
        slots["p"] = _redraw(rng, story.places, slots["p"])
    else:
        who = rng.choice([k for k in ("a", "b") if k in slots])
        other = [slots[k] for k in ("a", "b") if k in slots and k != who]
        slots[who] = _redraw(rng, story.names, slots[who], other)
    return template, slots


def hallucinate(rng: random.Random, story: Story, story_facts: list[tuple[str, dict]], n: int, say,
                article: str) -> tuple[list[str], list[str]]:
    """The summary's sentences with ``n`` facts edited (distinct facts, one slot each), and the edits'
    types (sorted, distinct). ``say(kind, slots)`` renders a fact; an edited sentence that the article
    states anyway is drawn again."""
    sentences = [say(k, s) for k, s in story_facts]
    types = set()
    for i in rng.sample(range(len(story_facts)), n):
        base = "help" if story_facts[i][0] in ("meet", "refuse") else story_facts[i][0]
        for _ in range(32):
            kind = rng.choice(EDITS[base])
            new = say(*edit(rng, story, story_facts[i], i, kind))
            if new != sentences[i] and new not in article:
                sentences[i] = new
                types.add(kind)
                break
        else:
            raise RuntimeError(f"no counterfactual of {sentences[i]!r} that the article does not state")
    return sentences, sorted(types)
