"""Rank 0 decides for every rank (``comm.decided_by_rank_zero``), and its errors reach them all.

    torchrun --nproc_per_node=N tests/dist/rank_zero.py OUT_DIR

Each rank writes OUT_DIR/rank<r>.json: what it got for a value every rank sees differently (its own
view of a shared filesystem), and what it raised when rank 0's decision failed.
"""

import json
import sys
from pathlib import Path


def main(out: str) -> None:
    from longsft.train.common.errors import ConfigError, is_same_on_every_rank
    from longsft.train.parallel import comm, distributed

    d = distributed.init(1)
    result = {"value": comm.decided_by_rank_zero(lambda: f"global_step{10 + d.rank}")}  # each rank's own view

    def fails():
        raise ConfigError(f"rank {d.rank} cannot read config.yaml")

    try:
        comm.decided_by_rank_zero(fails)
    except ConfigError as e:
        result["error"] = [str(e), is_same_on_every_rank(e)]
    Path(out, f"rank{d.rank}.json").write_text(json.dumps(result))
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
