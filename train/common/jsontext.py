"""JSON objects in model text: thinking blocks skipped, code fences and chatter around them ignored,
broken JSON lightly repaired. Shared by the scorer's judgement parser and the LLM client's re-ask helper."""

from __future__ import annotations

import json
import re

import json_repair

_THINK = re.compile(r"<think>.*?</think>", re.S)


def extract_json_object(text: str | None) -> dict | None:
    """The last JSON object in a model reply (thinking blocks skipped, light repair), or None."""
    objs = json_objects(strip_thinking(text if isinstance(text, str) else ""))
    return objs[-1] if objs else None


def strip_thinking(text: str) -> str:
    """``text`` without ``<think>...</think>`` blocks (and anything before a lone ``</think>``)."""
    text = _THINK.sub("", text)
    if "</think>" in text:  # the template opened <think> inside the prompt
        text = text.rsplit("</think>", 1)[1]
    return text


def json_objects(text: str) -> list[dict]:
    """Every top-level ``{...}`` that parses (strictly, else repaired), plus a truncated tail."""
    out: list[dict] = []
    depth, start, in_str, esc = 0, -1, False, False
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"' and depth > 0:
            in_str = True
        elif ch == "{":
            depth, start = depth + 1, i if depth == 0 else start
        elif ch == "}" and depth > 0:
            depth -= 1
            if depth == 0:
                obj = _loads(text[start : i + 1])
                if obj is not None:
                    out.append(obj)
                start = -1
    if depth > 0 and start >= 0:  # truncated output: repair the unfinished object
        obj = _loads(text[start:])
        if obj is not None:
            out.append(obj)
    return out


def _loads(s: str) -> dict | None:
    try:
        obj = json.loads(s)
    except ValueError:
        try:
            obj = json_repair.loads(s)
        except Exception:  # json_repair raises assorted errors on hopeless input
            return None
    return obj if isinstance(obj, dict) else None
