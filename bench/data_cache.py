"""Data at the paper's scale: one stage of 1,340 samples of ~100K Qwen3 tokens, on 2 ranks.

    python bench/data_cache.py [--samples 1340] [--tokens 100000] [--before-samples 67]

Before (longsft up to 0.x, every rank): ``load_samples`` keeps every sample's text, and the prompt
and the whole conversation are tokenized (two passes) into Python lists of ``input_ids`` and
full-length ``labels``; at every start and every resume. Measured in one process on
``--before-samples`` samples (each rank did the same) and scaled to the stage.

After: the token cache (``longsft.train.data.token_cache``), through the trainer's own data path
under ``torchrun --nproc-per-node 2``: a cold start (rank 0 builds with one worker per rank while
the other waits), a warm start, and a resume at step 500 (other rows). Each rank reports the time
from its launch to the first step's batch (the model build, the same before and after, is left
out) and its resident memory due to data (RSS after the first batch minus before the data).

Also the same tokens written as an Arrow dataset (``datasets``' ``save_to_disk``) against the
numpy memmap: write, open and one-row read times, and the memory an open holds.

Text: generated (English from a Zipf-distributed 30K-word lexicon, Chinese from 20K one- to three-
character words), half the samples each. Writes bench/results/data_cache.json.
Goals (issue 15): per-rank data memory <= 1/20 of before; warm start and resume <= 10 s; first build
>= 1M tokens/s on this machine.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
ROOT = Path(__file__).resolve().parents[1]
IGNORE = -100


# --------------------------------------------------------------------------- synthetic data

def _lexicons(rng: random.Random):
    onset = ["", "b", "br", "c", "ch", "d", "f", "g", "gr", "h", "j", "k", "l", "m", "n", "p", "pl", "r", "s",
             "sh", "st", "t", "th", "tr", "v", "w", "y"]
    nucleus = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "ou", "oo"]
    coda = ["", "", "n", "r", "s", "t", "l", "nd", "ck", "st", "ng", "rd"]
    common = ["the", "of", "and", "to", "a", "in", "was", "he", "that", "it", "his", "her", "with", "as", "had", "for", "she", "on", "at", "by", "not", "be", "said", "they", "from", "but", "all", "were", "him", "this", "which", "there", "when", "one", "you", "would", "an", "so", "their", "no", "what", "if", "out", "up", "into", "them", "could", "then", "now", "more", "about", "over", "after", "before", "night", "river", "castle", "letter", "winter", "road", "house"]
    en = list(dict.fromkeys(common + ["".join(rng.choice(onset) + rng.choice(nucleus) + rng.choice(coda)
                                              for _ in range(rng.choice([1, 1, 2, 2, 2, 3, 3, 4])))
                                      for _ in range(40000)]))[:30000]
    chars = [chr(c) for c in rng.sample(range(0x4E00, 0x4E00 + 6000), 3000)]
    zh = list(dict.fromkeys("".join(rng.choice(chars) for _ in range(rng.choice([1, 2, 2, 2, 3])))
                            for _ in range(30000)))[:20000]
    zipf = [1 / (r + 1) ** 1.07 for r in range(30000)]
    return {"en": (en, zipf[:len(en)]), "zh": (zh, zipf[:len(zh)])}


def _article(rng: random.Random, lang: str, lex, n_words: int) -> str:
    words, weights = lex[lang]
    ws = rng.choices(words, weights, k=n_words)
    out, i = [], 0
    while i < len(ws):
        n = rng.randint(6, 18)
        chunk = ws[i:i + n]
        i += n
        if lang == "en":
            s = " ".join(chunk)
            out.append(s[0].upper() + s[1:] + rng.choice([".", ".", ".", ",", ";", "?", "!"]))
        else:
            out.append("".join(chunk) + rng.choice(["。", "，", "，", "；", "？", "！"]))
        if rng.random() < 0.08:
            out.append("\n\n")
        elif rng.random() < 0.05:
            out.append(f" {rng.randint(2, 9000)} " if lang == "en" else str(rng.randint(2, 9000)))
    return (" " if lang == "en" else "").join(out).replace(" \n\n ", "\n\n")


def write_stage(path: Path, n: int, tokens: int, tok) -> int:
    """``n`` samples of about ``tokens`` tokens each (half zh, half en); returns the file's bytes."""
    rng = random.Random(0)
    lex = _lexicons(rng)
    per_word = {}
    for lang in ("en", "zh"):  # calibrate words per token on one article
        probe = _article(random.Random(1), lang, lex, 20000)
        per_word[lang] = len(tok(probe, add_special_tokens=False)["input_ids"]) / 20000
    with path.open("w") as f:
        for i in range(n):
            lang = "en" if i % 2 else "zh"
            art = _article(rng, lang, lex, int(tokens * rng.uniform(0.93, 0.99) / per_word[lang]))
            summ = _article(rng, lang, lex, 120)
            score = rng.choice([1, 2, 4, 5])
            rec = {"id": f"s{i:05d}", "language": lang, "article": art, "summary": summ, "gold_score": score,
                   "types": ["entity"] if score <= 2 else [], "reason": "synthetic", "bucket": "100k"}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return path.stat().st_size


# --------------------------------------------------------------------------- measuring

def rss() -> dict:
    """This process's resident memory (bytes): total, anonymous (private heap) and file-backed."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile"):
                fields[k] = int(v.split()[0]) * 1024
    return {"rss": fields["VmRSS"], "anon": fields["RssAnon"], "file": fields["RssFile"]}


def before(path: Path, n_sub: int, seq_len: int) -> dict:
    """The in-memory path on the first ``n_sub`` samples (run in a fresh process)."""
    from longsft.train.data.prompts import render_prompt
    from longsft.train.data.schema import load_samples
    from longsft.train.model.build import qwen_tokenizer

    tok = qwen_tokenizer()
    sub = path.with_name("before.jsonl")
    with path.open() as f, sub.open("w") as g:
        for _ in range(n_sub):
            g.write(f.readline())
    kw = {"tokenize": True, "return_dict": False, "enable_thinking": False}
    r0, t0 = rss(), time.perf_counter()
    samples = load_samples(sub)
    rows, n_tokens = [], 0
    for s in samples:
        user = [{"role": "user", "content": render_prompt(s)}]
        p = list(tok.apply_chat_template(user, add_generation_prompt=True, **kw))
        full = list(tok.apply_chat_template(user + [{"role": "assistant", "content": s.target}], **kw))
        ids = p + full[len(p):]
        assert len(ids) <= seq_len
        rows.append((s, ids, [IGNORE] * len(p) + full[len(p):], len(p)))
        n_tokens += len(ids)
    dt, r1 = time.perf_counter() - t0, rss()
    return {"samples": n_sub, "tokens": n_tokens, "seconds": dt, "tokens_per_s": n_tokens / dt,
            "data_rss_bytes": r1["rss"] - r0["rss"], "data_anon_bytes": r1["anon"] - r0["anon"]}


def worker(out: Path, start_step: int) -> None:
    """One rank of a launch: the curriculum's start (tokenizer, every stage cached), then the trainer's
    data phase and the batch of ``start_step``; writes its timings and memory to ``out``."""
    launched = float(os.environ["BENCH_LAUNCHED"])
    from longsft.train.config.recipes import parse_run_args
    from longsft.train.data.cache_ready import ensure_all
    from longsft.train.model.build import build_tokenizer
    from longsft.train.parallel import distributed
    from longsft.train.training.step import make_batch
    from longsft.train.training.tracker import Tracker
    from longsft.train.training.trainer import StageTrainer

    cfg = parse_run_args(json.loads(os.environ["BENCH_ARGS"]))
    d = distributed.init(cfg.parallel.sp_size)
    t_import = time.time()
    tok = build_tokenizer(cfg.model)
    r0, t_tok = rss(), time.time()  # memory and time from here on are the data's
    ensure_all(cfg, tok, log=print if d.is_main else None)
    tracker = Tracker(cfg.run_path, cfg.logging, False, {})
    trainer = StageTrainer(cfg, 0, d, tok, tracker, {}, lambda: None, None)
    trainer._data()
    t_data = time.time()
    idx = trainer.sampler.step(start_step)[0]
    _, n = make_batch([trainer.train[i] for i in idx], trainer.pad_id, d)
    t_batch, r1 = time.time(), rss()
    rec = {"rank": d.rank, "start_step": start_step, "launch_to_first_batch_s": t_batch - launched,
           "launch_to_tokenizer_s": t_tok - launched, "tokenizer_s": t_tok - t_import, "data_s": t_data - t_tok, "first_batch_s": t_batch - t_data,
           "batch_tokens": n, "data_rss_bytes": r1["rss"] - r0["rss"], "data_anon_bytes": r1["anon"] - r0["anon"],
           "data_file_bytes": r1["file"] - r0["file"]}
    Path(f"{out}.{d.rank}").write_text(json.dumps(rec))
    distributed.shutdown()


def launch(args: list[str], out: Path, start_step: int) -> list[dict]:
    env = {**os.environ, "BENCH_ARGS": json.dumps(args), "BENCH_LAUNCHED": str(time.time()), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29533",
                    __file__, "--worker", str(out), "--start-step", str(start_step)], env=env, check=True,
                   stdout=sys.stderr)
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]


def arrow_vs_memmap(cache: Path) -> dict:
    """The same tokens as an Arrow dataset (``save_to_disk``): write, open, one row, memory held."""
    import numpy as np
    import pyarrow as pa
    from datasets import Dataset, load_from_disk

    from longsft.train.data.token_cache import TokenCache

    index = np.load(cache / "index.npy")
    tokens = np.memmap(cache / "tokens.bin", dtype=np.uint32, mode="r")
    offsets = np.append(index[:, 0], index[-1, 0] + index[-1, 1]).astype(np.int64)
    t0 = time.perf_counter()
    col = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(np.asarray(tokens)))
    table = pa.table({"input_ids": col, "prompt_len": pa.array(index[:, 2])})
    folder = cache.parent / "arrow-copy"
    Dataset(table).save_to_disk(str(folder), num_proc=None)
    write_s = time.perf_counter() - t0
    del col, table
    out = {"arrow_write_s": write_s}
    for name, opener, row in [
        ("arrow", lambda: load_from_disk(str(folder)).with_format("numpy"), lambda ds, i: ds[i]["input_ids"]),
        ("memmap", lambda: TokenCache.open(cache), lambda c, i: np.array(c.items[i].input_ids)),  # a copy: read
    ]:
        r0, t0 = rss(), time.perf_counter()
        handle = opener()
        t1 = time.perf_counter()
        x = row(handle, len(index) // 2)
        t2 = time.perf_counter()
        out[name] = {"open_s": t1 - t0, "row_read_s": t2 - t1, "row_tokens": len(x),
                     "held_after_one_row_bytes": rss()["rss"] - r0["rss"]}
        del handle
    return out


def main() -> None:
    from machine import describe, write_result

    from longsft.train.model.build import qwen_tokenizer
    from longsft.train.plan.data_memory import host_bytes

    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=1340)
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--before-samples", type=int, default=67)
    ap.add_argument("--worker")
    ap.add_argument("--start-step", type=int, default=0)
    args = ap.parse_args()
    if args.worker:
        return worker(Path(args.worker), args.start_step)
    seq_len = 131072
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        tmp = Path(tmp)
        data = tmp / "train.jsonl"
        t0 = time.perf_counter()
        size = write_stage(data, args.samples, args.tokens, qwen_tokenizer())
        print(f"wrote {args.samples} samples, {size / 2**20:.0f} MiB in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import data_cache; "
                f"print(json.dumps(data_cache.before(__import__('pathlib').Path({str(data)!r}), "
                f"{args.before_samples}, {seq_len})))")
        old = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                        text=True).stdout.splitlines()[-1])
        scale = args.samples / args.before_samples
        run_args = ["recipe=tiny", f"run_dir={tmp / 'run'}", "data.source=files", f"data.train_file={data}",
                    f"data.cache_dir={tmp / 'cache'}", "parallel.sp_size=2", "model.loss_chunk_tokens=4096",
                    f"stages=[{{name: s100k, bucket: 100k, seq_len: {seq_len}, max_steps: 1000, validate: false}}]"]
        runs = {"cold": launch(run_args, tmp / "cold", 0), "warm": launch(run_args, tmp / "warm", 0),
                "resume": launch(run_args, tmp / "resume", 500)}
        cache = next(p for p in (tmp / "cache").iterdir() if not p.name.startswith("."))
        manifest = json.loads((cache / "manifest.json").read_text())
        formats = arrow_vs_memmap(cache)
        from longsft.train.config.recipes import parse_run_args

        cfg = parse_run_args(run_args)
        planned, _ = host_bytes(cfg, cfg.stages[0])
    old_per_rank = old["data_rss_bytes"] * scale
    new_per_rank = max(r["data_rss_bytes"] for r in runs["warm"] + runs["resume"])
    old_start = old["seconds"] * scale
    fixed = min(r["launch_to_tokenizer_s"] for r in runs["warm"])  # imports, process group, tokenizer
    result = {
        "machine": describe(), "samples": args.samples, "tokens": manifest["tokens"],
        "mean_sample_tokens": manifest["tokens"] / manifest["samples"], "source_mib": size / 2**20,
        "cache_mib": sum(v["bytes"] for v in manifest["files"].values()) / 2**20,
        "before": {**old, "scaled_to_stage": {"data_rss_bytes_per_rank": old_per_rank,
                                              "data_seconds_every_launch": old_start,
                                              "launch_to_first_batch_s": fixed + old_start}},
        "after": runs, "first_build": {"seconds": manifest["build_seconds"], "workers": manifest["workers"],
                                       "tokens_per_s": manifest["tokens_per_s"]},
        "planner_data_bytes_per_rank": planned, "arrow_vs_memmap": formats,
        "ratios": {"data_memory_after_over_before": new_per_rank / old_per_rank},
        "goals": {"data_memory_ratio_max": 1 / 20, "warm_or_resume_start_max_s": 10,
                  "first_build_tokens_per_s_min": 1_000_000},
    }
    warm = max(r["data_s"] + r["first_batch_s"] for r in runs["warm"] + runs["resume"])
    print(f"\n{args.samples} samples, {manifest['tokens']:,} tokens (mean {result['mean_sample_tokens']:,.0f}), "
          f"2 ranks, {describe()['cores']} cores\n")
    print(f"| | before (scaled from {args.before_samples} samples) | after: cold | warm | resume |")
    print("|---|---:|---:|---:|---:|")
    per = {k: max(runs[k], key=lambda r: r["launch_to_first_batch_s"]) for k in runs}
    print(f"| launch to first batch, s | {fixed + old_start:.0f} (every start) | "
          + " | ".join(f"{per[k]['launch_to_first_batch_s']:.1f}" for k in runs) + " |")
    print(f"| data: from the tokenizer to the first batch, s | {old_start:.1f} | "
          + " | ".join(f"{per[k]['data_s'] + per[k]['first_batch_s']:.1f}" for k in runs) + " |")
    print(f"| per-rank resident memory due to data, MiB | {old_per_rank / 2**20:,.0f} | "
          + " | ".join(f"{max(r['data_rss_bytes'] for r in runs[k]) / 2**20:.1f}" for k in runs) + " |")
    print(f"\nfirst build: {manifest['tokens_per_s'] / 1e6:.2f}M tokens/s with {manifest['workers']} workers "
          f"(before: {old['tokens_per_s'] / 1e6:.2f}M tokens/s per rank, every rank)")
    print(f"data memory after / before: {result['ratios']['data_memory_after_over_before']:.4f} (goal <= 0.05); "
          f"warm/resume data phase {warm:.1f} s (goal <= 10); planner's data figure {planned / 2**20:.1f} MiB per rank")
    a, m = formats["arrow"], formats["memmap"]
    print(f"arrow vs memmap: open {a['open_s']:.2f} / {m['open_s']:.2f} s, one row {a['row_read_s'] * 1e3:.1f} / "
          f"{m['row_read_s'] * 1e3:.1f} ms, held {a['held_after_one_row_bytes'] / 2**20:.1f} / "
          f"{m['held_after_one_row_bytes'] / 2**20:.1f} MiB (arrow write {formats['arrow_write_s']:.1f} s)")
    write_result("data_cache", result)


if __name__ == "__main__":
    main()
