"""``longsft constory``: ConStory-Bench-style consistency checking of long generated stories.

    longsft constory generate prompts=P.jsonl model=M [backend=...] out=DIR [target_words=8000]
    longsft constory check stories=S.jsonl judge=M [backend=openai base_url=...] out=DIR
    longsft constory metrics reports=DIR [prompts=P.jsonl]
    longsft constory generate --help                 every key with its default

Output folders (``out``): given, or by default ``runs/constory`` for ``generate``,
``runs/constory/check-<stories>-<judge>`` for ``check`` (``<stories>``: the stories file's name, or its
folder's for a ``stories.jsonl``), and the reports' own folder for ``metrics``. A folder holding another
check (other stories, judge or backend: its ``check.json``) is refused, never written over; a rerun of
the same check resumes.

The checker has four stages, all with one judge model (any ``longsft eval`` backend, including a
longsft checkpoint): (1) category-guided extraction of contradiction-prone spans, one prompt per
category, the story shown as numbered paragraphs; (2) pairing of the extracted spans into
consistent / contradictory; (3) an evidence chain (reasoning, conclusion) per contradictory pair;
(4) a JSON report per story whose every quote carries exact character offsets, validated
(``story[start:end] == quote``).

Offsets come from the paragraph the judge cites: the quote is located inside that paragraph (not
with a search over the whole story, which finds the wrong occurrence of repeated text); a quote
that is not verbatim in its paragraph is rejected and the judge asked again. Stories longer than
``max_story_tokens`` are read in overlapping paragraph windows for extraction (nothing is cut).

Metrics (:func:`metrics`): every error counts (not subtypes-with-errors). Words: English and other
space-separated text by word tokens; Chinese (and Japanese) by characters, one word each, plus
any Latin words in between. CED = errors per 10,000 words per story, averaged per model. GRR =
per prompt, models ranked by Q = words / (1 + errors), best = 1, ties share the mean rank;
averaged per model.

Unjudged stories: a story the judge gave no valid answer for at some stage (after its re-asks), or
an empty story, is reported ``"judged": false`` and left out of CED and GRR (never counted as
consistent); ``check`` and ``metrics`` then exit 3 and name how many. The judge's valid answers are
cached, so rerunning ``check`` asks again only what failed. Generated stories are cached by a hash
of the whole request (model, backend, prompt text, generation settings): an edited prompt is
generated anew.

Defects of the reference implementation, fixed here: it counts subtypes-with-errors (we count
errors: one per contradicting statement), splits Chinese on whitespace (we count characters), drops
errors whose subtype key does not match its prompt table (one taxonomy table serves prompts and
validation; an unknown subtype is kept as "unspecified"), and recovers quote positions with a
search over the whole story (we locate quotes in the paragraph the judge cites).
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from longsft.eval.harness import EvalConfig, LoadedOnFirstUse, OutputDir, check_model, make_backend, model_name
from longsft.train.common.cache import AppendCache
from longsft.train.common.errors import ConfigError, DataError
from longsft.train.common.io import (
    atomic_write_json,
    atomic_write_text,
    check_input_file,
    iter_jsonl,
    read_json,
    write_jsonl,
)
from longsft.train.common.llm import answer_key, reask_json
from longsft.train.config.help import config_help
from longsft.train.config.loader import from_args

# Five categories, 19 subtypes (our reading of the paper's taxonomy).
TAXONOMY = {
    "timeline_plot": ["absolute_time", "duration", "simultaneity", "causal_logic", "abandoned_plot"],
    "characterization": ["memory", "knowledge", "skill_power", "personality"],
    "world_setting": ["core_rule", "social_norm", "geography"],
    "factual_detail": ["appearance", "naming", "quantity", "object_state"],
    "narrative_style": ["perspective", "tone", "style"],
}
CATEGORY_TEXT = {
    "timeline_plot": "dates and calendar facts, durations, events said to happen at the same time, cause and effect, "
                     "plot threads set up",
    "characterization": "what characters remember, know, can do (skills, powers) and how they behave",
    "world_setting": "rules of the story world (magic, technology), social norms, places and distances",
    "factual_detail": "appearances, names, numbers and quantities, the state of objects",
    "narrative_style": "point of view and narrator, tone, style",
}
TASK_TYPES = ("generation", "continuation", "expansion", "completion")

EXTRACT = """You check a long story for consistency. Category: {category} ({what}); subtypes: {subtypes}.
List every statement in the story that establishes or uses a fact of this category and could contradict
another statement. Quote each one verbatim (a short exact span) and give the number of the paragraph it is in.
Reply with JSON only: {{"spans": [{{"paragraph": int, "quote": str, "subtype": str, "fact": str}}]}}

Story (numbered paragraphs):
{story}"""
PAIR = """Below are statements extracted from one story (category {category}). Find the pairs that contradict
each other (they cannot both be true in the story). Reply with JSON only:
{{"pairs": [{{"a": int, "b": int, "verdict": "contradictory" | "consistent", "subtype": str}}]}}

Statements:
{spans}"""
EVIDENCE = """Two passages from one story may contradict each other (category {category}, subtype {subtype}).
Passage A (paragraph {pa}): "{qa}"
Context A: {ca}
Passage B (paragraph {pb}): "{qb}"
Context B: {cb}
Reason step by step, then conclude. Reply with JSON only:
{{"reasoning": str, "conclusion": "error" | "no_error", "error_element": str}}"""


def paragraphs(story: str) -> list[tuple[int, int]]:
    """(start, end) character spans of the story's non-empty paragraphs (split at blank lines / newlines)."""
    return [(m.start(), m.end()) for m in re.finditer(r"[^\n]+(?:\n(?!\s*\n)[^\n]+)*", story) if m.group().strip()]


def locate(story: str, paras: list[tuple[int, int]], paragraph: int, quote: str) -> tuple[int, int] | None:
    """Exact offsets of ``quote`` inside paragraph ``paragraph`` (1-based), or None."""
    if not quote or not 1 <= paragraph <= len(paras):
        return None
    start, end = paras[paragraph - 1]
    i = story.find(quote, start, end)
    return (i, i + len(quote)) if i >= 0 else None


def count_words(text: str) -> int:
    """Space-separated words, plus one per CJK character (Chinese is not space-separated)."""
    cjk = len(re.findall(r"[\u3040-\u30ff\u3400-\u9fff\uf900-\ufaff]", text))
    latin = len(re.findall(r"[A-Za-z0-9]+(?:['’-][A-Za-z0-9]+)*", text))
    return cjk + latin


# ------------------------------------------------------------------ judge access


class Judge:
    """One backend, JSON answers validated and re-asked with the complaint (:func:`reask_json`); every
    valid answer cached."""

    def __init__(self, backend, cache: AppendCache, key_prefix: str, retries: int = 2):
        self.backend, self.cache, self.prefix, self.retries = backend, cache, key_prefix, retries
        self.failures: list[str] = []

    def ask(self, prompt: str, validate) -> dict | None:
        key = answer_key(self.prefix, prompt)
        hit = self.cache.get(key)
        if hit is not None:
            return hit["answer"]

        def reply(messages: list[dict]) -> str:
            g = self.backend().chat(messages)
            if g.error is not None:  # the backend gave up (after its own retries): asking again will not help
                raise _NoAnswer(g.error)
            return g.text

        try:
            obj, complaints = reask_json(reply, prompt, validate, self.retries)
        except _NoAnswer as e:
            obj, complaints = None, [str(e)]
        if obj is None:
            self.failures.append(complaints[-1])
            return None
        self.cache.put({"key": key, "answer": obj, "error": None})
        return obj


class _NoAnswer(Exception):
    pass


@dataclass
class Span:
    id: int
    category: str
    subtype: str
    paragraph: int
    quote: str
    start: int
    end: int
    fact: str


def check_story(story: str, judge: Judge, max_story_chars: int = 60_000) -> dict:
    """The four stages for one story; returns its report (errors with validated offsets)."""
    paras = paragraphs(story)
    spans: list[Span] = []
    for category, subtypes in TAXONOMY.items():
        for first, last in _windows(paras, max_story_chars):
            numbered = "\n\n".join(f"[{k + 1}] {story[s:e]}" for k, (s, e) in enumerate(paras) if first <= k <= last)
            found: list[tuple] = []

            def valid(obj: dict) -> str | None:
                found.clear()
                if not isinstance(obj.get("spans"), list):
                    return '"spans" must be a list'
                for x in obj["spans"]:
                    if not isinstance(x, dict):
                        return "each span must be an object"
                    p, q = x.get("paragraph"), x.get("quote")
                    if not isinstance(p, int) or not isinstance(q, str):
                        return "each span needs an integer paragraph and a quote"
                    where = locate(story, paras, p, q)
                    if where is None:
                        return f"the quote {q[:60]!r} is not verbatim in paragraph {p}"
                    found.append((p, q, where, x.get("subtype") if x.get("subtype") in subtypes else "unspecified",
                                  str(x.get("fact", ""))))
                return None

            answer = judge.ask(EXTRACT.format(category=category, what=CATEGORY_TEXT[category],
                                              subtypes=", ".join(subtypes), story=numbered), valid)
            if answer is not None:
                valid(answer)  # re-derive offsets (cached answers too)
                for p, q, (s, e), sub, fact in found:
                    if not any(x.start == s and x.end == e and x.category == category for x in spans):
                        spans.append(Span(len(spans), category, sub, p, q, s, e, fact))
    errors = []
    for category, subtypes in TAXONOMY.items():
        mine = [x for x in spans if x.category == category]
        if len(mine) < 2:
            continue
        ids = {x.id for x in mine}

        def valid_pairs(obj: dict) -> str | None:
            if not isinstance(obj.get("pairs"), list):
                return '"pairs" must be a list'
            for p in obj["pairs"]:
                if not isinstance(p, dict) or p.get("a") not in ids or p.get("b") not in ids or p["a"] == p["b"]:
                    return f"each pair must name two different statement ids from {sorted(ids)}"
            return None

        listing = "\n".join(f"{x.id}: (paragraph {x.paragraph}) \"{x.quote}\" — {x.fact}" for x in mine)
        answer = judge.ask(PAIR.format(category=category, spans=listing), valid_pairs)
        for p in (answer or {}).get("pairs", []):
            if p.get("verdict") != "contradictory":
                continue
            a, b = sorted((spans[p["a"]], spans[p["b"]]), key=lambda x: x.start)
            subtype = p.get("subtype") if p.get("subtype") in subtypes else b.subtype  # never dropped
            ev = judge.ask(EVIDENCE.format(category=category, subtype=subtype, pa=a.paragraph, qa=a.quote,
                                           ca=_context(story, a), pb=b.paragraph, qb=b.quote, cb=_context(story, b)),
                           lambda o: None if o.get("conclusion") in ("error", "no_error")
                           else '"conclusion" must be "error" or "no_error"')
            if ev and ev["conclusion"] == "error" and not any(  # one error per contradicting statement
                    e["quote"]["start"] == b.start and e["category"] == category for e in errors):
                errors.append({"category": category, "subtype": subtype,
                               "quote": {"text": b.quote, "start": b.start, "end": b.end, "paragraph": b.paragraph},
                               "contradiction_pair": {"text": a.quote, "start": a.start, "end": a.end,
                                                      "paragraph": a.paragraph},
                               "reasoning": str(ev.get("reasoning", "")), "error_element": str(ev.get("error_element", ""))})
    for e in errors:  # stage 4: every offset must point at its quote
        for q in (e["quote"], e["contradiction_pair"]):
            if story[q["start"]:q["end"]] != q["text"]:
                raise RuntimeError(f"offsets {q['start']}:{q['end']} do not hold the quote {q['text']!r}")
    return {"words": count_words(story), "characters": len(story), "errors": errors, "n_errors": len(errors),
            "spans": [{"category": x.category, "subtype": x.subtype, "paragraph": x.paragraph, "text": x.quote,
                       "start": x.start, "end": x.end} for x in spans],
            "judge_failures": list(judge.failures), "judged": not judge.failures}


def _windows(paras: list, max_chars: int) -> list[tuple[int, int]]:
    """Paragraph index ranges of at most ``max_chars`` characters, overlapping by one paragraph."""
    if not paras:
        return []
    out, first = [], 0
    while first < len(paras):
        last = first
        while last + 1 < len(paras) and paras[last + 1][1] - paras[first][0] <= max_chars:
            last += 1
        out.append((first, last))
        if last == len(paras) - 1:
            break
        first = max(first + 1, last)  # one paragraph of overlap
    return out


def _context(story: str, s: Span, width: int = 200) -> str:
    return story[max(0, s.start - width): s.end + width].replace("\n", " ")


# ------------------------------------------------------------------ metrics


def judged(report: dict) -> bool:
    """The judge answered every stage for this story (older reports: no judge failures)."""
    return bool(report.get("judged", not report.get("judge_failures")))


def metrics(reports: list[dict]) -> dict:
    """CED and GRR per model, errors per category / subtype / task type, error positions.

    ``reports``: dicts with ``id`` (prompt id), ``model_name``, ``task_type``, ``words``, ``n_errors``,
    ``errors`` and ``characters``. Unjudged stories (:func:`judged`) are counted in ``unjudged`` only."""
    unjudged = Counter(r["model_name"] for r in reports if not judged(r))
    reports = [r for r in reports if judged(r)]
    by_model: dict[str, list[dict]] = defaultdict(list)
    for r in reports:
        by_model[r["model_name"]].append(r)
    ced = {m: sum(r["n_errors"] / (r["words"] / 10_000) for r in rs if r["words"]) / len(rs)
           for m, rs in by_model.items()}
    ranks: dict[str, list[float]] = defaultdict(list)
    by_prompt: dict[str, list[dict]] = defaultdict(list)
    for r in reports:
        by_prompt[r["id"]].append(r)
    for rs in by_prompt.values():
        q = {r["model_name"]: r["words"] / (1 + r["n_errors"]) for r in rs}
        for m, rank in fractional_ranks(q).items():
            ranks[m].append(rank)
    grr = {m: sum(v) / len(v) for m, v in ranks.items()}
    cats = {m: dict(Counter(e["category"] for r in rs for e in r["errors"])) for m, rs in by_model.items()}
    subs = {m: dict(Counter(e["subtype"] for r in rs for e in r["errors"])) for m, rs in by_model.items()}
    task = {m: {t: sum(r["n_errors"] for r in rs if r.get("task_type") == t) for t in TASK_TYPES}
            for m, rs in by_model.items()}
    positions = [e["quote"]["start"] / r["characters"] for r in reports for e in r["errors"] if r["characters"]]
    return {"ced": ced, "grr": grr, "errors": {m: sum(r["n_errors"] for r in rs) for m, rs in by_model.items()},
            "stories": {m: len(rs) for m, rs in by_model.items()}, "unjudged": dict(unjudged),
            "by_category": cats, "by_subtype": subs, "by_task_type": task, "positions": positions}


def fractional_ranks(q: dict[str, float]) -> dict[str, float]:
    """Rank 1 = highest Q; tied values share the mean of their ranks."""
    order = sorted(q, key=lambda m: -q[m])
    out, i = {}, 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and q[order[j + 1]] == q[order[i]]:
            j += 1
        for m in order[i:j + 1]:
            out[m] = (i + j) / 2 + 1
        i = j + 1
    return out


def metrics_tables(m: dict, out: Path | None = None) -> str:
    unjudged = m.get("unjudged", {})
    models = sorted(set(m["ced"]) | set(unjudged))

    def num(d: dict, x: str) -> str:
        return f"{d[x]:.2f}" if x in d else "–"

    lines = ["| model | stories | errors | CED (errors / 10K words) | GRR (rank, 1 = best) | unjudged |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {x} | {m['stories'].get(x, 0)} | {m['errors'].get(x, 0)} | {num(m['ced'], x)} | {num(m['grr'], x)} "
              f"| {unjudged.get(x, 0)} |" for x in models]
    judged_models = sorted(m["ced"])
    lines += ["", "| model | " + " | ".join(TAXONOMY) + " |", "|---|" + "---:|" * len(TAXONOMY)]
    lines += [f"| {x} | " + " | ".join(str(m["by_category"][x].get(c, 0)) for c in TAXONOMY) + " |"
              for x in judged_models]
    lines += ["", "| model | " + " | ".join(TASK_TYPES) + " |", "|---|" + "---:|" * len(TASK_TYPES)]
    lines += [f"| {x} | " + " | ".join(str(m["by_task_type"][x][t]) for t in TASK_TYPES) + " |" for x in judged_models]
    text = "\n".join(lines)
    if out is not None:
        atomic_write_text(out / "constory_metrics.md", text + "\n")
        atomic_write_json(out / "constory_metrics.json", m)
        _position_plot(out / "error_positions.png", m["positions"])
    return text


def _position_plot(path: Path, positions: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(positions, bins=10, range=(0, 1), edgecolor="k")
    ax.set(xlabel="relative position in the story", ylabel="errors", title="Where consistency errors occur")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------ commands


@dataclass
class ConStoryConfig:
    prompts: str = ""
    stories: str = ""
    reports: str = ""
    model: str = ""  # generate: the story writer
    judge: str = ""  # check: the judge model
    backend: Literal["hf", "vllm", "openai"] = "hf"
    base_url: str | None = None  # openai: e.g. http://localhost:8000/v1
    tokenizer: str | None = None  # default: the model path ("qwen": the Qwen3 vocabulary, offline)
    recipe: str | None = None  # take tokenizer and rope scaling from this recipe's model section
    # output folder; default: runs/constory (generate), runs/constory/check-<stories>-<judge> (check), the
    # reports' folder (metrics)
    out: str = ""
    target_words: int = 8000  # generate: asked for in the prompt
    max_new_tokens: int = 16384
    max_story_chars: int = 60_000  # check: longer stories are read in overlapping windows
    limit: int = 0  # the first N inputs only (0: all)
    progress: bool = True


def _backend(cfg: ConStoryConfig, model: str):
    return make_backend(EvalConfig(model=model, data="-", backend=cfg.backend, base_url=cfg.base_url,
                                   tokenizer=cfg.tokenizer, recipe=cfg.recipe, max_new_tokens=cfg.max_new_tokens))


# per input: the fields it needs and their types (a story may be empty: it is reported unjudged)
_FIELDS = {
    "prompts": {"id": (str, int), "language": str, "task_type": str, "prompt": str},
    "stories": {"id": (str, int), "model_name": str, "generated_story": str},
    "reports": {"id": (str, int), "model_name": str, "words": int, "n_errors": int, "errors": list,
                "characters": int},
}
_TYPE_NAMES = {str: "a string", int: "an integer", list: "a list", (str, int): "a string or an integer"}


def _records(path: str, kind: str, unique: tuple[str, ...] = ("id",)) -> list[dict]:
    """The JSONL input ``kind``, every field typed; repeated ``unique`` keys name both lines."""
    need = _FIELDS[kind]
    if not path:
        raise ConfigError(f"give {kind}=FILE (JSONL with {', '.join(need)} per line)")
    recs, seen = [], {}
    for lineno, rec in iter_jsonl(path):
        missing = [k for k in need if k not in rec]
        if missing:
            raise DataError(f"{path}:{lineno}: missing field(s) {missing}")
        for k, tp in need.items():
            if isinstance(rec[k], bool) or not isinstance(rec[k], tp):
                hint = " (a failed generation? rerun `constory generate`)" if k == "generated_story" else ""
                raise DataError(f"{path}:{lineno}: field {k!r} must be {_TYPE_NAMES[tp]}, got "
                                f"{json.dumps(rec[k])[:40]}{hint}")
        key = tuple(str(rec[k]) for k in unique)
        if key in seen:
            raise DataError(f"{path}:{lineno}: {'/'.join(unique)} {'/'.join(key)!r} repeats {path}:{seen[key]}")
        seen[key] = lineno
        recs.append(rec)
    if not recs:
        raise DataError(f"{path}: no records")
    return recs


def generation_key(cfg: ConStoryConfig, ask: str) -> str:
    """Cache key of one story: the whole request (an edited prompt or setting is a new story)."""
    settings = {"model": cfg.model, "backend": cfg.backend, "recipe": cfg.recipe, "tokenizer": cfg.tokenizer,
                "max_new_tokens": cfg.max_new_tokens, "temperature": 0}
    return answer_key(json.dumps(settings, sort_keys=True), ask)


def _check_stories_out(out: Path, model: str) -> None:
    """``generate`` does not replace another model's stories.jsonl."""
    path = out / "stories.jsonl"
    if not path.is_file():
        return
    others = {str(r.get("model_name")) for _, r in iter_jsonl(path)} - {model}
    if others:
        raise ConfigError(f"out={out} holds stories of model={sorted(others)[0]!r} (stories.jsonl), this run is "
                          f"model={model!r}: give each model its own out=, or delete {path}")


def _plain(name: str) -> str:
    """``name`` as one folder-name component."""
    return re.sub(r"[^\w.-]", "_", name).lstrip(".") or "x"


def default_out(cmd: str, cfg: ConStoryConfig) -> Path:
    """``out`` when none is given: ``generate`` -> runs/constory; ``check`` -> a folder of its own per stories
    file and judge; ``metrics`` -> the folder of the reports it reads (a check's), else one per reports file."""
    if cfg.out:
        return Path(cfg.out)
    if cmd == "check":
        path = Path(cfg.stories)
        stories = path.resolve().parent.name if path.name == "stories.jsonl" else path.stem
        return Path("runs/constory") / f"check-{_plain(stories)}-{_plain(model_name(cfg.judge, cfg.backend))}"
    if cmd == "metrics" and cfg.reports:
        path = Path(cfg.reports)
        if path.is_dir() or path.name == "reports.jsonl":
            return path if path.is_dir() else path.parent
        return Path("runs/constory") / f"metrics-{_plain(path.stem)}"
    return Path("runs/constory")


def check_identity(cfg: ConStoryConfig) -> dict:
    """What makes one check: the stories file, the judge and its backend (``check.json`` in its folder)."""
    return {"stories": str(Path(cfg.stories).resolve()), "judge": cfg.judge, "backend": cfg.backend}


def _check_reports_out(out: Path, ident: dict, stories: list[dict]) -> None:
    """``check`` writes only into a new folder, a folder without a check, or its own (a rerun resumes):
    another check's reports.jsonl is never replaced. A folder from before ``check.json`` is its own
    when its reports are of the same stories."""
    record, reports = out / "check.json", out / "reports.jsonl"
    if record.is_file():
        old = read_json(record, "ConStory check record")
        old = old if isinstance(old, dict) else {}
        differ = [k for k in ident if old.get(k) != ident[k]]
        if differ:
            what = ", ".join(f"{k}={old.get(k)!r} there, {ident[k]!r} now" for k in differ)
            raise ConfigError(f"out={out} holds another ConStory check ({what}); it is neither resumed nor "
                              f"replaced: give this one its own out= (or leave out= unset), or delete {out}")
    elif reports.is_file():
        had = {(str(r.get("id")), str(r.get("model_name"))) for _, r in iter_jsonl(reports, log=True)}
        now = {(str(s["id"]), s["model_name"]) for s in stories}
        if had != now:
            raise ConfigError(f"out={out} holds the reports of other stories ({reports}); give this check its own "
                              "out= (or leave out= unset), or delete it")


def _check_metrics_out(out: Path, source: Path) -> None:
    """``metrics`` does not replace the metrics a check folder holds of its own, other reports."""
    reports = out / "reports.jsonl"
    if reports.is_file() and reports.resolve() != source.resolve():
        raise ConfigError(f"out={out} is the folder of another ConStory check ({reports}); its metrics would be "
                          f"replaced by those of {source}: give another out=, or leave out= unset")


def constory_help() -> str:
    return config_help(ConStoryConfig, __doc__.split("\n\n", 2)[1])


def _unjudged(reports: list[dict]) -> int:
    """0 when every story was judged, else 3 with a line saying how many were not."""
    bad = [r for r in reports if not judged(r)]
    if not bad:
        return 0
    print(f"longsft: {len(bad)} of {len(reports)} stories unjudged (the judge gave no valid answer, or the story is "
          f"empty; e.g. id {bad[0]['id']!r}): not counted in CED/GRR. Rerun the same command to ask the judge again "
          "(its valid answers are cached).", file=sys.stderr)
    return 3


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("generate", "check", "metrics"):
        raise ConfigError("usage: longsft constory generate|check|metrics key=value ... (--help: every key)")
    cmd, cfg = argv[0], from_args(ConStoryConfig, argv[1:], "stories=S.jsonl judge=MODEL")
    if cfg.limit < 0:
        raise ConfigError(f"limit={cfg.limit} must be >= 0")
    if cfg.backend == "openai" and not cfg.base_url:
        raise ConfigError("backend=openai needs base_url= (an OpenAI-compatible endpoint, e.g. http://host:8000/v1)")
    out = default_out(cmd, cfg)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out={out}: is a file; give a folder")
    if cmd == "generate":
        prompts = _records(cfg.prompts, "prompts")[: cfg.limit or None]
        if not cfg.model:
            raise ConfigError("model= is required (the story writer)")
        check_model(cfg.model, cfg.backend)
        _check_stories_out(out, cfg.model)
        with OutputDir(out) as made:
            cache = made.cache = AppendCache(out / "generations.jsonl")
            backend = LoadedOnFirstUse(lambda: _backend(cfg, cfg.model))
            stories = []
            for p in prompts:
                ask = f"{p['prompt']}\n\n(Write about {cfg.target_words} words.)"
                key = generation_key(cfg, ask)
                if cache.get(key) is None:
                    g = backend().generate(ask)
                    cache.put({"key": key, "id": p["id"], "prediction": g.text, "error": g.error})
                story = cache.latest(key)
                stories.append({**p, "model_name": cfg.model, "generated_story": story["prediction"],
                                "error": story["error"]})
            write_jsonl(out / "stories.jsonl", stories)
        print(f"{len(stories)} stories -> {out / 'stories.jsonl'}")
        return 0
    if cmd == "check":
        stories = _records(cfg.stories, "stories", ("id", "model_name"))[: cfg.limit or None]
        if not cfg.judge:
            raise ConfigError("judge= is required (the judge model)")
        check_model(cfg.judge, cfg.backend, "judge")
        ident = check_identity(cfg)
        _check_reports_out(out, ident, stories)
        with OutputDir(out) as made:
            atomic_write_json(out / "check.json", ident)
            cache = made.cache = AppendCache(out / "judge_cache.jsonl")
            backend = LoadedOnFirstUse(lambda: _backend(cfg, cfg.judge))
            reports = []
            for s in stories:
                judge = Judge(backend, cache, f"{cfg.judge}:{cfg.backend}")
                if s["generated_story"].strip():
                    r = check_story(s["generated_story"], judge, cfg.max_story_chars)
                else:
                    r = {"words": 0, "characters": len(s["generated_story"]), "errors": [], "n_errors": 0,
                         "spans": [], "judge_failures": ["empty story"], "judged": False}
                reports.append({"id": s["id"], "model_name": s["model_name"], "task_type": s.get("task_type"),
                                "language": s.get("language"), **r})
            write_jsonl(out / "reports.jsonl", reports)
            print(metrics_tables(metrics(reports), out))
        return _unjudged(reports)
    if not cfg.reports:
        raise ConfigError("give reports=DIR (a `constory check` output folder) or reports=FILE")
    source = Path(cfg.reports) / "reports.jsonl" if Path(cfg.reports).is_dir() else Path(cfg.reports)
    reports = _records(str(check_input_file(source)), "reports", ("id", "model_name"))
    _check_metrics_out(out, source)
    with OutputDir(out):
        print(metrics_tables(metrics(reports), out))
    return _unjudged(reports)
