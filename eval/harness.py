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
resumed into or replaced; a rerun of the same evaluation resumes."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

from longsft.eval.backends import HFBackend, OpenAIBackend, VLLMBackend
from longsft.eval.eval_config import EvalConfig, check_model, check_out_dir, model_config, run_identity
from longsft.eval.rag import combine, make_embedder, plan
from longsft.train.common.cache import AppendCache
from longsft.train.common.io import atomic_write_json, write_jsonl
from longsft.train.common.llm import answer_key
from longsft.train.common.model_files import check_model_source
from longsft.train.config.loader import to_dict
from longsft.train.data.prompts import render_prompt
from longsft.train.data.schema import load_samples
from longsft.train.scoring.judgement import parse_judgement
from longsft.train.scoring.metrics import Item, score_items


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
        atomic_write_json(out / "config.json", {**to_dict(cfg), "identity": run_identity(cfg)})
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
