"""`longsft data ablation`: Table 5 sets with shared held-out articles, nested sizes and a sweep file."""

import json
import random
import subprocess
import sys

import pytest
from conftest import record_writes

from longsft.launch.cluster.sweep import check_sweep
from longsft.train.common.errors import DataError
from longsft.train.datagen.ablation import build_ablation, parse_sizes


def tagged(n_articles=16, seed=0):
    """Per bucket and article: a human summary, two MMA summaries and one ERHG perturbation."""
    rng, recs = random.Random(seed), []
    for bucket in ("512", "1k"):
        for a in range(n_articles):
            lang = "zh" if a % 2 else "en"
            base = {"language": lang, "article": f"{bucket} article {a} " * 5, "bucket": bucket}
            recs.append({**base, "id": f"{bucket}-{a}-h", "summary": "s", "gold_score": 5, "source": "human"})
            for m in range(2):
                recs.append({**base, "id": f"{bucket}-{a}-m{m}", "summary": f"m{m}", "gold_score": rng.randint(0, 5),
                             "source": "mma"})
            recs.append({**base, "id": f"{bucket}-{a}-e", "summary": "e", "gold_score": 2, "source": "erhg",
                         "types": ["entity"]})
    return recs


@pytest.fixture
def inputs(tmp_path):
    path = tmp_path / "tagged.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in tagged()))
    return path


def _read(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_sets_sources_heldout_and_nesting(inputs, tmp_path):
    out = tmp_path / "out"
    m = build_ablation([inputs], out, [10, 20, None], n_val=2, n_test=3, seed=1)
    held = {split: [r for b in ("512", "1k") for r in _read(out / "heldout" / b / f"{split}.jsonl")]
            for split in ("validation", "test")}
    held_articles = {r["article"] for rows in held.values() for r in rows}
    assert len({r["article"] for r in held["validation"]}) == 4 and len({r["article"] for r in held["test"]}) == 6
    for split, rows in held.items():  # every sample of a held-out article is held out, both languages present
        assert len(rows) == 4 * len({r["article"] for r in rows})
        assert {r["language"] for r in rows} == {"zh", "en"}
    for variant, sources in (("mma_only", {"human", "mma"}), ("mma_erhg", {"human", "mma", "erhg"})):
        sets = {n: [r for b in ("512", "1k") if (out / f"{variant}_{n}" / b / "train.jsonl").exists()
                    for r in _read(out / f"{variant}_{n}" / b / "train.jsonl")] for n in ("10", "20", "all")}
        assert len(sets["10"]) == 10 and len(sets["20"]) == 20
        assert {r["id"] for r in sets["10"]} < {r["id"] for r in sets["20"]} < {r["id"] for r in sets["all"]}
        assert {r["source"] for r in sets["all"]} == sources
        assert not held_articles & {r["article"] for r in sets["all"]}  # no held-out article is trained on
        assert {r["bucket"] for r in sets["10"]} == {"512", "1k"}  # sizes stratified by bucket
        assert m["sets"][f"{variant}_all"]["512"]["n"] == len([r for r in sets["all"] if r["bucket"] == "512"])
    assert len(_read(out / "mma_erhg_all" / "512" / "train.jsonl")) == 4 * 11


def test_same_seed_same_bytes(inputs, tmp_path):
    build_ablation([inputs], tmp_path / "a", [10], 2, 2, seed=3)
    build_ablation([inputs], tmp_path / "b", [10], 2, 2, seed=3)
    for rel in ("mma_erhg_10/1k/train.jsonl", "heldout/512/test.jsonl", "mma_only_10/512/train.jsonl"):
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes()


def test_sweep_file_trains_each_set_with_the_shared_validation(inputs, tmp_path):
    out = tmp_path / "out"
    build_ablation([inputs], out, [10, None], 2, 2, seed=1)
    tasks = check_sweep(out / "table5.sweep", tmp_path / "runs", ["recipe=tiny"])
    assert [t.name for t, _ in tasks] == ["mma_only_10", "mma_only_all", "mma_erhg_10", "mma_erhg_all"]
    for task, cfg in tasks:
        assert cfg.data.source == "files"
        assert cfg.data.train_file.format(bucket="1k") == f"{out.resolve()}/{task.name}/1k/train.jsonl"
        assert cfg.data.validation_file.format(bucket="512") == f"{out.resolve()}/heldout/512/validation.jsonl"


@pytest.mark.parametrize("edit, sizes, message", [
    (lambda rs: rs[3].update(source="gpt"), [5], "tagged.jsonl:4: source 'gpt' is not one of"),
    (lambda rs: rs[0].pop("bucket"), [5], "tagged.jsonl:1: missing field 'bucket'"),
    (lambda rs: None, [500], "variant mma_only: "),
    (lambda rs: rs[1].update(id=rs[0]["id"]), [5], "tagged.jsonl:2: duplicate id"),
])
def test_bad_input(tmp_path, edit, sizes, message):
    recs = tagged()
    edit(recs)
    path = tmp_path / "tagged.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(DataError, match=message):
        build_ablation([path], tmp_path / "out", sizes, 2, 2)


def test_too_few_articles_and_bad_sizes(inputs, tmp_path):
    with pytest.raises(DataError, match="bucket '1k': 16 articles, need more than 10 validation \\+ 6 test"):
        build_ablation([inputs], tmp_path / "out", [5], 10, 6)
    with pytest.raises(DataError, match="'ten' is not a positive integer"):
        parse_sizes("10,ten")


def test_cli(inputs, tmp_path):
    r = subprocess.run([sys.executable, "-m", "longsft.launch.cli", "data", "ablation", str(inputs), "--out",
                        str(tmp_path / "o"), "--sizes", "10,all", "--val-articles", "2", "--test-articles", "2"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "mma_erhg_10: 1k" in r.stdout and "table5.sweep" in r.stdout


def test_the_sweep_file_is_written_last(inputs, tmp_path, monkeypatch):
    """bench/table5_mini.py resumes by the sweep file: it is written after every set and the manifest, so a
    run cut off before it makes the arms again rather than reading a manifest that is not there."""
    import longsft.train.datagen.ablation as ablation

    order = record_writes(monkeypatch, ablation)
    build_ablation([inputs], tmp_path / "out", [10], 2, 2, seed=3)
    assert order[-1].endswith("table5.sweep") and any(p.endswith("manifest.json") for p in order[:-1])
