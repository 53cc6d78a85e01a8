"""Run a longsft curriculum.

    torchrun --nproc_per_node=2 launch/curriculum.py recipe=tiny
    torchrun --nproc_per_node=8 launch/curriculum.py recipe=qwen3_32b model.path=/models/Qwen3-32B

Arguments are ``key=value`` overrides of the recipe (``recipe=`` picks it; default ``tiny``).
"""

import sys
import warnings

from longsft.train.cli import parse_run_args
from longsft.train.config import ConfigError


def main(argv: list[str]) -> int:
    try:
        cfg = parse_run_args(argv)
    except ConfigError as e:
        print(f"longsft: config error: {e}", file=sys.stderr)
        return 2
    # DeepSpeed still calls torch collectives that torch has deprecated; not actionable for users.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    from longsft.train.curriculum import run

    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
