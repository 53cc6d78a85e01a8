"""LongNovel samples: the record schema, read with ``file:line`` errors.

Accepted record forms (one JSON object per line):

- released LongNovel: ``id, language, article, summary, instruction, input, output``.
  ``instruction`` is the task prompt and ``output`` the gold judgement (a JSON string).
- richer longsft form: ``id, language, article, summary`` plus ``gold_score`` (0-5) and the optional
  ``types``, ``reason``, ``bucket``, ``source`` (human/mma/erhg), ``split``.

Provenance fields that longsft's own tools add are accepted too: ``book, units, tokens`` from
``data extend``, ``parent, edits`` from ``data erhg``, and ``generator, judges, arbitrated`` from
``data mma``. ``meta`` is free-form, for anything of your own. Any other field is refused as a likely
typo (``file:line: unknown field 'typs' (did you mean 'types'?)``), because a misspelled optional
field would otherwise be dropped without a word.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from longsft.train.common.errors import DataError
from longsft.train.data.prompts import render_target
from longsft.train.data.sources import open_source
from longsft.train.scoring.judgement import TYPES, normalize_type, normalize_types, parse_judgement

LANGUAGES = ("zh", "en")

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
    """Read and validate a samples source (:func:`~longsft.train.data.sources.open_source`); errors
    name the file, line (or row) and field."""
    return [parse_record(rec, where) for where, rec in _checked_records(path)]


def read_records(path: str | Path, required: tuple[str, ...] = ("id", "language", "article", "summary")) -> list[dict]:
    """The raw records of a samples file for the data commands, checked as :func:`check_sample`
    does (with ``required`` fields), ids unique; errors name the file and line."""
    return [rec for _, rec in _checked_records(path, required)]


def _checked_records(path: str | Path, required: tuple[str, ...] = ("id", "language", "article", "summary")):
    """Yield ('file:line', record) after :func:`check_sample`; a repeated id or no record is a DataError."""
    seen: dict = {}
    for where, rec in open_source(path):
        check_sample(rec, where, required)
        check_unique(rec["id"], where, seen)
        yield where, rec
    if not seen:
        raise DataError(f"{path}: no samples")


def check_unique(sample_id: str, where: str, seen: dict[str, str]) -> None:
    """A DataError when ``sample_id`` is in ``seen`` (id -> where); else record it."""
    if sample_id in seen:
        raise DataError(f"{where}: duplicate id {sample_id!r} (also at {seen[sample_id]})")
    seen[sample_id] = where


def read_sample(source, i: int) -> tuple[str, Sample]:
    """('where', sample) of row ``i`` of an open source, checked (but for the unique-id check) and parsed."""
    where, rec = source.get(i)
    check_sample(rec, where)
    return where, parse_record(rec, where)


def parse_record(rec: dict, where: str) -> Sample:
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
