"""Where samples are read from, by row: every reader of samples goes through :func:`open_source`.

- ``*.jsonl``: one JSON object per line (errors name ``file:line``);
- ``*.json``: a JSON array of objects, or JSON lines;
- ``*.parquet``: a Parquet file;
- a folder written by ``datasets``' ``save_to_disk`` (a ``DatasetDict`` folder needs ``#SPLIT``);
- ``hf:NAME[:CONFIG]#SPLIT``: a dataset already in the local Hugging Face cache (never downloaded).

Errors in a row name ``source: row N`` (1-based) for the non-line formats. ``digest()`` hashes
the source's bytes: the token cache's fingerprint.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from pathlib import Path

import numpy as np

from longsft.train.common.errors import DataError
from longsft.train.common.io import check_input_file, loads, read_json, sha256_file

BLOCK = 4 << 20  # bytes scanned for line ends at a time (the temporary stays small and is given back)


class Source:
    """Random access to a samples source's raw records (dicts)."""

    name: str

    def __len__(self) -> int:
        raise NotImplementedError

    def get(self, i: int) -> tuple[str, dict]:
        """('where' for errors, record) of row ``i`` (0-based)."""
        raise NotImplementedError

    def files(self) -> list[Path]:
        """The files whose bytes are the source (for :meth:`digest`)."""
        raise NotImplementedError

    def digest(self) -> str:
        h = hashlib.sha256()
        for f in self.files():
            h.update(f.name.encode() + b"\0" + sha256_file(f).encode())
        return h.hexdigest()

    def __iter__(self):
        for i in range(len(self)):
            yield self.get(i)

    def _record(self, rec, where: str) -> dict:
        if not isinstance(rec, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        return rec


class JsonlSource(Source):
    """One object per non-blank line; rows are found by their byte offsets (no parse up front)."""

    def __init__(self, path: Path):
        self.path, self.name = check_input_file(path), str(path)
        with self.path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                self.starts = self.ends = self.lines = np.zeros(0, dtype=np.int64)
                return
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        with m:  # line ends found in blocks: no file-sized temporary
            nl = np.concatenate([np.flatnonzero(np.frombuffer(m, np.uint8, min(BLOCK, size - a), a) == 10) + a
                                 for a in range(0, size, BLOCK)])
            ends = np.append(nl, size) if (nl.size == 0 or nl[-1] != size - 1) else nl
            starts = np.concatenate([[0], ends[:-1] + 1])
            lines = np.arange(1, len(starts) + 1)
            keep = ends > starts
            # a record starts with "{": any other line may be blank (spaces, \r, U+3000), skipped as before
            first = np.frombuffer(m, np.uint8)[np.minimum(starts, size - 1)]
            for j in np.flatnonzero(keep & (first != ord("{"))):
                keep[j] = bool(m[starts[j]:ends[j]].decode("utf-8", errors="replace").strip())
        self.starts, self.ends, self.lines = starts[keep], ends[keep], lines[keep]
        self._fh = None

    def __len__(self) -> int:
        return len(self.starts)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_fh"}

    def __setstate__(self, state):
        self.__dict__.update(state, _fh=None)

    def get(self, i: int) -> tuple[str, dict]:
        where = f"{self.path}:{self.lines[i]}"
        if self._fh is None:
            self._fh = self.path.open("rb")
        self._fh.seek(int(self.starts[i]))
        raw = self._fh.read(int(self.ends[i] - self.starts[i]))
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{where}: not UTF-8 text (byte {raw[e.start]:#04x}); is it a binary file?") from None
        return where, self._record(loads(text, where), where)

    def files(self) -> list[Path]:
        return [self.path]


class RowsSource(Source):
    """Rows of a list (a JSON array) or a ``datasets.Dataset`` (memory-mapped: pickles by its files)."""

    def __init__(self, name: str, rows, files: list[Path]):
        self.name, self._rows, self._files = name, rows, files

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, i: int) -> tuple[str, dict]:
        where = f"{self.name}: row {i + 1}"
        return where, self._record(self._row(i), where)

    def _row(self, i: int):
        return self._rows[i]

    def files(self) -> list[Path]:
        return self._files


class ParquetSource(RowsSource):
    """A Parquet file, memory-mapped; a worker process reopens it rather than receive the table."""

    def __init__(self, path: Path):
        super().__init__(str(path), self._open(path), [path])

    @staticmethod
    def _open(path: Path):
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path, memory_map=True)
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
            raise DataError(f"{path}: not a readable Parquet file ({e})") from None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_rows"}

    def __setstate__(self, state):
        self.__dict__.update(state, _rows=self._open(state["_files"][0]))

    def _row(self, i: int) -> dict:
        return self._rows.slice(i, 1).to_pylist()[0]


def _json_source(path: Path) -> Source:
    with path.open("rb") as f:
        head = f.read(4096).lstrip()
    if not head.startswith(b"["):
        return JsonlSource(path)
    rows = read_json(path)
    if not isinstance(rows, list):
        raise DataError(f"{path}: expected a JSON array of samples, got {type(rows).__name__}")
    return RowsSource(str(path), rows, [path])


def _dataset_source(name: str, ds, split: str | None) -> Source:
    import datasets

    if isinstance(ds, datasets.DatasetDict):
        if split is None or split not in ds:
            raise DataError(f"{name}: holds splits {sorted(ds)}; name one as {name.split('#')[0]}#SPLIT")
        ds = ds[split]
    elif split is not None:
        raise DataError(f"{name}: a single dataset, not a DatasetDict: drop '#{split}'")
    files = sorted({Path(f["filename"]) for f in ds.cache_files})
    if not files:
        raise DataError(f"{name}: an in-memory dataset without files; save it with save_to_disk first")
    return RowsSource(name, ds, files)


def open_source(spec: str | Path) -> Source:
    """The source ``spec`` names (see the module docstring); a DataError when it cannot be read."""
    text = str(spec)
    if text.startswith("hf:"):
        return _hub_source(text)
    # FOLDER#SPLIT, unless the whole text names a file or folder ('#' may be part of a name)
    path, _, split = ("", "", "") if Path(text).exists() else text.rpartition("#")
    p = Path(path or text)
    if p.is_dir():
        import datasets

        try:
            ds = datasets.load_from_disk(str(p))
        except FileNotFoundError as e:
            raise DataError(f"{p}: a folder, but not one written by datasets' save_to_disk ({e})") from None
        return _dataset_source(text, ds, split or None)
    p = check_input_file(p)
    if split:
        raise DataError(f"{text}: '#{split}' selects a split of a save_to_disk folder; {p} is a file")
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        return ParquetSource(p)
    if suffix == ".json":
        return _json_source(p)
    return JsonlSource(p)


def _hub_source(text: str) -> Source:
    """``hf:NAME[:CONFIG]#SPLIT`` from the local HF datasets cache, offline."""
    import datasets

    name, _, split = text[3:].partition("#")
    repo, _, config = name.partition(":")
    if not repo or not split:
        raise DataError(f"{text}: write a cached Hugging Face dataset as hf:NAME[:CONFIG]#SPLIT")
    datasets.config.HF_HUB_OFFLINE = True  # never download at run time
    try:
        ds = datasets.load_dataset(repo, config or None, split=split)
    except (OSError, ValueError) as e:  # datasets: DatasetNotFoundError (an OSError), ConnectionError, ValueError
        raise DataError(f"{text}: not in the local Hugging Face datasets cache ({str(e).splitlines()[0]}); "
                        "load it once on a machine with network, or save it with save_to_disk") from None
    return _dataset_source(text, ds, None)


def selector(spec: str | Path) -> str:
    """What picks the rows out of the source's files (a split, a dataset name): part of the cache key."""
    text = str(spec)
    if text.startswith("hf:"):
        return text
    return "" if Path(text).exists() else text.rpartition("#")[2]

