"""``longsft data extend``: textual units of books -> LongNovel samples in token-length buckets.

Input, one JSON object per line, the units of a book contiguous and in order::

    {"book": "hlm", "unit": 1, "language": "zh", "text": "...", "summary": "..."}

For each bucket ``[lower, upper]`` (Qwen3 tokens of the article) a window starts at a unit and
grows unit by unit until its token count enters the range; the sample's article is the units'
text (joined by a blank line) and its summary the units' summaries joined in order. The next
window starts after it (windows of one bucket never overlap, so no text is shared between two
samples of a bucket). A start whose first fitting growth already overshoots ``upper`` moves on by
one unit; what is left at a book's end below ``lower`` is discarded (the residue rule); a unit
without a summary ends the window (a summary must cover the whole article). Every count is the
exact token count of the joined article, computed from per-unit counts and a correction at each
join (:meth:`Builder.join_corrections`), so the text is tokenized once, not once per bucket.

Streams one book at a time. Output: ``<out>/<bucket>/samples.jsonl`` (the richer sample form,
gold_score 5, source "human"), ``<out>/stats.json``, ``<out>/problems.jsonl`` (each skipped unit or
book with its id and why) and ``<out>/progress.json``, which lets an interrupted build resume
where it stopped (``--resume``) with byte-identical output.

Nothing the user had is overwritten: the whole input is checked (one quick pass, no tokenizing)
before anything is written; a new build refuses an ``--out`` that already holds any of its output
files; a finished build is left as it is (``--resume`` on it prints its stats again). Unit
fields other than ``book, unit, language, text, summary`` and the free-form ``meta`` are refused.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from longsft.train.common.errors import DataError
from longsft.train.common.io import (
    atomic_write_json,
    check_input_file,
    check_output_dir,
    iter_jsonl,
    read_json,
    safe_name,
)
from longsft.train.data.schema import check_fields

SEP = "\n\n"
SUMMARY_JOIN = {"zh": "", "en": " "}
# Our choice (the paper names the four targets, not the bounds): a window fills at least 3/4 of
# its bucket, so a 16k sample is 12,000-16,000 tokens; override with name=lower:upper.
DEFAULT_BUCKETS = {"16k": (12_000, 16_000), "32k": (24_000, 32_000), "64k": (48_000, 64_000),
                   "100k": (75_000, 100_000)}
UNIT_FIELDS = ("book", "unit", "language", "text", "summary", "meta")


@dataclass(frozen=True)
class Bucket:
    name: str
    lower: int
    upper: int


def parse_buckets(spec: str) -> list[Bucket]:
    """``16k,32k`` (default bounds) or ``16k=12000:16000,tiny=100:200``."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, bounds = part.partition("=")
        if bounds:
            try:
                lo, hi = (int(x) for x in bounds.split(":"))
            except ValueError:
                raise DataError(f"--buckets {part!r}: expected name=lower:upper with integers") from None
        elif name in DEFAULT_BUCKETS:
            lo, hi = DEFAULT_BUCKETS[name]
        else:
            raise DataError(f"--buckets: unknown bucket {name!r} (known: {', '.join(DEFAULT_BUCKETS)}; "
                            "or give name=lower:upper)")
        if not 0 < lo <= hi:
            raise DataError(f"--buckets {part!r}: need 0 < lower <= upper")
        safe_name(name, "--buckets name")
        if any(b.name == name for b in out):
            raise DataError(f"--buckets: bucket {name!r} given twice")
        out.append(Bucket(name, lo, hi))
    if not out:
        raise DataError("--buckets: no bucket given")
    return out


@dataclass
class Unit:
    book: str
    index: int
    language: str
    text: str
    summary: str
    line: int

    @property
    def id(self) -> str:
        return f"{self.book}#{self.index}"


@dataclass
class Stats:
    books: int = 0
    units: int = 0
    samples: Counter = field(default_factory=Counter)  # bucket -> n
    by_language: Counter = field(default_factory=Counter)  # "bucket/lang" -> n
    residue_units: Counter = field(default_factory=Counter)  # bucket -> units discarded at books' ends
    overshoot_starts: Counter = field(default_factory=Counter)  # bucket -> starts whose growth jumped past upper
    tokens: dict = field(default_factory=dict)  # bucket -> list of sample token counts
    problems: int = 0


def read_books(path: str | Path, problems: list) -> Iterator[list[Unit]]:
    """Yield each book's units in order; bad units go to ``problems`` (id + reason), bad order fails."""
    book, units, done = None, [], set()
    for lineno, rec in iter_jsonl(path):
        where = f"{path}:{lineno}"
        check_fields(rec, UNIT_FIELDS, where)
        missing = [k for k in ("book", "unit", "language", "text") if k not in rec]
        if missing:
            raise DataError(f"{where}: missing field(s) {missing}")
        for k in ("text", "summary"):
            if rec.get(k) is not None and not isinstance(rec[k], str):
                raise DataError(f"{where}: field {k!r} must be a string, got {type(rec[k]).__name__}")
        if not isinstance(rec["book"], (str, int)) or isinstance(rec["book"], bool):
            raise DataError(f"{where}: field 'book' must be a string, got {type(rec['book']).__name__}")
        b = str(rec["book"])
        if b != book:
            if b in done:
                raise DataError(f"{where}: units of book {b!r} are not contiguous (it appeared before line {lineno})")
            if units:
                yield units
            if book is not None:
                done.add(book)
            book, units = b, []
        if rec["language"] not in SUMMARY_JOIN:
            raise DataError(f"{where}: unknown language {rec['language']!r} (zh or en)")
        unit_no = rec["unit"]
        if not isinstance(unit_no, int) or isinstance(unit_no, bool) or (units and unit_no <= units[-1].index):
            raise DataError(f"{where}: unit {rec['unit']!r} of book {b!r} is out of order (integers, increasing)")
        unit = Unit(b, rec["unit"], rec["language"], str(rec["text"] or ""), str(rec.get("summary") or "").strip(),
                    lineno)
        if not unit.text.strip():
            problems.append({"id": unit.id, "line": lineno, "problem": "empty text"})
            unit.summary = ""  # an empty unit breaks windows, as a missing summary does
        elif not unit.summary:
            problems.append({"id": unit.id, "line": lineno, "problem": "no summary: windows do not span this unit"})
        units.append(unit)
    if units:
        yield units


def windows(n: int, usable: list[bool], lower: int, upper: int,
            count) -> Iterator[tuple[int, int, int] | tuple[str, int]]:
    """Windows ``(first, last, tokens)`` over ``n`` units, ``count(i, j)`` being the exact token
    count of units i..j joined; also yields ``("residue", n_units)`` and ``("overshoot", start)``."""
    i = 0
    while i < n:
        if not usable[i]:
            i += 1
            continue
        j = i
        while count(i, j) < lower and j + 1 < n and usable[j + 1]:
            j += 1
        tokens = count(i, j)
        if lower <= tokens <= upper:
            yield (i, j, tokens)
            i = j + 1
        elif tokens > upper:
            yield ("overshoot", i)
            i += 1
        elif j + 1 >= n:  # the book ended below the lower bound: the residue is discarded
            yield ("residue", n - i)
            return
        else:  # the next unit has no summary: no window spans it
            i = j + 2


class Builder:
    """Writes the buckets' samples for one input file; see the module docstring."""

    def __init__(self, out: Path, buckets: list[Bucket], tokenizer, resume: bool = False):
        self.out, self.buckets, self.tok = Path(out), buckets, tokenizer
        self.sep = len(tokenizer.encode(SEP, add_special_tokens=False))
        self.progress_path = self.out / "progress.json"
        self.stats = Stats(tokens={b.name: [] for b in buckets})
        self.done_books: set[str] = set()
        self.finished = None  # the stats of a finished build found in ``out``
        files = {b.name: self.out / b.name / "samples.jsonl" for b in buckets}
        files["problems"] = self.out / "problems.jsonl"
        sizes = {}
        if self.progress_path.exists():
            p = read_json(self.progress_path, "progress file")
            if not isinstance(p, dict) or not {"buckets", "books_done", "sizes", "stats"} <= p.keys():
                raise DataError(f"{self.progress_path}: not a longsft progress file; use a new --out")
            if p["buckets"] != [[b.name, b.lower, b.upper] for b in buckets]:
                raise DataError(f"{self.progress_path}: the {'finished' if p.get('finished') else 'partial'} build "
                                f"used buckets {p['buckets']}; resume with the same --buckets or use a new --out")
            if p.get("finished"):
                if not resume:
                    raise DataError(f"{self.out} holds a finished build; use a new --out (or delete it to rebuild)")
                self.finished = read_json(self.out / "stats.json", "stats file")
                return
            if not resume:
                raise DataError(f"{self.out} holds a (partial) build: pass --resume to continue it, or use a new --out")
            for key, path in files.items():
                if key not in p["sizes"] or not path.exists() or path.stat().st_size < p["sizes"][key]:
                    raise DataError(f"{path}: missing or shorter than {self.progress_path} records; "
                                    "start in a new --out")
            self.done_books, sizes = set(p["books_done"]), p["sizes"]
            self.stats = _stats_from_json(p["stats"])
        else:
            there = [str(f) for f in [*files.values(), self.out / "stats.json"] if f.exists()]
            if there:
                raise DataError(f"{there[0]} already exists (another build?): use a new --out, or delete it; "
                                "nothing was changed")
            self.out.mkdir(parents=True, exist_ok=True)
            sizes = {key: 0 for key in files}  # from here on a crash leaves a build that --resume continues
            self._save_progress(sizes)
        self.files = {}
        for key, path in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            f = open(path, "r+b" if key in sizes and path.exists() else "wb")
            f.truncate(sizes.get(key, 0))  # drop what a crash left after the last finished book
            f.seek(0, os.SEEK_END)
            self.files[key] = f

    def count(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self.tok(texts, add_special_tokens=False)["input_ids"]]

    def join_corrections(self, units: list[Unit], edge: int = 64) -> list[int]:
        """Per join k (units k, k+1): tokens(A + SEP + B) - tokens(A) - tokens(SEP) - tokens(B).

        BPE works within pre-tokens, so only the pre-tokens next to the join can differ (e.g. "。"
        and "\n\n" become one); counting ``edge`` characters each side of every join gives the exact
        count of any window from per-unit counts, tokenizing the text once (tests check it against
        tokenizing every sample's article)."""
        if len(units) < 2:
            return []
        tails = [u.text[-edge:] for u in units[:-1]]
        heads = [u.text[:edge] for u in units[1:]]
        c = self.count(tails + heads + [t + SEP + h for t, h in zip(tails, heads)])
        k = len(tails)
        return [c[2 * k + i] - c[i] - c[k + i] - self.sep for i in range(k)]

    def add_book(self, units: list[Unit], problems: list) -> None:
        book = units[0].book
        if book in self.done_books:
            return
        self.stats.books += 1
        self.stats.units += len(units)
        for p in problems:
            self._write("problems", p)
        counts = self.count([u.text for u in units])
        joins = self.join_corrections(units)
        prefix = [0]
        for k, c in enumerate(counts):  # prefix[k+1]: units 0..k joined, as if tokenized apart, corrected
            prefix.append(prefix[-1] + c + (self.sep + joins[k - 1] if k else 0))
        usable = [bool(u.summary) for u in units]
        smallest = min(b.lower for b in self.buckets)
        if prefix[-1] < smallest:
            self._write("problems", {"id": book, "line": units[0].line,
                                     "problem": f"book has {prefix[-1]} tokens, fewer than the smallest bucket's lower "
                                                f"bound {smallest}: no sample"})

        def exact(i: int, j: int) -> int:
            return prefix[j + 1] - prefix[i] - (self.sep + joins[i - 1] if i else 0)

        for b in self.buckets:
            for w in windows(len(units), usable, b.lower, b.upper, exact):
                if w[0] == "residue":
                    self.stats.residue_units[b.name] += w[1]
                elif w[0] == "overshoot":
                    self.stats.overshoot_starts[b.name] += 1
                else:
                    self._sample(b, units[w[0]:w[1] + 1], w[2])
        self._checkpoint(book)

    def _sample(self, b: Bucket, units: list[Unit], tokens: int) -> None:
        lang = units[0].language
        rec = {"id": f"{units[0].book}-{b.name}-{units[0].index}-{units[-1].index}", "language": lang,
               "article": SEP.join(u.text for u in units),
               "summary": SUMMARY_JOIN[lang].join(u.summary for u in units), "gold_score": 5, "types": [],
               "source": "human", "bucket": b.name, "book": units[0].book,
               "units": [units[0].index, units[-1].index], "tokens": tokens}
        self._write(b.name, rec)
        self.stats.samples[b.name] += 1
        self.stats.by_language[f"{b.name}/{lang}"] += 1
        self.stats.tokens[b.name].append(tokens)

    def _write(self, key: str, rec: dict) -> None:
        if key == "problems":
            self.stats.problems += 1
        self.files[key].write((json.dumps(rec, ensure_ascii=False) + "\n").encode())

    def _checkpoint(self, book: str) -> None:
        """After each book: flush outputs, then record their sizes (a resume truncates to them)."""
        self.done_books.add(book)
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
        self._save_progress({k: f.tell() for k, f in self.files.items()})

    def _save_progress(self, sizes: dict, finished: bool = False) -> None:
        atomic_write_json(self.progress_path, {
            "buckets": [[b.name, b.lower, b.upper] for b in self.buckets], "books_done": sorted(self.done_books),
            "sizes": sizes, "stats": _stats_to_json(self.stats), "finished": finished})

    def finish(self) -> dict:
        sizes = {k: f.tell() for k, f in self.files.items()}
        for f in self.files.values():
            f.close()
        summary = summarize(self.stats, self.buckets)
        atomic_write_json(self.out / "stats.json", summary)
        self._save_progress(sizes, finished=True)
        return summary


def _stats_to_json(s: Stats) -> dict:
    return {k: dict(v) if isinstance(v, Counter) else v for k, v in s.__dict__.items()}


def _stats_from_json(d: dict) -> Stats:
    s = Stats(**{k: Counter(v) if isinstance(getattr(Stats(), k), Counter) else v for k, v in d.items()})
    return s


def summarize(s: Stats, buckets: list[Bucket], bins: int = 8) -> dict:
    """Per bucket: samples, zh/en, token min/mean/max and a histogram over [lower, upper]."""
    out = {"books": s.books, "units": s.units, "problems": s.problems, "buckets": {}}
    for b in buckets:
        toks = s.tokens[b.name]
        width = max(1, (b.upper - b.lower + 1) // bins)
        hist = Counter(min(bins - 1, (t - b.lower) // width) for t in toks)
        out["buckets"][b.name] = {
            "lower": b.lower, "upper": b.upper, "samples": s.samples[b.name],
            "zh": s.by_language[f"{b.name}/zh"], "en": s.by_language[f"{b.name}/en"],
            "tokens_min": min(toks, default=None), "tokens_max": max(toks, default=None),
            "tokens_mean": sum(toks) / len(toks) if toks else None,
            "histogram": [[b.lower + k * width, hist[k]] for k in range(bins)],
            "residue_units": s.residue_units[b.name], "overshoot_starts": s.overshoot_starts[b.name]}
    return out


def build(units_file: str | Path, out: str | Path, buckets: list[Bucket], tokenizer, resume: bool = False) -> dict:
    """Check the whole input (one pass, no tokenizing), then build; see the module docstring."""
    check_input_file(units_file)
    check_output_dir(out)
    if not any(True for _ in read_books(units_file, [])):
        raise DataError(f"{units_file}: no units")
    builder = Builder(Path(out), buckets, tokenizer, resume)
    if builder.finished is not None:
        return builder.finished
    problems: list = []
    for units in read_books(units_file, problems):
        builder.add_book(units, problems)
        problems.clear()
    return builder.finish()


def format_stats(summary: dict) -> str:
    lines = [f"{summary['books']} books, {summary['units']} units, {summary['problems']} problems "
             "(see problems.jsonl)", "",
             "| bucket | range | samples | zh | en | tokens min/mean/max | residue units | overshoots |",
             "|---|---|---:|---:|---:|---|---:|---:|"]
    for name, b in summary["buckets"].items():
        mean = "–" if b["tokens_mean"] is None else f"{b['tokens_min']}/{b['tokens_mean']:.0f}/{b['tokens_max']}"
        lines.append(f"| {name} | {b['lower']}–{b['upper']} | {b['samples']} | {b['zh']} | {b['en']} | {mean} | "
                     f"{b['residue_units']} | {b['overshoot_starts']} |")
    lines.append("\ntoken histograms (bin start: samples):")
    for name, b in summary["buckets"].items():
        lines.append(f"  {name}: " + "  ".join(f"{lo}:{n}" for lo, n in b["histogram"]))
    return "\n".join(lines)
