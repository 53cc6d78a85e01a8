"""Tokenize once: a stage's training and validation samples, encoded into an on-disk cache that every
rank memory-maps (holding only the rows it trains on) and every resume or requeue finds.

A cache is one folder, named by the fingerprint of everything that changes its tokens (the source's
bytes, the tokenizer and its chat template, the prompt texts and variant, ``seq_len``, the overflow
policy, :data:`~longsft.train.data.encoding.ENCODING_VERSION`)::

    tokens.bin     every kept sample's ids end to end: uint32 [total tokens]
    index.npy      int64 [samples, 4]: offset, length, prompt_len, truncated (labels: the ids after prompt_len)
    meta.jsonl     per sample: source row, id, language, gold_score, types, bucket, source
    manifest.json  the fingerprint's inputs, counts, stats, each file's size and sha256 (written last)

It is built in a ``.tmp-*`` folder beside it and renamed into place, so a folder under its final
name is whole; its checksums are checked before use, and one that fails them is removed and rebuilt.
Nothing is unpickled: the index is read with ``allow_pickle=False``, the rest is JSON."""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
import uuid
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from longsft.train.common.errors import ConfigError, DataError
from longsft.train.common.io import cache_dir, sha256_file
from longsft.train.config.schema import RunConfig, StageConfig
from longsft.train.data.encoding import ENCODING_VERSION, Encoded, EncodeStats, Meta, encode
from longsft.train.data.prompts import template_digest
from longsft.train.data.schema import check_unique, read_sample
from longsft.train.data.sources import Source, open_source, selector

FILES = ("tokens.bin", "index.npy", "meta.jsonl")


POOL_MIN_BYTES = 8 << 20  # smaller sources are tokenized in process


@dataclass(frozen=True)
class Split:
    """One tokenized set: a samples source encoded at ``seq_len`` with one prompt and overflow policy."""

    source: str
    seq_len: int
    prompt: str
    overflow: str


def cache_root(cfg: RunConfig) -> Path:
    return Path(cfg.data.cache_dir) if cfg.data.cache_dir else cache_dir() / "tokens"


def stage_files(cfg: RunConfig, stage: StageConfig) -> tuple[str, str]:
    """(train, validation) sources of ``stage``: the sample set in the run dir, or the recipe's."""
    if cfg.data.source == "sample":
        root = cfg.run_path / "data" / stage.bucket
        return str(root / "train.jsonl"), str(root / "validation.jsonl")
    return (cfg.data.train_file.format(bucket=stage.bucket, split="train"),
            cfg.data.validation_file.format(bucket=stage.bucket, split="validation"))


def stage_splits(cfg: RunConfig, stage: StageConfig) -> tuple[Split, Split | None]:
    """The stage's training split and its validation split (None: the stage does not validate).

    Validation prompts are encoded ``validation.max_new_tokens`` shorter: they leave room for the
    generated judgement.
    """
    train, val = stage_files(cfg, stage)
    t = Split(train, stage.seq_len, cfg.data.prompt, stage.overflow)
    v = Split(val, stage.seq_len - cfg.validation.max_new_tokens, cfg.data.prompt, stage.overflow)
    return t, v if stage.validate else None


_VOCAB_DIGESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> sha256 of its definition


def tokenizer_digest(tokenizer) -> str:
    """sha256 of the tokenizer's full definition (vocabulary, merges, added tokens) and chat template."""
    template = json.dumps([tokenizer.chat_template, tokenizer.eos_token_id], sort_keys=True)
    if tokenizer not in _VOCAB_DIGESTS:  # an object's vocabulary does not change; its template may
        backend = getattr(tokenizer, "backend_tokenizer", None)
        definition = backend.to_str() if backend is not None else json.dumps(  # a slow (Python) tokenizer
            [sorted(tokenizer.get_vocab().items()), str(tokenizer.added_tokens_decoder), tokenizer.init_kwargs],
            default=str)
        _VOCAB_DIGESTS[tokenizer] = hashlib.sha256(definition.encode()).hexdigest()
    return hashlib.sha256((_VOCAB_DIGESTS[tokenizer] + template).encode()).hexdigest()


def fingerprint_inputs(split: Split, src: Source, tokenizer) -> dict:
    return {"encoding_version": ENCODING_VERSION, "source": split.source, "source_sha256": src.digest(),
            "source_selector": selector(split.source), "source_rows": len(src),
            "tokenizer_sha256": tokenizer_digest(tokenizer), "prompt_texts_sha256": template_digest(),
            "prompt": split.prompt, "seq_len": split.seq_len, "overflow": split.overflow}


def fingerprint(inputs: dict) -> str:
    """The cache folder's name; the source's name is not part of it (moved data keeps its cache)."""
    key = {k: v for k, v in inputs.items() if k != "source"}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


@dataclass
class TokenCache:
    """An opened cache: ``items`` view into the memory-mapped ``tokens.bin`` (nothing is copied)."""

    path: Path
    items: list[Encoded]
    rows: list[int]  # each item's row in its source
    stats: EncodeStats

    @classmethod
    def open(cls, path: Path) -> TokenCache:
        manifest = json.loads((path / "manifest.json").read_text())
        index = np.load(path / "index.npy", allow_pickle=False)
        tokens = (np.memmap(path / "tokens.bin", dtype=np.uint32, mode="r") if manifest["tokens"]
                  else np.zeros(0, dtype=np.uint32))
        items, rows = [], []
        with (path / "meta.jsonl").open(encoding="utf-8") as f:
            for (off, n, prompt_len, truncated), line in zip(index.tolist(), f, strict=True):
                m = json.loads(line)
                rows.append(m.pop("row"))
                items.append(Encoded(Meta(**{**m, "types": tuple(m["types"])}), tokens[off:off + n], prompt_len,
                                     bool(truncated)))
        return cls(path, items, rows, EncodeStats(**manifest["stats"]))

    def first(self, n_rows: int = 0) -> tuple[list[Encoded], EncodeStats]:
        """The items of the source's first ``n_rows`` rows (``validation.max_samples``; 0: all), with their stats."""
        if n_rows <= 0:
            return self.items, self.stats
        keep = [e for e, r in zip(self.items, self.rows) if r < n_rows]
        st = EncodeStats(total=min(n_rows, self.stats.total), kept=len(keep),
                         truncated=sum(e.truncated for e in keep), max_len=max((len(e.input_ids) for e in keep), default=0))
        st.skipped = st.total - st.kept
        return keep, st


class CacheUnreadable(ConfigError):
    """The cache's files cannot be read (an I/O error, permissions): neither used nor removed."""


def verify(path: Path) -> str | None:
    """Why the cache at ``path`` cannot be used (None: it is whole and matches its checksums).

    An I/O error other than a missing file raises :class:`CacheUnreadable`: the folder may be fine.
    """
    try:
        return _check(path)
    except OSError as e:
        raise CacheUnreadable(f"token cache {path}: cannot read it ({e}); fix the filesystem or set "
                              "data.cache_dir elsewhere") from None


def _check(path: Path) -> str | None:
    try:
        manifest = json.loads((path / "manifest.json").read_text())
        for name in FILES:
            f = path / name
            size, want = manifest["files"][name]["bytes"], manifest["files"][name]["sha256"]
            if f.stat().st_size != size:
                return f"{name} has {f.stat().st_size} bytes, the manifest says {size}"
            if sha256_file(f) != want:
                return f"{name} does not match its checksum"
    except FileNotFoundError as e:
        return f"{Path(e.filename).name} is missing"
    except (ValueError, KeyError, TypeError) as e:
        return f"unreadable manifest ({e})"
    return None


_WORK: tuple | None = None  # (source, tokenizer, split) of a build worker process


def _init_worker(source: Source, tokenizer, split: Split, pool: bool = True) -> None:
    global _WORK
    if pool:  # one core per worker process
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORK = (source, tokenizer, split)


def _encode_rows(rows: range) -> list[tuple[int, str, Encoded | None]]:
    """(row, where, encoded or None when skipped) of each row, checked as :func:`load_samples` does."""
    source, tokenizer, split = _WORK
    out = []
    for i in rows:
        where, s = read_sample(source, i)
        e = encode(s, tokenizer, split.seq_len, split.prompt, split.overflow)
        if e is not None:
            e.input_ids = np.asarray(e.input_ids, dtype=np.uint32)
        out.append((i, where, e))
    return out


def _chunks(n: int, workers: int) -> list[range]:
    size = max(1, min(32, n // (8 * workers)))
    return [range(a, min(n, a + size)) for a in range(0, n, size)]


def _pool_size(source: Source, workers: int) -> int:
    """``workers``, or 1 (in process) for a source of a few MB: a pool takes seconds to start."""
    big = len(source) >= 2 * workers and sum(f.stat().st_size for f in source.files()) > POOL_MIN_BYTES
    return workers if big else 1


def build(split: Split, source: Source, tokenizer, dest: Path, inputs: dict, workers: int = 1,
          progress: bool = False) -> dict:
    """Encode every row of ``source`` into a new cache at ``dest`` (``workers`` processes); returns the manifest.

    A bad row raises a DataError naming it, and nothing is left behind.
    """
    if len(source) == 0:
        raise DataError(f"{split.source}: no samples")
    tmp = dest.parent / f".tmp-{dest.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)  # beside dest: the final rename stays on one filesystem
    t0 = time.time()
    try:
        stats, index, seen, n_tokens = EncodeStats(), [], {}, 0
        digests = {"tokens.bin": hashlib.sha256(), "meta.jsonl": hashlib.sha256()}  # while written
        bar = _progress_bar(len(source), split.source) if progress else None
        with (tmp / "tokens.bin").open("wb") as tok_f, (tmp / "meta.jsonl").open("wb") as meta_f:
            for part in _encoded_parts(split, source, tokenizer, workers):
                for row, where, e in part:
                    stats.add(e)
                    if e is None:
                        continue
                    check_unique(e.meta.id, where, seen)
                    _write(tok_f, e.input_ids.tobytes(), digests["tokens.bin"])
                    index.append((n_tokens, len(e.input_ids), e.prompt_len, int(e.truncated)))
                    n_tokens += len(e.input_ids)
                    meta = json.dumps({"row": row, **asdict(e.meta)}, ensure_ascii=False) + "\n"
                    _write(meta_f, meta.encode(), digests["meta.jsonl"])
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix_str(f"{n_tokens / max(time.time() - t0, 1e-9) / 1e6:.2f}M tokens/s", refresh=False)
                if bar is not None:
                    bar.update(sum(e is None for _, _, e in part))
            for f in (tok_f, meta_f):
                f.flush()
                os.fsync(f.fileno())
        if bar is not None:
            bar.close()
        np.save(tmp / "index.npy", np.asarray(index, dtype=np.int64).reshape(-1, 4), allow_pickle=False)
        digests["index.npy"] = hashlib.sha256((tmp / "index.npy").read_bytes())
        seconds = time.time() - t0
        manifest = {"fingerprint": dest.name, "inputs": inputs, "samples": stats.kept, "tokens": n_tokens,
                    "stats": asdict(stats), "build_seconds": round(seconds, 3), "workers": workers,
                    "tokens_per_s": round(n_tokens / max(seconds, 1e-9)),
                    "files": {name: {"bytes": (tmp / name).stat().st_size, "sha256": digests[name].hexdigest()}
                              for name in FILES}}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False))
        for name in ("index.npy", "manifest.json", "."):  # the data files were synced as they closed
            _fsync(tmp / name)
        tmp.rename(dest)
        _fsync(dest.parent)
        return manifest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _encoded_parts(split: Split, source: Source, tokenizer, workers: int):
    """Encoded rows in source order, chunk by chunk (in a pool of ``workers`` processes when worth it)."""
    chunks = _chunks(len(source), workers)
    if workers <= 1:
        _init_worker(source, tokenizer, split, pool=False)
        yield from map(_encode_rows, chunks)
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    # spawn, not fork: the parent may hold torch and process-group threads. A worker that dies (the
    # OOM killer) fails the build (BrokenProcessPool) instead of leaving it waiting.
    with ProcessPoolExecutor(workers, mp.get_context("spawn"), _init_worker, (source, tokenizer, split)) as pool:
        ahead = collections.deque()  # a few chunks in flight: results do not pile up in memory
        for chunk in chunks:
            ahead.append(pool.submit(_encode_rows, chunk))
            if len(ahead) >= 2 * workers:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()


def _progress_bar(total: int, what: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=f"tokenizing {what}", unit="sample", file=sys.stderr, mininterval=2)


def _write(f, data: bytes, digest) -> None:
    f.write(data)
    digest.update(data)


def _fsync(path: Path) -> None:
    """Flush a file's or a folder's entries to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_VERIFIED: dict[tuple, Path] = {}  # (split, tokenizer, root, source stat) -> a cache checked in this process


def ensure(split: Split, tokenizer, root: Path, workers: int = 1, progress: bool = False,
           log=None) -> tuple[Path, str]:
    """The path of ``split``'s cache under ``root``, built when missing or damaged; and what happened
    ("found", "built" or "rebuilt: why"). One process; see :func:`ensure_all` for a job's ranks."""
    source = open_source(split.source)
    stat_key = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in source.files())
    memo = (split, tokenizer_digest(tokenizer), str(root), stat_key)
    if memo in _VERIFIED and (_VERIFIED[memo] / "manifest.json").exists():
        return _VERIFIED[memo], "found"
    inputs = fingerprint_inputs(split, source, tokenizer)
    path = root / fingerprint(inputs)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"token cache folder {root}: cannot make it ({e.strerror}); set data.cache_dir to a "
                          "folder this job may write") from None
    # one builder per cache: jobs sharing data.cache_dir (a sweep's tasks) wait, then find it built
    with _locked(root / f".lock-{path.name}"):
        what = "found"
        if path.exists():
            why = verify(path)
            if why is not None:  # set aside, not deleted: another job may still have it mapped
                path.rename(root / f".damaged-{path.name}-{uuid.uuid4().hex[:8]}")
                what = f"rebuilt: the cache was damaged ({why})"
        else:
            what = "built"
        if what != "found":
            for stale in root.glob(f".tmp-{path.name}-*"):  # a builder that was killed (we hold the lock)
                shutil.rmtree(stale, ignore_errors=True)
            workers = _pool_size(source, workers)
            m = build(split, source, tokenizer, path, inputs, workers, progress)
            if log is not None:
                log(f"tokenized {split.source} (seq_len {split.seq_len}): {m['samples']} samples, {m['tokens']:,} "
                    f"tokens in {m['build_seconds']:.1f} s ({m['tokens_per_s'] / 1e6:.2f}M tokens/s, {workers} "
                    f"worker(s)) -> {path}")
    _VERIFIED[memo] = path
    return path, what


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive kernel lock (flock) on ``path`` while the block runs; a killed holder frees it."""
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
