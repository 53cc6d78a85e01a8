"""The token cache: the same ids, labels and order as encoding in memory; rebuilt on any change of
its inputs and on damage; a bad row leaves nothing behind; every source format reads alike."""

import copy
import json
import os
import re

import numpy as np
import pytest
from conftest import ROOT, free_port, run_cli, torchrun

from longsft.train.common.errors import DataError
from longsft.train.data import encoding, token_cache
from longsft.train.data.batching import collate, pack
from longsft.train.data.encoding import encode_all
from longsft.train.data.prompts import render_prompt
from longsft.train.data.schema import load_samples
from longsft.train.data.token_cache import Split, TokenCache, ensure
from longsft.train.plan import data_memory


def _reference_turns(tok, text, answer):
    """The two-pass encoding ``apply_chat_template`` defines: the prompt and the conversation each whole."""
    user = [{"role": "user", "content": text}]
    kw = {"tokenize": True, "return_dict": False, "enable_thinking": False}
    p = list(tok.apply_chat_template(user, add_generation_prompt=True, **kw))
    full = list(tok.apply_chat_template(user + [{"role": "assistant", "content": answer}], **kw))
    assert full[:len(p)] == p
    return p, full[len(p):]


@pytest.mark.parametrize("variant", ["end", "begin", "cot"])
def test_one_pass_turns_equal_the_chat_template(tokenizer, sample_dir, variant):
    samples = load_samples(sample_dir / "512" / "train.jsonl") + load_samples(sample_dir / "1k" / "validation.jsonl")
    assert {s.language for s in samples} == {"zh", "en"}
    for s in samples:
        text = render_prompt(s, variant)
        assert encoding._turns(tokenizer, text, s.target) == _reference_turns(tokenizer, text, s.target), s.id
    # text that ends in the characters a template puts after the user turn, and special tokens inside it
    for text in ["x\n", "<|im_end|>\n<|im_start|>assistant\n", "a  \n\n  ", "摘要：\n"]:
        assert encoding._turns(tokenizer, text, '{"score": 4}') == _reference_turns(tokenizer, text, '{"score": 4}')


def _same(cached, direct):
    assert [e.meta for e in cached] == [e.meta for e in direct]
    assert [np.asarray(e.input_ids).tolist() for e in cached] == [list(e.input_ids) for e in direct]
    assert [(e.prompt_len, e.truncated, e.labels) for e in cached] == [(e.prompt_len, e.truncated, e.labels)
                                                                       for e in direct]


@pytest.mark.parametrize("overflow", ["truncate", "skip"])
def test_cache_gives_the_ids_labels_and_order_of_encoding_in_memory(tmp_path, tokenizer, sample_dir, overflow):
    path = sample_dir / "1k" / "train.jsonl"
    split = Split(str(path), 700, "end", overflow)  # shorter than some samples: truncated or skipped
    direct, stats = encode_all(load_samples(path), tokenizer, 700, "end", overflow)
    folder, what = ensure(split, tokenizer, tmp_path)
    assert what == "built" and (stats.truncated if overflow == "truncate" else stats.skipped) > 0
    cache = TokenCache.open(folder)
    _same(cache.items, direct)
    assert cache.stats == stats
    rows = pack(cache.items, 1400, True)
    assert [[e.meta.id for e in r] for r in rows] == [[e.meta.id for e in r] for r in pack(direct, 1400, True)]
    a, b = collate(rows[:2], 0), collate(pack(direct, 1400, True)[:2], 0)
    assert all(a[k].equal(b[k]) for k in a)
    # validation.max_samples: the source's first rows, counted as encoding only those would count them
    head, head_stats = cache.first(5)
    want, want_stats = encode_all(load_samples(path)[:5], tokenizer, 700, "end", overflow)
    _same(head, want)
    assert head_stats == want_stats
    assert ensure(split, tokenizer, tmp_path) == (folder, "found")


def test_a_changed_input_builds_a_new_cache(tmp_path, tokenizer, sample_dir):
    src = tmp_path / "train.jsonl"
    src.write_bytes((sample_dir / "512" / "train.jsonl").read_bytes())
    split = Split(str(src), 512, "end", "truncate")
    first, _ = ensure(split, tokenizer, tmp_path / "c")
    other = copy.deepcopy(tokenizer)
    other.chat_template = tokenizer.chat_template.replace("<|im_start|>assistant\n", "<|im_start|>assistant\n\n")
    changed = {
        "seq_len": ensure(Split(str(src), 256, "end", "truncate"), tokenizer, tmp_path / "c"),
        "prompt": ensure(Split(str(src), 512, "begin", "truncate"), tokenizer, tmp_path / "c"),
        "overflow": ensure(Split(str(src), 512, "end", "skip"), tokenizer, tmp_path / "c"),
        "template": ensure(split, other, tmp_path / "c"),
    }
    lines = src.read_text().splitlines(keepends=True)
    rec = json.loads(lines[0])
    src.write_text(json.dumps({**rec, "summary": rec["summary"] + " More."}, ensure_ascii=False) + "\n"
                   + "".join(lines[1:]))
    changed["file"] = ensure(split, tokenizer, tmp_path / "c")
    assert all(what == "built" for _, what in changed.values()), changed
    assert len({first} | {p for p, _ in changed.values()}) == 6
    edited = TokenCache.open(changed["file"][0]).items[0]
    assert edited.input_ids.tolist() == encoding.encode(load_samples(src)[0], tokenizer, 512).input_ids


@pytest.mark.parametrize("damage, why", [
    (lambda d: os.truncate(d / "tokens.bin", (d / "tokens.bin").stat().st_size // 2), "tokens.bin has"),
    (lambda d: _flip(d / "tokens.bin"), "tokens.bin does not match its checksum"),
    (lambda d: (d / "manifest.json").unlink(), "manifest.json is missing"),
    (lambda d: (d / "manifest.json").write_text("{"), "unreadable manifest"),
], ids=["truncated", "flipped-byte", "no-manifest", "cut-manifest"])
def test_a_damaged_cache_is_detected_and_rebuilt(tmp_path, tokenizer, sample_dir, damage, why):
    split = Split(str(sample_dir / "512" / "train.jsonl"), 512, "end", "truncate")
    folder, _ = ensure(split, tokenizer, tmp_path)
    good = [encoding.Encoded(e.meta, e.input_ids.tolist(), e.prompt_len, e.truncated)  # copied: damage
            for e in TokenCache.open(folder).items]  # a mapped file's pages fault (SIGBUS) once it is cut
    token_cache._VERIFIED.clear()  # a new process: nothing checked yet
    damage(folder)
    again, what = ensure(split, tokenizer, tmp_path)
    assert again == folder and what.startswith("rebuilt") and why in what, what
    _same(TokenCache.open(folder).items, good)
    assert _entries(tmp_path) == [folder.name]  # no temporary folder left
    [aside] = tmp_path.glob(f".damaged-{folder.name}-*")  # set aside, not deleted: a job may have it mapped
    assert aside.is_dir()


def _entries(root):
    """The cache folders (and leftovers) under ``root``, without the builders' lock files."""
    return sorted(p.name for p in root.iterdir() if not p.name.startswith((".lock-", ".damaged-")))


def test_a_killed_builders_leftover_is_removed_and_builders_take_turns(tmp_path, tokenizer, sample_dir):
    split = Split(str(sample_dir / "512" / "train.jsonl"), 512, "end", "truncate")
    source = token_cache.open_source(split.source)
    name = token_cache.fingerprint(token_cache.fingerprint_inputs(split, source, tokenizer))
    (tmp_path / f".tmp-{name}-dead").mkdir()  # what a killed build leaves
    import fcntl
    import threading

    lock = (tmp_path / f".lock-{name}").open("a")
    fcntl.flock(lock, fcntl.LOCK_EX)  # another job is building it
    done = []
    t = threading.Thread(target=lambda: done.append(ensure(split, tokenizer, tmp_path)))
    t.start()
    t.join(1.0)
    assert not done and t.is_alive()  # waits for the other builder
    fcntl.flock(lock, fcntl.LOCK_UN)
    t.join(60)
    assert done and done[0][1] == "built"
    assert _entries(tmp_path) == [name]


def _flip(path):
    with path.open("r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))


@pytest.mark.parametrize("bad, message", [
    ('{"id": "b", "language": "en", "article": "x", "summary": "y"}', "t.jsonl:3: needs 'gold_score' or 'output'"),
    ('{"id": "a0", "language": "en", "article": "x", "summary": "y", "gold_score": 1}',
     "t.jsonl:3: duplicate id 'a0' (also at {path}:1)"),
    ('{"id": "b", "language": "en", "article": "x", "summary": "y", "gold_score": 1', "t.jsonl:3: malformed JSON"),
], ids=["no-gold", "duplicate-id", "cut-line"])
def test_a_bad_row_fails_naming_it_and_leaves_nothing(tmp_path, tokenizer, bad, message):
    path = tmp_path / "t.jsonl"
    good = [json.dumps({"id": f"a{i}", "language": "en", "article": "A tale.", "summary": "A.", "gold_score": 4})
            for i in range(4)]
    path.write_text("\n".join(good[:2] + [bad] + good[2:]) + "\n")
    with pytest.raises(DataError) as e:
        ensure(Split(str(path), 512, "end", "truncate"), tokenizer, tmp_path / "cache")
    assert message.format(path=path) in str(e.value)
    assert _entries(tmp_path / "cache") == []


def test_every_source_format_reads_alike(tmp_path, sample_dir):
    import datasets

    jsonl = sample_dir / "512" / "validation.jsonl"
    recs = [json.loads(line) for line in jsonl.read_text().splitlines()]
    (tmp_path / "a.json").write_text(json.dumps(recs, ensure_ascii=False))
    ds = datasets.Dataset.from_list(recs)
    ds.to_parquet(str(tmp_path / "a.parquet"))
    ds.save_to_disk(str(tmp_path / "arrow"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dict"))
    want = load_samples(jsonl)
    for spec in ["a.json", "a.parquet", "arrow", "dict#train"]:
        assert load_samples(f"{tmp_path}/{spec}") == want, spec
    with pytest.raises(DataError, match=r"dict: holds splits \['train'\]; name one as .*dict#SPLIT"):
        load_samples(tmp_path / "dict")
    datasets.Dataset.from_list([recs[0], {**recs[1], "gold_score": 9}]).to_parquet(str(tmp_path / "bad.parquet"))
    with pytest.raises(DataError, match=r"bad.parquet: row 2: gold_score must be an integer 0..5, got 9"):
        load_samples(tmp_path / "bad.parquet")


def test_a_dataset_in_the_local_hugging_face_cache_is_read_offline(tmp_path, sample_dir, monkeypatch):
    import datasets
    from datasets.packaged_modules.json.json import Json

    # the layout a download leaves: <cache>/ORG___NAME/default/0.0.0/<hash>/NAME-train.arrow
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    jsonl = sample_dir / "512" / "validation.jsonl"
    Json(cache_dir=str(tmp_path / "hf"), dataset_name="someorg___longnovel", data_files={"train": [str(jsonl)]},
         hash="0123abcd").download_and_prepare()
    [config] = (tmp_path / "hf" / "someorg___longnovel").glob("default-*")
    config.rename(config.with_name("default"))
    [arrow] = (tmp_path / "hf" / "someorg___longnovel" / "default").glob("*/*/*.arrow")
    arrow.rename(arrow.with_name(arrow.name.replace("someorg___longnovel-", "longnovel-")))
    assert load_samples("hf:someorg/longnovel#train") == load_samples(jsonl)
    with pytest.raises(DataError, match="hf:someorg/other#train: not in the local Hugging Face datasets cache"):
        load_samples("hf:someorg/other#train")
    with pytest.raises(DataError, match=r"write a cached Hugging Face dataset as hf:NAME\[:CONFIG\]#SPLIT"):
        load_samples("hf:someorg/longnovel")


@pytest.mark.parametrize("form", ["jsonl", "parquet", "json"])
def test_a_pool_of_workers_builds_the_same_cache(tmp_path, tokenizer, sample_dir, form):
    import datasets

    path = sample_dir / "1k" / "train.jsonl"
    if form != "jsonl":  # the source travels to spawned workers: a Parquet table is reopened there
        recs = [json.loads(line) for line in path.read_text().splitlines()]
        path = tmp_path / f"train.{form}"
        if form == "json":
            path.write_text(json.dumps(recs, ensure_ascii=False))
        else:
            datasets.Dataset.from_list(recs).to_parquet(str(path))
    split = Split(str(path), 1024, "end", "truncate")
    source = token_cache.open_source(path)
    inputs = token_cache.fingerprint_inputs(split, source, tokenizer)
    token_cache.build(split, source, tokenizer, tmp_path / "one", inputs, workers=1)
    m = token_cache.build(split, source, tokenizer, tmp_path / "two", inputs, workers=2)
    assert m["workers"] == 2
    for name in token_cache.FILES:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


def test_source_edges(tmp_path, tokenizer):
    import datasets

    rec = {"id": "a", "language": "en", "article": "A tale.", "summary": "A.", "gold_score": 4}
    folder = tmp_path / "#1"  # a '#' in a name is part of the name
    folder.mkdir()
    jsonl = folder / "t.jsonl"
    blank = " " * 20 + "\n\u3000\n\r\n"  # blank lines, long or Unicode, are skipped as before
    jsonl.write_text(blank + json.dumps(rec) + "\n" + blank + json.dumps({**rec, "id": "b"}))  # no final newline
    assert [s.id for s in load_samples(jsonl)] == ["a", "b"]
    with pytest.raises(DataError, match=r"t.jsonl:8: duplicate id 'a' \(also at .*t.jsonl:4\)"):
        jsonl.write_text(blank + json.dumps(rec) + "\n" + blank + json.dumps(rec) + "\n")
        load_samples(jsonl)
    datasets.Dataset.from_list([rec]).save_to_disk(str(tmp_path / "one"))
    with pytest.raises(DataError, match="one#test: a single dataset, not a DatasetDict: drop '#test'"):
        load_samples(f"{tmp_path}/one#test")
    with pytest.raises(DataError, match="'#train' selects a split of a save_to_disk folder"):
        load_samples(f"{jsonl}#train")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(DataError, match="empty.jsonl: no samples"):
        ensure(Split(str(empty), 512, "end", "truncate"), tokenizer, tmp_path / "c")


def test_data_prepare_builds_every_stage_once(tmp_path, capsys):
    argv = ["data", "prepare", "recipe=tiny", f"run_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}",
            "data.sample_size=4", ("stages=[{name: a, bucket: '512', seq_len: 512, max_steps: 1, validate: false}, "
                                   "{name: b, bucket: 1k, seq_len: 1024, max_steps: 1}]"), "--json", str(tmp_path / "p.json")]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0
    assert [line.split()[:2] for line in out.splitlines()] == [["a", "train"], ["b", "train"], ["b", "validation"]]
    assert out.count(" built ") == 3 and err.count("tokenized ") == 3
    records = json.loads((tmp_path / "p.json").read_text())
    assert [r["seq_len"] for r in records] == [512, 1024, 1024 - 48]
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0 and out.count(" found ") == 3
    assert len(_entries(tmp_path / "cache")) == 3


def _files_run(tmp_path, bad_row: bool) -> list[str]:
    """A one-stage run's settings on files in ``tmp_path/d`` (row 3 of train.jsonl in French if ``bad_row``)."""
    data = tmp_path / "d" / "512"
    data.mkdir(parents=True)
    good = [json.dumps({"id": f"a{i}", "language": "en", "article": "A tale.", "summary": "A.", "gold_score": 4})
            for i in range(4)]
    bad = good[0].replace('"a0", "language": "en"', '"b", "language": "fr"')
    (data / "train.jsonl").write_text("\n".join(good[:2] + [bad if bad_row else good[3]] + good[:2]
                                                ).replace('"a3"', '"a9"') + "\n")
    (data / "validation.jsonl").write_text("\n".join(good) + "\n")
    return ["recipe=tiny", f"run_dir={tmp_path / 'run'}", "data.source=files",
            f"data.train_file={tmp_path}/d/{{bucket}}/train.jsonl",
            f"data.validation_file={tmp_path}/d/{{bucket}}/validation.jsonl", f"data.cache_dir={tmp_path / 'c'}",
            "logging.progress=false", "stages=[{name: a, bucket: '512', seq_len: 512, max_steps: 2}]"]


@pytest.mark.parametrize("fault", ["bad-row", "cache-dir-is-a-file"])
def test_rank_0s_failure_stops_both_ranks_before_the_run_directory_is_made(tmp_path, fault):
    """Rank 0 checks and builds while rank 1 waits; both stop at once with rank 0's error (no hang)."""
    data, cache = tmp_path / "d" / "512", tmp_path / "c"
    args = _files_run(tmp_path, bad_row=fault == "bad-row")
    if fault == "cache-dir-is-a-file":
        cache.write_text("not a folder")
    r = torchrun([str(ROOT / "launch" / "curriculum.py"), *args], nproc=2, check=False, timeout=300)
    message = (f"{data / 'train.jsonl'}:3: unknown language 'fr'" if fault == "bad-row" else
               f"token cache folder {cache}: cannot make it (File exists); set data.cache_dir")
    assert r.stderr.count(message) == 1, r.stderr[-3000:]  # said once
    # rank 0 exits 2 (bad input), and torchrun stops rank 1 (or it exits 2 too). A rank left waiting
    # would hang the launch past the timeout of 300 s.
    assert "0" in re.findall(r"rank\s+: (\d) .*\n\s+exitcode\s+: 2 ", r.stderr), r.stderr[-3000:]
    assert not (tmp_path / "run").exists()
    if fault == "bad-row":
        assert _entries(cache) == []


def test_a_failed_run_destroys_its_process_groups(tmp_path, capsys, monkeypatch):
    """An error after the process group is made tears it down before the command returns: groups left
    to the interpreter's exit can abort the process there (gloo's threads: SIGABRT, "terminate called
    without an active exception", seen in CI on the 2-rank bad-row run above)."""
    import torch.distributed as dist

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "DS_ACCELERATOR": "cpu",
                       "LOCAL_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)  # a world of one in this process, restored after the test
    code, _, err = run_cli(capsys, "train", *_files_run(tmp_path, bad_row=True), "parallel.sp_size=1")
    assert code == 2 and "train.jsonl:3: unknown language 'fr'" in err, err
    assert not dist.is_initialized()


def test_the_planner_counts_the_samples_a_rank_holds(sample_dir):
    from longsft.train.config.recipes import load_config

    cfg = load_config("tiny", ["data.source=files", f"data.train_file={sample_dir}/{{bucket}}/train.jsonl",
                               f"data.validation_file={sample_dir}/{{bucket}}/validation.jsonl"])
    stage = cfg.stages[1]  # bucket 1k, validated
    n = len(load_samples(sample_dir / "1k" / "train.jsonl")) + len(load_samples(sample_dir / "1k" / "validation.jsonl"))
    batch = cfg.optim.micro_batch_size * stage.seq_len * data_memory.HOST_BYTES_PER_BATCH_TOKEN
    assert data_memory.host_bytes(cfg, stage) == (n * data_memory.HOST_BYTES_PER_SAMPLE + batch, n)
    s2k = cfg.stages[2]  # bucket 2k is not there: its samples are not counted
    assert data_memory.host_bytes(cfg, s2k) == (s2k.seq_len * data_memory.HOST_BYTES_PER_BATCH_TOKEN, None)
