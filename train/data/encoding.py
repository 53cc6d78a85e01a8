"""Tokenisation: prompt plus answer, with labels on the answer only; over-long articles are cut in the middle."""

from __future__ import annotations

from dataclasses import dataclass

from longsft.train.data.prompts import TRUNCATION_MARK, PromptVariant, render_prompt
from longsft.train.data.schema import Sample

IGNORE = -100


# --------------------------------------------------------------------------- tokenisation


@dataclass
class Encoded:
    """Token ids of one sample; ``labels`` are IGNORE on the prompt (answer-only training)."""

    sample: Sample
    input_ids: list[int]
    labels: list[int]
    prompt_len: int
    truncated: bool = False


def prompt_ids(tokenizer, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                              return_dict=False, enable_thinking=False))


def _answer_ids(tokenizer, prompt: list[int], text: str, answer: str) -> list[int]:
    msgs = [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
    full = list(tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False, enable_thinking=False))
    if full[: len(prompt)] == prompt and len(full) > len(prompt):
        return full[len(prompt):]
    # Templates that rewrite earlier turns (thinking blocks): answer tokens + end of turn.
    return tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]


def encode(s: Sample, tokenizer, seq_len: int, variant: PromptVariant = "end",
           overflow: str = "truncate") -> Encoded | None:
    """Prompt + answer ids within ``seq_len``; None when ``overflow='skip'`` and too long.

    Truncation removes the middle of the article (the summary and instruction stay whole).
    """
    text = render_prompt(s, variant)
    p = prompt_ids(tokenizer, text)
    a = _answer_ids(tokenizer, p, text, s.target)
    truncated = False
    if len(p) + len(a) > seq_len:
        if overflow == "skip":
            return None
        p, text = _truncate_middle(s, tokenizer, seq_len - len(a), variant, len(p))
        if p is None:
            return None
        a = _answer_ids(tokenizer, p, text, s.target)
        truncated = True
    return Encoded(s, p + a, [IGNORE] * len(p) + a, len(p), truncated)


def _truncate_middle(s: Sample, tokenizer, budget: int, variant: PromptVariant, prompt_len: int):
    """Shrink the article's middle until the prompt fits ``budget`` tokens (a few passes)."""
    art = tokenizer.encode(s.article, add_special_tokens=False)
    mark = TRUNCATION_MARK[s.language]
    overhead = prompt_len - len(art)
    keep = budget - overhead - 8
    for _ in range(6):
        if keep <= 0:
            return None, None
        head = keep // 2
        article = tokenizer.decode(art[:head]) + mark + tokenizer.decode(art[len(art) - (keep - head):])
        text = render_prompt(s, variant, article)
        p = prompt_ids(tokenizer, text)
        if len(p) <= budget:
            return p, text
        keep -= len(p) - budget + 4
    return None, None


@dataclass
class EncodeStats:
    total: int = 0
    kept: int = 0
    truncated: int = 0
    skipped: int = 0
    max_len: int = 0


def encode_all(samples: list[Sample], tokenizer, seq_len: int, variant: PromptVariant,
               overflow: str) -> tuple[list[Encoded], EncodeStats]:
    out, st = [], EncodeStats(total=len(samples))
    for s in samples:
        e = encode(s, tokenizer, seq_len, variant, overflow)
        if e is None:
            st.skipped += 1
            continue
        st.kept += 1
        st.truncated += e.truncated
        st.max_len = max(st.max_len, len(e.input_ids))
        out.append(e)
    return out, st
