"""LongNovel samples: schema, prompts, tokenisation with answer-only labels, batching.

Accepted record forms (one JSON object per line):

- released LongNovel: ``id, language, article, summary, instruction, input, output`` —
  ``instruction`` is the task prompt, ``output`` the gold judgement (JSON string);
- richer longsft form: ``id, language, article, summary`` plus ``gold_score`` (0-5) and optional
  ``types``, ``reason``, ``bucket``, ``source`` (human/mma/erhg), ``split``.

Provenance that longsft's own tools add is accepted too (``book, units, tokens`` from ``data
extend``, ``parent, edits`` from ``data erhg``, ``generator, judges, arbitrated`` from ``data mma``);
``meta`` is free-form, for anything of your own. Any other field is refused as a likely typo
(``file:line: unknown field 'typs' (did you mean 'types'?)``): a misspelled optional field would
otherwise be dropped without a word.

The prompt is always rendered from its parts (instruction, article, summary) so that the
article can be truncated in the middle without touching the summary.
"""

from __future__ import annotations

import difflib
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from longsft.eval.judgement import TYPES, normalize_type, normalize_types, parse_judgement

from .io import DataError, iter_jsonl

LANGUAGES = ("zh", "en")
IGNORE = -100

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

# Every field a sample may carry (see the module docstring); ``meta`` is the free-form one.
SAMPLE_FIELDS = ("id", "language", "article", "summary", "gold_score", "types", "reason", "bucket", "source", "split",
                 "instruction", "input", "output", "book", "units", "tokens", "parent", "edits", "generator",
                 "judges", "arbitrated", "meta")


def check_fields(rec: dict, known: tuple[str, ...], where: str) -> None:
    """Refuse a field not in ``known``, naming the nearest known one (a typo is not dropped silently)."""
    for key in rec:
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"did you mean {near[0]!r}?" if near else f"known: {', '.join(known)}"
            raise DataError(f"{where}: unknown field {key!r} ({hint}); free-form data goes under 'meta'")


def check_sample(rec: dict, where: str, required: tuple[str, ...] = ("id", "language", "article", "summary")) -> None:
    """The checks every sample reader shares: known fields, ``required`` text fields, language, gold_score."""
    check_fields(rec, SAMPLE_FIELDS, where)
    for key in required:
        if key not in rec:
            raise DataError(f"{where}: missing field {key!r}")
        if not isinstance(rec[key], str) or (key != "id" and not rec[key].strip()):
            raise DataError(f"{where}: field {key!r} must be a non-empty string, got {_show(rec[key])}")
    if "language" in rec and rec["language"] not in LANGUAGES:
        raise DataError(f"{where}: unknown language {rec['language']!r} (expected one of {list(LANGUAGES)})")
    if "gold_score" in rec:
        score = rec["gold_score"]
        if isinstance(score, bool) or not isinstance(score, int) or not 0 <= score <= 5:
            raise DataError(f"{where}: gold_score must be an integer 0..5, got {score!r}")
    for key in ("instruction", "input", "output", "reason", "bucket", "source", "split", "book", "parent", "generator"):
        if rec.get(key) is not None and not isinstance(rec[key], str):
            raise DataError(f"{where}: field {key!r} must be a string, got {_show(rec[key])}")
    types = rec.get("types")
    if types is not None:
        if not isinstance(types, (list, str)):
            raise DataError(f"{where}: types must be a list of type names, got {_show(types)}")
        for t in types if isinstance(types, list) else re.split(r"[,、;/|]", types):
            t = str(t).strip()
            if t and normalize_type(t) is None:
                near = difflib.get_close_matches(t.lower(), TYPES, n=1)
                hint = f"did you mean {near[0]!r}?" if near else f"known: {', '.join(TYPES)}"
                raise DataError(f"{where}: types: unknown hallucination type {t!r} ({hint})")


def _show(value) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass
class Sample:
    id: str
    language: str
    article: str
    summary: str
    gold_score: int
    target: str  # the judgement text the model is trained to produce
    types: list[str] = field(default_factory=list)
    instruction: str | None = None
    bucket: str | None = None
    source: str | None = None
    split: str | None = None


def load_samples(path: str | Path) -> list[Sample]:
    """Read and validate a JSONL file; errors name the file, line and field."""
    return [_parse_record(rec, where) for where, rec in _checked_records(path)]


def read_records(path: str | Path, required: tuple[str, ...] = ("id", "language", "article", "summary")) -> list[dict]:
    """The raw records of a samples file for the data commands, checked as :func:`check_sample`
    does (with ``required`` fields), ids unique; errors name the file and line."""
    return [rec for _, rec in _checked_records(path, required)]


def _checked_records(path: str | Path, required: tuple[str, ...] = ("id", "language", "article", "summary")):
    """Yield ('file:line', record) after :func:`check_sample`; a repeated id or no record is a DataError."""
    seen: dict = {}
    for lineno, rec in iter_jsonl(path):
        where = f"{path}:{lineno}"
        check_sample(rec, where, required)
        if rec["id"] in seen:
            raise DataError(f"{where}: duplicate id {rec['id']!r} (also on line {seen[rec['id']]})")
        seen[rec["id"]] = lineno
        yield where, rec
    if not seen:
        raise DataError(f"{path}: no samples")


def _parse_record(rec: dict, where: str) -> Sample:
    """One record already checked by :func:`check_sample` -> Sample (its training target rendered)."""
    lang = rec["language"]
    if "gold_score" in rec:
        score = rec["gold_score"]
        types = normalize_types(rec.get("types"))
        target = rec.get("output") or render_target(lang, score, types, rec.get("reason") or "")
    elif "output" in rec:
        j = parse_judgement(rec["output"])
        if not j.valid:
            raise DataError(f"{where}: field 'output' holds no valid judgement score")
        score, types, target = int(j.score), j.types, rec["output"]
    else:
        raise DataError(f"{where}: needs 'gold_score' or 'output' (the gold judgement)")
    return Sample(id=rec["id"], language=lang, article=rec["article"], summary=rec["summary"],
                  gold_score=score, target=target, types=types, instruction=rec.get("instruction"),
                  bucket=rec.get("bucket"), source=rec.get("source"), split=rec.get("split"))


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


# --------------------------------------------------------------------------- batching


Row = list[Encoded]  # one batch row: a single sample, or several packed end to end


def pack(items: list[Encoded], seq_len: int, enabled: bool) -> list[Row]:
    """Group samples into rows of at most ``seq_len`` tokens (first-fit decreasing, deterministic).

    Without packing every row holds one sample. Packed documents never see each other: they get
    their own position ids and document ids, and attention is masked per document.
    """
    if not enabled:
        return [[e] for e in items]
    rows: list[Row] = []
    space: list[int] = []
    for e in sorted(items, key=lambda e: (-len(e.input_ids), e.sample.id)):
        n = len(e.input_ids)
        j = next((i for i, free in enumerate(space) if free >= n), None)
        if j is None:
            rows.append([e])
            space.append(seq_len - n)
        else:
            rows[j].append(e)
            space[j] -= n
    return rows


def collate(rows: list[Row | Encoded], pad_id: int, pad_to_multiple: int = 1) -> dict[str, torch.Tensor]:
    """Right-pad rows to a common length. Labels are shifted here, before any sequence split, and
    per document: ``shift_labels[b, t]`` is the target of position ``t`` (IGNORE at a document's
    last token and on padding). Position ids restart at 0 for each packed document.

    Returns input_ids, attention_mask, position_ids, shift_labels, doc_ids (-1 on padding): [batch, seq].
    """
    rows = [r if isinstance(r, list) else [r] for r in rows]
    n = max(sum(len(e.input_ids) for e in r) for r in rows)
    n = -(-n // pad_to_multiple) * pad_to_multiple
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    shift = torch.full((len(rows), n), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    docs = torch.full((len(rows), n), -1, dtype=torch.long)
    pos = torch.arange(n).repeat(len(rows), 1)
    for i, row in enumerate(rows):
        t = 0
        for j, e in enumerate(row):
            k = len(e.input_ids)
            ids[i, t:t + k] = torch.tensor(e.input_ids)
            shift[i, t:t + k - 1] = torch.tensor(e.labels[1:])
            pos[i, t:t + k] = torch.arange(k)
            docs[i, t:t + k] = j
            t += k
        mask[i, :t] = 1
        pos[i, t:] = torch.arange(t, n) if len(row) == 1 else torch.arange(n - t)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "shift_labels": shift, "doc_ids": docs}


class StepSampler:
    """Deterministic map from optimizer step -> this rank's micro-batches.

    Each epoch is a seeded permutation; a global step takes ``dp_size * micro * accum`` samples
    (the tail that does not fill a step is dropped, so every rank sees the same number of
    batches). Resuming at step ``s`` needs nothing but ``s``.
    """

    def __init__(self, n: int, dp_size: int, dp_rank: int, micro: int, accum: int, seed: int):
        self.n, self.dp_size, self.dp_rank, self.micro, self.accum, self.seed = n, dp_size, dp_rank, micro, accum, seed
        self.global_batch = dp_size * micro * accum
        self.steps_per_epoch = n // self.global_batch

    def global_indices(self, step: int) -> list[int]:
        """Every sample index of global ``step``, all ranks together."""
        epoch, pos = divmod(step, self.steps_per_epoch)
        perm = list(range(self.n))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(perm)
        return perm[pos * self.global_batch:(pos + 1) * self.global_batch]

    def step(self, step: int) -> list[list[int]]:
        """Indices for ``accum`` micro-batches of this rank at global ``step``."""
        mine = self.global_indices(step)[self.dp_rank::self.dp_size]
        return [mine[i * self.micro:(i + 1) * self.micro] for i in range(self.accum)]
