"""Host memory of the data one rank holds in a stage, for the planner (``bench/data_cache.py`` measures the
constants): per sample, the index entry, its metadata and their Python objects; per token of a micro-batch
row, the ids read from the cache (uint32) and collate's five int64 tensors."""

from __future__ import annotations

from longsft.train.common.errors import DataError
from longsft.train.config.schema import RunConfig, StageConfig
from longsft.train.data.sources import open_source
from longsft.train.data.token_cache import stage_splits

HOST_BYTES_PER_SAMPLE = 1024
HOST_BYTES_PER_BATCH_TOKEN = 4 + 5 * 8


def host_bytes(cfg: RunConfig, stage: StageConfig) -> tuple[float, int | None]:
    """(bytes of data one rank holds in ``stage``, samples counted; None when a source is not there yet)."""
    n = 0
    for split in stage_splits(cfg, stage):
        if split is None:
            continue
        try:
            n += len(open_source(split.source))
        except DataError:
            return cfg.optim.micro_batch_size * stage.seq_len * HOST_BYTES_PER_BATCH_TOKEN, None
    return n * HOST_BYTES_PER_SAMPLE + cfg.optim.micro_batch_size * stage.seq_len * HOST_BYTES_PER_BATCH_TOKEN, n
