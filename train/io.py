"""File helpers: JSONL with file:line errors, atomic writes. Nothing the user had is lost."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


class DataError(ValueError):
    """Bad input data; the message names the file and line."""


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    """Yield (line_number, record) for each non-blank line; malformed lines raise DataError."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: file not found")
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(rec, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            yield lineno, rec


def read_jsonl(path: str | Path) -> list[dict]:
    return [rec for _, rec in iter_jsonl(path)]


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write via a temp file in the same folder + fsync + rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def read_log(path: str | Path):
    """Records of an append-only JSONL log; a line cut off by a crash is skipped, not an error."""
    if not Path(path).exists():
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                yield json.loads(line)
            except ValueError:
                continue


def write_jsonl(path: str | Path, records: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def replace_dir(tmp: Path, final: Path) -> None:
    """Swap a fully written ``tmp`` folder into ``final``; the old one is removed only after.

    A crash at any point leaves either the old or the new folder under a recoverable name
    (``final``, ``final.old`` or ``tmp``); :func:`recover_dir` restores ``final``.
    """
    old = final.with_name(final.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)


def recover_dir(final: Path) -> None:
    """Undo a swap interrupted by a crash: bring ``final.old`` back if ``final`` is missing."""
    old = final.with_name(final.name + ".old")
    if not final.exists() and old.exists():
        os.replace(old, final)
