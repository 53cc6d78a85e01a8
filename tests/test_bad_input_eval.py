"""Bad input to ``longsft score``, ``eval`` and ``constory``, through the real command.

Each case: the exit status (2 bad input; 3 for unjudged ConStory stories), no traceback, a message
naming the file, line or key at fault, every pre-existing file unchanged and no partial output.
"""

import json
import os
import shutil

import pytest
from conftest import run_cli, snapshot
from llm_server import Server

EVAL = ["tokenizer=qwen", "max_new_tokens=2", "bootstrap=0", "progress=false"]
SAMPLES = [{"id": "a", "language": "en", "article": "Tom went home. He ate bread.", "summary": "Tom ate bread.",
            "gold_score": 5},
           {"id": "b", "language": "en", "article": "Tom went home. He ate bread.", "summary": "Tom ate rice.",
            "gold_score": 1}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def checkpoint(model_dir, dest, **config):
    """A copy of the tiny model at ``dest`` (weights hard-linked), config.json edited by ``config``."""
    shutil.copytree(model_dir, dest, copy_function=os.link)
    if config:
        cfg = json.loads((dest / "config.json").read_text())
        (dest / "config.json").unlink()  # a hard link: do not edit the shared file
        (dest / "config.json").write_text(json.dumps({**cfg, **config}))
    return dest


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("qwen3")


@pytest.fixture
def data(tmp_path):
    return write_jsonl(tmp_path / "d.jsonl", SAMPLES)


# ------------------------------------------------------------------ longsft score

PRED = {"id": "1", "prediction": '{"score": 1, "reason": "x"}', "gold_score": 1}


@pytest.mark.parametrize("content, message", [
    (b'\x89PNG\r\n\x1a\n\x00\x00binary\n', "p.jsonl:1: not UTF-8 text"),
    (b'{"id": "1", "prediction": "x", "gold_score": 1}\n{"id": "1", "prediction": "y", "gold_score": 2}\n',
     "p.jsonl:2: duplicate id '1' (first at {p}:1)"),
    (b'{"id": "1", "prediction": "x", "gold_score": 3.5}\n', "p.jsonl:1: gold_score must be an integer 0..5, got 3.5"),
], ids=["binary", "duplicate-id", "fractional-gold"])
def test_score_bad_predictions(tmp_path, capsys, content, message):
    preds = tmp_path / "p.jsonl"
    preds.write_bytes(content)
    (tmp_path / "p.scores.json").write_text("{}\n")  # an earlier result: kept as it was
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "score", preds, "--bootstrap", "0")
    assert code == 2 and message.format(p=preds) in err
    assert snapshot(tmp_path) == before


def test_score_predictions_folder(tmp_path, capsys):
    (tmp_path / "p.jsonl").mkdir()
    code, _, err = run_cli(capsys, "score", tmp_path / "p.jsonl")
    assert code == 2 and f"{tmp_path / 'p.jsonl'}: is a directory, expected a file" in err
    assert list(tmp_path.iterdir()) == [tmp_path / "p.jsonl"]


@pytest.mark.parametrize("out, message", [("folder", "folder: is a directory; give a file name"),
                                          ("missing/s.json", "missing/s.json: folder {tmp}/missing does not exist"),
                                          ("p.jsonl", "is the predictions file itself")])
def test_score_out_not_a_writable_file(tmp_path, capsys, out, message):
    preds = write_jsonl(tmp_path / "p.jsonl", [PRED])
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "keep.txt").write_text("mine")
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "score", preds, "--out", tmp_path / out, "--bootstrap", "0")
    assert code == 2 and message.format(tmp=tmp_path) in err
    assert snapshot(tmp_path) == before and not (tmp_path / "missing").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "p.jsonl"]  # no temp file left


# ------------------------------------------------------------------ longsft eval


@pytest.mark.parametrize("content, message", [
    (b'{"id": "b", "language": "en", "article": "T\xe9l\xe9", "summary": "x", "gold_score": 1}\n',
     "d.jsonl:1: not UTF-8"),  # Latin-1
    (b'{"id": "a", "language": "en", "article": "Tom went home.", "summary": "Tom left.", "output": 5}\n',
     "d.jsonl:1: field 'output'"),
], ids=["latin-1", "output-number"])
def test_eval_bad_data(model, tmp_path, capsys, content, message):
    (tmp_path / "d.jsonl").write_bytes(content)
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "eval", f"model={model}", f"data={tmp_path / 'd.jsonl'}", f"out={tmp_path / 'o'}",
                           *EVAL)
    assert code == 2 and message in err
    assert snapshot(tmp_path) == before and not (tmp_path / "o").exists()


@pytest.mark.parametrize("what, message", [("file", "model={m}: is a file"), ("missing", "model={m}: not found"),
                                           ("folder", "model={m}: no config.json in this folder")])
def test_eval_model_not_a_checkpoint(data, tmp_path, capsys, what, message):
    m = tmp_path / "m"
    if what == "file":
        m.write_text("weights?")
    elif what == "folder":
        m.mkdir()
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "eval", f"model={m}", f"data={data}", f"out={tmp_path / 'o'}", *EVAL)
    assert code == 2 and message.format(m=m) in err
    assert snapshot(tmp_path) == before and not (tmp_path / "o").exists()


@pytest.mark.parametrize("arg, message", [
    ("name=../../escape", "name='../../escape' is not a plain name"),
    ("name=.hidden", "name='.hidden' is not a plain name"),
    ("name=a/b", "name='a/b' is not a plain name"),
    ("out=runs/eval/../../escape", "out=runs/eval/../../escape: no '..'"),
    ("out=runs/{model}", "out=runs/{model}: only {name} may stand in braces"),
])
def test_eval_output_outside_its_folder(model, data, tmp_path, capsys, monkeypatch, arg, message):
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "eval", f"model={model}", f"data={data}", arg, *EVAL)
    assert code == 2 and message in err
    assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]


def test_two_best_checkpoints_get_their_own_folders_and_no_run_resumes_into_another(model, data, tmp_path, capsys,
                                                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = checkpoint(model, tmp_path / "runs" / "A" / "stages" / "s1" / "best")
    b = checkpoint(model, tmp_path / "runs" / "B" / "stages" / "s1" / "best")
    assert run_cli(capsys, "eval", f"model={a}", f"data={data}", *EVAL)[0] == 0
    assert (tmp_path / "runs/eval/A-s1-best-direct-end/eval.json").exists()
    first = snapshot(tmp_path / "runs" / "eval")
    assert run_cli(capsys, "eval", f"model={b}", f"data={data}", *EVAL)[0] == 0
    assert (tmp_path / "runs/eval/B-s1-best-direct-end/eval.json").exists()
    assert {k: v for k, v in snapshot(tmp_path / "runs" / "eval").items() if k in first} == first
    # the same folder asked for by name: refused, naming both models and the way out
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "eval", f"model={b}", f"data={data}", "name=A-s1-best-direct-end", *EVAL)
    assert code == 2 and "out=runs/eval/A-s1-best-direct-end holds another evaluation" in err
    assert f"model='{a}' there, '{b}' now" in err and "give this one its own name= or out=" in err
    assert snapshot(tmp_path) == before
    # other settings too; a rerun of the same evaluation resumes (nothing generated again)
    code, _, err = run_cli(capsys, "eval", f"model={a}", f"data={data}", *EVAL[:1], "max_new_tokens=3", *EVAL[2:])
    assert code == 2 and "max_new_tokens=2 there, 3 now" in err and snapshot(tmp_path) == before
    assert run_cli(capsys, "eval", f"model={a}", f"data={data}", *EVAL)[0] == 0
    gens = tmp_path / "runs/eval/A-s1-best-direct-end/generations.jsonl"
    assert gens.read_bytes() == before[str(gens)]


def test_eval_into_a_folder_that_holds_something_else(model, data, tmp_path, capsys):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "eval", f"model={model}", f"data={data}", f"out={tmp_path / 'o'}", *EVAL)
    assert code == 2 and f"out={tmp_path / 'o'}: exists and holds no evaluation" in err
    assert snapshot(tmp_path) == before


def test_an_older_eval_folder_resumes_with_its_own_settings_only(data, tmp_path, monkeypatch):
    """A config.json from before identities were recorded: compared with the settings as given."""
    from longsft.eval.eval_config import check_out_dir, parse_eval_args
    from longsft.train.common.errors import ConfigError
    from longsft.train.config.loader import to_dict

    monkeypatch.chdir(tmp_path)
    args = ["model=runs/A/stages/s1/best", "data=d.jsonl", "out=o"]
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "config.json").write_text(json.dumps(to_dict(parse_eval_args(args))))
    check_out_dir(parse_eval_args(args))
    with pytest.raises(ConfigError, match="model='runs/A/stages/s1/best' there, 'runs/B/stages/s1/best' now"):
        check_out_dir(parse_eval_args([*args, "model=runs/B/stages/s1/best"]))


def test_generation_uses_the_kv_cache_even_if_the_checkpoint_says_not_to(model, tmp_path):
    from longsft.eval.backends import HFBackend
    from longsft.eval.eval_config import EvalConfig, model_config

    old = checkpoint(model, tmp_path / "old", use_cache=False)
    backend = HFBackend(model_config(EvalConfig(model=str(old), data="d", tokenizer="qwen")), 4, dtype="fp32")
    lengths, forward = [], backend.model.forward

    def spy(*args, **kw):
        lengths.append(kw["input_ids"].shape[1])
        return forward(*args, **kw)

    backend.model.forward = spy
    assert backend.generate("Hello").gen_tokens == 4
    assert lengths[0] > 1 and lengths[1:] == [1, 1, 1]  # one new token per step: the cache is used


# ------------------------------------------------------------------ longsft constory


def test_constory_generate_keys_its_cache_by_the_whole_request(model, tmp_path, capsys):
    prompts, out = tmp_path / "p.jsonl", tmp_path / "gen"
    args = ["constory", "generate", f"prompts={prompts}", f"model={model}", "tokenizer=qwen", "max_new_tokens=2",
            "target_words=10", f"out={out}"]
    write_jsonl(prompts, [{"id": "p1", "language": "en", "task_type": "generation", "prompt": "A cat."}])
    assert run_cli(capsys, *args)[0] == 0
    write_jsonl(prompts, [{"id": "p1", "language": "en", "task_type": "generation", "prompt": "A dog instead."}])
    assert run_cli(capsys, *args)[0] == 0
    gens = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
    assert len(gens) == 2 and gens[0]["key"] != gens[1]["key"]  # the edited prompt was generated anew
    assert run_cli(capsys, *args[:-2], "target_words=20", f"out={out}")[0] == 0  # a setting is part of the request
    assert len((out / "generations.jsonl").read_text().splitlines()) == 3
    assert run_cli(capsys, *args)[0] == 0
    assert len((out / "generations.jsonl").read_text().splitlines()) == 3  # the same request: cached


@pytest.mark.parametrize("story, message", [(None, "s.jsonl:2: field 'generated_story' must be a string, got null"),
                                            (7, "s.jsonl:2: field 'generated_story' must be a string, got 7")])
def test_constory_check_story_not_text(tmp_path, capsys, story, message):
    stories = write_jsonl(tmp_path / "s.jsonl", [{"id": "p1", "model_name": "m", "generated_story": "Once."},
                                                 {"id": "p2", "model_name": "m", "generated_story": story}])
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "constory", "check", f"stories={stories}", "judge=j", "backend=openai",
                           "base_url=http://127.0.0.1:9/v1", f"out={tmp_path / 'c'}")
    assert code == 2 and message in err
    assert snapshot(tmp_path) == before and not (tmp_path / "c").exists()


def test_constory_stories_the_judge_never_answered_are_unjudged_not_consistent(tmp_path, capsys):
    stories = write_jsonl(tmp_path / "s.jsonl", [
        {"id": "p1", "model_name": "m", "generated_story": "Anna was born in 1990.\n\nAnna was born in 1985."},
        {"id": "p2", "model_name": "m", "generated_story": ""}])  # a failed generation: nothing to judge
    judge = Server(lambda body: (200, {}, "Hmm, hard to say."))  # never answers with JSON
    try:
        code, out, err = run_cli(capsys, "constory", "check", f"stories={stories}", "judge=j", "backend=openai",
                                 f"base_url={judge.url}", f"out={tmp_path / 'c'}")
    finally:
        judge.close()
    assert code == 3 and "2 of 2 stories unjudged" in err and "Rerun the same command" in err
    assert "| m | 0 | 0 | – | – | 2 |" in out  # no CED 0.00 / GRR 1.00 for stories nobody judged
    reports = [json.loads(x) for x in (tmp_path / "c" / "reports.jsonl").read_text().splitlines()]
    assert [r["judged"] for r in reports] == [False, False] and reports[0]["judge_failures"]
    metrics = json.loads((tmp_path / "c" / "constory_metrics.json").read_text())
    assert metrics["ced"] == {} and metrics["unjudged"] == {"m": 2}
    before = snapshot(tmp_path)
    code, out, err = run_cli(capsys, "constory", "metrics", f"reports={tmp_path / 'c'}", f"out={tmp_path / 'm'}")
    assert code == 3 and "| m | 0 | 0 | – | – | 2 |" in out
    assert {k: v for k, v in snapshot(tmp_path).items() if k in before} == before


def test_unjudged_stories_leave_the_metrics_of_judged_ones_alone():
    from longsft.eval.constory_metrics import metrics

    def r(pid, model, n_errors, **extra):
        return {"id": pid, "model_name": model, "words": 10_000, "n_errors": n_errors, "characters": 50_000,
                "errors": [{"category": "timeline_plot", "subtype": "duration", "quote": {"start": 0}}] * n_errors,
                **extra}

    m = metrics([r("p1", "A", 2), r("p1", "B", 0, judged=False), r("p2", "A", 0), r("p2", "B", 1),
                 r("p3", "B", 0, judge_failures=["no JSON object in the reply"])])  # an older report
    assert m["ced"] == {"A": 1.0, "B": 1.0} and m["stories"] == {"A": 2, "B": 1}
    assert m["unjudged"] == {"B": 2} and m["grr"] == {"A": 1.0, "B": 2.0}  # p1 ranks A alone
