"""Stop requests: checkpoint at the next step and exit, so that a job can requeue itself.

A stop is requested by ``SIGUSR1`` to any rank, or by creating ``<run_dir>/STOP`` (what the
sbatch scripts do when SLURM signals the batch shell before the time limit: torchrun does not
forward ``SIGUSR1`` to its workers). Ranks agree at step boundaries with one all-reduce, so every
rank saves the same step.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from longsft.train.common.errors import LongsftError
from longsft.train.parallel import comm

STOP_FILE = "STOP"
EXIT_STOPPED = 75  # EX_TEMPFAIL: checkpointed, run the same command again to continue


class StopRequested(LongsftError, RuntimeError):
    """The run checkpointed and stopped on request; rerunning the same command resumes it. Exit status
    :data:`EXIT_STOPPED`, but 0 under torchrun (which would report 75 as a failure; ``longsft status`` tells)."""

    def exit_status(self) -> int:
        return 0 if "TORCHELASTIC_RUN_ID" in os.environ else EXIT_STOPPED


class StopRequests:
    """Watches for a stop request; :meth:`requested` is collective (call it on every rank).

    Ctrl-C (SIGINT) and SIGTERM are stop requests too: the run checkpoints at the end of the
    current step and exits with one line. A second Ctrl-C more than ``GRACE_S`` after the first
    quits at once (torchrun forwards the terminal's Ctrl-C a second time within that window).
    """

    GRACE_S = 2.0

    def __init__(self, run_dir: Path, is_main: bool):
        self.path, self.is_main = Path(run_dir) / STOP_FILE, is_main
        self._signalled = False
        self._interrupted_at: float | None = None
        self._previous = {}
        for sig, handler in ((signal.SIGUSR1, self._on_signal), (signal.SIGTERM, self._on_signal),
                             (signal.SIGINT, self._on_interrupt)):
            try:
                self._previous[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread (e.g. inside a test harness): the file still works
                pass

    def close(self) -> None:
        """Give the signals back to whoever had them."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum, frame) -> None:
        self._signalled = True

    def _on_interrupt(self, signum, frame) -> None:
        now = time.monotonic()
        if self._interrupted_at is None:
            self._interrupted_at, self._signalled = now, True
            if self.is_main:
                print("\nlongsft: interrupted: saving a checkpoint at the end of this step (Ctrl-C again to quit "
                      "without saving)", file=sys.stderr, flush=True)
        elif now - self._interrupted_at > self.GRACE_S:
            self.close()
            raise KeyboardInterrupt

    def requested(self) -> bool:
        local = self._signalled or (self.is_main and self.path.exists())
        return bool(comm.max_over_ranks(int(local)))

    def consume(self) -> None:
        """Forget the request once acted on (the file too), so that the resumed run trains on."""
        self._signalled = False
        if self.is_main:
            self.path.unlink(missing_ok=True)
