"""Parse a model's hallucination judgement: score 0-5, hallucination types, reason.

The same parser serves the training validation hook and ``longsft eval``/``longsft score``.
It survives what LongNovel models actually print: ``<think>`` blocks, code fences, chatter,
repeated or truncated JSON, full-width punctuation, doubled braces, single quotes, scores as
strings/floats, plain-text scores ("score: 2/5", "评分：2分"). Of several judgements the last
valid one wins (repetition loops re-state, and self-corrections come last).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from longsft.train.common.jsontext import json_objects, strip_thinking

# The eight canonical types (LongNovel appendix B) and every name they appear under.
TYPES = ("entity", "numerical", "relation", "inversion", "event", "temporal", "causal", "fabrication")
_ALIASES = {
    "entity": ["entity", "实体", "ent", "entity error"],
    "numerical": ["numerical", "numeric", "number", "数字", "数值", "num"],
    "relation": ["relation", "relational", "relationship", "关系", "rel"],
    "inversion": ["contradictory statement", "logical inversion", "reverse statement", "reverse-statement",
                  "polarity", "inversion", "contradictory", "反向陈述", "逻辑反转", "log"],
    "event": ["event", "事件", "evt"],
    "temporal": ["timeline disruption", "temporal", "timeline", "time", "时间线乱序", "时间线", "时间", "tmp"],
    "causal": ["causal chain fabrication", "causal", "causal chain", "causality", "因果链伪造", "因果", "cau"],
    "fabrication": ["fictional event", "event fabrication", "fabricated event", "fabrication", "fictional",
                    "虚构事件", "虚构", "fab"],
}
_TYPE_OF = {alias.lower(): canon for canon, names in _ALIASES.items() for alias in names}
_SUFFIX = re.compile(r"\s*(hallucinations?|errors?|幻觉|错误)\s*$", re.I)

_FULL_WIDTH = str.maketrans({"：": ":", "，": ",", "“": '"', "”": '"', "＂": '"', "｛": "{", "｝": "}",
                             "‘": "'", "’": "'", "［": "[", "］": "]", "（": "(", "）": ")", "；": ";"})
_PLAIN_TYPES = re.compile(r"(?:hallucination[_ ]types?|幻觉类型)\s*[:=]\s*([^\n]*)", re.I)
_SCORE_KEYS = ("score", "consistency_score", "评分", "分数", "得分")
_PLAIN_SCORES = [  # fallbacks when no JSON judgement parses; the last match in the text wins
    re.compile(r"(?:score|rating)\s*(?:is|of)?\s*[:=]?\s*[\"']?(-?\d+(?:\.\d+)?)\s*(?:/\s*5)?", re.I),
    re.compile(r"(?:评分|分数|得分|打分)\s*(?:为|是)?\s*[:=]?\s*(-?\d+(?:\.\d+)?)\s*分?"),
    re.compile(r"(-?\d+(?:\.\d+)?)\s*/\s*5\b"),
]


@dataclass
class Judgement:
    """One parsed model output. ``score`` is None when the output is invalid."""

    score: float | None
    types: list[str] = field(default_factory=list)
    reason: str | None = None

    @property
    def valid(self) -> bool:
        return self.score is not None

    @property
    def hallucinated(self) -> bool | None:
        """Binary label by score (<= 2 hallucinated); None when invalid."""
        return None if self.score is None else self.score < 3

    @property
    def contradiction(self) -> bool:
        """Types listed although the score says 'no hallucination' (paper H.6)."""
        return self.score is not None and self.score >= 3 and bool(self.types)


def normalize_type(name: str) -> str | None:
    """'Timeline Disruption', '时间线乱序', 'Tmp', 'temporal hallucination' -> 'temporal'."""
    key = _SUFFIX.sub("", str(name).strip().translate(_FULL_WIDTH)).strip().lower()
    key = key.strip("\"'`[]() ")
    return _TYPE_OF.get(key) or _TYPE_OF.get(key.replace("_", " ")) or _TYPE_OF.get(key.replace("-", " "))


def normalize_types(value: object) -> list[str]:
    """A list or a delimited string of type names -> canonical, de-duplicated, in order."""
    if value is None:
        return []
    items = value if isinstance(value, list) else re.split(r"[,、;/|]", str(value))
    out: list[str] = []
    for item in items:
        t = normalize_type(str(item))
        if t and t not in out:
            out.append(t)
    return out


def parse_judgement(text: str | None) -> Judgement:
    """Raw model text -> :class:`Judgement` (score None when nothing valid is found, or not text)."""
    if not text or not isinstance(text, str):
        return Judgement(None)
    text = strip_thinking(text).translate(_FULL_WIDTH).replace("{{", "{").replace("}}", "}")
    for obj in reversed(json_objects(text)):
        j = _from_obj(obj)
        if j is not None:
            return j
    return _from_plain_text(text)


def _from_obj(obj: dict) -> Judgement | None:
    lowered = {str(k).strip().lower(): v for k, v in obj.items()}
    for key in _SCORE_KEYS:
        if key in lowered:
            score = _score(lowered[key])
            if score is None:
                return None
            types = normalize_types(lowered.get("hallucination_types", lowered.get("幻觉类型")))
            reason = lowered.get("reason", lowered.get("理由"))
            return Judgement(score, types, None if reason is None else str(reason))
    return None


def _from_plain_text(text: str) -> Judgement:
    for pattern in _PLAIN_SCORES:
        matches = pattern.findall(text)
        for m in reversed(matches):
            score = _score(m)
            if score is not None:
                listed = _PLAIN_TYPES.findall(text)
                return Judgement(score, normalize_types(listed[-1]) if listed else [], None)
    return Judgement(None)


def _score(value: object) -> float | None:
    """0..5 as int where integral; anything else (out of range, text, bool) is invalid."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*(?:/\s*5|分)?\s*", value)
        if not m:
            return None
        value = float(m.group(1))
    if not isinstance(value, (int, float)) or not 0 <= value <= 5:
        return None
    return int(value) if float(value).is_integer() else float(value)
