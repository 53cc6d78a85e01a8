"""Model files checked before and while they are read: every command that reads a model (plan, train,
eval, serve) refuses a missing one at once and names the file at fault when one is cut off or corrupt,
in one line. :func:`check_model_source` before, :func:`reading_model` around each read (config,
tokenizer, weights)."""

from __future__ import annotations

import contextlib
import os
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path

from longsft.train.common.errors import ConfigError, DataError
from longsft.train.common.io import read_json, weights_source

MODEL_FILE_FIX = "the file is cut off or corrupt: copy or download it again"
# which files each read needs, checked in this order (the safetensors shards follow for "weights")
MODEL_FILES = {"config": ("config.json",), "weights": ("config.json", "model.safetensors.index.json"),
               "tokenizer": ("tokenizer_config.json", "tokenizer.json")}


def model_not_found(key: str, path: str) -> ConfigError:
    """The refusal of a model path that is not there: the same line from plan, train, eval and serve."""
    return ConfigError(f"{key}={path}: not found (no such folder or file here; a model is a local folder with "
                       "config.json, a .gguf file, or a Hugging Face hub id such as Qwen/Qwen3-8B)")


def looks_local(path: str) -> bool:
    """Whether ``path`` can only be a local path, never a hub id (``name`` or ``org/name``): it starts with
    ``/``, ``.`` or ``~``, ends with ``/``, has a ``\\`` or more than one ``/``, or its ``org`` is a local folder
    (``models/foo`` beside a ``models`` folder)."""
    if path.startswith(("/", ".", "~")) or path.endswith("/") or "\\" in path or path.count("/") > 1:
        return True
    return "/" in path and os.path.isdir(path.split("/")[0])


def hub_snapshot(repo_id: str) -> Path | None:
    """The local Hugging Face cache's folder of hub model ``repo_id`` (its config or tokenizer files are
    there), else None. Reads the cache only: no request to the hub."""
    from huggingface_hub import try_to_load_from_cache

    for name in ("config.json", "tokenizer_config.json", "tokenizer.json"):
        try:
            found = try_to_load_from_cache(repo_id, name)
        except ValueError:  # not a valid repo id
            return None
        if isinstance(found, str):
            return Path(found).parent
    return None


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set: transformers reads the local cache only."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def check_model_source(path: str, gguf_file: str | None = None, key: str = "model.path",
                       what: str | None = "weights") -> tuple[str, dict[str, str]]:
    """:func:`weights_source` of ``path``, refused now if it cannot be read: a path that looks local
    (:func:`looks_local`) and is not there, a hub id not in the local cache while ``HF_HUB_OFFLINE`` is
    set (it would fail only after the hub lookup), or a file that is cut off or corrupt
    (:func:`model_file_problem`: the files ``what`` needs; a GGUF file whatever ``what``). Reads headers
    only: milliseconds, never the weights. A hub id that is not cached is left to transformers to download
    (and of a cached one, online, only the config is checked: missing shards are downloaded).
    """
    where, extra = weights_source(path, gguf_file, key)
    folder: Path | None = Path(where)
    if not extra and not folder.exists():
        if looks_local(where):
            raise model_not_found(key, path)
        from huggingface_hub.utils import validate_repo_id

        try:
            validate_repo_id(where)
        except ValueError:
            raise model_not_found(key, path) from None
        folder = hub_snapshot(where)
        if folder is None and hub_offline():
            raise ConfigError(f"{key}={path}: not in the local Hugging Face cache, and HF_HUB_OFFLINE is set (no "
                              f"download): fetch it where there is network (hf download {where}) or give a local "
                              "folder")
        if what == "weights" and not hub_offline():
            what = "config"  # shards not cached yet are downloaded
    problem = model_file_problem(folder, extra.get("gguf_file"), what)
    if problem:
        raise ConfigError(problem)
    return where, extra


def model_file_problem(folder: Path | None, gguf: str | None = None, what: str | None = "weights") -> str | None:
    """The first file of the model in ``folder`` (or its GGUF file ``gguf``) that is cut off or corrupt, as
    one line naming it; None when every file ``what`` needs (:data:`MODEL_FILES`; ``"weights"``: the
    safetensors shards too) reads, or is not there (transformers says what is missing)."""
    if gguf:
        return gguf_problem(Path(gguf))
    if what is None or folder is None or not folder.is_dir():
        return None
    for name in MODEL_FILES[what]:
        if (folder / name).is_file() and (problem := json_problem(folder / name)):
            return problem
    if what != "weights":
        return None
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        shards = sorted({s for s in weight_map.values() if isinstance(s, str)}) if isinstance(weight_map, dict) else []
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            return f"{index}: names the shard {missing[0]}, which is not in {folder} (an interrupted copy or download?)"
    for shard in sorted(folder.glob("*.safetensors")):
        if problem := safetensors_problem(shard):
            return problem
    for shard in sorted(folder.glob("pytorch_model*.bin")):
        with shard.open("rb") as f:
            zipped = f.read(4) == b"PK\x03\x04"  # torch.save's zip format (older files are pickles)
        if zipped and not zipfile.is_zipfile(shard):
            return f"{shard}: not a complete zip archive (torch.save's format); {MODEL_FILE_FIX}"
    return None


def json_problem(path: Path) -> str | None:
    """``path`` as a JSON object, else one line naming it (and the line at fault)."""
    try:
        obj = read_json(path)
    except DataError as e:
        return f"{e}; {MODEL_FILE_FIX}"
    if not isinstance(obj, dict):
        return f"{path}: expected a JSON object, got {type(obj).__name__}; {MODEL_FILE_FIX}"
    return None


def safetensors_problem(path: Path) -> str | None:
    """``path`` as safetensors opens it (its header, and data that covers what the header lists), else one line."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except (SafetensorError, OSError) as e:
        return f"{path}: not a readable safetensors file ({_first_line(e)}); {MODEL_FILE_FIX}"
    return None


# GGUF metadata value types (gguf.GGUFValueType) of fixed size, in bytes; 8 is a string, 9 an array
_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_problem(path: Path) -> str | None:
    """``path`` as a whole GGUF file (header, metadata, tensor index, and tensor data to its last byte), else
    one line naming it. Walks the metadata without reading it (about 0.1 s where gguf's reader takes seconds)."""
    import mmap

    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                return f"{path}: not a complete GGUF file (cut off in its header, at {size} bytes); {MODEL_FILE_FIX}"
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                if m[:4] != b"GGUF":
                    return f"{path}: not a GGUF file (no GGUF magic number at its start); {MODEL_FILE_FIX}"
                need = _gguf_bytes(m)
    except OSError as e:
        return f"{path}: cannot be read ({e.strerror or e})"
    except struct.error:
        return f"{path}: not a complete GGUF file (cut off in its metadata, at {size} bytes); {MODEL_FILE_FIX}"
    except ValueError:  # a tensor or value type this gguf package does not know: left to the reader
        return None
    if need > size:
        return (f"{path}: not a complete GGUF file (its tensors end at byte {need}, the file has {size} bytes); "
                f"{MODEL_FILE_FIX}")
    return None


def _gguf_bytes(m) -> int:
    """The size a GGUF file (``m``: its bytes) must have: where its last tensor's data ends. struct.error
    where the metadata itself is cut off; ValueError for a type this gguf package does not know."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    order = "<" if struct.unpack_from("<I", m, 4)[0] & 0xFFFF else ">"  # a big-endian file reads 0 there
    pos = 24

    def take(fmt: str) -> tuple:
        nonlocal pos
        values = struct.unpack_from(order + fmt, m, pos)
        pos += struct.calcsize(order + fmt)
        return values

    def skip(kind: int) -> None:
        nonlocal pos
        if kind in _GGUF_SCALAR_BYTES:
            pos += _GGUF_SCALAR_BYTES[kind]
        elif kind == 8:
            (length,) = take("Q")
            pos += length
        elif kind == 9:
            item, count = take("IQ")
            if item in _GGUF_SCALAR_BYTES:
                pos += count * _GGUF_SCALAR_BYTES[item]
            else:
                for _ in range(count):
                    skip(item)
        else:
            raise ValueError(f"GGUF value type {kind}")
        if pos > len(m):
            raise struct.error("past the end")

    n_tensors, n_kv = struct.unpack_from(order + "QQ", m, 8)
    alignment = 32  # GGUF_DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        (length,) = take("Q")
        name = bytes(m[pos:pos + length])
        pos += length
        (kind,) = take("I")
        if name == b"general.alignment" and kind == 4:
            (alignment,) = take("I")
        else:
            skip(kind)
    end = 0
    for _ in range(n_tensors):
        (length,) = take("Q")
        pos += length  # the tensor's name
        (dims,) = take("I")
        shape = take(f"{dims}Q")
        kind, offset = take("IQ")
        block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        elements = 1
        for n in shape:
            elements *= n
        end = max(end, offset + elements // block * type_bytes)
    return -(-pos // max(alignment, 1)) * max(alignment, 1) + end


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _read_error(e: Exception) -> bool:
    """An error of reading files (missing, cut off, not the format expected), not a bug of the reader."""
    return isinstance(e, (OSError, ValueError, EOFError, struct.error)) or type(e).__name__ == "SafetensorError"


@contextlib.contextmanager
def reading_model(where: str, extra: dict | None = None, what: str = "weights") -> Iterator[None]:
    """Around one read of the model at ``where`` (a folder or hub id; ``extra``: :func:`weights_source`'s
    GGUF file) by transformers: what it raises becomes one ConfigError naming the file at fault
    (config.json, a safetensors shard, the GGUF file: :func:`model_file_problem` of the files ``what``
    needs), else, for an error of reading, the model with the reader's first line. Other errors pass."""
    try:
        yield
    except (ConfigError, DataError):
        raise
    except Exception as e:
        gguf = (extra or {}).get("gguf_file")
        folder = Path(where) if Path(where).exists() else (None if gguf or looks_local(where) else hub_snapshot(where))
        problem = model_file_problem(folder, gguf, what)
        if problem is None and not _read_error(e):
            raise
        raise ConfigError(problem or f"{gguf or where}: cannot read the model's {what} ({type(e).__name__}: "
                                     f"{_first_line(e)})") from None
