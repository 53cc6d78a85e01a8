"""``longsft data ...``: the data commands' arguments (prepare, sample, extend, erhg, mma, ablation), each
handed to the library that does the work."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace

from longsft.train.common.errors import ConfigError
from longsft.train.common.helpfmt import DefaultsHelp
from longsft.train.common.io import check_output_file, say
from longsft.train.config.help import run_keys_epilog, wants_help
from longsft.train.config.recipes import parse_run_args


def prepare_command(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="longsft data prepare", formatter_class=DefaultsHelp,
                                 epilog=run_keys_epilog() if wants_help(argv) else None,
                                 description="tokenize every stage's training and validation data into the token "
                                             "cache (data.cache_dir) once, e.g. on a CPU node before the GPU job; "
                                             "training and every resume then start from it")
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                    help="processes that tokenize (default: this machine's cores)")
    ap.add_argument("--json", default=None, help="also write one record per split to this file")
    args, rest = ap.parse_known_args(argv)
    cfg = parse_run_args(rest)
    if args.workers < 1:
        raise ConfigError(f"--workers {args.workers}: at least 1")
    if args.json:
        check_output_file(args.json)
    from longsft.train.data.cache_ready import prepare
    from longsft.train.model.build import build_tokenizer
    from longsft.train.training.preflight import prepare_data
    from longsft.train.training.rundir import check_run_dir

    tokenizer = build_tokenizer(cfg.model)
    if cfg.data.source == "sample":  # the sample set lives in the run directory
        check_run_dir(cfg)
        prepare_data(cfg, tokenizer)
    records = prepare(cfg, tokenizer, args.workers, log=say)
    for r in records:
        print(f"{r['stage']:>12} {r['split']:<10} {r['samples']:>7} samples {r['tokens']:>13,} tokens  "
              f"{r['what']}  {r['path']}")
    if args.json:
        from longsft.train.common.io import atomic_write_json

        atomic_write_json(args.json, records)
    return 0


def data_command(argv: list[str]) -> int:
    if argv[:1] == ["prepare"]:
        return prepare_command(argv[1:])
    ap = argparse.ArgumentParser(prog="longsft data", formatter_class=DefaultsHelp)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare", help="tokenize every stage's data into the token cache (recipe=NAME key=value ...; "
                                   "see longsft data prepare --help)")
    s = sub.add_parser("sample", formatter_class=DefaultsHelp, help="write the deterministic offline sample set")
    s.add_argument("--out", required=True, help="output folder (BUCKET/train.jsonl, BUCKET/validation.jsonl)")
    s.add_argument("--buckets", default="512,1k,2k,4k", help="length buckets to write")
    s.add_argument("--n", type=int, default=16, help="train samples per language and bucket")
    s.add_argument("--n-validation", type=int, default=4, help="validation samples per language and bucket")
    s.add_argument("--seed", type=int, default=42, help="random seed")
    s.add_argument("--n-test", type=int, default=0, help="held-out test samples per language and bucket (test.jsonl)")
    s.add_argument("--languages", default="zh,en", help="languages to write")
    s.add_argument("--balanced", action="store_true",
                   help="alternately faithful and hallucinated per split and language: half of an even count "
                        "(else each sample is drawn)")
    s.add_argument("--tokenizer", default="qwen", help="sizes the articles: qwen, an HF path, a .gguf or pkg:PKG/FILE")
    s.add_argument("--edits", default="erhg", choices=["erhg", "counterfactual"],
                   help="hallucinated summaries: the ERHG rule engine's edits (which leave marks a summary-only "
                        "classifier finds), or a fact's slot redrawn from the story's own values (only the "
                        "article tells them apart)")
    e = sub.add_parser("extend", formatter_class=DefaultsHelp,
                       help="textual units of books -> samples in token-length buckets")
    e.add_argument("units", help="JSONL: book, unit, language, text, summary (a book's units contiguous, in order)")
    e.add_argument("--out", required=True, help="output folder (one JSONL per bucket, stats)")
    e.add_argument("--buckets", default="16k,32k,64k,100k", help="names (default bounds) or name=lower:upper")
    e.add_argument("--tokenizer", default="qwen", help="qwen (the Qwen3 vocabulary, offline), an HF path, a .gguf "
                                                       "or pkg:PKG/FILE")
    e.add_argument("--resume", action="store_true", help="continue an interrupted build in --out")
    a = sub.add_parser("ablation", formatter_class=DefaultsHelp,
                       help="Table 5 training sets (mma_only, mma_erhg) x sizes + held-out sets")
    a.add_argument("inputs", nargs="+", help="JSONL samples with bucket and source (human/mma/erhg)")
    a.add_argument("--out", required=True, help="output folder (training and held-out sets, table5.sweep)")
    a.add_argument("--sizes", default="all", help="training-set sizes, e.g. 1000,2000,all")
    a.add_argument("--val-articles", type=int, default=20, help="held-out validation articles per bucket")
    a.add_argument("--test-articles", type=int, default=50, help="held-out test articles per bucket")
    a.add_argument("--seed", type=int, default=42, help="random seed of the splits and subsets")
    h = sub.add_parser("erhg", formatter_class=DefaultsHelp,
                       help="hallucinated summaries by entity-referenced edits (offline rules or an LLM)")
    h.add_argument("input", help="JSONL of faithful samples (e.g. data extend output)")
    h.add_argument("--out", required=True, help="output JSONL (problems and stats written next to it)")
    h.add_argument("--engine", choices=["rules", "llm"], default="rules", help="offline rules or an LLM endpoint")
    h.add_argument("--endpoint", help="llm engine: MODEL@http://host:port/v1 (OpenAI-compatible)")
    h.add_argument("--multi", type=float, default=0.3, help="share of samples with three edits (gold 1), else one (gold 2)")
    h.add_argument("--seed", type=int, default=42, help="random seed of the edits")
    m = sub.add_parser("mma", formatter_class=DefaultsHelp,
                       help="summaries by generator models, scored by two judges and an arbiter")
    m.add_argument("input", help="JSONL samples whose articles to summarise")
    m.add_argument("--out", required=True, help="output JSONL (answers cached in OUT.cache.jsonl)")
    m.add_argument("--generator", action="append", required=True, help="MODEL@URL (repeat)")
    m.add_argument("--judge", action="append", required=True, help="MODEL@URL (exactly twice)")
    m.add_argument("--arbiter", required=True, help="MODEL@URL")
    m.add_argument("--max-gap", type=int, default=1, help="judges agree within this many points (same label)")
    m.add_argument("--concurrency", type=int, default=1,
                   help="articles worked on at once (a server that batches or runs requests side by side: vLLM, "
                        "longsft serve batch=N)")
    m.add_argument("--max-tokens", type=int, default=1024, help="the most tokens of each model's reply")
    args = ap.parse_args(argv)
    if args.cmd in ("erhg", "mma"):
        return _synthesise(args)
    if args.cmd == "ablation":
        from longsft.train.datagen.ablation import build_ablation, parse_sizes

        m = build_ablation(args.inputs, args.out, parse_sizes(args.sizes), args.val_articles, args.test_articles,
                           args.seed)
        for name, counts in m["sets"].items():
            print(f"{name}: " + ", ".join(f"{b} {c['n']} ({c['hallucinated']} hallucinated)" for b, c in counts.items()))
        print(f"sweep file: {args.out}/table5.sweep")
        return 0
    if args.cmd == "extend":
        from longsft.train.common.io import check_input_file
        from longsft.train.datagen.extend import build, format_stats, parse_buckets

        buckets = parse_buckets(args.buckets)
        check_input_file(args.units)
        print(format_stats(build(args.units, args.out, buckets, _tokenizer(args.tokenizer), args.resume)))
        return 0
    from longsft.train.datagen.sample_data import write_sample_data

    paths = write_sample_data(args.out, _tokenizer(args.tokenizer), [b.strip() for b in args.buckets.split(",")], args.n, args.n_validation,
                              args.seed, [x.strip() for x in args.languages.split(",")], args.n_test, args.balanced,
                              args.edits)
    for bucket, p in paths.items():
        print(f"{bucket}: " + "  ".join(map(str, p.values())))
    return 0


def _tokenizer(name: str):
    """``--tokenizer``: qwen (offline), an HF folder or hub id, a .gguf file or pkg:PACKAGE/FILE."""
    from longsft.train.common.io import weights_source
    from longsft.train.config.schema import ModelConfig
    from longsft.train.model.build import build_tokenizer

    if name != "qwen":
        weights_source(name, None, "--tokenizer")  # a missing package or GGUF file, named as this flag
    try:
        return build_tokenizer(ModelConfig(tokenizer=name))
    except (OSError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"--tokenizer {name}: cannot load it ({str(e).splitlines()[0]})") from None


def _synthesise(args) -> int:
    import json
    import random

    from longsft.train.common.cache import AppendCache
    from longsft.train.common.llm import Endpoint, EndpointError
    from longsft.train.datagen.erhg import check_paths

    def endpoint(spec: str) -> Endpoint:
        try:
            return Endpoint.parse(spec)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    # the arguments, then the files, before anything is asked or written (the answer cache included)
    if args.cmd == "mma":
        if len(args.judge) != 2:
            raise ConfigError(f"--judge: MMA needs exactly two judges, got {len(args.judge)}")
        if args.max_gap < 0:
            raise ConfigError(f"--max-gap {args.max_gap}: must be >= 0")
        if args.concurrency < 1:
            raise ConfigError(f"--concurrency {args.concurrency}: must be >= 1")
        if args.max_tokens < 1:
            raise ConfigError(f"--max-tokens {args.max_tokens}: must be >= 1")
        sized = lambda spec: replace(endpoint(spec), max_tokens=args.max_tokens)  # noqa: E731
        eps = [sized(g) for g in args.generator], [sized(j) for j in args.judge], sized(args.arbiter)
    else:
        if not 0 <= args.multi <= 1:
            raise ConfigError(f"--multi {args.multi}: a share, 0..1")
        if args.engine == "llm" and not args.endpoint:
            raise ConfigError("--engine llm needs --endpoint MODEL@URL")
        ep = endpoint(args.endpoint) if args.engine == "llm" else None
    check_paths(args.input, args.out)
    cache = args.out + ".cache.jsonl"
    try:
        if args.cmd == "mma":
            from longsft.train.datagen.mma import run as run_mma

            stats = run_mma(args.input, args.out, *eps, args.max_gap, concurrency=args.concurrency)
        else:
            from longsft.train.datagen.erhg import LLMEngine, RuleEngine
            from longsft.train.datagen.erhg import run as run_erhg

            engine = LLMEngine(ep, AppendCache(cache)) if ep else RuleEngine(random.Random(args.seed))
            stats = run_erhg(args.input, args.out, engine, args.multi, args.seed)
    except EndpointError as e:
        kept = f" (the answers so far are cached in {cache}: a rerun resumes)" if os.path.exists(cache) else ""
        raise ConfigError(f"endpoint {e} Stopped, no output written{kept}.") from None
    print(json.dumps(stats, indent=2, ensure_ascii=False))
    return 0
