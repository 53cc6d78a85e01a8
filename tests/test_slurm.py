"""SLURM: sweep files, `longsft submit`, and a real local slurmctld/slurmd running the sbatch scripts.

The cluster tests (one node, ``localhost``) submit the curriculum script, signal a running job as
SLURM does before a time limit, and check that it checkpoints, requeues itself and ends exactly like
an uninterrupted run; they run an evaluation sweep. Several nodes, the training array sweep and
faults across hosts: ``test_multinode.py``.
"""

import json
import subprocess
import sys
import time

import pytest
import slurm_cluster
from conftest import ROOT, TWO_STAGES, assert_same_run, skip_or_fail, steps_logged

CLI = [sys.executable, "-m", "longsft.launch.cli"]
SWEEP = ROOT / "launch" / "slurm" / "tiny_sweep.txt"


def cli(*args, cwd=ROOT, env=None, check=True):
    r = subprocess.run([*CLI, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)
    if check and r.returncode != 0:
        raise AssertionError(f"longsft {' '.join(args)}: {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


# ---------------------------------------------------------------- without SLURM


def test_sweep_lists_every_task_with_its_run_dir(tmp_path):
    r = cli("sweep", str(SWEEP), "--root", str(tmp_path), "recipe=tiny")
    names = [line.split("\t")[1] for line in r.stdout.splitlines()]
    assert names == ["base", "lr_low", "seed_1"]
    task = cli("sweep", str(SWEEP), "--root", str(tmp_path), "--task", "1", "--print0", "recipe=tiny", "optim.lr=9")
    assert task.stdout.split("\0")[:-1] == ["recipe=tiny", "optim.lr=9", "optim.lr=1e-3", f"run_dir={tmp_path}/lr_low"]


@pytest.mark.parametrize("text, message", [
    ("a optim.lrr=1\n", "bad.txt:1 (task a): override 'optim.lrr=1': unknown key 'optim.lrr' (did you mean 'optim.lr'?)"),
    ("# c\n\nb 'open\n", "bad.txt:3: No closing quotation"),
    ("a\nb seed=1\na seed=2\n", "bad.txt:3: task name 'a' is also on line 1"),
    ("a seed\n", "bad.txt:1: 'seed' is not key=value"),
    ("seed=1\n", "bad.txt:1: a line starts with the task name"),
    ("a run_dir=/tmp/x\nb run_dir=/tmp/x\n", "bad.txt:2: task b writes to /tmp/x, as task a does"),
    ("# only comments\n", "no task lines"),
])
def test_bad_sweep_lines_are_refused_before_submission(tmp_path, text, message):
    bad = tmp_path / "bad.txt"
    bad.write_text(text)
    r = cli("submit", "--dry-run", "--sweep", str(bad), "--root", str(tmp_path / "root"), "recipe=tiny", check=False)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not (tmp_path / "root").exists()


def test_submit_checks_world_size_before_anything(tmp_path):
    r = cli("submit", "--dry-run", "--gpus-per-node", "0", "--nproc-per-node", "3", "recipe=tiny",
            f"run_dir={tmp_path / 'run'}", check=False)
    assert r.returncode == 2
    assert "parallel.sp_size=2 must divide the world size 3" in r.stderr and "--nodes 1 x 3" in r.stderr
    # 2 nodes x 3: the world divides, but group 2-3 would hold one rank of each node
    r = cli("submit", "--dry-run", "--gpus-per-node", "0", "--nodes", "2", "--nproc-per-node", "3", "recipe=tiny",
            f"run_dir={tmp_path / 'run'}", check=False)
    assert r.returncode == 2 and "sequence-parallel group 2-3 has ranks on node 0 (2), node 1 (3)" in r.stderr
    assert not (tmp_path / "run").exists()


def test_submit_plans_memory_before_booking_gpus(tmp_path):
    """--gpu-gib: the planner runs on the allocation; a stage that would not fit is refused."""
    args = ["submit", "--dry-run", "--nodes", "1", "--gpus-per-node", "8", "recipe=qwen3_8b",
            f"run_dir={tmp_path / 'run'}"]
    r = cli(*args[:-2], "--gpu-gib", "16", *args[-2:], check=False)  # the early stages fit, s64k does not
    assert r.returncode == 2 and "stage s64k needs" in r.stderr and "more than --gpu-gib 16" in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()
    r = cli(*args[:-2], "--gpu-gib", "80", *args[-2:])
    assert "planned peak per GPU: warmup_2k" in r.stdout and "s100k" in r.stdout


def test_dry_run_writes_a_self_contained_submission(tmp_path):
    r = cli("submit", "--dry-run", "--nodes", "2", "--time", "1:00:00", "--sweep", str(SWEEP), "--root",
            str(tmp_path), "--max-parallel", "2", "recipe=tiny")
    sub = next((tmp_path / "submit").iterdir())
    assert f"dry run: {sub / 'command.sh'}" in r.stdout
    command = (sub / "command.sh").read_text()
    for part in ("--nodes=2", "--gpus-per-node=8", "--time=1:00:00", "--array=0-2%2", f"PYTHONPATH={sub / 'code'}",
                 str(sub / "array.sbatch")):
        assert part in command
    assert sorted(p.name for p in (sub / "configs").iterdir()) == ["base.yaml", "lr_low.yaml", "seed_1.yaml"]
    assert "lr: 0.001" in (sub / "configs" / "lr_low.yaml").read_text()
    # the job imports the snapshot, not the checkout
    for f in ("launch/cli.py", "train/scoring/metrics.py", "recipes/tiny.yaml", "ds_configs/zero3_offload.json",
              "launch/slurm/curriculum.sbatch"):
        assert (sub / "code" / "longsft" / f).exists(), f
    snap = subprocess.run([sys.executable, "-c", "import longsft.launch.cli as m; print(m.__file__)"],
                          env={"PYTHONPATH": str(sub / "code")}, capture_output=True, text=True)
    assert snap.stdout.strip() == str(sub / "code" / "longsft" / "launch" / "cli.py")
    assert (sub / "code" / "git.txt").read_text().startswith("commit ")


def test_status_exit_code_says_whether_the_run_is_finished(tmp_path):
    state = {"recipe": "tiny", "stages": {"a": {"status": "done", "steps_done": 2, "total_steps": 2},
                                          "b": {"status": "stopped", "steps_done": 1, "total_steps": 4}}}
    (tmp_path / "state.json").write_text(json.dumps(state))
    r = cli("status", str(tmp_path), check=False)
    assert r.returncode == 1 and "b\tstopped\t1/4" in r.stdout
    state["stages"]["b"]["status"] = "done"
    (tmp_path / "state.json").write_text(json.dumps(state))
    assert cli("status", str(tmp_path), check=False).returncode == 0
    r = cli("status", str(tmp_path / "nope"), check=False)
    assert r.returncode == 2 and "not a run directory" in r.stderr


# ---------------------------------------------------------------- a real SLURM


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    skip_or_fail("SLURM", slurm_cluster.unavailable())
    c = slurm_cluster.start(tmp_path_factory.mktemp("slurm"))
    yield c
    slurm_cluster.stop(c)


@pytest.mark.slow
def test_signalled_job_checkpoints_requeues_and_ends_like_an_uninterrupted_run(cluster, two_stage_ref, tmp_path):
    run_dir = tmp_path / "run"
    r = cli("submit", "--gpus-per-node", "0", "--nproc-per-node", "2", "--cpus-per-task", "2", "recipe=tiny",
            f"run_dir={run_dir}", *TWO_STAGES, cwd=tmp_path, env=cluster.env)
    job = r.stdout.split("job: ")[1].strip()
    deadline = time.time() + 300
    while time.time() < deadline and steps_logged(run_dir, "b") < 1:  # the stop lands on step 2 or 3 of 4
        time.sleep(0.2)
    assert steps_logged(run_dir, "b") >= 1, cluster.logs()
    # what SLURM does before a time limit with --signal=B:USR1@300
    cluster.run("scancel", "--signal=USR1", "--batch", job)
    end = cluster.wait(job)[0]
    log = next((run_dir / "submit").iterdir()).joinpath(f"slurm-{job}.out").read_text()
    assert end["JobState"] == "COMPLETED" and end["Restarts"] == "1", log
    assert "SLURM asked to stop" in log and "requeueing job" in log
    assert "2 CPU(s) per node, 1 thread(s) per rank" in log  # --cpus-per-task 2 shared by 2 ranks
    assert "stopped on request at step" in log and "resumed from" in log
    state = json.loads((run_dir / "state.json").read_text())["stages"]["b"]
    assert state["status"] == "done" and state["steps_done"] == 4
    assert not (run_dir / "STOP").exists()
    assert_same_run(two_stage_ref, run_dir)


@pytest.mark.slow
def test_evaluation_sweep_runs_longsft_eval_per_line(cluster, tmp_path, tiny_model_dir, sample_dir):
    sweep = tmp_path / "eval_sweep.txt"
    sweep.write_text("# prompt variants of one model\nend    prompt=end\nbegin  prompt=begin\n")
    root = tmp_path / "evals"
    common = [f"model={tiny_model_dir('qwen3')}", "tokenizer=qwen", f"data={sample_dir / '512' / 'validation.jsonl'}",
              "max_new_tokens=8", "bootstrap=100", "progress=false", "limit=4"]
    r = cli("submit", "--command", "eval", "--gpus-per-node", "0", "--nproc-per-node", "1", "--cpus-per-task", "1",
            "--sweep", str(sweep), "--root", str(root), *common, cwd=tmp_path, env=cluster.env)
    jobs = cluster.wait(r.stdout.split("job: ")[1].strip())
    sub = next((root / "submit").iterdir())
    assert [j["JobState"] for j in jobs] == ["COMPLETED"] * 2, "\n".join(p.read_text() for p in sub.glob("*.out"))
    for name, prompt in (("end", "end"), ("begin", "begin")):
        e = json.loads((root / name / "eval.json").read_text())
        assert e["n"] == 4 and e["prompt"] == prompt
    report = cli("report", str(root))
    assert "| end |" in report.stdout and "| begin |" in report.stdout  # Table 4 rows named by task


def test_stop_request_by_signal_or_file(tmp_path):
    """SIGUSR1 to a rank, or <run_dir>/STOP, asks for a stop; acting on it clears both."""
    import os
    import signal

    from longsft.train.training.preempt import STOP_FILE, StopRequests

    before = signal.getsignal(signal.SIGINT)  # pytest's Ctrl-C handler (ignored under a backgrounding shell)
    watch = StopRequests(tmp_path, is_main=True)
    assert not watch.requested()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert watch.requested()
    watch.consume()
    assert not watch.requested()
    (tmp_path / STOP_FILE).touch()
    assert watch.requested()
    watch.consume()
    assert not (tmp_path / STOP_FILE).exists() and not watch.requested()
    other = StopRequests(tmp_path, is_main=False)  # only rank 0 reads the file
    (tmp_path / STOP_FILE).touch()
    assert not other.requested()
    other.close(), watch.close()
    assert signal.getsignal(signal.SIGINT) is before  # pytest's Ctrl-C is back


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_and_sigterm_are_stop_requests(tmp_path, capsys, sig):
    """The first Ctrl-C (or SIGTERM) asks for a checkpoint; torchrun's echo of it is ignored; a later one quits."""
    import os
    import signal

    from longsft.train.training.preempt import StopRequests

    before = signal.getsignal(signal.SIGINT)  # Python's Ctrl-C handler, or SIG_IGN under `nohup make test &`
    watch = StopRequests(tmp_path, is_main=True)
    try:
        os.kill(os.getpid(), getattr(signal, sig))
        assert watch.requested()
        if sig == "SIGINT":
            assert "saving a checkpoint at the end of this step" in capsys.readouterr().err
            os.kill(os.getpid(), signal.SIGINT)  # within the grace window: torchrun forwarding the same Ctrl-C
            watch.GRACE_S = 0.0
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
    finally:
        watch.close()
    assert signal.getsignal(signal.SIGINT) is before  # given back as it was, however the tests were started
