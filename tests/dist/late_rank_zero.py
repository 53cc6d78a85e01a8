"""An error every rank has, where rank 0 reaches it last: rank 0 still says it.

    torchrun --nproc_per_node=2 tests/dist/late_rank_zero.py

Rank 0 waits 2 s before failing; the other ranks fail at once, as a loaded machine can order them.
"""

import os
import sys
import time


def main() -> int:
    from longsft.launch.cli import _say_error
    from longsft.train.common.errors import ConfigError, same_on_every_rank

    if os.environ["RANK"] == "0":
        time.sleep(2)
    e = same_on_every_rank(ConfigError("late rank 0 says this"))
    _say_error(str(e), e, started=True)
    return e.exit_status()


if __name__ == "__main__":
    sys.exit(main())
