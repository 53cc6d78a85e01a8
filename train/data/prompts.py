"""The task prompt and the gold answer text, in both languages.

The prompt is always rendered from its parts (instruction, article, summary). This lets the article
be truncated in the middle without touching the summary.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # schema renders targets with this module
    from longsft.train.data.schema import Sample

# Canonical type -> the name the prompt of each language uses (LongNovel's prompt vocabulary).
TYPE_NAMES = {
    "en": {"entity": "Entity", "numerical": "Numeric", "relation": "Relational",
           "inversion": "Contradictory Statement", "event": "Event", "temporal": "Timeline Disruption",
           "causal": "Causal Chain Fabrication", "fabrication": "Fictional Event"},
    "zh": {"entity": "实体", "numerical": "数字", "relation": "关系", "inversion": "反向陈述", "event": "事件",
           "temporal": "时间线乱序", "causal": "因果链伪造", "fabrication": "虚构事件"},
}

_INSTRUCTION = {
    "en": ("You are a consistency checker for novel summaries. Compare the summary with the original text "
           "and rate its factual consistency from 0 to 5: 5 = fully consistent; 4 = consistent with minor "
           "over-inference; 3 = correct but generalised or simplified; 2 = clear errors in names, numbers, "
           "times or events; 1 = mostly fabricated; 0 = irrelevant. Omissions do not lower the score. "
           "Hallucination types: " + ", ".join(TYPE_NAMES["en"].values()) + ". Answer with JSON only: "
           '{"score": int, "reason": str} when the score is 3 or more, otherwise '
           '{"reason": str, "score": int, "hallucination_types": [str]}.'),
    "zh": ("你是小说摘要的一致性检查员。请对照原文判断摘要的事实一致性，打分0到5分：5分=完全一致；4分=基本一致，"
           "略有过度推断；3分=事实正确但有概括或简化；2分=时间、人名、数字或事件有明显错误；1分=大部分内容虚构；"
           "0分=与原文无关。遗漏不扣分。幻觉类型：" + "、".join(TYPE_NAMES["zh"].values()) + "。只输出JSON："
           '3分及以上为{"score": int, "reason": str}，否则为{"reason": str, "score": int, "hallucination_types": [str]}。'),
}
_COT = {"en": " Think step by step about each summary sentence before the JSON.",
        "zh": "请先逐句分析摘要，再输出JSON。"}
_LABELS = {"en": ("Original text:", "Summary:"), "zh": ("原文：", "摘要：")}
TRUNCATION_MARK = {"en": "\n[... middle of the text omitted ...]\n", "zh": "\n【……中间部分省略……】\n"}

PromptVariant = Literal["end", "begin", "cot"]


def template_digest() -> str:
    """sha256 of every text a prompt or target is rendered from (a change re-tokenizes cached data)."""
    texts = [TYPE_NAMES, _INSTRUCTION, _COT, _LABELS, TRUNCATION_MARK]
    return hashlib.sha256(json.dumps(texts, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def render_target(language: str, score: int, types: list[str], reason: str) -> str:
    """The paper's judgement JSON: reason first (and types) when hallucinated."""
    if score >= 3:
        obj = {"score": score, "reason": reason}
    else:
        obj = {"reason": reason, "score": score,
               "hallucination_types": [TYPE_NAMES[language][t] for t in types]}
    return json.dumps(obj, ensure_ascii=False)


def render_prompt(s: Sample, variant: PromptVariant = "end", article: str | None = None) -> str:
    """User message: instruction + article + summary (summary last unless ``begin``)."""
    instruction = s.instruction or _INSTRUCTION[s.language]
    if variant == "cot":
        instruction += _COT[s.language]
    art_label, sum_label = _LABELS[s.language]
    art = f"{art_label}\n{s.article if article is None else article}"
    summ = f"{sum_label}\n{s.summary}"
    body = f"{summ}\n\n{art}" if variant == "begin" else f"{art}\n\n{summ}"
    return f"{instruction}\n\n{body}"
