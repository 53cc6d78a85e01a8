"""Bad input to the data commands (`longsft data sample|extend|erhg|mma|ablation`) and the sample loader.

Each case runs the real command: exit status 2, no traceback, a message naming the file, line or
key at fault, every file that was there unchanged and no partial output.
"""

import json
import random
import shutil
import time

import pytest
from conftest import free_port, run_cli, snapshot
from test_ablation import tagged

from longsft.train.common.errors import DataError
from longsft.train.data.schema import load_samples
from longsft.train.datagen.extend import build, parse_buckets
from longsft.train.datagen.sample_data import synthetic_book

BUCKETS = "t=100:400"
BINARY = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe" * 8
DEEP = '{"id": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
SAMPLE = {"id": "s1", "language": "en", "summary": "Arthur led 300 soldiers to Ravenford. Beatrice met Cedric.",
          "article": "Arthur led 300 soldiers to Ravenford. Beatrice met Cedric at Kingsbridge. " * 4,
          "gold_score": 5, "source": "human", "bucket": "t"}


def _jsonl(path, recs):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs), encoding="utf-8")
    return path


def _fails(capsys, *argv, needle: str, roots=()):
    """Run ``longsft ARGV``: exit 2, ``needle`` in the message, every file under ``roots`` unchanged."""
    before = snapshot(*roots)
    code, out, err = run_cli(capsys, *argv)
    assert code == 2, (out, err)
    assert needle in err, err
    assert snapshot(*roots) == before
    return err


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tokenizer):
    """A units file and a finished `data extend` build of it."""
    d = tmp_path_factory.mktemp("extend")
    units = _jsonl(d / "units.jsonl", synthetic_book(random.Random(0), "b0", "en", 6, (300, 600)))
    build(units, d / "out", parse_buckets(BUCKETS), tokenizer)
    return units, d / "out"


@pytest.fixture
def ext(finished, tmp_path):
    """A private copy of the finished build (a failing test cannot spoil the others)."""
    units, out = finished
    shutil.copytree(out, tmp_path / "out")
    return units, tmp_path / "out"


@pytest.mark.parametrize("resume", [[], ["--resume"]])
def test_extend_typo_in_the_input_keeps_a_finished_build(capsys, ext, tmp_path, resume):
    _, out = ext
    _fails(capsys, "data", "extend", tmp_path / "unitz.jsonl", "--out", out, "--buckets", BUCKETS, *resume,
           needle="unitz.jsonl: file not found", roots=[tmp_path])


def test_extend_never_truncates_earlier_outputs(capsys, ext, tmp_path):
    units, out = ext
    (out / "progress.json").unlink()  # an older build, or a folder put together by hand
    for name in (tmp_path / "unitz.jsonl", units):
        _fails(capsys, "data", "extend", name, "--out", out, "--buckets", BUCKETS,
               needle="file not found" if name != units else f"{out / 't' / 'samples.jsonl'} already exists",
               roots=[tmp_path])


def test_extend_rerun_of_a_finished_build(capsys, ext, tmp_path):
    units, out = ext
    _fails(capsys, "data", "extend", units, "--out", out, "--buckets", BUCKETS, needle=f"{out} holds a finished build",
           roots=[tmp_path])
    _fails(capsys, "data", "extend", units, "--out", out, "--buckets", "t=100:300", "--resume",
           needle="the finished build used buckets [['t', 100, 400]]", roots=[tmp_path])
    before = snapshot(tmp_path)
    code, stdout, _ = run_cli(capsys, "data", "extend", units, "--out", out, "--buckets", BUCKETS, "--resume")
    assert code == 0 and "| t | 100–400 |" in stdout and snapshot(tmp_path) == before


def test_bucket_names_stay_inside_out(capsys, finished, tmp_path):
    out = tmp_path / "a" / "b" / "out"  # '../../x' would land inside tmp_path: the snapshot sees it
    _fails(capsys, "data", "extend", finished[0], "--out", out, "--buckets", "../../x=100:400",
           needle="--buckets name='../../x' is not a plain name", roots=[tmp_path])
    recs = tagged()
    recs[5]["bucket"] = "../../x"
    data = _jsonl(tmp_path / "tagged.jsonl", recs)
    _fails(capsys, "data", "ablation", data, "--out", out, "--val-articles", "2", "--test-articles", "2",
           needle=f"{data}:6: bucket='../../x' is not a plain name", roots=[tmp_path])
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("edit, needle", [
    (dict(gold_score="5"), ":4: gold_score must be an integer 0..5, got '5'"),
    (dict(article=None), ":4: field 'article' must be a non-empty string, got null"),
    (dict(bucket=512), ":4: field 'bucket' must be a string, got 512"),
    (dict(sorce="mma"), ":4: unknown field 'sorce' (did you mean 'source'?)"),
    (dict(types=["entiy"]), ":4: types: unknown hallucination type 'entiy' (did you mean 'entity'?)"),
])
def test_ablation_bad_values(capsys, tmp_path, edit, needle):
    recs = tagged()
    recs[3].update(edit)
    data = _jsonl(tmp_path / "tagged.jsonl", recs)
    _fails(capsys, "data", "ablation", data, "--out", tmp_path / "out", "--val-articles", "2", "--test-articles", "2",
           needle=f"{data}{needle}", roots=[tmp_path])
    assert not (tmp_path / "out").exists()


def test_ablation_too_large_a_size_writes_nothing(capsys, tmp_path):
    data = _jsonl(tmp_path / "tagged.jsonl", tagged())
    _fails(capsys, "data", "ablation", data, "--out", tmp_path / "out", "--val-articles", "2", "--test-articles", "2",
           "--sizes", "10,100000", needle="size 100000 asked for", roots=[tmp_path])
    assert not (tmp_path / "out").exists()  # the held-out sets were not written before the size was checked


def _commands(tmp_path, data):
    """Every command that reads a samples/units file, with outputs in ``tmp_path``; endpoints are dead
    (the input must be refused before any request)."""
    dead = f"m@http://127.0.0.1:{free_port()}/v1"
    return {
        "extend": ["data", "extend", data, "--out", tmp_path / "o", "--buckets", BUCKETS],
        "erhg": ["data", "erhg", data, "--out", tmp_path / "o.jsonl"],
        "erhg-llm": ["data", "erhg", data, "--out", tmp_path / "o.jsonl", "--engine", "llm", "--endpoint", dead],
        "mma": ["data", "mma", data, "--out", tmp_path / "o.jsonl", "--generator", dead, "--judge", dead,
                "--judge", dead, "--arbiter", dead],
        "ablation": ["data", "ablation", data, "--out", tmp_path / "o"],
        "eval": ["eval", "model=m", f"data={data}", f"out={tmp_path}/o/{{name}}"],  # the training sample loader
    }


COMMANDS = ["extend", "erhg", "erhg-llm", "mma", "ablation", "eval"]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("content, needle", [(BINARY, ":1: not UTF-8 text"),
                                             (DEEP.encode(), ":1: JSON nested too deeply")])
def test_unreadable_input(capsys, tmp_path, command, content, needle):
    data = tmp_path / "in.jsonl"
    data.write_bytes(content)
    _fails(capsys, *_commands(tmp_path, data)[command], needle=f"{data}{needle}", roots=[tmp_path])


@pytest.mark.parametrize("command, rec, needle", [
    ("erhg", {k: v for k, v in SAMPLE.items() if k != "article"}, ":1: missing field 'article'"),
    ("mma", {k: v for k, v in SAMPLE.items() if k != "article"}, ":1: missing field 'article'"),
    ("erhg", dict(SAMPLE, summary=None), ":1: field 'summary' must be a non-empty string, got null"),
    ("erhg", {**SAMPLE, "typs": ["entity"]}, ":1: unknown field 'typs' (did you mean 'types'?)"),
    ("mma", {**SAMPLE, "langauge": "en"}, ":1: unknown field 'langauge' (did you mean 'language'?)"),
    ("eval", {**SAMPLE, "typs": ["entity"]}, ":1: unknown field 'typs' (did you mean 'types'?)"),
    ("eval", {**SAMPLE, "gold_score": 1, "types": "entity, evnt"},
     ":1: types: unknown hallucination type 'evnt' (did you mean 'event'?)"),
    ("extend", {"book": "b", "unit": 1, "language": "en", "text": "t", "summray": "s"},
     ":1: unknown field 'summray' (did you mean 'summary'?)"),
    ("extend", {"book": "b", "unit": 1, "language": "en", "text": ["t"]}, ":1: field 'text' must be a string"),
])
def test_bad_record(capsys, tmp_path, command, rec, needle):
    data = _jsonl(tmp_path / "in.jsonl", [rec])
    _fails(capsys, *_commands(tmp_path, data)[command], needle=f"{data}{needle}", roots=[tmp_path])


def test_meta_is_the_free_form_field(tmp_path):
    data = _jsonl(tmp_path / "in.jsonl", [{**SAMPLE, "meta": {"anything": [1, {"goes": True}]}}])
    assert load_samples(data)[0].id == "s1"
    with pytest.raises(DataError, match=r"in.jsonl:1: unknown field 'chapter_no' \(known: id, language, .*'meta'"):
        load_samples(_jsonl(tmp_path / "in.jsonl", [{**SAMPLE, "chapter_no": 3}]))


@pytest.mark.parametrize("command", ["erhg", "mma"])
def test_file_outputs(capsys, tmp_path, command):
    data = _jsonl(tmp_path / "in.jsonl", [SAMPLE])
    argv = _commands(tmp_path, data)[command]
    (tmp_path / "folder").mkdir()
    for out, needle in [(tmp_path / "folder", f"{tmp_path / 'folder'}: is a directory; give a file name"),
                        (tmp_path / "nope" / "o.jsonl", f"{tmp_path / 'nope' / 'o.jsonl'}: folder "),
                        (data, f"--out {data}: is the input file")]:
        _fails(capsys, *argv[:4], out, *argv[5:], needle=needle, roots=[tmp_path])
    assert not (tmp_path / "nope").exists()


@pytest.mark.parametrize("command", ["extend", "ablation", "sample"])
def test_folder_output_that_is_a_file(capsys, tmp_path, finished, command):
    (tmp_path / "taken").write_text("mine\n")
    data = finished[0] if command == "extend" else _jsonl(tmp_path / "in.jsonl", tagged())
    argv = {"extend": ["data", "extend", data, "--buckets", BUCKETS], "ablation": ["data", "ablation", data],
            "sample": ["data", "sample", "--buckets", "512", "--n", "1"]}[command]
    _fails(capsys, *argv, "--out", tmp_path / "taken",
           needle=f"--out {tmp_path / 'taken'}: is a file, expected a folder", roots=[tmp_path])


@pytest.mark.parametrize("args, needle", [
    (["--buckets", "512,8k"], "bucket '8k': the sample set has no such bucket; known: 512, 1k, 2k, 4k"),
    (["--n", "0"], "--n 0: must be at least 1"),
    (["--n-validation", "0"], "--n-validation 0: must be at least 1"),
])
def test_sample_arguments_are_checked_before_writing(capsys, tmp_path, args, needle):
    _fails(capsys, "data", "sample", "--out", tmp_path / "out", "--buckets", "512", "--n", "1", *args, needle=needle,
           roots=[tmp_path])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["erhg-llm", "mma"])
def test_dead_endpoint_fails_fast(capsys, tmp_path, command):
    data = _jsonl(tmp_path / "in.jsonl", [SAMPLE, dict(SAMPLE, id="s2")])
    argv = _commands(tmp_path, data)[command]
    url = argv[-1]
    t0 = time.time()
    err = _fails(capsys, *argv, needle=f"longsft: endpoint {url}: no answer after 3 requests", roots=[tmp_path])
    assert time.time() - t0 < 10
    assert "Connection refused" in err and err.count("retry ") == 2  # the retries are shown, and few
    assert "no output written" in err and not list(tmp_path.glob("o.jsonl*"))  # not even an empty answer cache
