"""A rule-based "judge model" for the ConStory checker tests, served over real HTTP by llm_server.

It reads the checker's prompts and answers like a careful judge would for the planted facts:
birth years ("born in 1990" / "生于1990年") and eye colours ("eyes were blue" / "眼睛是蓝色").
Its first extraction answer quotes text that is not in the story, so the checker must re-ask.
"""

import json
import re

FACTS = {"timeline_plot": [r"[A-Z][a-z]+ was born in \d{4}\.", r"[\u4e00-\u9fff]{2}生于\d{4}年。"],
         "factual_detail": [r"Her eyes were (?:blue|green)\.", r"她的眼睛是[蓝绿]色的。"]}
state = {"fooled": False}


def value(quote: str) -> str:
    return re.search(r"\d{4}|blue|green|蓝|绿", quote).group()


def answer(prompt: str) -> str:
    if prompt.startswith("You check a long story"):
        category = re.search(r"Category: (\w+)", prompt).group(1)
        if not state["fooled"]:
            state["fooled"] = True
            return json.dumps({"spans": [{"paragraph": 1, "quote": "words that are not in the story", "fact": "x"}]})
        spans = []
        for m in re.finditer(r"^\[(\d+)\] (.*)$", prompt, re.M):
            for pat in FACTS.get(category, []):
                for q in re.findall(pat, m.group(2)):
                    spans.append({"paragraph": int(m.group(1)), "quote": q, "subtype": "", "fact": q})
        return json.dumps({"spans": spans})
    if prompt.startswith("Below are statements"):
        items = [(int(i), q) for i, q in re.findall(r'^(\d+): \(paragraph \d+\) "(.*)" —', prompt, re.M)]
        pairs = [{"a": a, "b": b, "verdict": "contradictory" if value(qa) != value(qb) else "consistent",
                  "subtype": "absolute_time" if value(qa).isdigit() else "appearance"}
                 for k, (a, qa) in enumerate(items) for b, qb in items[k + 1:]]
        return json.dumps({"pairs": pairs})
    if prompt.startswith("Two passages"):
        return json.dumps({"reasoning": "the two passages state different values", "conclusion": "error",
                           "error_element": "value"})
    raise ValueError(prompt[:80])
