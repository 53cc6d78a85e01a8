"""``longsft constory``: ConStory-Bench-style consistency checking of long generated stories.

    longsft constory generate prompts=P.jsonl model=M [backend=...] out=DIR [target_words=8000]
    longsft constory check stories=S.jsonl judge=M [backend=openai base_url=...] out=DIR
    longsft constory metrics reports=DIR [prompts=P.jsonl]
    longsft constory generate --help                 every key with its default

Output folders (``out``): given, or by default ``runs/constory`` for ``generate``,
``runs/constory/check-<stories>-<judge>`` for ``check`` (``<stories>``: the stories file's name, or its
folder's for a ``stories.jsonl``), and the reports' own folder for ``metrics``. A folder holding another
check (other stories, judge or backend: its ``check.json``) is refused, never written over; a rerun of
the same check resumes."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from longsft.eval.constory import Judge, check_story, judged
from longsft.eval.constory_metrics import metrics, metrics_tables
from longsft.eval.eval_config import EvalConfig, check_model, model_name
from longsft.eval.harness import LoadedOnFirstUse, OutputDir, make_backend
from longsft.train.common.cache import AppendCache
from longsft.train.common.errors import ConfigError, DataError
from longsft.train.common.io import atomic_write_json, check_input_file, iter_jsonl, read_json, write_jsonl
from longsft.train.common.llm import answer_key
from longsft.train.config.help import config_help
from longsft.train.config.loader import from_args


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
