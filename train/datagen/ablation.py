"""``longsft data ablation``: the Table 5 training sets from one tagged dataset.

Input: samples (the richer form) with ``bucket`` and ``source`` (``human``, ``mma``, ``erhg``).
Output, under ``--out``::

    heldout/<bucket>/validation.jsonl, test.jsonl      identical for every variant
    <variant>_<size>/<bucket>/train.jsonl              one training set per variant and size
    manifest.json                                      counts per set, bucket, source and label; inputs
    table5.sweep                                       one line per training set, for launch/slurm/array.sbatch

Choices (the paper states the variants, not these mechanics):

- held-out samples are drawn per (bucket, language, label), whole *articles* at a time: every
  sample made from one article (its human summary, MMA summaries, ERHG perturbations) lands in
  the same split, so no article is seen in training and then tested;
- variants: ``mma_only`` trains on human + MMA samples, ``mma_erhg`` (the paper's full data) on
  human + MMA + ERHG; the untrained base model of Table 5 needs no set;
- sizes are nested per variant (the 1000-sample set is the start of the 2000-sample set) and drawn
  stratified by bucket, so variants differ in data source and not in size or length mix.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter, defaultdict
from pathlib import Path

from longsft.train.common.errors import DataError
from longsft.train.common.io import (
    atomic_write_json,
    atomic_write_text,
    check_input_file,
    check_output_dir,
    iter_jsonl,
    safe_name,
)
from longsft.train.data.schema import check_sample

SOURCES = ("human", "mma", "erhg")
VARIANTS = {"mma_only": ("human", "mma"), "mma_erhg": ("human", "mma", "erhg")}


def read_tagged(paths: list[str | Path]) -> list[dict]:
    """Records with bucket, source, gold_score and an article, each checked as training data (the
    sets are training data); errors name file and line. All inputs are checked before any is read."""
    for path in paths:
        check_input_file(path)
    out, seen = [], {}
    for path in paths:
        for lineno, rec in iter_jsonl(path):
            where = f"{path}:{lineno}"
            for key in ("id", "bucket", "source", "article", "summary", "gold_score", "language"):
                if key not in rec:
                    raise DataError(f"{where}: missing field {key!r} (ablation sets need tagged samples)")
            check_sample(rec, where)
            safe_name(rec["bucket"], f"{where}: bucket")
            if rec["source"] not in SOURCES:
                raise DataError(f"{where}: source {rec['source']!r} is not one of {list(SOURCES)}")
            if rec["id"] in seen:
                raise DataError(f"{where}: duplicate id {rec['id']!r} (also at {seen[rec['id']]})")
            seen[rec["id"]] = where
            out.append(rec)
    if not out:
        raise DataError(f"{', '.join(map(str, paths))}: no samples")
    return out


def article_key(rec: dict) -> str:
    return hashlib.sha1(rec["article"].encode()).hexdigest()


def split_heldout(recs: list[dict], n_val: int, n_test: int, seed: int) -> tuple[set, set]:
    """Article keys for validation and test: per bucket, ``n_val``/``n_test`` articles each,
    balanced over (language, hallucinated?) of the article's human-or-first sample."""
    by_bucket: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in recs:
        by_bucket[r["bucket"]][article_key(r)].append(r)
    val, test = set(), set()
    rng = random.Random(seed)
    for bucket in sorted(by_bucket):
        arts = by_bucket[bucket]
        strata: dict[tuple, list[str]] = defaultdict(list)
        for key in sorted(arts):
            group = arts[key]
            strata[(group[0]["language"], any(x["gold_score"] <= 2 for x in group))].append(key)
        for keys in strata.values():
            rng.shuffle(keys)
        order = _round_robin([strata[k] for k in sorted(strata)])
        if len(order) < n_val + n_test + 1:
            raise DataError(f"bucket {bucket!r}: {len(order)} articles, need more than {n_val} validation + "
                            f"{n_test} test articles to leave any for training")
        val.update(order[:n_val])
        test.update(order[n_val:n_val + n_test])
    return val, test


def _round_robin(lists: list[list]) -> list:
    out, i = [], 0
    while any(i < len(x) for x in lists):
        out += [x[i] for x in lists if i < len(x)]
        i += 1
    return out


def nested_sizes(pool: list[dict], sizes: list[int | None], seed: int) -> dict[int | None, list[dict]]:
    """Per size, a prefix of one seeded, bucket-interleaved order of ``pool`` (None: all)."""
    rng = random.Random(seed)
    by_bucket: dict[str, list] = defaultdict(list)
    for r in sorted(pool, key=lambda r: r["id"]):
        by_bucket[r["bucket"]].append(r)
    for recs in by_bucket.values():
        rng.shuffle(recs)
    order = _round_robin([by_bucket[b] for b in sorted(by_bucket)])
    return {n: order if n is None else order[:n] for n in sizes}


def build_ablation(inputs: list[str | Path], out: str | Path, sizes: list[int | None], n_val: int, n_test: int,
                   seed: int = 42) -> dict:
    """Every set is made and checked in memory first; only then are files written (each atomically),
    so bad input or a size too large leaves ``out`` as it was."""
    out = check_output_dir(out)
    if n_val < 1 or n_test < 0:
        raise DataError(f"--val-articles {n_val} / --test-articles {n_test}: need at least 1 validation article "
                        "per bucket and no negative count")
    recs = read_tagged(inputs)
    val, test = split_heldout(recs, n_val, n_test, seed)
    manifest = {"inputs": [str(p) for p in inputs], "seed": seed, "variants": {k: list(v) for k, v in VARIANTS.items()},
                "heldout_articles_per_bucket": {"validation": n_val, "test": n_test}, "sets": {}}
    files: dict[Path, str] = {}
    heldout = {"validation": [r for r in recs if article_key(r) in val],
               "test": [r for r in recs if article_key(r) in test]}
    for split, rows in heldout.items():
        manifest["sets"][f"heldout/{split}"] = _by_bucket(out / "heldout", split, rows, files)
    train_pool = [r for r in recs if article_key(r) not in val and article_key(r) not in test]
    lines = ["# Table 5: one training run per line (longsft submit --sweep table5.sweep recipe=...)",
             "# name  overrides"]
    for variant, sources in VARIANTS.items():
        pool = [r for r in train_pool if r["source"] in sources]
        for n in sizes:
            if n is not None and n > len(pool):
                raise DataError(f"variant {variant}: {len(pool)} training samples, size {n} asked for; "
                                "lower --sizes or add data")
        for n, rows in nested_sizes(pool, sizes, seed).items():
            name = f"{variant}_{'all' if n is None else n}"
            manifest["sets"][name] = _by_bucket(out / name, "train", rows, files)
            lines.append(f"{name}  data.source=files data.train_file={out.resolve()}/{name}/{{bucket}}/train.jsonl "
                         f"data.validation_file={out.resolve()}/heldout/{{bucket}}/validation.jsonl")
    for path, text in files.items():
        atomic_write_text(path, text)
    atomic_write_json(out / "manifest.json", manifest)
    # the sweep file last: it says the arms are made (bench/table5_mini.py resumes by it)
    atomic_write_text(out / "table5.sweep", "\n".join(lines) + "\n")
    return manifest


def _by_bucket(root: Path, split: str, rows: list[dict], files: dict[Path, str]) -> dict:
    """Adds ``root/<bucket>/<split>.jsonl`` (sorted by id within a bucket) to ``files``; returns counts."""
    by_bucket: dict[str, list] = defaultdict(list)
    for r in rows:
        by_bucket[r["bucket"]].append(r)
    counts = {}
    for bucket, recs in sorted(by_bucket.items()):
        recs.sort(key=lambda r: r["id"])
        files[root / bucket / f"{split}.jsonl"] = "".join(json.dumps(dict(r, split=split), ensure_ascii=False) + "\n"
                                                          for r in recs)
        counts[bucket] = {"n": len(recs), "by_source": dict(Counter(r["source"] for r in recs)),
                          "hallucinated": sum(r["gold_score"] <= 2 for r in recs),
                          "by_language": dict(Counter(r["language"] for r in recs))}
    return counts


def parse_sizes(spec: str) -> list[int | None]:
    out = []
    for part in spec.split(","):
        part = part.strip()
        if part == "all":
            out.append(None)
        elif part.isdigit() and int(part) > 0:
            out.append(int(part))
        else:
            raise DataError(f"--sizes: {part!r} is not a positive integer or 'all'")
    return out
