"""The wall time a resumable benchmark run spent, over every allocation it took.

``bench/learn.py`` and ``bench/table5_mini.py`` keep each finished phase's seconds in their working
folder's ``wall.json`` (a rerun adds to them). A run stopped by SIGTERM (``bench/gpu_learn.sh``'s
``LIMIT``) loses the phase it was in: the next run starts it over or resumes it, and only that run's part
would be counted. :func:`count_cut_off` adds the stopped phase's seconds to the entry ``cut_off``, so
that the phases and ``cut_off`` together are all the time the run took.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

CUT_OFF = "cut_off"


def write_wall(wall_file: Path, wall: dict[str, float]) -> None:
    """Replace ``wall_file`` whole with ``wall`` (a signal or a snapshot never meets it half written)."""
    tmp = wall_file.with_name(wall_file.name + ".tmp")
    tmp.write_text(json.dumps(wall))
    os.replace(tmp, wall_file)


def count_cut_off(wall_file: Path, mark: Callable[[], float]) -> None:
    """On SIGTERM, add the seconds since ``mark()`` (the last finished phase's end, ``time.time()``) to
    ``wall_file``'s ``cut_off``, then end as SIGTERM ends the process by default (the signal's status: the
    children the signal also reached, a trainer saving its checkpoint, are left to finish)."""

    def stopped(signum: int, frame) -> None:
        try:
            wall = json.loads(wall_file.read_text()) if wall_file.exists() else {}
            wall[CUT_OFF] = wall.get(CUT_OFF, 0) + time.time() - mark()
            write_wall(wall_file, wall)
        except (OSError, ValueError):  # (not counted: the process still ends by the signal, files whole)
            pass
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, stopped)
