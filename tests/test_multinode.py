"""Multi-node SLURM across separate network hosts: three SLURM nodes, each a network namespace with
its own address, hostname, /etc/hosts and /dev/shm (tests/net_hosts.py), its own slurmd; one
slurmctld on the bridge's address. Jobs run through `longsft submit`, one torchrun per node (srun),
c10d rendezvous between the hosts, gloo between the ranks.

The hosts files map each host's own name to 127.0.1.1, as Debian writes them: gloo alone would
listen on loopback there, so these runs fail unless longsft picks the interface itself.
"""

import json
import subprocess
import sys
import time

import net_hosts
import psutil
import pytest
import slurm_cluster
from conftest import (
    ROOT,
    TEST_OVERRIDES,
    TWO_STAGES,
    assert_same_run,
    run_metrics,
    skip_or_fail,
    steps_logged,
    torchrun,
)

CLI = [sys.executable, "-m", "longsft.launch.cli"]
NODES = ["node0", "node1", "node2"]
# 2 x 2: one short stage (4 ranks share the 2 cores)
SHORT = [*TEST_OVERRIDES[:-1], "stages=[{name: b, bucket: 1k, seq_len: 1024, max_steps: 2, every_steps: 2}]"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    skip_or_fail("SLURM", slurm_cluster.unavailable())
    skip_or_fail("multi-node", net_hosts.unavailable())
    c = slurm_cluster.start_hosts(tmp_path_factory.mktemp("slurm_hosts"), NODES, cpus=2)
    yield c
    slurm_cluster.stop(c)


def submit(cluster, tmp_path, run_dir, procs=1, cpus=1, overrides=TWO_STAGES):
    r = subprocess.run([*CLI, "submit", "--gpus-per-node", "0", "--nodes", "2", "--nproc-per-node", str(procs),
                        "--cpus-per-task", str(cpus), "recipe=tiny", f"run_dir={run_dir}", *overrides],
                       cwd=tmp_path, env=cluster.env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.split("job: ")[1].strip()


def job_log(run_dir, job) -> str:
    return next((run_dir / "submit").glob(f"*/slurm-{job}.out")).read_text()


def wait_for_step(cluster, run_dir, job, stage, step, timeout=300):
    deadline = time.time() + timeout
    while steps_logged(run_dir, stage) < step:
        assert time.time() < deadline, f"no step {stage}/{step} after {timeout} s\n{cluster.logs()}"
        assert cluster.job(job)["JobState"] not in slurm_cluster.ENDED, job_log(run_dir, job)
        time.sleep(0.2)


def torchrun_on(cluster, node: str) -> psutil.Process:
    """The torchrun agent running on ``node`` (found by its network namespace)."""
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "torch.distributed.run" in cmd and (h := cluster.hosts.host_of(p.pid)) and h.name == node:
            return p
    raise AssertionError(f"no torchrun on {node}")


def test_interface_choice_without_a_cluster():
    """On the rendezvous host whose names map to loopback (here: this machine's root namespace): the
    one interface if there is one (container bridges do not count), else a warning naming them and the
    variable to set; nothing for a world on one host, or when the user chose."""
    from longsft.train.parallel import netif

    assert netif.choose("127.0.0.1", {"eth0": "192.0.2.10"})[0] == "eth0"
    name, why = netif.choose("127.0.0.1", {"ib0": "192.0.2.20", "eth0": "192.0.2.10"})
    assert name is None and "the up interfaces are eth0 (192.0.2.10), ib0 (192.0.2.20). gloo keeps its own" in why
    assert "set GLOO_SOCKET_IFNAME" in why
    one_host = [dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="vm"),  # one node
                dict(WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", MASTER_ADDR="localhost"),  # two agents, one host
                dict(WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1"),
                dict(WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", MASTER_ADDR="::1"),
                dict(WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", MASTER_ADDR=""),
                dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", MASTER_ADDR="n0", GLOO_SOCKET_IFNAME="ib7")]
    for env in one_host:
        before = dict(env)
        assert netif.setup_gloo_interface(env) is None and env == before, env
    assert all(not n.startswith(("docker", "virbr", "br-", "lo")) for n in netif.interfaces())


@pytest.mark.parametrize("hosts, sp, verdict", [
    (["a", "a", "b", "b"], 2, "4 rank(s) on 2 node(s); sequence-parallel groups of 2 inside a node"),
    (["a", "b"], 2, "groups of 2 across whole nodes"),
    (["a"] * 2 + ["b"] * 2 + ["c"] * 2 + ["d"] * 2, 4, "groups of 4 across whole nodes"),
    (["a"] * 6 + ["b"] * 6, 4, "group 4-7 has ranks on a (4-5), b (6-7), and a also holds ranks outside the group"),
    (["a", "b", "a", "b"], 2, "group 0-1 has ranks on a (0), b (1), and a also holds ranks outside the group"),
])
def test_sequence_parallel_groups_lie_inside_nodes_or_over_whole_nodes(hosts, sp, verdict):
    from longsft.train.common.errors import ConfigError
    from longsft.train.parallel.distributed import ParallelDims

    dims = ParallelDims(len(hosts), sp)
    if "also holds" in verdict:
        with pytest.raises(ConfigError, match=verdict.replace("(", r"\(").replace(")", r"\)")):
            dims.check_nodes(hosts)
    else:
        assert verdict in dims.check_nodes(hosts)


def test_hosts_are_separate_and_each_picks_its_network_interface(cluster):
    """Each host has its own name, address and /dev/shm; its name maps to loopback (so gloo's own
    choice would fail); longsft's choice is the host's one interface, on the rendezvous host and off it."""
    probe = ("import os, socket, sys; from longsft.train.parallel import netif; "
             "env = dict(WORLD_SIZE='2', LOCAL_WORLD_SIZE='1', MASTER_ADDR='node0'); "
             "open('/dev/shm/longsft-probe', 'w').close() if sys.argv[1] == 'node0' else None; "
             "print(socket.gethostname(), socket.gethostbyname(socket.gethostname()), "
             "netif.setup_gloo_interface(env, say=print), netif.interfaces()['eth0'], "
             "os.path.exists('/dev/shm/longsft-probe'))")
    seen = {}
    for h in cluster.hosts.hosts[:2]:
        r = subprocess.run([*cluster.hosts.prefix(h), sys.executable, "-c", probe, h.name], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        seen[h.name] = r.stdout
    assert "node0 127.0.1.1 " in seen["node0"] and "node1 127.0.1.1 " in seen["node1"]
    a0, a1 = (h.addr for h in cluster.hosts.hosts[:2])
    assert "this node's only network interface besides loopback" in seen["node0"]
    assert f"eth0 {a0} True" in seen["node0"]
    assert f"the interface that reaches MASTER_ADDR=node0 ({a0})" in seen["node1"]
    assert f"eth0 {a1} False" in seen["node1"]  # node0's /dev/shm file is not on node1


@pytest.mark.slow
def test_two_nodes_train_like_one_node(cluster, two_stage_ref, tmp_path):
    """2 nodes x 1 rank, sp=2 spanning the two hosts: the losses and validations of one node's 2 ranks."""
    run_dir = tmp_path / "run"
    job = submit(cluster, tmp_path, run_dir)
    end = cluster.wait(job)[0]
    log = job_log(run_dir, job)
    assert end["JobState"] == "COMPLETED" and end["NodeList"] == "node[0-1]", log
    assert "2 rank(s) on 2 node(s); sequence-parallel groups of 2 across whole nodes" in log, log
    assert "node0 ranks 0, node1 ranks 1" in log
    assert log.count("longsft: gloo between nodes over eth0") == 2
    assert_same_run(two_stage_ref, run_dir)


@pytest.mark.slow
def test_two_by_two_keeps_sp_inside_nodes_and_equals_one_node(cluster, tmp_path):
    """2 nodes x 2 ranks, sp=2 inside each node, ZeRO-3 and data parallelism across them: one node's 4 ranks."""
    ref = tmp_path / "ref"
    torchrun([str(ROOT / "launch" / "curriculum.py"), "recipe=tiny", f"run_dir={ref}", *SHORT], nproc=4)
    run_dir = tmp_path / "run"
    job = submit(cluster, tmp_path, run_dir, procs=2, cpus=2, overrides=SHORT)
    end = cluster.wait(job)[0]
    log = job_log(run_dir, job)
    assert end["JobState"] == "COMPLETED", log
    assert "4 rank(s) on 2 node(s); sequence-parallel groups of 2 inside a node" in log, log
    assert "node0 ranks 0-1, node1 ranks 2-3" in log
    assert_same_run(ref, run_dir)


@pytest.mark.slow
def test_node_lost_mid_stage_ends_the_job_and_the_rerun_resumes(cluster, two_stage_ref, tmp_path):
    """kill -9 the torchrun of one node: the job ends within seconds (no wait for a collective
    timeout); submitting it again resumes from the last checkpoint and ends as if never stopped."""
    run_dir = tmp_path / "run"
    job = submit(cluster, tmp_path, run_dir)
    wait_for_step(cluster, run_dir, job, "b", 3)
    agent = torchrun_on(cluster, "node1")
    agent.kill()
    t0 = time.time()
    end = cluster.wait(job, timeout=120)[0]
    ended_after = time.time() - t0
    log = job_log(run_dir, job)
    assert end["JobState"] == "FAILED" and ended_after < 30, (ended_after, log)
    assert json.loads((run_dir / "state.json").read_text())["stages"]["b"]["status"] != "done"
    job2 = submit(cluster, tmp_path, run_dir)
    end = cluster.wait(job2)[0]
    log = job_log(run_dir, job2)
    assert end["JobState"] == "COMPLETED", log
    assert "resumed from" in log
    assert_same_run(two_stage_ref, run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("moved", [False, True], ids=["same_nodes", "other_nodes"])
def test_time_limit_requeue_resumes_on_the_same_or_other_nodes(cluster, two_stage_ref, tmp_path, moved):
    """The time-limit signal checkpoints and requeues; the job resumes and ends as if never stopped.
    moved: node0 is drained meanwhile, so the requeued job runs on node1 and node2 and rank 0 moves to
    node1, the host that held rank 1."""
    run_dir = tmp_path / "run"
    job = submit(cluster, tmp_path, run_dir)
    wait_for_step(cluster, run_dir, job, "b", 1)  # the stop lands on step 2 or 3 of 4
    try:
        if moved:
            cluster.run("scontrol", "update", "NodeName=node0", "State=DRAIN", "Reason=longsft-test")
        cluster.run("scancel", "--signal=USR1", "--batch", job)  # what SLURM does before a time limit
        end = cluster.wait(job)[0]
    finally:
        cluster.run("scontrol", "update", "NodeName=node0", "State=RESUME", check=False)
    log = job_log(run_dir, job)
    assert end["JobState"] == "COMPLETED" and end["Restarts"] == "1", log
    first, second = log.split("requeueing job")
    assert "node0 ranks 0, node1 ranks 1" in first and "stopped on request at step" in first, log
    assert "resumed from" in second, log
    if moved:
        assert end["NodeList"] == "node[1-2]" and end["BatchHost"] == "node1", end
        assert "node1 ranks 0, node2 ranks 1" in second, log
    else:
        assert end["NodeList"] == "node[0-1]" and "node0 ranks 0, node1 ranks 1" in second, log
    state = json.loads((run_dir / "state.json").read_text())["stages"]["b"]
    assert state["status"] == "done" and state["steps_done"] == 4
    assert_same_run(two_stage_ref, run_dir)


@pytest.mark.slow
def test_array_sweep_tasks_land_on_several_nodes_and_report_aggregates(cluster, tmp_path):
    """An array sweep (one line a task), each task a whole node (--cpus-per-task 2): tasks on separate hosts."""
    root = tmp_path / "sweep"
    overrides = ["parallel.sp_size=1", *TEST_OVERRIDES[:-1],
                 "stages=[{name: a, bucket: '512', seq_len: 512, max_steps: 2}]"]
    r = subprocess.run([*CLI, "submit", "--gpus-per-node", "0", "--nproc-per-node", "1", "--cpus-per-task", "2",
                        "--sweep", str(ROOT / "launch" / "slurm" / "tiny_sweep.txt"), "--root", str(root),
                        "recipe=tiny", *overrides], cwd=tmp_path, env=cluster.env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    jobs = cluster.wait(r.stdout.split("job: ")[1].strip())
    sub = next((root / "submit").iterdir())
    logs = "\n".join(p.read_text() for p in sub.glob("slurm-*.out"))
    assert [j["JobState"] for j in jobs] == ["COMPLETED"] * 3, logs
    assert len({j["BatchHost"] for j in jobs}) >= 2, [j["BatchHost"] for j in jobs]
    for name in ("base", "lr_low", "seed_1"):
        assert json.loads((root / name / "state.json").read_text())["stages"]["a"]["status"] == "done"
    assert "lr: 0.001" in (root / "lr_low" / "config.yaml").read_text()
    assert "seed: 1" in (root / "seed_1" / "config.yaml").read_text()
    base, low = run_metrics(root / "base"), run_metrics(root / "lr_low")
    assert base[("train", 2)]["loss"] != low[("train", 2)]["loss"]  # the tasks differ
    report = subprocess.run([*CLI, "report", str(root), "--bootstrap", "200"], capture_output=True, text=True)
    assert report.returncode == 0 and report.stdout.count("| done | 1/1 |") == 3, report.stderr
    rows = json.loads((root / "report.json").read_text())
    assert [row["run"] for row in rows] == ["base", "lr_low", "seed_1"]
    for row in rows:
        ci = row["ci"]["balanced_accuracy"]
        assert ci["low"] <= row["balanced_accuracy"] <= ci["high"]
