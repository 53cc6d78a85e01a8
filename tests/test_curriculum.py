"""The real curriculum on 2 ranks (ZeRO-3 + CPU offload, gloo): run dir, hand-off, resume."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from conftest import ROOT, TEST_OVERRIDES, assert_same_run, free_port, skip_or_fail, torchrun
from safetensors.torch import load_file

from longsft.train.training.checkpoint import complete_tags, latest_resume
from longsft.train.training.tracker import latest_metrics

LAUNCH = str(ROOT / "launch" / "curriculum.py")
# stage c trains with lr 0 from b's best: its output must be b's best, bit for bit
HANDOFF = TEST_OVERRIDES[:-1] + [
    TEST_OVERRIDES[-1][:-1] + ", {name: c, bucket: 1k, seq_len: 1024, max_steps: 1, lr: 0.0}]"]


def _state(run_dir):
    return json.loads((run_dir / "state.json").read_text())


def test_latest_metrics_keeps_the_newest_record_per_step(tmp_path):
    """A resumed run re-logs the steps after its checkpoint, a kill can cut a line: one record per
    (stage, kind, step), the newest, in first-logged order; the cut line skipped."""
    recs = [{"kind": "train", "stage": "a", "step": 1, "loss": 3.0}, {"kind": "train", "stage": "a", "step": 2, "loss": 2.0},
            {"kind": "val", "stage": "a", "step": 2, "balanced_accuracy": 0.5}]
    again = [{"kind": "train", "stage": "a", "step": 2, "loss": 1.5}, {"kind": "val", "stage": "a", "step": 2,
                                                                       "balanced_accuracy": 0.6}]
    lines = [json.dumps(r) for r in recs] + ['{"kind": "train", "sta'] + [json.dumps(r) for r in again]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    got = latest_metrics(tmp_path)
    assert [(r["kind"], r["step"]) for r in got] == [("train", 1), ("train", 2), ("val", 2)]
    assert got[1]["loss"] == 1.5 and got[2]["balanced_accuracy"] == 0.6


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("e2e") / "run"
    r = torchrun([LAUNCH, "recipe=tiny", f"run_dir={run_dir}", *HANDOFF])
    return run_dir, r


@pytest.mark.slow
def test_run_directory_layout(finished_run):
    run_dir, r = finished_run
    state = _state(run_dir)
    assert [s["status"] for s in state["stages"].values()] == ["done"] * 3
    b = state["stages"]["b"]
    assert b["steps_done"] == 4 and len(b["validations"]) == 2  # every_steps=2
    for key in ("balanced_accuracy", "mcc", "invalid_rate"):
        assert key in b["best"]
    assert (run_dir / "config.yaml").exists() and (run_dir / "report.md").exists()
    report = (run_dir / "report.md").read_text()
    assert "| b | done | 4/4 |" in report
    for png in ("plots/loss.png", "plots/val_ba.png"):
        assert (run_dir / png).read_bytes()[:4] == b"\x89PNG"
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {m["kind"] for m in metrics} == {"train", "val"}
    assert all(m["loss"] > 0 and m["tokens_per_s"] > 0 for m in metrics if m["kind"] == "train")
    assert all(m["memory_gb"] > 0 for m in metrics)  # validation rounds too (GPU: each record's own peak)
    # a finished stage keeps its best model only: its resumable checkpoints are deleted
    for name in ("a", "b", "c"):
        assert not (run_dir / "stages" / name / "ckpt").exists()
        assert (run_dir / "stages" / name / "best" / "model.safetensors").exists()
    # validation predictions are in `longsft score` format and score to the recorded metrics
    preds = sorted((run_dir / "stages" / "b" / "val").glob("step_*.jsonl"))
    assert len(preds) == 2
    out = subprocess.run([sys.executable, "-m", "longsft.launch.cli", "score", str(preds[-1]), "--out",
                          str(run_dir / "rescored.json")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    rescored = json.loads((run_dir / "rescored.json").read_text())
    assert rescored["balanced_accuracy"] == pytest.approx(b["validations"][-1]["balanced_accuracy"])


@pytest.mark.slow
def test_best_model_loads_with_transformers(finished_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, _ = finished_run
    path = _state(run_dir)["stages"]["b"]["best"]["path"]
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("hello", return_tensors="pt").input_ids
    assert model(ids).logits.shape[-1] == model.config.vocab_size


@pytest.mark.slow
def test_stage_starts_from_previous_best(finished_run):
    run_dir, _ = finished_run
    state = _state(run_dir)
    assert state["stages"]["b"]["init_from"] == state["stages"]["a"]["best"]["path"]
    assert state["stages"]["c"]["init_from"] == state["stages"]["b"]["best"]["path"]
    b = load_file(run_dir / "stages" / "b" / "best" / "model.safetensors")
    c = load_file(run_dir / "stages" / "c" / "best" / "model.safetensors")
    a = load_file(run_dir / "stages" / "a" / "best" / "model.safetensors")
    assert all(torch.equal(b[k], c[k]) for k in b)  # lr 0: c's weights are b's best
    assert not all(torch.equal(a[k], b[k]) for k in a)  # b did train


@pytest.mark.slow
def test_rerun_resumes_instead_of_retraining(finished_run):
    run_dir, _ = finished_run
    before = _state(run_dir)
    ckpt = run_dir / "stages" / "b" / "best" / "model.safetensors"
    mtime, state_file = ckpt.stat().st_mtime, (run_dir / "state.json").read_bytes()
    r = torchrun([LAUNCH, "recipe=tiny", f"run_dir={run_dir}", *HANDOFF])
    assert r.stdout.count("done, skipping") == 3
    assert (run_dir / "state.json").read_bytes() == state_file  # said done at once: nothing written
    after = _state(run_dir)
    for name in ("a", "b", "c"):
        assert after["stages"][name]["best"] == before["stages"][name]["best"]
    assert ckpt.stat().st_mtime == mtime


@pytest.mark.slow
def test_killed_rank_ends_the_job_and_the_rerun_ends_like_an_uninterrupted_run(tmp_path):
    """kill -9 one rank after two mid-stage checkpoints: the whole job ends quickly. Then damage the
    newest checkpoint (a truncated file): rerunning the same command detects it, resumes from the one
    before and ends exactly like an uninterrupted run. With class-stratified steps (data.stratify): the
    resumed steps draw the same samples."""
    over = TEST_OVERRIDES[:-1] + ["data.stratify=true",
                                  "stages=[{name: a, bucket: '512', seq_len: 512, max_steps: 8, every_steps: 4, "
                                  "save_every_steps: 2}]"]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    torchrun([LAUNCH, "recipe=tiny", f"run_dir={ref_dir}", *over])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           LAUNCH, "recipe=tiny", f"run_dir={run_dir}", *over]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    marker = run_dir / "stages" / "a" / "ckpt" / "step_0000004" / "manifest.json"
    deadline = time.time() + 300
    while not marker.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    ranks = [c for c in psutil.Process(p.pid).children(recursive=True) if "curriculum.py" in " ".join(c.cmdline())]
    victim = next(c for c in ranks if c.environ().get("RANK") == "1")
    victim.send_signal(signal.SIGKILL)
    t0 = time.time()
    _, err = p.communicate(timeout=120)
    assert p.returncode != 0 and time.time() - t0 < 60, "the job must end quickly when a rank dies"
    assert "Signal 9 (SIGKILL)" in err or "exitcode  : -9" in err, err[-3000:]
    _, alive = psutil.wait_procs(ranks, timeout=30)
    assert not alive
    assert _state(run_dir)["stages"]["a"]["status"] == "running"
    tags = complete_tags(run_dir / "stages" / "a" / "ckpt")
    assert len(tags) == 2 and tags[-1].name >= "step_0000004"  # checkpoint.keep=2
    optim = next(tags[-1].glob("*optim_states.pt"))
    with open(optim, "r+b") as f:  # bit of a disk failure: the file loses its tail
        f.truncate(optim.stat().st_size // 2)
    r = torchrun([LAUNCH, "recipe=tiny", f"run_dir={run_dir}", *over])
    assert "(classes stratified per step)" in r.stdout
    assert f"deleted damaged checkpoint {tags[-1]} ({optim.name} has" in r.stdout
    # nothing before the last good save is lost: the rerun starts from it
    assert f"resumed from {tags[-2]} at step {int(tags[-2].name[5:])}" in r.stdout
    assert_same_run(ref_dir, run_dir, "a")
    assert _state(run_dir)["stages"]["a"]["best"]["step"] == _state(ref_dir)["stages"]["a"]["best"]["step"]


@pytest.mark.slow
def test_bad_data_fails_fast_and_overwrites_nothing(tmp_path):
    data = tmp_path / "d" / "512"
    data.mkdir(parents=True)
    good = json.dumps({"id": "1", "language": "en", "article": "a", "summary": "b", "gold_score": 4})
    (data / "train.jsonl").write_text(good + "\n" + '{"id": "2", "language": "en", "article": \n')
    (data / "validation.jsonl").write_text(good + "\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "state.json").write_text("SENTINEL")
    t0 = time.time()
    r = torchrun([LAUNCH, "recipe=tiny", f"run_dir={run_dir}", "data.source=files",
                  f"data.train_file={tmp_path}/d/{{bucket}}/train.jsonl",
                  f"data.validation_file={tmp_path}/d/{{bucket}}/validation.jsonl",
                  "stages=[{name: a, bucket: '512', seq_len: 512, max_steps: 2}]"], check=False)
    assert r.returncode != 0
    assert f"{data / 'train.jsonl'}:2: malformed JSON" in r.stderr
    assert r.stderr.count("malformed JSON") == 1  # said once, not once per rank
    assert time.time() - t0 < 120
    assert (run_dir / "state.json").read_text() == "SENTINEL"
    assert sorted(p.name for p in run_dir.iterdir()) == ["state.json"]


@pytest.mark.slow
def test_one_process_bf16_zero2_with_offline_wandb(tmp_path):
    """`python launch/curriculum.py` (a world of one), bf16, ZeRO-2, wandb offline: no network needed."""
    from transformers import AutoModelForCausalLM

    from longsft.train.common.cpu_features import fast_bf16

    run_dir = tmp_path / "run"
    r = torchrun([LAUNCH, "recipe=tiny", f"run_dir={run_dir}", "model.dtype=bf16", "deepspeed.config=zero2",
                  "parallel.sp_size=1",
                  "logging.wandb=true", *TEST_OVERRIDES[:-1],
                  "stages=[{name: a, bucket: '512', seq_len: 512, max_steps: 2}]"], nproc=1,
                 env={"WANDB_MODE": "offline"})
    # where PyTorch's CPU bf16 matmuls are slow the run says fp32 is faster there; elsewhere it does not
    slow = fast_bf16() is False and not torch.cuda.is_available()
    assert ("model.dtype=fp32 is faster on this machine" in r.stderr) == slow
    state = _state(run_dir)
    assert state["stages"]["a"]["status"] == "done"
    assert list((run_dir / "wandb").glob("offline-run-*"))
    model = AutoModelForCausalLM.from_pretrained(state["stages"]["a"]["best"]["path"])
    assert model.dtype == torch.bfloat16


@pytest.mark.slow
def test_resume_with_a_different_config_is_refused(finished_run):
    run_dir, _ = finished_run
    before = (run_dir / "config.yaml").read_text()
    r = torchrun([LAUNCH, "recipe=tiny", f"run_dir={run_dir}", *HANDOFF, "optim.lr=0.1"], check=False, timeout=120)
    assert r.returncode != 0
    assert "has trained with a different config (optim.lr: 0.005 -> 0.1). To resume it, rerun with its config" in r.stderr
    assert (run_dir / "config.yaml").read_text() == before


@pytest.mark.slow
def test_non_finite_loss_stops_the_stage_with_a_message(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    bad = tmp_path / "nan_model"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen3"))
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    model.save_pretrained(bad)
    run_dir = tmp_path / "run"
    r = torchrun([LAUNCH, "recipe=tiny", f"run_dir={run_dir}", f"model.path={bad}", "model.config=null",
                  "parallel.sp_size=1", *TEST_OVERRIDES[:-1],
                  "stages=[{name: a, bucket: '512', seq_len: 512, max_steps: 3, validate: false}]"], check=False)
    assert r.returncode != 0, r.stderr[-2000:]  # torchrun reports a failed child as 1; the CLI exits 3
    assert "stage a: loss is nan at step 1; stopped" in r.stderr
    assert r.stderr.count("loss is nan") == 1
    state = _state(run_dir)["stages"]["a"]
    assert state["status"] == "failed" and state["error"] == "loss nan at step 1"
    # No step completed: the same run directory takes the corrected config (the model), keeping the old one beside.
    r = torchrun([LAUNCH, "recipe=tiny", f"run_dir={run_dir}", f"model.path={tiny_model_dir('qwen3')}",
                  "model.config=null", "parallel.sp_size=1", *TEST_OVERRIDES[:-1],
                  "stages=[{name: a, bucket: '512', seq_len: 512, max_steps: 3, validate: false}]"])
    assert "never completed a step with its config; training the new config" in r.stderr
    assert _state(run_dir)["stages"]["a"]["status"] == "done" and (run_dir / "config.yaml.untrained").exists()


@pytest.mark.slow
def test_run_directory_in_use_is_refused(tmp_path):
    import fcntl

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open(run_dir / ".lock", "w") as held:  # another job holds the run directory
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("host=elsewhere pid=1 slurm_job=42\n")
        held.flush()
        r = torchrun([LAUNCH, "recipe=tiny", f"run_dir={run_dir}", *TEST_OVERRIDES], check=False, timeout=120)
    assert r.returncode != 0
    assert "is in use by another job (host=elsewhere pid=1 slurm_job=42)" in r.stderr
    assert not (run_dir / "state.json").exists()


@pytest.mark.slow
def test_killing_the_launcher_ends_every_rank(tmp_path):
    """kill -9 of torchrun alone: the ranks die with it instead of training on as orphans."""
    over = TEST_OVERRIDES[:-1] + ["stages=[{name: a, bucket: '512', seq_len: 512, max_steps: 500, validate: false}]"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           LAUNCH, "recipe=tiny", f"run_dir={tmp_path / 'run'}", *over]
    p = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    while not metrics.exists() and time.time() < deadline:  # training is under way
        time.sleep(0.1)
    ranks = psutil.Process(p.pid).children(recursive=True)
    assert len([r for r in ranks if "curriculum.py" in " ".join(r.cmdline())]) == 2
    p.kill()
    p.wait()
    gone, alive = psutil.wait_procs(ranks, timeout=30)
    assert not alive


@pytest.fixture
def small_disk(tmp_path):
    """A real 350 MB filesystem (tmpfs): room for one tiny-recipe checkpoint (≈230 MB), not two."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=350m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        skip_or_fail("disk-full", f"cannot mount a small tmpfs here (needs root): {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow
def test_disk_full_while_saving_keeps_the_previous_checkpoint(tmp_path, small_disk):
    over = TEST_OVERRIDES[:-1] + ["stages=[{name: a, bucket: '512', seq_len: 512, max_steps: 4, validate: false, "
                                  "save_every_steps: 2}]"]
    ref_dir, run_dir = tmp_path / "ref", small_disk / "run"
    torchrun([LAUNCH, "recipe=tiny", f"run_dir={ref_dir}", *over])
    r = torchrun([LAUNCH, "recipe=tiny", f"run_dir={run_dir}", *over], check=False)
    assert r.returncode != 0
    assert "saving the checkpoint of step 4 failed" in r.stderr and "no space left on device" in r.stderr, r.stderr[-3000:]
    kept = run_dir / "stages" / "a" / "ckpt" / "step_0000002"
    assert f"the previous checkpoint {kept} is intact" in r.stderr
    assert latest_resume(run_dir / "stages" / "a") == kept
    assert json.loads((run_dir / "state.json").read_text())["stages"]["a"]["steps_done"] == 2
    # space freed: the same command resumes from step 2 and ends like the uninterrupted run
    subprocess.run(["mount", "-o", "remount,size=1g", str(small_disk)], check=True)
    r = torchrun([LAUNCH, "recipe=tiny", f"run_dir={run_dir}", *over])
    assert f"resumed from {kept} at step 2" in r.stdout
    assert_same_run(ref_dir, run_dir, "a")


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_says_how_to_resume(tmp_path):
    """Ctrl-C: the step in flight finishes, a checkpoint is saved, one line says how to resume (no traceback)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, LAUNCH, "recipe=tiny", f"run_dir={run_dir}", "parallel.sp_size=1", *TEST_OVERRIDES[:-1],
           "stages=[{name: a, bucket: '512', seq_len: 512, max_steps: 200, validate: false}]"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    deadline = time.time() + 300
    while not (run_dir / "metrics.jsonl").exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 75, err[-3000:]
    assert "Traceback" not in err and "interrupted: saving a checkpoint at the end of this step" in err
    assert "stage a: stopped on request at step" in err and "Run the same command to resume" in err
    state = _state(run_dir)["stages"]["a"]
    assert state["status"] == "stopped" and 0 < state["steps_done"] < 200
    assert [t.name for t in complete_tags(run_dir / "stages" / "a" / "ckpt")] == [f"step_{state['steps_done']:07d}"]
