"""The bad-input catalogue (README): the classes not covered next to their feature's tests.

Each case checks the message a user gets, naming the file, line or key at fault.
"""

import json

import pytest
import torch
import yaml
from conftest import ROOT, TEST_OVERRIDES, torchrun

from longsft.train.common.errors import ConfigError, DataError
from longsft.train.config.checks import validate
from longsft.train.config.recipes import load_config
from longsft.train.data.schema import load_samples
from longsft.train.parallel.distributed import Dist, ParallelDims, cpu_threads
from longsft.train.training.checkpoint import MANIFEST, load_resume
from longsft.train.training.rundir import check_run_dir, load_state

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


def test_cpu_threads_per_rank(monkeypatch):
    """LONGSFT_THREADS (what the SLURM script passes on) wins; unset, the process's CPUs are shared by
    the node's ranks; a bad value is named."""
    import os

    monkeypatch.delenv("LONGSFT_THREADS", raising=False)
    assert cpu_threads(1) == len(os.sched_getaffinity(0))
    assert cpu_threads(1000) == 1
    monkeypatch.setenv("LONGSFT_THREADS", "3")
    assert cpu_threads(2) == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("LONGSFT_THREADS", bad)
        with pytest.raises(ConfigError, match=f"LONGSFT_THREADS='{bad}': expected a whole number"):
            cpu_threads(1)


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
    (tmp_path / "state.json").write_text(json.dumps({"recipe": "x", "stages": {"s2k": {"status": "done"}, "s16k": {"status": "pending"}}}))
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
    from longsft.launch.cli import main

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
    ('{"id": 1, "prediction": "x", "gold_score": 7}', "pred.jsonl:1: gold_score must be an integer 0..5, got 7"),
])
def test_predictions_to_score(tmp_path, line, message):
    from longsft.train.scoring.score import load_predictions

    (tmp_path / "pred.jsonl").write_text(line + "\n")
    with pytest.raises(DataError) as e:
        load_predictions(tmp_path / "pred.jsonl")
    assert message in str(e.value)


def test_report_of_a_folder_without_runs(tmp_path):
    from longsft.train.training.report import aggregate

    with pytest.raises(ConfigError, match="neither a run directory nor a folder of run directories"):
        aggregate([tmp_path])


@pytest.mark.parametrize("path, message", [("/nope/model", "model.path=/nope/model: not found"),
                                           ("{empty}", "empty: cannot read the model's config")])
def test_model_path_that_is_not_a_model(tmp_path, capsys, path, message):
    from longsft.launch.cli import main

    (tmp_path / "empty").mkdir()
    path = path.format(empty=tmp_path / "empty")
    assert main(["train", "recipe=tiny", f"model.path={path}", "model.config=null", f"run_dir={tmp_path / 'run'}"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- every command (issue 17): recipes and overrides


@pytest.mark.parametrize("text, message", [
    (b"base: [tiny]\n", "bad.yaml:1: base must be one recipe name or path, got ['tiny']"),
    (b"a: &x [*x]\n", "bad.yaml: nested too deeply, or a YAML alias that refers to itself"),
    (b"optim: &o\n  lr: *o\n", "bad.yaml: nested too deeply, or a YAML alias that refers to itself"),
    (b"optim:\n  lr: \xff\xfe\n", "bad.yaml:2: not UTF-8 text"),
])
def test_broken_recipe_files(tmp_path, capsys, text, message):
    from conftest import run_cli

    (tmp_path / "bad.yaml").write_bytes(text)
    code, _, err = run_cli(capsys, "config", f"recipe={tmp_path / 'bad.yaml'}")
    assert code == 2 and message in err, err


def test_a_folder_given_as_recipe(tmp_path, capsys):
    from conftest import run_cli

    code, _, err = run_cli(capsys, "config", f"recipe={tmp_path}")
    assert code == 2 and f"{tmp_path}: is a directory, expected a file" in err


@pytest.mark.parametrize("override, message", [
    ("optim.lr=nan", "'optim.lr' must be a finite number, got nan"),
    ("optim.lr=.inf", "'optim.lr' must be a finite number, got inf"),
    ("optim.lr=-1", "optim.lr=-1.0 must be > 0"),
    ("stages.0.epochs=nan", "'stages.0.epochs' must be a finite number"),
    ("stages.0.lr=-0.1", "stages.0.lr=-0.1 must be >= 0"),
    ("logging.log_every=0", "logging.log_every=0 must be >= 1"),
    ("optim.betas=[0.9, 1.5]", "optim.betas.1=1.5 must be in [0, 1)"),
    ("optim.min_lr_ratio=2", "optim.min_lr_ratio=2.0 must be >= 0 and <= 1"),
    ("parallel.pad_multiple=0", "parallel.pad_multiple=0 must be auto or >= 1"),
    ("stages.0.name=../../x", "stages.0.name='../../x' is not a plain name"),
    ("stages.0.name=/abs", "stages.0.name='/abs' is not a plain name"),
    ("stages.1.bucket=..", "stages.1.bucket='..' is not a plain name"),
])
def test_values_out_of_range_are_refused_by_every_command(tmp_path, capsys, override, message):
    """`config`, `train` and `plan` refuse alike, and `train` before the run directory exists."""
    from conftest import run_cli

    for cmd in ("config", "train", "plan"):
        code, _, err = run_cli(capsys, cmd, "recipe=tiny", override, f"run_dir={tmp_path / 'run'}")
        assert code == 2 and message in err, (cmd, err)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- run directories


def test_run_dir_that_is_someone_elses_folder_is_left_alone(tmp_path, capsys):
    from conftest import run_cli, snapshot

    theirs = tmp_path / "results"
    (theirs / "plots").mkdir(parents=True)
    (theirs / "report.md").write_text("my paper's numbers\n")
    (theirs / "plots" / "fig1.png").write_bytes(b"\x89PNG")
    before = snapshot(theirs)
    code, _, err = run_cli(capsys, "train", "recipe=tiny", f"run_dir={theirs}")
    assert code == 2 and f"run_dir={theirs} exists and is not a longsft run directory (it holds plots, report.md)" in err
    assert snapshot(theirs) == before
    submitted = tmp_path / "submitted"  # what `longsft submit` and the sbatch script leave before the run starts
    (submitted / "submit" / "20261201-000000").mkdir(parents=True)
    (submitted / "STOP").touch()
    check_run_dir(load_config("tiny", [f"run_dir={submitted}"]))
    (tmp_path / "file").write_text("x")
    code, _, err = run_cli(capsys, "train", "recipe=tiny", f"run_dir={tmp_path / 'file'}")
    assert code == 2 and "is a file, not a folder" in err


def _fake_run(run_dir, cfg_overrides=(), trained=False):
    """A run directory as a run leaves it: config.yaml, state.json (and a best model if ``trained``)."""
    from longsft.train.config.loader import dump_yaml

    run_dir.mkdir(parents=True)
    cfg = load_config("tiny", [f"run_dir={run_dir}", *cfg_overrides])
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    stages = {s.name: {"status": "failed" if i == 0 else "pending", "steps_done": 0} for i, s in enumerate(cfg.stages)}
    if trained:
        first = cfg.stages[0].name
        stages[first] = {"status": "done", "steps_done": 4, "total_steps": 4,
                         "best": {"path": str(run_dir / "stages" / first / "best"), "step": 4,
                                  "balanced_accuracy": 0.5, "mcc": 0.0}}
        (run_dir / "stages" / first / "best").mkdir(parents=True)
    (run_dir / "state.json").write_text(json.dumps({"recipe": "tiny", "stages": stages}))
    (run_dir / "report.md").write_text("the run's own report\n")
    return cfg


def test_a_run_that_never_trained_takes_a_corrected_config(tmp_path, capsys):
    from longsft.train.training.rundir import check_resolved_config

    _fake_run(tmp_path / "run", ["optim.lr=1e-3"])
    assert check_resolved_config(load_config("tiny", [f"run_dir={tmp_path / 'run'}", "optim.lr=1e-4"])) is True
    _fake_run(tmp_path / "trained", ["optim.lr=1e-3"], trained=True)
    with pytest.raises(ConfigError, match=r"has trained with a different config \(optim.lr: 0.001 -> 0.0001\)\. To "
                                          r"resume it, rerun with its config \(`longsft train recipe=.*config.yaml`\)"):
        check_resolved_config(load_config("tiny", [f"run_dir={tmp_path / 'trained'}", "optim.lr=1e-4"]))
    assert check_resolved_config(load_config("tiny", [f"run_dir={tmp_path / 'trained'}", "optim.lr=1e-3"])) is False
    # a run made before a key existed (model.gguf_file, validation.whole_model_gb) resumes: the key is at its
    # default
    saved = tmp_path / "trained" / "config.yaml"
    old = yaml.safe_load(saved.read_text())
    del old["model"]["gguf_file"], old["validation"]["whole_model_gb"]  # defaults None and 4.0
    saved.write_text(yaml.safe_dump(old))
    assert check_resolved_config(load_config("tiny", [f"run_dir={tmp_path / 'trained'}", "optim.lr=1e-3"])) is False
    # and resumes with memory settings changed (after running out of memory, say): the same training
    old["model"]["keep_attention"], old["model"]["mlp_tile_tokens"] = False, 1024  # now: auto, 0
    old["model"]["sdpa_cudnn"] = True  # a kernel choice: now false
    saved.write_text(yaml.safe_dump(old))
    assert check_resolved_config(load_config("tiny", [f"run_dir={tmp_path / 'trained'}", "optim.lr=1e-3"])) is False
    assert "resuming with model.keep_attention: False -> 'auto'; model.mlp_tile_tokens: 1024 -> 0; " \
           "model.sdpa_cudnn: True -> False (memory and speed settings only)" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"optim.lr: 0.001 -> 0.0001"):  # not with anything else changed
        check_resolved_config(load_config("tiny", [f"run_dir={tmp_path / 'trained'}", "optim.lr=1e-4"]))


def test_a_finished_curriculum_returns_at_once(tmp_path):
    """A rerun of a finished curriculum with its config says each stage is done before torch is imported,
    and writes nothing; anything else (another config, a stage left, a damaged state) is the curriculum's."""
    import subprocess
    import sys

    from conftest import snapshot

    from longsft.train.training.rundir import finished

    run = tmp_path / "run"
    cfg = _fake_run(run, trained=True)
    state = json.loads((run / "state.json").read_text())
    for entry in state["stages"].values():
        entry["status"] = "done"
    (run / "state.json").write_text(json.dumps(state))
    assert finished(cfg) == state
    assert finished(load_config("tiny", [f"run_dir={run}", "logging.log_every=5"])) == state
    assert finished(load_config("tiny", [f"run_dir={run}", "optim.lr=1e-4"])) is None  # refused by the curriculum
    assert finished(load_config("tiny", [f"run_dir={run}", "model.keep_attention=false"])) is None  # resumed there
    before = snapshot(run)
    code = ("import sys; from longsft.launch.cli import main; rc = main(['train', 'recipe=tiny', 'run_dir=' + "
            "sys.argv[1]]); assert 'torch' not in sys.modules; sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.count("done, skipping") == len(cfg.stages), r.stderr
    assert snapshot(run) == before
    state["stages"][cfg.stages[-1].name]["status"] = "running"
    (run / "state.json").write_text(json.dumps(state))
    assert finished(cfg) is None
    (run / "state.json").write_text("{")
    assert finished(cfg) is None


def test_report_of_a_run_keeps_the_runs_own_report(tmp_path, capsys):
    from conftest import run_cli, snapshot

    run = tmp_path / "run"
    _fake_run(run, trained=True)
    before = snapshot(run)
    code, out, _ = run_cli(capsys, "report", run, "--bootstrap", "0")
    assert code == 0 and "| run | tiny |" in out
    assert snapshot(run) == before
    code, _, err = run_cli(capsys, "report", run, "--out", run)
    assert code == 2 and "is a run directory: its report.md is the run's own" in err
    code, _, err = run_cli(capsys, "report", run, "--bootstrap", "-5")
    assert code == 2 and "--bootstrap -5: replicates must be >= 0" in err
    assert snapshot(run) == before


@pytest.mark.parametrize("cmd", ["status", "report"])
@pytest.mark.parametrize("content, message", [("{\"recipe\": \"tiny\", \"stag", "state.json:1: malformed JSON"),
                                              ("[1, 2]", "state.json: not a longsft state file"),
                                              ("", "state.json: empty state file")])
def test_cut_off_state_file(tmp_path, capsys, cmd, content, message):
    from conftest import run_cli, snapshot

    (tmp_path / "state.json").write_text(content)
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, cmd, tmp_path)
    assert code == 2 and message in err, err
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------- plan, sweep


@pytest.mark.parametrize("config, message", [
    ('{"model_type": "qwen3", "vocab', "config.json:1: malformed JSON"),
    ('{"model_type": "qwenn3", "vocab_size": 8}', "model_type 'qwenn3' is not one this transformers knows "
                                                  "(did you mean 'qwen3'?)"),
    ('{"model_type": "qwen3"}', "config.json: no vocab_size, hidden_size, num_hidden_layers, num_attention_heads"),
    ('{"model_type": "qwen3", "vocab_size": 100, "hidden_size": -64, "num_hidden_layers": 2, '
     '"num_attention_heads": 4}', "config.json: hidden_size=-64 must be a positive integer"),
])
def test_plan_of_a_broken_model_config(tmp_path, capsys, config, message):
    from conftest import run_cli

    (tmp_path / "config.json").write_text(config)
    code, _, err = run_cli(capsys, "plan", "recipe=tiny", f"model.path={tmp_path}", "model.config=null")
    assert code == 2 and message in err, err


@pytest.mark.parametrize("flags, message", [
    (["--gpus-per-node", "0"], "--gpus-per-node 0: must be >= 1"),
    (["--nodes", "-1"], "--nodes -1: must be >= 1"),
    (["--gpu-gib", "-3"], "--gpu-gib -3.0: must be a positive number of GiB"),
    (["--fragmentation", "1"], "--fragmentation 1.0: must be in [0, 1)"),
    (["--targets", "0"], "--targets 0: loss tokens per sequence must be >= 1"),
    (["--json", "{tmp}/no/such/x.json"], "x.json: folder {tmp}/no/such does not exist"),
    (["--json", "{tmp}"], "{tmp}: is a directory; give a file name"),
])
def test_plan_flags_out_of_range(tmp_path, capsys, flags, message):
    from conftest import run_cli

    code, _, err = run_cli(capsys, "plan", "recipe=tiny", *[f.format(tmp=tmp_path) for f in flags])
    assert code == 2 and message.format(tmp=tmp_path) in err, err


def test_binary_sweep_file(tmp_path, capsys):
    from conftest import run_cli

    (tmp_path / "t.sweep").write_bytes(b"a optim.lr=1e-5\n\x89PNG\xff\n")
    code, _, err = run_cli(capsys, "sweep", tmp_path / "t.sweep")
    assert code == 2 and "t.sweep:2: not UTF-8 text" in err, err


def test_an_override_that_contains_itself(capsys):
    from conftest import run_cli

    code, _, err = run_cli(capsys, "config", "recipe=tiny", "stages=&a [*a]")
    assert code == 2 and "override 'stages=&a [*a]': a YAML alias refers to itself" in err, err


def test_first_run_says_it_builds_cpu_adam(tmp_path, monkeypatch, capsys):
    from longsft.train.training.engine import _say_if_building_cpu_adam

    ds = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}, "optimizer": {"params": {}}}
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    _say_if_building_cpu_adam(ds)
    assert "building DeepSpeed's CPU Adam extension once" in capsys.readouterr().out
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    _say_if_building_cpu_adam(ds)
    assert capsys.readouterr().out == ""


def test_learn_bench_refuses_a_stage_smaller_than_one_step(tmp_path):
    """bench/learn.py --gpu trains in steps of 4: buckets of fewer samples, and a bad key=value, are refused in
    one line before any data, evaluation or training (the curriculum would refuse them only after both)."""
    import subprocess
    import sys

    out = tmp_path / "learn"
    for extra, message in ((["--n-1k", "2"], "--n-1k 2: each stage needs at least one optimizer step of 4 samples"),
                           (["optim.grad_accum=zero"], "'optim.grad_accum' must be an integer, got 'zero'")):
        r = subprocess.run([sys.executable, str(ROOT / "bench" / "learn.py"), "--gpu", *extra, "--out", str(out)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr
        assert not out.exists()


def test_retest_bench_refuses_a_run_it_cannot_test(tmp_path):
    """bench/retest.py refuses, in one line and before drawing or evaluating anything, the training data's
    seed, a folder that is no learn.py run, an unfinished run, one without its data, no test size, an odd
    one and a best without weights."""
    import subprocess
    import sys

    run = tmp_path / "learn"
    (run / "run").mkdir(parents=True)
    best = run / "run" / "stages" / "s512" / "best"

    def refusal(*extra: str, state: str | None = None) -> str:
        if state:
            (run / "run" / "state.json").write_text(json.dumps({"stages": {"s512": {
                "status": state, "best": {"path": str(best)}}}}))
            train_file = "x/data/counterfactual/{bucket}/train.jsonl"
            (run / "run" / "config.yaml").write_text(f"data:\n  train_file: {train_file}\n")
        r = subprocess.run([sys.executable, str(ROOT / "bench" / "retest.py"), "--run", str(run), *extra],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not (run / "retest").exists()
        return r.stderr

    assert "--seed 42: the training data's seed" in refusal("--seed", "42")
    assert "--json '../../x': a plain file name" in refusal("--seed", "7", "--json", "../../x")
    assert "not a bench/learn.py working folder" in refusal("--seed", "7")
    assert "stage(s) s512 not done" in refusal("--seed", "7", state="running")
    assert "the run's data are not there" in refusal("--seed", "7", state="done")
    (run / "data" / "counterfactual" / "512").mkdir(parents=True)
    (run / "data" / "counterfactual" / "512" / "train.jsonl").write_text("")
    assert "no test set to take the size from; give --test" in refusal("--seed", "7")
    assert "--test 3: an even number" in refusal("--seed", "7", "--test", "3")
    assert "best checkpoint has no weights" in refusal("--seed", "7", "--test", "4")


def test_table5_bench_refuses_options_it_cannot_honour(tmp_path):
    """bench/table5_mini.py refuses, before sampling anything, --gpu-sizes with --smoke or --gpu, a results
    name leading out of bench/results, a negative --judge-steps, a report of no run and a working folder made
    with other sizes (its data and answers were made for those)."""
    import subprocess
    import sys

    out = tmp_path / "t5"

    def refusal(*args: str) -> str:
        r = subprocess.run([sys.executable, str(ROOT / "bench" / "table5_mini.py"), "--out", str(out), *args],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2, r.stderr
        assert not (out / "human.jsonl").exists() and not (out / "sample").exists()
        return r.stderr

    assert "--gpu-sizes with --smoke" in refusal("--smoke", "--gpu-sizes")
    assert "--gpu-sizes with --gpu" in refusal("--gpu", "--gpu-sizes")
    assert "a plain file name" in refusal("--smoke", "--json", "../x")
    assert "--judge-steps -1" in refusal("--smoke", "--judge-steps", "-1")
    assert "holds no run of this script" in refusal("--report")
    assert not out.exists()  # (nothing made a folder)
    out.mkdir()
    (out / "sizes.json").write_text(json.dumps({"articles": 3}))
    err = refusal("--gpu-sizes")
    assert "was made with sizes" in err and len(err.strip().splitlines()) == 1, err
    assert json.loads((out / "sizes.json").read_text()) == {"articles": 3}  # the folder's record kept
    (out / "sizes.json").write_bytes(b"\xff\xfe")
    assert "not this script's sizes record" in refusal("--report")
    assert (out / "sizes.json").read_bytes() == b"\xff\xfe"
    (tmp_path / "f").write_text("mine")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "table5_mini.py"), "--out", str(tmp_path / "f")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "a file, not a folder" in r.stderr and (tmp_path / "f").read_text() == "mine"


def test_table5_bench_report_writes_what_the_folder_holds(tmp_path):
    """bench/table5_mini.py --report on a run that has made its sweep file and nothing after: a results file
    marked incomplete, the arm listed untrained, no rows, the tables' headers printed; the run's folder left
    as it was (no log line, no wall time)."""
    import ast
    import os
    import subprocess
    import sys

    script = ast.parse((ROOT / "bench" / "table5_mini.py").read_text())
    sizes = next(ast.literal_eval(node.value) for node in script.body
                 if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "SIZES")
    out = tmp_path / "t5"
    (out / "arms").mkdir(parents=True)
    (out / "sizes.json").write_text(json.dumps(sizes["smoke"], sort_keys=True))
    (out / "arms" / "table5.sweep").write_text("# name  overrides\nmma_only_4  data.source=files\n")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    name = f"test_table5_report_{os.getpid()}"
    result = ROOT / "bench" / "results" / f"{name}.json"
    try:
        r = subprocess.run([sys.executable, str(ROOT / "bench" / "table5_mini.py"), "--smoke", "--out", str(out),
                            "--report", "--note", "a test", "--json", name],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert "| training data | samples |" in r.stdout
        written = json.loads(result.read_text())
        assert written["complete"] is False and written["rows"] == [] and written["note"].endswith("a test")
        assert written["arm_training"] == {"mma_only_4": None}
    finally:
        result.unlink(missing_ok=True)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
