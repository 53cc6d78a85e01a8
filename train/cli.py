"""The ``longsft`` command.

    longsft train recipe=tiny [key=value ...]     same as launch/curriculum.py (one process)
    longsft config recipe=NAME [key=value ...]    print the resolved config, check it, exit
    longsft score PRED.jsonl [--out F]            score predictions with the shared scorer
    longsft data sample --out DIR [--buckets 512,1k] [--n 16]
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from .config import ConfigError, RunConfig, dump_yaml, load_config, validate
from .io import DataError

DEFAULT_RECIPE = "tiny"


def parse_run_args(argv: list[str]) -> RunConfig:
    """``recipe=NAME`` plus ``key=value`` overrides -> validated config."""
    recipe, overrides = DEFAULT_RECIPE, []
    for arg in argv:
        if "=" not in arg:
            raise ConfigError(f"argument {arg!r} is not key=value (e.g. recipe=tiny optim.lr=1e-5)")
        if arg.startswith("recipe="):
            recipe = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
    cfg = load_config(recipe, overrides)
    validate(cfg)
    return cfg


def _data(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="longsft data")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sample", help="write the deterministic offline sample set")
    s.add_argument("--out", required=True)
    s.add_argument("--buckets", default="512,1k,2k,4k")
    s.add_argument("--n", type=int, default=16, help="train samples per language and bucket")
    s.add_argument("--n-validation", type=int, default=4)
    s.add_argument("--seed", type=int, default=42)
    args = ap.parse_args(argv)
    from .model import qwen_tokenizer
    from .sample_data import write_sample_data

    paths = write_sample_data(args.out, qwen_tokenizer(), args.buckets.split(","), args.n, args.n_validation,
                              args.seed)
    for bucket, p in paths.items():
        print(f"{bucket}: {p['train']}  {p['validation']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd, rest = argv[0], argv[1:]
    try:
        if cmd == "train":
            cfg = parse_run_args(rest)
            # DeepSpeed still calls torch collectives that torch deprecated; nothing a user can act on.
            warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
            from .curriculum import run

            run(cfg)
            return 0
        if cmd == "config":
            print(dump_yaml(parse_run_args(rest)), end="")
            return 0
        if cmd == "score":
            from longsft.eval.score import main as score_main

            return score_main(rest)
        if cmd == "data":
            return _data(rest)
    except (ConfigError, DataError) as e:
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank fails alike: say it once
            print(f"longsft: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from .trainer import TrainingError

        if not isinstance(e, TrainingError):
            raise
        if os.environ.get("RANK", "0") == "0":
            print(f"longsft: {e}", file=sys.stderr)
        return 3
    print(f"longsft: unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
