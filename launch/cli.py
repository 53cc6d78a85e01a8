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

import os
import sys
import warnings

from longsft.launch.data_commands import data_command
from longsft.launch.run_commands import (
    config_command,
    plan_command,
    report_command,
    status_command,
    submit_command,
    sweep_command,
)
from longsft.train.common.errors import LongsftError, is_same_on_every_rank, is_this_rank_only
from longsft.train.config.help import run_help, wants_help
from longsft.train.config.recipes import parse_run_args


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
    else:  # rank 0 (or this node's first rank) says it: let it, before this rank's exit ends the job
        _wait_for_rank_zero()


RANK_ZERO_GRACE_S = 20.0


def _wait_for_rank_zero(grace_s: float = RANK_ZERO_GRACE_S) -> None:
    """Hold a silent rank's exit for up to ``grace_s``. torchrun (and srun --kill-on-bad-exit) ends every
    other rank with SIGTERM once one rank exits, so a rank that fails first would cut off the rank that
    says the error (seen in CI: rank 0, behind rank 1, printed nothing). The speaker's own exit ends this
    wait the same way, so the wait costs nothing when it fails alike; at most ``grace_s`` otherwise."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import time

        time.sleep(grace_s)


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
    from longsft.eval.eval_config import eval_help

    return eval_help()


def _serve_help() -> str:
    from longsft.eval.serve import serve_help

    return serve_help()


def _constory_help() -> str:
    from longsft.eval.constory_cli import constory_help

    return constory_help()


# Commands whose arguments are key=value settings of a typed config: --help lists every key and default.
KEY_VALUE_HELP = {"train": lambda: run_help("train"), "config": lambda: run_help("config", " [--get KEY]"),
                  "eval": _eval_help, "serve": _serve_help, "constory": _constory_help}


def _train(cfg) -> int:
    from longsft.train.training.rundir import say_finished

    if say_finished(cfg):  # nothing to train: said before torch is imported
        return 0
    # DeepSpeed still calls torch collectives that torch deprecated; nothing a user can act on.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    from longsft.train.training.curriculum import run

    run(cfg)
    return 0


def _eval(argv: list[str]) -> int:
    from longsft.eval.eval_config import parse_eval_args
    from longsft.eval.harness import run_eval

    summary = run_eval(parse_eval_args(argv))
    m = summary["mean"]
    print(f"{summary['name']}: n={summary['n']} x {summary['repeats']}  BA {m['balanced_accuracy']:.3f}  "
          f"MCC {m['mcc']:.3f}  invalid {m['invalid_rate']:.1%}  ({summary['generation']['failed']} failed "
          f"generations)\nwrote {summary['out']}/eval.json")
    return 0


def _constory(argv: list[str]) -> int:
    from longsft.eval.constory_cli import main as constory_main

    return constory_main(argv)


def _serve(argv: list[str]) -> int:
    from longsft.eval.serve import serve

    return serve(argv)


def _score(argv: list[str]) -> int:
    from longsft.train.scoring.score import main as score_main

    return score_main(argv)


def _vote(argv: list[str]) -> int:
    from longsft.eval.vote import main as vote_main

    return vote_main(argv)


# Every command: argv after the command's name -> exit status. Each imports what it runs when it runs
# (``longsft score`` imports no torch).
COMMANDS = {"train": lambda argv: _train(parse_run_args(argv)), "eval": _eval, "constory": _constory, "serve": _serve, "score": _score, "vote": _vote,
            "config": config_command, "plan": plan_command, "status": status_command, "report": report_command,
            "sweep": sweep_command, "submit": submit_command, "data": data_command}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"longsft: unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
        return 2
    if cmd in KEY_VALUE_HELP and wants_help(rest):
        print(KEY_VALUE_HELP[cmd]())
        return 0
    started = False  # past the command line: an error may now be one rank's own (a file, a node)
    try:
        if cmd == "train":  # the one command every rank runs
            cfg = parse_run_args(rest)
            started = True
            return _train(cfg)
        return COMMANDS[cmd](rest)
    except LongsftError as e:  # bad config or data (2), training failed (3), stopped on request (75 / 0)
        _say_error(str(e), e, started)
        return e.exit_status()
    except (OSError, UnicodeDecodeError, RecursionError) as e:
        # The net under the specific checks: a file the user named that cannot be read or written.
        message = _os_message(e)
        if message is None:
            raise
        _say_error(message, e, started)
        return 2


if __name__ == "__main__":
    sys.exit(main())
