"""The bad-input catalogue (README): the classes not covered next to their feature's tests.

Each case checks the message a user gets, naming the file, line or key at fault.
"""

import json

import pytest
import torch

from conftest import ROOT, TEST_OVERRIDES, torchrun
from longsft.train.checkpoint import MANIFEST, load_resume
from longsft.train.config import ConfigError, load_config, validate
from longsft.train.curriculum import load_state
from longsft.train.data import load_samples
from longsft.train.distributed import Dist, ParallelDims
from longsft.train.io import DataError

LAUNCH = str(ROOT / "launch" / "curriculum.py")


def test_unknown_recipe_names_the_nearest():
    with pytest.raises(ConfigError, match=r"unknown recipe 'qwen3_32' \(did you mean 'qwen3_32b'\?\)"):
        load_config("qwen3_32")


def test_recipe_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="recipe file not found: .*nope.yaml"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  lr: [1,\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: invalid YAML"):
        load_config(str(bad))
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(f"base: {b}\n")
    b.write_text(f"base: {a}\n")
    with pytest.raises(ConfigError, match="circular base chain"):
        load_config(str(a))


def test_cross_field_values():
    cfg = load_config("tiny", ["checkpoint.keep=0"])
    with pytest.raises(ConfigError, match=r"checkpoint.keep=0 must be >= 1"):
        validate(cfg)


def test_data_file_missing_or_empty(tmp_path):
    with pytest.raises(DataError, match=r"missing.jsonl: file not found"):
        load_samples(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"empty.jsonl: no samples"):
        load_samples(tmp_path / "empty.jsonl")


def test_run_directory_of_another_curriculum_is_refused(tmp_path):
    cfg = load_config("tiny", [f"run_dir={tmp_path}"])
    (tmp_path / "state.json").write_text(json.dumps({"recipe": "x", "stages": {"s2k": {}, "s16k": {}}}))
    with pytest.raises(ConfigError, match=r"holds stages \['s2k', 's16k'\], the recipe has"):
        load_state(cfg)


def test_resume_with_another_world_size_is_refused(tmp_path):
    (tmp_path / MANIFEST).write_text(json.dumps({"step": 2, "world_size": 2, "files": {}, "trainer_state": {}}))
    d = Dist(rank=0, local_rank=0, dims=ParallelDims(4, 1), device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="was saved with 2 ranks, this job has 4; resume with the same number"):
        load_resume(None, d, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("n_train, val_words, message", [
    (1, 3, "stage 'a': 1 usable samples in {train} (of 1; 0 skipped as longer than 512) do not fill one global "
           "batch of 2"),
    (4, 2000, "stage 'a': no usable validation samples in {val}"),  # every one longer than the stage: skipped
])
def test_stage_data_too_small_fails_before_training(tmp_path, n_train, val_words, message):
    data = tmp_path / "d" / "512"
    data.mkdir(parents=True)

    def write(name, n, words):
        recs = [{"id": f"{name}{i}", "language": "en", "article": " ".join(["word"] * words), "summary": "A tale.",
                 "gold_score": 4} for i in range(n)]
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))

    write("train", n_train, 3)
    write("validation", 2, val_words)
    r = torchrun([LAUNCH, "recipe=tiny", f"run_dir={tmp_path / 'run'}", "parallel.sp_size=1", "data.source=files",
                  f"data.train_file={tmp_path}/d/{{bucket}}/train.jsonl",
                  f"data.validation_file={tmp_path}/d/{{bucket}}/validation.jsonl", *TEST_OVERRIDES[:-1],
                  "stages=[{name: a, bucket: '512', seq_len: 512, max_steps: 2, overflow: skip}]"],
                 nproc=1, check=False, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert message.format(train=data / "train.jsonl", val=data / "validation.jsonl") in r.stderr
    assert not (tmp_path / "run" / "stages" / "a" / "ckpt").exists()  # failed before any training


def test_config_get_of_an_unknown_key(capsys):
    from longsft.train.cli import main

    assert main(["config", "--get", "optim.lrr", "recipe=tiny"]) == 2
    assert "--get optim.lrr: no key 'lrr'" in capsys.readouterr().err
    assert main(["config", "--get", "optim.lr", "recipe=tiny"]) == 0
    assert capsys.readouterr().out.strip() == "0.005"


def test_cross_field_stage_names_and_model():
    with pytest.raises(ConfigError, match=r"stage names must be unique, repeated: \['a'\]"):
        validate(load_config("tiny", ["stages=[{name: a, bucket: '512'}, {name: a, bucket: 1k}]"]))
    with pytest.raises(ConfigError, match="model.path or model.config must be set"):
        validate(load_config("tiny", ["model.config=null"]))


@pytest.mark.parametrize("line, message", [
    ('{"id": 1, "prediction": "x"}', "pred.jsonl:1: missing field(s) ['gold_score']"),
    ('{"id": 1, "prediction": "x", "gold_score": 7}', "pred.jsonl:1: gold_score must be a number in 0..5, got 7"),
])
def test_predictions_to_score(tmp_path, line, message):
    from longsft.eval.score import load_predictions

    (tmp_path / "pred.jsonl").write_text(line + "\n")
    with pytest.raises(DataError) as e:
        load_predictions(tmp_path / "pred.jsonl")
    assert message in str(e.value)


def test_report_of_a_folder_without_runs(tmp_path):
    from longsft.train.report import aggregate

    with pytest.raises(ConfigError, match="neither a run directory nor a folder of run directories"):
        aggregate([tmp_path])


@pytest.mark.parametrize("path, message", [("/nope/model", "model.path=/nope/model: no such folder"),
                                           ("{empty}", "cannot read its config.json")])
def test_model_path_that_is_not_a_model(tmp_path, capsys, path, message):
    from longsft.train.cli import main

    (tmp_path / "empty").mkdir()
    path = path.format(empty=tmp_path / "empty")
    assert main(["train", "recipe=tiny", f"model.path={path}", "model.config=null", f"run_dir={tmp_path / 'run'}"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
