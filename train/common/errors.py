"""The errors a user sees as one line, each with its exit status: one base, :class:`LongsftError`, so that the
command line has one ``except`` for them (bad configuration and bad input data exit 2; the training loop's
own, in ``train/training``, 3 or the stop status)."""


class LongsftError(Exception):
    """An error the command line says in one line (no traceback) and exits with :meth:`exit_status`."""

    exit_code = 2

    def exit_status(self) -> int:
        return self.exit_code


class ConfigError(LongsftError, ValueError):
    """A recipe or override is invalid; the message names the key and where it came from."""


class DataError(LongsftError, ValueError):
    """Bad input data; the message names the file and line."""


def same_on_every_rank(e: BaseException) -> BaseException:
    """Mark ``e`` as an error every rank of the job raises alike (rank 0's, shared with the others, or one
    decided from what every rank knows): the CLI says it once, on rank 0. Returns ``e``."""
    e.same_on_every_rank = True
    return e


def is_same_on_every_rank(e: BaseException) -> bool:
    return getattr(e, "same_on_every_rank", False)


def this_rank_only(e: BaseException) -> BaseException:
    """Mark ``e`` as an error of this rank alone (a failed save, a GPU this rank lacks): the CLI says it on
    this rank, whichever it is. Returns ``e``."""
    e.this_rank_only = True
    return e


def is_this_rank_only(e: BaseException) -> bool:
    return getattr(e, "this_rank_only", False)
