"""Tokenisation: prompt plus answer, with labels on the answer only; over-long articles are cut in the middle."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from longsft.train.data.prompts import TRUNCATION_MARK, PromptVariant, render_prompt
from longsft.train.data.schema import Sample

IGNORE = -100
# Bump when a change here (or in how a cache stores it) changes the tokens of any sample.
ENCODING_VERSION = 2


# --------------------------------------------------------------------------- tokenisation


@dataclass(frozen=True)
class Meta:
    """What training and validation need of a sample besides its tokens (no text)."""

    id: str
    language: str
    gold_score: int
    types: tuple[str, ...] = ()
    bucket: str | None = None
    source: str | None = None

    @classmethod
    def of(cls, s: Sample) -> Meta:
        return cls(s.id, s.language, s.gold_score, tuple(s.types), s.bucket, s.source)


@dataclass
class Encoded:
    """One sample's token ids: the prompt's ``prompt_len`` ids, then the answer's (the only targets).

    ``input_ids`` is a list or a read-only view into a token cache (:mod:`~longsft.train.data.token_cache`).
    """

    meta: Meta
    input_ids: Sequence[int]
    prompt_len: int
    truncated: bool = False

    @property
    def labels(self) -> list[int]:
        """IGNORE on the prompt, the ids themselves on the answer: [len(input_ids)]."""
        return [IGNORE] * self.prompt_len + [int(x) for x in self.input_ids[self.prompt_len:]]


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _render(tokenizer, msgs: list[dict], prompt: bool) -> str:
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=prompt, tokenize=False, enable_thinking=False)


def prompt_ids(tokenizer, text: str) -> list[int]:
    """The chat-templated user turn plus the assistant header (what generation starts from)."""
    return _ids(tokenizer, _render(tokenizer, [{"role": "user", "content": text}], True))


def _special_starts(tokenizer, text: str) -> int:
    """Where the last special token in ``text`` starts (-1: none)."""
    specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    return max((text.rfind(s) for s in specials), default=-1)


def _turns(tokenizer, text: str, answer: str) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of a user turn and its answer, with one pass over the long prompt.

    A tokenizer splits its text at special tokens first and encodes the pieces independently, so the
    conversation's ids up to the prompt's last special token (the assistant header) are the prompt's
    too; only the short tail from there is encoded both ways. When that split does not hold (checked)
    or the template rewrites earlier turns, both are encoded whole, as ``apply_chat_template`` would.
    """
    user = [{"role": "user", "content": text}]
    p_text, f_text = _render(tokenizer, user, True), _render(tokenizer, user + [{"role": "assistant", "content": answer}], False)
    full = _ids(tokenizer, f_text)
    split_specials = not getattr(tokenizer, "split_special_tokens", False)  # else specials are plain text
    cut = _special_starts(tokenizer, p_text) if split_specials and f_text.startswith(p_text) else -1
    if cut > 0:
        p_tail, f_tail = _ids(tokenizer, p_text[cut:]), _ids(tokenizer, f_text[cut:])
        head = len(full) - len(f_tail)
        if head >= 0 and full[head:] == f_tail and f_tail[:len(p_tail)] == p_tail and len(f_tail) > len(p_tail):
            return full[:head] + p_tail, f_tail[len(p_tail):]
    prompt = _ids(tokenizer, p_text)
    if full[: len(prompt)] == prompt and len(full) > len(prompt):
        return prompt, full[len(prompt):]
    # Templates that rewrite earlier turns (thinking blocks): answer tokens + end of turn.
    return prompt, tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]


def encode(s: Sample, tokenizer, seq_len: int, variant: PromptVariant = "end",
           overflow: str = "truncate") -> Encoded | None:
    """Prompt + answer ids within ``seq_len``; None when ``overflow='skip'`` and too long.

    Truncation removes the middle of the article (the summary and instruction stay whole).
    """
    text = render_prompt(s, variant)
    p, a = _turns(tokenizer, text, s.target)
    truncated = False
    if len(p) + len(a) > seq_len:
        if overflow == "skip":
            return None
        p, text = _truncate_middle(s, tokenizer, seq_len - len(a), variant, len(p))
        if p is None:
            return None
        p, a = _turns(tokenizer, text, s.target)
        truncated = True
    return Encoded(Meta.of(s), p + a, len(p), truncated)


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

    def add(self, e: Encoded | None) -> None:
        """Count one sample's outcome (None: skipped)."""
        self.total += 1
        if e is None:
            self.skipped += 1
            return
        self.kept += 1
        self.truncated += e.truncated
        self.max_len = max(self.max_len, len(e.input_ids))


def encode_all(samples: list[Sample], tokenizer, seq_len: int, variant: PromptVariant,
               overflow: str) -> tuple[list[Encoded], EncodeStats]:
    out, st = [], EncodeStats()
    for s in samples:
        e = encode(s, tokenizer, seq_len, variant, overflow)
        st.add(e)
        if e is not None:
            out.append(e)
    return out, st
