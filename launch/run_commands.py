"""The commands about a run and its resources: ``config``, ``plan``, ``status``, ``report``, ``sweep``,
``submit`` (their ``--flags``; the run itself is ``recipe=NAME key=value ...``)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from longsft.train.common.errors import ConfigError
from longsft.train.common.helpfmt import DefaultsHelp
from longsft.train.common.io import check_output_file
from longsft.train.config.help import run_keys_epilog, wants_help
from longsft.train.config.loader import dump_yaml
from longsft.train.config.recipes import parse_run_args


def config_command(argv: list[str]) -> int:
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


def plan_command(argv: list[str]) -> int:
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


def status_command(argv: list[str]) -> int:
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


def report_command(argv: list[str]) -> int:
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


def sweep_command(argv: list[str]) -> int:
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


def submit_command(argv: list[str]) -> int:
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
