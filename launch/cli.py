"""The ``longsft`` command.

    longsft train recipe=tiny [key=value ...]     same as launch/curriculum.py (one process)
    longsft config [--get KEY] recipe=NAME [key=value ...]
                                                  print the resolved config (or one key), check it, exit
    longsft plan recipe=NAME [key=value ...] [--gpus-per-node 8 --nodes 1 --gpu-gib 80 --json F]
                                                  predicted per-GPU peak memory per stage; exit 1 if one
                                                  does not fit (and what would make it fit)
    longsft status RUN_DIR                        stage table; exit 0 when every stage is done, else 1
    longsft report DIR [DIR ...] [--out DIR] [--compare A B]
                                                  tables from training runs (a sweep root) or eval runs
    longsft submit [--sweep FILE] [--nodes N] [--gpu-gib G] ... recipe=NAME [key=value ...]
                                                  check (and plan), snapshot and sbatch a run or a sweep (--help)
    longsft sweep FILE [--root DIR] [key=value]   check every task of a sweep file, list its run dirs
    longsft eval model=PATH data=FILE [backend=hf|vllm|openai] [prompt=end|begin|cot] [repeats=3] ...
                                                  evaluate a model (resumable; see longsft.eval.harness)
    longsft serve model=PATH [port=8000]          OpenAI-compatible endpoint over the HF backend
    longsft constory generate|check|metrics ...   consistency of long generated stories (ConStory)
    longsft score PRED.jsonl [--out F]            score predictions with the shared scorer
    longsft vote RUN RUN RUN [--out DIR]          majority-vote ensemble of eval runs (an eval run itself)
    longsft data prepare recipe=NAME [key=value ...] [--workers N]
                                                  tokenize every stage's data into the token cache once
    longsft data sample --out DIR [--buckets 512,1k] [--n 16]
    longsft data extend UNITS.jsonl --out DIR [--buckets 16k,32k,64k,100k] [--resume]
    longsft data erhg SAMPLES.jsonl --out F [--engine rules|llm --endpoint MODEL@URL]
    longsft data mma SAMPLES.jsonl --out F --generator M@URL ... --judge M@URL --judge M@URL --arbiter M@URL
    longsft data ablation SAMPLES.jsonl ... --out DIR [--sizes 1000,2000,all]

Arguments, one rule: what a command runs is configured by key=value settings of a typed config, the
same keys a recipe or a sweep line holds (train, config, plan, submit, sweep lines, eval, serve,
constory); options of the command itself that no config stores are --flags (the hardware of plan and
submit, sweep selection, the files score, vote, report, status and data read and write).
`longsft COMMAND --help` lists every key or flag with its default.

Exit status: 0 done, 1 unfinished (status) or does not fit (plan), 2 bad input, 3 training failed (e.g. NaN loss) or ConStory stories left unjudged,
75 stopped on request (STOP file, SIGUSR1, SIGTERM, Ctrl-C) with a checkpoint: rerun the same command to resume
(0 under torchrun, which would report 75 as a failure; `longsft status` tells).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from dataclasses import replace
from pathlib import Path

from longsft.train.common.errors import ConfigError, DataError, is_same_on_every_rank, is_this_rank_only, this_rank_only
from longsft.train.common.helpfmt import DefaultsHelp
from longsft.train.common.io import check_output_file, say
from longsft.train.config.help import run_help, run_keys_epilog, wants_help
from longsft.train.config.loader import dump_yaml
from longsft.train.config.recipes import parse_run_args


def _prepare(argv: list[str]) -> int:
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
    from longsft.train.data.token_cache import prepare
    from longsft.train.model.build import build_tokenizer
    from longsft.train.training.curriculum import prepare_data
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


def _data(argv: list[str]) -> int:
    if argv[:1] == ["prepare"]:
        return _prepare(argv[1:])
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
                              args.seed, [x.strip() for x in args.languages.split(",")], args.n_test, args.balanced)
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

            stats = run_mma(args.input, args.out, *eps, args.max_gap)
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


def _config(argv: list[str]) -> int:
    key = None
    if argv[:1] == ["--get"]:
        if len(argv) < 2:
            raise ConfigError("--get needs a key, e.g. --get run_dir")
        key, argv = argv[1], argv[2:]
    cfg = parse_run_args(argv)
    if key is None:
        print(dump_yaml(cfg), end="")
        return 0
    value = cfg
    for part in key.split("."):
        if not hasattr(value, part):
            raise ConfigError(f"--get {key}: no key {part!r}")
        value = getattr(value, part)
    print(cfg.run_path if key == "run_dir" else value)
    return 0


def _plan(argv: list[str]) -> int:
    from longsft.train.plan.choose import advice, plan
    from longsft.train.plan.hardware import GIB, Hardware
    from longsft.train.plan.report import table, to_json

    ap = argparse.ArgumentParser(prog="longsft plan", formatter_class=DefaultsHelp,
                                 epilog=run_keys_epilog() if wants_help(argv) else None,  # built only for --help
                                 description="predicted per-GPU peak memory of every stage")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node")
    ap.add_argument("--nodes", type=int, default=1, help="nodes")
    ap.add_argument("--gpu-gib", type=float, default=79.0,
                    help="memory of one GPU as PyTorch reports it (80 GB H100/A100: 79; H200: 139.8)")
    ap.add_argument("--host-gib", type=float, default=None, help="host memory per node, to check offloading")
    ap.add_argument("--reserve-gib", type=float, default=1.0, help="CUDA context and library workspaces")
    ap.add_argument("--fragmentation", type=float, default=0.10, help="allocator slack, a share of the working set")
    ap.add_argument("--targets", type=int, default=None,
                    help="loss tokens per sequence (default: every token, the worst case)")
    ap.add_argument("--json", default=None, help="also write the prediction to this file")
    args, rest = ap.parse_known_args(argv)
    cfg = parse_run_args(rest)
    hw = Hardware(args.gpus_per_node, args.nodes, args.gpu_gib, args.host_gib, args.reserve_gib,
                       fragmentation=args.fragmentation)
    hw.check()
    if args.targets is not None and args.targets < 1:
        raise ConfigError(f"--targets {args.targets}: loss tokens per sequence must be >= 1")
    if args.json:
        check_output_file(args.json)
    print(f"longsft plan: tracing {len(cfg.stages)} stage(s) on the meta device (no memory, a few seconds each)",
          file=sys.stderr, flush=True)
    shape, rows = plan(cfg, hw, args.targets)
    print(table(cfg, hw, shape, rows))
    for stage, est in zip(cfg.stages, rows):
        if not est.fits:
            fixes = advice(cfg, stage, shape, hw, args.targets)
            print(f"\nstage {stage.name} does not fit ({est.total / GIB:.1f} of {hw.gpu_gib:g} GiB); "
                  + ("each of these fits:\n  " + "\n  ".join(fixes) if fixes else
                     "no single change fits: more GPUs (nodes), a larger sp_size or a shorter seq_len"))
    if args.json:
        from longsft.train.common.io import atomic_write_json

        atomic_write_json(args.json, to_json(cfg, hw, shape, rows))
    host_ok = hw.host_gib is None or max(e.host_per_node for e in rows) <= hw.host_gib * GIB
    if not host_ok:
        print("\nhost memory does not fit: more nodes (offloaded state is split over every GPU), or offload less")
    return 0 if host_ok and all(e.fits for e in rows) else 1


def _status(argv: list[str]) -> int:
    from longsft.train.training.report import status_table
    from longsft.train.training.rundir import read_state

    ap = argparse.ArgumentParser(prog="longsft status", formatter_class=DefaultsHelp,
                                 description="stage table of a run; exit 0 when every stage is done, else 1")
    ap.add_argument("run_dir", help="the run directory (holds state.json)")
    if wants_help(argv):
        ap.print_help()
        return 0
    if len(argv) != 1:
        raise ConfigError("usage: longsft status RUN_DIR")
    state = read_state(argv[0])
    print(status_table(state))
    return 0 if all(s["status"] == "done" for s in state["stages"].values()) else 1


def _report(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="longsft report", formatter_class=DefaultsHelp,
                                 description="tables from training or evaluation runs")
    ap.add_argument("dirs", nargs="*", help="run directories, or folders of them (a sweep root, runs/eval)")
    ap.add_argument("--out", help="where to write the report files (default: the only DIR given)")
    ap.add_argument("--bootstrap", type=int, default=2000, help="replicates for 95%% CIs (0: none)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two eval runs: paired bootstrap of B - A")
    args = ap.parse_args(argv)
    from longsft.eval.report import compare, eval_tables, find_eval_runs
    from longsft.train.training.report import aggregate

    if args.bootstrap < 0:
        raise ConfigError(f"--bootstrap {args.bootstrap}: replicates must be >= 0 (0: no intervals)")
    # The only DIR given is where its aggregate goes, unless it is a run (its report.md is its own).
    only = args.dirs[0] if len(args.dirs) == 1 and not (Path(args.dirs[0]) / "state.json").exists() else None
    out = args.out or only
    if args.compare:
        print(compare(Path(args.compare[0]), Path(args.compare[1]), args.bootstrap or 2000))
        if not args.dirs:
            return 0
    if not args.dirs:
        raise ConfigError("longsft report: give run directories (or --compare A B)")
    evals = find_eval_runs(args.dirs)
    if evals:
        print(eval_tables(evals, Path(out) if out else None))
    rest = [d for d in args.dirs if not find_eval_runs([d])]
    if rest or not evals:
        print(aggregate(rest or args.dirs, out, args.bootstrap))
    return 0


def _sweep(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="longsft sweep", formatter_class=DefaultsHelp,
                                 description="check a sweep file, or print one task's args")
    ap.add_argument("file", help="sweep file: one task per line, NAME key=value ...")
    ap.add_argument("--root", help="task NAME trains in ROOT/NAME (default runs/sweeps/<file stem>)")
    ap.add_argument("--task", type=int, help="print this task's arguments (the array index) instead")
    ap.add_argument("--print0", action="store_true", help="NUL-separated (for the array script)")
    ap.add_argument("--command", choices=["train", "eval"], default="train", help="what each line runs")
    args, common = ap.parse_known_args(argv)
    from longsft.launch.cluster.sweep import OUTPUT_KEY, check_sweep, load_sweep, task_args

    root = args.root or f"runs/sweeps/{os.path.splitext(os.path.basename(args.file))[0]}"
    if args.task is None:
        for task, cfg in check_sweep(args.file, root, common, args.command):
            print(f"{task.index}\t{task.name}\t{getattr(cfg, OUTPUT_KEY[args.command])}")
        return 0
    tasks = load_sweep(args.file)
    if not 0 <= args.task < len(tasks):
        raise ConfigError(f"{args.file}: task {args.task} asked for; the file has tasks 0..{len(tasks) - 1}")
    out = task_args(tasks[args.task], root, common, args.command)
    print("\0".join(out) + "\0" if args.print0 else " ".join(out), end="" if args.print0 else "\n")
    return 0


def _submit(argv: list[str]) -> int:
    from longsft.launch.cluster.slurm import Resources, submit

    ap = argparse.ArgumentParser(prog="longsft submit", formatter_class=DefaultsHelp,
                                 epilog=run_keys_epilog() if wants_help(argv) else None,
                                 description="check, snapshot and sbatch a run or sweep")
    ap.add_argument("--sweep", help="sweep file: submit an array job, one task per line")
    ap.add_argument("--root", help="sweep: task NAME trains in ROOT/NAME (default runs/sweeps/<file stem>)")
    ap.add_argument("--nodes", type=int, default=1, help="nodes per run")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="0 for CPU-only nodes")
    ap.add_argument("--nproc-per-node", type=int, help="processes per node (default: GPUs per node)")
    ap.add_argument("--cpus-per-task", type=int, help="sbatch --cpus-per-task (default: SLURM's)")
    ap.add_argument("--time", help="sbatch --time, e.g. 2-00:00:00")
    ap.add_argument("--partition", help="sbatch --partition")
    ap.add_argument("--account", help="sbatch --account")
    ap.add_argument("--job-name", help="sbatch --job-name (default: longsft-<recipe>)")
    ap.add_argument("--max-parallel", type=int, help="sweep: at most this many tasks at once")
    ap.add_argument("--command", choices=["train", "eval"], default="train",
                    help="sweep: lines are training runs or `longsft eval` runs")
    ap.add_argument("--sbatch", action="append", default=[], metavar="ARG", help="extra sbatch option (repeat)")
    ap.add_argument("--dry-run", action="store_true", help="prepare the submission folder, do not sbatch")
    ap.add_argument("--gpu-gib", type=float, default=None,
                    help="memory of one GPU: plan every stage first and refuse what would not fit (longsft plan)")
    args, rest = ap.parse_known_args(argv)
    res = Resources(args.nodes, args.gpus_per_node, args.nproc_per_node, args.cpus_per_task, args.time,
                    args.partition, args.account, args.job_name, args.max_parallel, args.sbatch)
    if args.command == "eval" and not args.sweep:
        raise ConfigError("--command eval is for sweeps (--sweep FILE); a single evaluation needs no cluster script")
    sub, job = submit(rest, res, args.sweep, args.root, args.dry_run, args.command, args.gpu_gib)
    print(f"submission: {sub}\n" + (f"job: {job}" if job else f"dry run: {sub / 'command.sh'}"))
    return 0


def _say_error(message: str, e: BaseException, started: bool) -> None:
    """Say a failed command's error on stderr. Under torchrun rank 0 says it; so does each node's first
    rank, naming itself (a file its node cannot read, a node with fewer GPUs), and any rank whose error
    is its own alone (a failed save); not the errors every rank has alike (the command line's, rank 0's
    shared with every rank): one line per node at most, for an error of many ranks."""
    rank = int(os.environ.get("RANK", "0"))
    node_first = os.environ.get("LOCAL_RANK", "0") == "0"
    if rank == 0:
        print(f"longsft: {message}", file=sys.stderr, flush=True)
    elif started and not is_same_on_every_rank(e) and (node_first or is_this_rank_only(e)):
        import socket

        print(f"longsft: rank {rank} ({socket.gethostname()}): {message}", file=sys.stderr, flush=True)


def _os_message(e: BaseException) -> str | None:
    """One line for an input/output error a user can fix, or None (a bug: keep the traceback)."""
    if isinstance(e, UnicodeDecodeError):
        return f"an input file is not UTF-8 text ({e.reason} at byte {e.start}); is it a binary file?"
    if isinstance(e, RecursionError):
        return "an input is nested too deeply (JSON or YAML)"
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        target = f"{e.filename} -> {e.filename2}" if e.filename2 else e.filename
        return f"{target}: {e.strerror}"
    return None


def _eval_help() -> str:
    from longsft.eval.harness import eval_help

    return eval_help()


def _serve_help() -> str:
    from longsft.eval.serve import serve_help

    return serve_help()


def _constory_help() -> str:
    from longsft.eval.constory import constory_help

    return constory_help()


# Commands whose arguments are key=value settings of a typed config: --help lists every key and default.
KEY_VALUE_HELP = {"train": lambda: run_help("train"), "config": lambda: run_help("config", " [--get KEY]"),
                  "eval": _eval_help, "serve": _serve_help, "constory": _constory_help}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd in KEY_VALUE_HELP and wants_help(rest):
        print(KEY_VALUE_HELP[cmd]())
        return 0
    started = False  # past the command line: an error may now be one rank's own (a file, a node)
    try:
        if cmd == "train":
            cfg = parse_run_args(rest)
            started = True
            from longsft.train.training.rundir import say_finished

            if say_finished(cfg):  # nothing to train: said before torch is imported
                return 0
            # DeepSpeed still calls torch collectives that torch deprecated; nothing a user can act on.
            warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
            from longsft.train.training.curriculum import run

            run(cfg)
            return 0
        if cmd == "eval":
            from longsft.eval.harness import parse_eval_args, run_eval

            summary = run_eval(parse_eval_args(rest))
            m = summary["mean"]
            print(f"{summary['name']}: n={summary['n']} x {summary['repeats']}  BA {m['balanced_accuracy']:.3f}  "
                  f"MCC {m['mcc']:.3f}  invalid {m['invalid_rate']:.1%}  ({summary['generation']['failed']} failed "
                  f"generations)\nwrote {summary['out']}/eval.json")
            return 0
        if cmd == "constory":
            from longsft.eval.constory import main as constory_main

            return constory_main(rest)
        if cmd == "serve":
            from longsft.eval.serve import serve

            return serve(rest)
        handler = {"config": _config, "plan": _plan, "status": _status, "report": _report, "sweep": _sweep,
                   "submit": _submit, "data": _data}.get(cmd)
        if handler is not None:
            return handler(rest)
        if cmd == "score":
            from longsft.train.scoring.score import main as score_main

            return score_main(rest)
        if cmd == "vote":
            from longsft.eval.vote import main as vote_main

            return vote_main(rest)
    except (ConfigError, DataError) as e:
        _say_error(str(e), e, started)
        return 2
    except (OSError, UnicodeDecodeError, RecursionError) as e:
        # The net under the specific checks: a file the user named that cannot be read or written.
        message = _os_message(e)
        if message is None:
            raise
        _say_error(message, e, started)
        return 2
    except RuntimeError as e:
        from longsft.train.training.preempt import EXIT_STOPPED, StopRequested
        from longsft.train.training.trainer import SaveError, TrainingError

        if not isinstance(e, (TrainingError, StopRequested)):
            raise
        _say_error(str(e), this_rank_only(e) if isinstance(e, SaveError) else e, started)
        if isinstance(e, StopRequested):  # under torchrun, 0: a stop is no failure ("longsft status" tells)
            return 0 if "TORCHELASTIC_RUN_ID" in os.environ else EXIT_STOPPED
        return 3
    print(f"longsft: unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
