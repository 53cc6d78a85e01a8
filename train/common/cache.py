"""The one append-only cache: records by key in a JSONL log, so an interrupted job resumes without
asking again. Used for LLM answers (data construction), generations (``longsft eval``, ConStory)
and judge answers (ConStory)."""

from __future__ import annotations

import threading
from pathlib import Path

from longsft.train.common.io import JsonlLog, iter_jsonl


class AppendCache:
    """Records ``{"key": ..., ...}`` in ``path`` (JSONL; ``None``: in memory only).

    A record is *good* unless its ``error`` is set. Per key, :meth:`get` gives the newest good
    record and :meth:`latest` the newest good one or, failing that, the newest failed one: a
    failure is kept for the report but asked again on the next run. Lines cut off by a crash
    are skipped; nothing is written until the first :meth:`put`.
    """

    def __init__(self, path: str | Path | None):
        self.good: dict[str, dict] = {}
        self.failed: dict[str, dict] = {}
        self.added = 0
        self.log = JsonlLog(path) if path is not None else None
        self._lock = threading.Lock()  # puts from several threads (data mma's concurrency) stay whole lines
        for _, rec in iter_jsonl(path, log=True) if path is not None else ():
            if "key" in rec:
                self._keep(rec)

    def _keep(self, rec: dict) -> None:
        (self.failed if rec.get("error") else self.good)[rec["key"]] = rec

    def get(self, key: str) -> dict | None:
        return self.good.get(key)

    def latest(self, key: str) -> dict | None:
        return self.good.get(key) or self.failed.get(key)

    def put(self, rec: dict) -> None:
        with self._lock:
            self._keep(rec)
            self.added += 1
            if self.log is not None:
                self.log.write(rec)

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
