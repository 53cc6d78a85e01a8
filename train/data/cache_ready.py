"""The token caches a run needs, ready on every rank: rank 0 checks and builds while the others wait and
share its error (``comm.decided_by_rank_zero``), the result visible on every node; ``longsft data prepare``
builds them ahead, in one process."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from longsft.train.common.errors import ConfigError
from longsft.train.config.schema import RunConfig, StageConfig
from longsft.train.data.token_cache import Split, TokenCache, cache_root, ensure, stage_splits
from longsft.train.parallel import comm


def build_workers() -> int:
    """Processes a rank may use to build: its node's ranks wait meanwhile, so one per local rank."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(local, len(os.sched_getaffinity(0))))


def ensure_all(cfg: RunConfig, tokenizer, stages: list[StageConfig] | None = None, log=None) -> dict[Split, Path]:
    """Every split of ``stages`` (default: all) cached, for a job's ranks: rank 0 checks and builds
    (with one worker per local rank) while the others wait; a bad row fails every rank with the
    same DataError, before any training. Returns split -> cache folder, on every rank."""
    splits = [s for st in (stages or cfg.stages) for s in stage_splits(cfg, st) if s is not None]
    root = cache_root(cfg)
    def prepare() -> dict:
        paths = {}
        for s in dict.fromkeys(splits):
            paths[s], what = ensure(s, tokenizer, root, build_workers(), progress=sys.stderr.isatty(), log=log)
            if what.startswith("rebuilt") and log is not None:
                log(f"{s.source}: {what}")
        return paths

    with comm.waiting_group() as group:  # made before rank 0 starts (a collective); its timeout outlasts a build
        paths = comm.decided_by_rank_zero(prepare, group=group)
    missing = [str(p) for p in paths.values() if not (p / "manifest.json").exists()]
    if any(comm.all_gather_objects(bool(missing))):
        raise ConfigError(f"the token cache {root} is not visible on every node ({missing[:1] or 'see rank 0'} is "
                          "missing on some): set data.cache_dir to a filesystem all nodes share, or run "
                          "`longsft data prepare` on each node first")
    return paths


def prepare(cfg: RunConfig, tokenizer, workers: int, log) -> list[dict]:
    """``longsft data prepare``: every split of every stage cached (one process, ``workers`` tokenizing);
    one record per split: stage, source, seq_len, what happened, path, samples, tokens, seconds."""
    out = []
    for stage in cfg.stages:
        for kind, split in zip(("train", "validation"), stage_splits(cfg, stage)):
            if split is None:
                continue
            t0 = time.time()
            path, what = ensure(split, tokenizer, cache_root(cfg), workers, progress=sys.stderr.isatty(), log=log)
            m = json.loads((path / "manifest.json").read_text())
            out.append({"stage": stage.name, "split": kind, "source": split.source, "seq_len": split.seq_len,
                        "what": what, "path": str(path), "samples": m["samples"], "tokens": m["tokens"],
                        "seconds": round(time.time() - t0, 3), "build_tokens_per_s": m["tokens_per_s"]})
    return out


def stage_data(cfg: RunConfig, stage: StageConfig, tokenizer,
               paths: dict[Split, Path] | None = None) -> tuple[TokenCache, TokenCache | None]:
    """(train cache, validation cache or None) of ``stage``: opened from ``paths`` (what :func:`ensure_all`
    returned for the run), else ensured now (every rank calls it)."""
    train, val = stage_splits(cfg, stage)
    if paths is None or train not in paths or (val is not None and val not in paths):
        paths = ensure_all(cfg, tokenizer, [stage])
    return TokenCache.open(paths[train]), TokenCache.open(paths[val]) if val else None
