"""GPU: the validation hook's generation speed (greedy ``generate`` on a whole, unsplit prompt).

    python bench/gpu_validation.py           (bench/gpu.sh runs it)
    python bench/gpu_validation.py --smoke   (CPU, a tiny shape: checks the script)

A Qwen3-1.7B-shaped model (random weights), bf16, one GPU, a 16K-token prompt (and 32K at the end),
as the hook sees it (``generate`` with a KV cache, no sequence parallelism). Per row, from one
``generate`` call whose logits processor notes the time of every new token: prefill seconds (the
prompt's forward and the first token), decode tokens/s over the next tokens, and peak memory. Rows,
in this order (a row that no longer fits the step's budget is skipped, and says so):

1. ``plain``: the model as longsft builds it (``build_model``), 16 new tokens;
2. ``hf``: transformers' own class (``AutoModelForCausalLM.from_config``, SDPA) with the same weights:
   longsft's per-token cost against transformers';
3. ``profile``: torch.profiler over 8 decode tokens of ``plain`` (the prefill not recorded): the
   top-25 ops by self CPU and by self CUDA time in the results, and on a GPU a chrome trace
   (bench/results/gpu_validation_trace.json.gz): where the fixed cost per token goes;
4. ``zero3 validation path``: the trainer's ZeRO-3 engine and the hook's own choice
   (``validation.generation_model``): a whole copy of the model when its weights fit in
   ``validation.whole_model_gb`` (the copy's seconds reported), else the partitioned model;
5. ``zero3 partitioned``: ``engine.module`` itself (each new token gathers every layer's weights), what
   the hook runs for a model larger than ``whole_model_gb``, 8 new tokens;
6. ``zero3_offload validation path`` and ``zero3_offload partitioned``: ``ds_configs/zero3_offload.json``
   as the recipes use it (parameters and optimizer on the host: each token of the partitioned model
   copies the weights over PCIe), 4 and 3 new tokens;
7. ``plain`` on a 32K prompt.

Every row records its seconds (``elapsed_s``, engine builds included in the first row of an engine).
Writes bench/results/gpu_validation.json (``--smoke``: gpu_validation_smoke.json) after every row.
"""

import argparse
import contextlib
import copy
import gzip
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import onestep  # noqa: E402
from gpu_train import QWEN3_1_7B, SMOKE  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "bench" / "results" / "gpu_validation_trace.json.gz"  # GPU runs only (--smoke: under /tmp)
BUDGET_S = 72  # rows that would end later are skipped (bench/gpu.sh gives the step 80 s)
# rough GPU seconds of each stage (engine builds included), to skip what no longer fits
COST_S = {"plain": 5, "hf": 7, "profile": 8, "zero3": 14, "zero3 partitioned": 6, "zero3_offload": 20,
          "zero3_offload partitioned": 8, "plain_32k": 6}


def timing_processor(cuda: bool, on_token=None):
    """A logits processor noting the (synchronised) time of every new token; ``on_token`` after each."""
    from transformers import LogitsProcessor

    class Timer(LogitsProcessor):
        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            if on_token is not None:
                on_token()
            return scores

    return Timer()


def generate(model, ids: torch.Tensor, new: int, on_token=None) -> dict:
    """One greedy ``generate`` of exactly ``new`` tokens: prefill seconds, decode tokens/s."""
    from transformers import LogitsProcessorList

    timer = timing_processor(ids.is_cuda, on_token)
    if ids.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, use_cache=True, pad_token_id=0, logits_processor=LogitsProcessorList([timer]))
    if ids.is_cuda:
        torch.cuda.synchronize()
    t = timer.times
    decode = (new - 1) / (t[-1] - t[0]) if new > 1 and t[-1] > t[0] else None
    return {"new_tokens": new, "prefill_s": t[0] - t0, "decode_tokens_per_s": decode,
            "decode_ms_per_token": 1000 / decode if decode else None, "generate_s": time.perf_counter() - t0,
            "tokens": out[0, ids.shape[1]:].tolist()}


def measure(model, ids: torch.Tensor, new: int) -> dict:
    """A 1-token warm-up on a short prompt, then one timed ``generate``; peak memory of the row."""
    cuda = ids.is_cuda
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else None
    generate(model, ids[:, :256], 1)  # warm-up (first kernels, ZeRO-3's first trace)
    row = {"prompt_tokens": ids.shape[1], **generate(model, ids, new)}
    row.update(base_gib=base / 2**30 if cuda else None,
               peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None)
    return row


def hf_twin(model, device: str):
    """transformers' own class for ``model``'s config (SDPA attention), holding ``model``'s weights."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from longsft.train.common.compat import without_zero3_init

    config = copy.deepcopy(model.config)
    config.use_cache = True
    with without_zero3_init(), no_init_weights(), torch.device(device):
        twin = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                dtype=next(model.parameters()).dtype)
    twin.tie_weights()
    twin.load_state_dict(model.state_dict())
    for name, b in model.named_buffers():  # non-persistent ones too (rotary frequencies), as whole_copy does
        twin.get_buffer(name).copy_(b)
    return twin.eval()


def profile_decode(model, ids: torch.Tensor, tokens: int, trace: Path | None) -> dict:
    """torch.profiler over ``tokens`` decode steps of one ``generate`` (the prefill and the first
    decode step not recorded): the top-25 ops by self CPU and by self device time."""
    from torch.profiler import ProfilerActivity, profile, schedule

    cuda = ids.is_cuda
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # profiler steps end at each new token: step 0 is the prefill, step 1 a warm-up decode step
    with profile(activities=acts, schedule=schedule(wait=1, warmup=1, active=tokens, repeat=1)) as prof:
        timed = generate(model, ids, tokens + 2, on_token=prof.step)
    events = prof.key_averages()

    def device_us(e, total: bool = False) -> float:
        names = ("device_time_total", "cuda_time_total") if total else \
            ("self_device_time_total", "self_cuda_time_total")
        return next((getattr(e, n) for n in names if hasattr(e, n)), 0.0)

    def top(key) -> list[dict]:
        return [{"op": e.key, "count": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                 "cpu_total_ms": e.cpu_time_total / 1e3, "self_device_ms": device_us(e) / 1e3,
                 "device_total_ms": device_us(e, True) / 1e3}
                for e in sorted(events, key=key, reverse=True)[:25]]

    out = {"profiled_decode_tokens": tokens, "wall_ms_per_token_profiled": timed["decode_ms_per_token"],
           "self_cpu_ms_per_token": sum(e.self_cpu_time_total for e in events) / 1e3 / tokens,
           "self_device_ms_per_token": sum(device_us(e) for e in events) / 1e3 / tokens,
           "top_self_cpu": top(lambda e: e.self_cpu_time_total), "top_self_device": top(device_us), "trace": None}
    if trace is not None:
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            with open(raw, "rb") as f, gzip.open(trace, "wb", compresslevel=6) as g:
                shutil.copyfileobj(f, g)
        out["trace"] = str(trace.relative_to(ROOT) if trace.is_relative_to(ROOT) else trace)
        out["trace_mib"] = trace.stat().st_size / 2**20
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for the rows (default {BUDGET_S}; --smoke: none)")
    a = ap.parse_args()
    t_start = time.perf_counter()
    from machine import describe, write_result

    from longsft.train.common.compat import without_zero3_init
    from longsft.train.config.recipes import load_config
    from longsft.train.model.build import build_model
    from longsft.train.parallel import distributed
    from longsft.train.training.validation import generation_model, weight_gb

    cuda = torch.cuda.is_available() and not a.smoke
    device = "cuda" if cuda else "cpu"
    shape, dtype = (SMOKE, "fp32") if a.smoke else (QWEN3_1_7B, "bf16")
    short, long_ = (512, 1024) if a.smoke else (16384, 32768)
    new, profiled = (4, 2) if a.smoke else (16, 8)
    budget = a.budget if a.budget is not None else (None if a.smoke else BUDGET_S)
    base = [*(f"model.config.{k}={v}" for k, v in shape.items()), f"model.dtype={dtype}", "parallel.sp_size=1",
            "deepspeed.torch_adam=true", "optim.grad_accum=1"]
    os.environ.update(onestep.rendezvous_env())
    distributed.init(1)
    rows: list[dict] = []
    machine = describe()
    out = "gpu_validation_smoke" if a.smoke else "gpu_validation"
    if not a.smoke:
        TRACE.unlink(missing_ok=True)

    def save() -> None:  # after every row: a cut-off run keeps what it measured
        write_result(out, {"benchmark": "gpu_validation", "shape": shape, "dtype": dtype, "budget_s": budget,
                           "elapsed_s": time.perf_counter() - t_start, "rows": rows, "machine": machine})

    def fits(stage: str, path: str, **fields) -> bool:
        left = budget - (time.perf_counter() - t_start) if budget else None
        if left is not None and left < COST_S[stage]:
            rows.append({"path": path, **fields, "elapsed_s": 0.0,
                         "skipped": f"time budget: about {COST_S[stage]} s needed, {left:.0f} s left"})
            print(rows[-1], flush=True)
            save()
            return False
        print(f"started {path}", flush=True)
        return True

    @contextlib.contextmanager
    def row(path: str, before_s: float = 0.0, **fields):
        """One row: its fields, its seconds (``before_s``: spent on it before, an engine's build), its
        failure (the next rows still run); saved at the end."""
        r = {"path": path, **fields}
        t0 = time.perf_counter()
        try:
            yield r
        except Exception as e:
            r.update(failed=True, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])
        r["elapsed_s"] = time.perf_counter() - t0 + before_s
        rows.append(r)
        print({k: v for k, v in r.items() if not k.startswith("top_")}, flush=True)
        save()

    def plain_model():
        cfg = load_config("tiny", [*base, "deepspeed.config=zero3"])
        with without_zero3_init(), torch.device(device):  # random initialisation on the GPU, seeded: same weights
            model = build_model(cfg.model, seed=cfg.seed).eval()
        model.config.use_cache = True
        return model

    vocab = None

    def prompt(seq: int) -> torch.Tensor:
        return torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0)).to(device)

    # 1-3: the plain model as longsft builds it, transformers' class with its weights, the profile
    model = None
    if fits("plain", "plain", prompt_tokens=short):
        t0 = time.perf_counter()
        model = plain_model()
        vocab = model.config.vocab_size
        build_s = time.perf_counter() - t0
        with row("plain", build_s, model="longsft build_model", build_s=build_s) as r:
            r.update(measure(model, prompt(short), new))
    if model is not None and fits("hf", "hf"):
        t0 = time.perf_counter()
        with row("hf", model="AutoModelForCausalLM.from_config, sdpa, the plain row's weights") as r:
            twin = hf_twin(model, device)
            r["build_s"] = time.perf_counter() - t0
            try:
                r.update(measure(twin, prompt(short), new))
                plain = next((x.get("tokens") for x in rows if x["path"] == "plain"), None)
                r["same_tokens_as_plain"] = r["tokens"] == plain
            finally:
                del twin
    if model is not None and fits("profile", "profile"):
        with row("profile", model="longsft build_model", prompt_tokens=short) as r:
            trace = TRACE if cuda else Path(tempfile.gettempdir()) / "gpu_validation_trace_smoke.json.gz"
            r.update(profile_decode(model, prompt(short), profiled, trace))
    del model
    if cuda:
        torch.cuda.empty_cache()

    # 4-6: the trainer's engines, the hook's own choice of model, then the partitioned model itself
    for ds, n_whole, n_part in (("zero3", new, max(2, new // 2)), ("zero3_offload", max(2, new // 4), 3)):
        if not fits(ds, f"{ds} validation path"):
            continue
        cfg = load_config("tiny", [*base, f"deepspeed.config={ds}"])
        t0 = time.perf_counter()
        engine = None
        try:
            engine = onestep.zero3_engine(cfg, total_steps=1)
            vocab = vocab or engine.module.config.vocab_size
            build_s = time.perf_counter() - t0
            limit = cfg.validation.whole_model_gb
            with row(f"{ds} validation path", build_s, engine_build_s=build_s, weight_gb=weight_gb(engine.module),
                     whole_model_gb=limit) as r:
                t1 = time.perf_counter()
                with generation_model(engine, "sdpa", limit, torch.device(device)) as (gen, synced):
                    r.update(whole_copy=gen is not engine.module, copy_s=time.perf_counter() - t1, synced=synced)
                    r.update(measure(gen, prompt(short), n_whole))
                    del gen
            if fits(f"{ds} partitioned", f"{ds} partitioned"):
                with row(f"{ds} partitioned", model="engine.module: every layer gathered for every token") as r:
                    engine.module.eval()
                    try:
                        r.update(measure(engine.module, prompt(short), n_part))
                    finally:
                        engine.module.train()
        except Exception as e:  # the engine itself failed: say so, go on
            rows.append({"path": f"{ds} engine", "failed": True, "error": f"{type(e).__name__}: {e}",
                         "trace": traceback.format_exc()[-2000:], "elapsed_s": time.perf_counter() - t0})
            print(rows[-1]["error"], flush=True)
            save()
        finally:
            if engine is not None:
                engine.destroy()
            del engine
            if cuda:
                torch.cuda.empty_cache()

    # 7: the plain model on the longer prompt
    if fits("plain_32k", "plain", prompt_tokens=long_):
        t0 = time.perf_counter()
        with row("plain", model="longsft build_model") as r:
            model = plain_model()
            vocab = vocab or model.config.vocab_size
            r["build_s"] = time.perf_counter() - t0
            r.update(measure(model, prompt(long_), new))
        del model

    print("\n| path | prompt | new | prefill s | decode tokens/s | ms/token | peak GiB | row s |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "prefill_s" not in r:
            what = r.get("skipped") or r.get("error") or (
                f"{r.get('self_cpu_ms_per_token', 0):.1f} ms self CPU, {r.get('self_device_ms_per_token', 0):.1f} ms "
                "self device per token" if r["path"] == "profile" else "")
            print(f"| {r['path']} | {str(what)[:100]} | | | | | | {r['elapsed_s']:.1f} |")
            continue
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        rate = f"{r['decode_tokens_per_s']:.1f} | {r['decode_ms_per_token']:.0f}" if r["decode_tokens_per_s"] \
            else "- | -"
        print(f"| {r['path']} | {r['prompt_tokens']} | {r['new_tokens']} | {r['prefill_s']:.2f} | {rate} | {peak} | "
              f"{r['elapsed_s']:.1f} |")
    print(f"{time.perf_counter() - t_start:.1f} s in all")
    distributed.shutdown()
    sys.exit(1 if any(r.get("failed") for r in rows) else 0)


if __name__ == "__main__":
    main()
