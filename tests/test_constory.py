"""ConStory checker: planted contradictions (en, zh) found at exact offsets through a real HTTP judge;
CED / GRR against hand-computed values (ties included); word counting; the CLI end to end."""

import json
import subprocess
import sys

import pytest
from llm_server import Server

from longsft.eval.backends import OpenAIBackend
from longsft.eval.constory import Judge, check_story, count_words, paragraphs, windows
from longsft.eval.constory_metrics import fractional_ranks, metrics
from longsft.eval.harness import LoadedOnFirstUse
from longsft.train.common.cache import AppendCache

FILLER_EN = "The rain kept falling on the old town, and the river rose a little more each night."
FILLER_ZH = "雨一直下着，小镇的河水每晚都涨高一点。"


def story_en():
    paras = [FILLER_EN] * 12
    paras[1] = "Anna was born in 1990. " + FILLER_EN
    paras[4] = "Anna was born in 1990. She said so again."  # the same quote, consistent, in another paragraph
    paras[8] = FILLER_EN + " Anna was born in 1985."  # the planted contradiction
    return "\n\n".join(paras)


def story_zh():
    paras = [FILLER_ZH] * 10
    paras[0] = "林远生于1990年。" + FILLER_ZH
    paras[2] = "她的眼睛是蓝色的。"
    paras[5] = FILLER_ZH + "林远生于1985年。"
    paras[7] = "她的眼睛是绿色的。" + FILLER_ZH
    return "\n\n".join(paras)


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.close()


def _judge(server, tmp_path):
    backend = LoadedOnFirstUse(lambda: OpenAIBackend("constory-judge", server.url, 512, retries=0))
    return Judge(backend, AppendCache(tmp_path / "cache.jsonl"), "constory-judge")


def test_planted_contradictions_are_found_at_exact_offsets(server, tmp_path):
    story = story_en()
    report = check_story(story, _judge(server, tmp_path))
    paras = paragraphs(story)
    assert len(paras) == 12
    (err,) = report["errors"]
    want = story.index("Anna was born in 1985.")
    assert (err["quote"]["start"], err["quote"]["paragraph"], err["category"]) == (want, 9, "timeline_plot")
    for q in (err["quote"], err["contradiction_pair"]):
        assert story[q["start"]:q["end"]] == q["text"]
    # the repeated sentence keeps the offsets of the paragraph it was quoted from (not the first match)
    located = {s["paragraph"]: s["start"] for s in report["spans"] if s["text"] == "Anna was born in 1990."}
    assert located == {2: paras[1][0], 5: paras[4][0]}
    assert report["judge_failures"] == []  # the bad first quote was re-asked, not kept


def test_chinese_story_two_categories(server, tmp_path):
    story = story_zh()
    report = check_story(story, _judge(server, tmp_path))
    got = sorted((e["category"], story[e["quote"]["start"]:e["quote"]["end"]]) for e in report["errors"])
    assert got == [("factual_detail", "她的眼睛是绿色的。"), ("timeline_plot", "林远生于1985年。")]
    assert report["words"] == count_words(story)


def test_word_counting():
    assert count_words("Anna's sister-in-law came home.") == 4
    assert count_words("林远生于1990年。") == 5 + 1  # five characters and one number
    assert count_words("他说 OK 然后走了") == 6 + 1


def test_long_story_is_read_in_overlapping_windows_not_cut():
    paras = [(i * 100, i * 100 + 90) for i in range(10)]
    w = windows(paras, 350)
    assert w[0][0] == 0 and w[-1][1] == 9
    assert all(b[0] <= a[1] for a, b in zip(w, w[1:]))  # consecutive windows overlap
    assert all(paras[b][1] - paras[a][0] <= 350 for a, b in w)


def test_ced_and_grr_equal_hand_computed_values_with_ties():
    def r(pid, model, words, errors, task="generation"):
        return {"id": pid, "model_name": model, "task_type": task, "words": words, "n_errors": errors,
                "characters": words * 5, "errors": [{"category": "timeline_plot", "subtype": "duration",
                                                      "quote": {"start": words}}] * errors}

    reports = [r("p1", "A", 10_000, 2), r("p1", "B", 5_000, 0), r("p1", "C", 15_000, 2),   # Q: 3333, 5000, 5000
               r("p2", "A", 8_000, 1), r("p2", "B", 8_000, 3, "completion"), r("p2", "C", 4_000, 0)]  # Q: 4000, 2000, 4000
    m = metrics(reports)
    assert m["ced"]["A"] == pytest.approx((2 / 1.0 + 1 / 0.8) / 2)
    assert m["ced"]["B"] == pytest.approx((0 + 3 / 0.8) / 2)
    assert m["ced"]["C"] == pytest.approx((2 / 1.5 + 0) / 2)
    # p1: B and C tie at 5000 -> 1.5 each, A 3; p2: A and C tie at 4000 -> 1.5 each, B 3
    assert m["grr"] == {"A": pytest.approx((3 + 1.5) / 2), "B": pytest.approx((1.5 + 3) / 2), "C": 1.5}
    assert m["errors"] == {"A": 3, "B": 3, "C": 2}  # every error counts
    assert m["by_task_type"]["B"] == {"generation": 0, "continuation": 0, "expansion": 0, "completion": 3}
    assert fractional_ranks({"x": 1.0, "y": 1.0, "z": 1.0}) == {"x": 2.0, "y": 2.0, "z": 2.0}


def test_cli_check_and_metrics_end_to_end(server, tmp_path):
    stories = tmp_path / "stories.jsonl"
    stories.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in (
        {"id": "p1", "language": "en", "task_type": "generation", "model_name": "m1", "generated_story": story_en()},
        {"id": "p2", "language": "zh", "task_type": "continuation", "model_name": "m1",
         "generated_story": story_zh()})))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "longsft.launch.cli", "constory", "check", f"stories={stories}",
                        "judge=constory-judge", "backend=openai", f"base_url={server.url}", f"out={out}"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| m1 | 2 | 3 |" in r.stdout
    assert (out / "error_positions.png").read_bytes()[:4] == b"\x89PNG"
    again = subprocess.run([sys.executable, "-m", "longsft.launch.cli", "constory", "metrics", f"reports={out}",
                            f"out={tmp_path / 'm'}"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "| m1 | 2 | 3 |" in again.stdout


def test_generate_is_cached_and_resumable(tiny_model_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "language": "en", "task_type": "generation",
                                           "prompt": f"Write a story about a lighthouse {i}."}) + "\n" for i in range(2)))
    cmd = [sys.executable, "-m", "longsft.launch.cli", "constory", "generate", f"prompts={prompts}",
           f"model={tiny_model_dir('qwen3')}", "tokenizer=qwen", "max_new_tokens=16", "target_words=500",
           f"out={tmp_path / 'gen'}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    stories = [json.loads(x) for x in (tmp_path / "gen" / "stories.jsonl").read_text().splitlines()]
    assert [s["id"] for s in stories] == ["p0", "p1"] and all(s["generated_story"] for s in stories)
    lines = (tmp_path / "gen" / "generations.jsonl").read_text()
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    assert (tmp_path / "gen" / "generations.jsonl").read_text() == lines  # nothing generated again


def test_check_and_metrics_write_to_a_folder_of_their_own(server, tmp_path, monkeypatch, capsys):
    """No shared default folder: ``check`` writes to one per stories file and judge, ``metrics`` beside the
    reports it reads. A folder holding another check (other stories, judge or backend) is refused, never
    written over; the same check resumes there; an explicit ``out=`` works as before."""
    from pathlib import Path

    from conftest import run_cli, snapshot

    from longsft.eval.constory_cli import ConStoryConfig, default_out

    monkeypatch.chdir(tmp_path)
    qwen = ConStoryConfig(stories="runs/cs/qwen3/stories.jsonl", judge="gpt-4o", backend="openai")
    assert default_out("check", qwen) == Path("runs/constory/check-qwen3-gpt-4o")
    others = {default_out("check", ConStoryConfig(stories="llama.jsonl", judge="gpt-4o", backend="openai")),
              default_out("check", ConStoryConfig(stories=qwen.stories, judge="/models/Judge-7B", backend="hf"))}
    assert others == {Path("runs/constory/check-llama-gpt-4o"), Path("runs/constory/check-qwen3-Judge-7B")}
    assert default_out("generate", ConStoryConfig()) == Path("runs/constory")  # as before
    stories = tmp_path / "s.jsonl"
    stories.write_text(json.dumps({"id": "p1", "model_name": "m1", "generated_story": story_en()}) + "\n")
    check = ["constory", "check", f"stories={stories}", "backend=openai", f"base_url={server.url}"]
    code, out, err = run_cli(capsys, *check, "judge=constory-judge")  # no out=: its own folder
    mine = tmp_path / "runs" / "constory" / "check-s-constory-judge"
    assert code == 0 and (mine / "reports.jsonl").is_file() and (mine / "check.json").is_file(), err
    code, out, err = run_cli(capsys, "constory", "metrics", f"reports={mine}")  # no out=: beside the reports
    assert code == 0 and "| m1 |" in out and (mine / "constory_metrics.md").is_file()
    assert sorted(p.name for p in (tmp_path / "runs" / "constory").iterdir()) == ["check-s-constory-judge"]

    before = snapshot(mine)
    code, _, err = run_cli(capsys, *check, "judge=other-judge", f"out={mine}")  # another judge, the same folder
    assert code == 2 and f"out={mine} holds another ConStory check (judge='constory-judge' there, 'other-judge' " \
                          "now)" in err, err
    other = tmp_path / "other_reports.jsonl"
    other.write_text((mine / "reports.jsonl").read_text())
    code, _, err = run_cli(capsys, "constory", "metrics", f"reports={other}", f"out={mine}")
    assert code == 2 and f"out={mine} is the folder of another ConStory check" in err
    assert snapshot(mine) == before
    assert run_cli(capsys, *check, "judge=constory-judge", f"out={mine}")[0] == 0  # the same check: resumed

    (mine / "check.json").unlink()  # a folder written before check.json: its reports say whose it is
    assert run_cli(capsys, *check, "judge=constory-judge", f"out={mine}")[0] == 0
    (mine / "check.json").unlink()
    stories.write_text(json.dumps({"id": "p2", "model_name": "m1", "generated_story": story_en()}) + "\n")
    code, _, err = run_cli(capsys, *check, "judge=constory-judge", f"out={mine}")
    assert code == 2 and f"out={mine} holds the reports of other stories" in err
