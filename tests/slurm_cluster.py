"""A real SLURM (Debian's slurmctld + slurmd) in a temp dir, for the SLURM tests.

:func:`start`: one node, ``localhost``. :func:`start_hosts`: one slurmd per separate network host
(``tests/net_hosts.py``: a network namespace, address, hostname and /dev/shm each), the controller
and the clients on the bridge's address in the root namespace. Stopped by the PIDs it started.
Needs root (the daemons run as root with ``auth/none``) and the packages ``slurmctld slurmd
slurm-client`` (``.ci/run`` installs them).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

CONF = """\
ClusterName=longsft-test
SlurmctldHost={ctld_host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire=10
StateSaveLocation={tmp}/state
SlurmdSpoolDir={tmp}/spool/slurmd-%n
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd-%n.pid
SlurmctldLogFile={tmp}/slurmctld.log
SlurmdLogFile={tmp}/slurmd-%n.log
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=1,bf_interval=1
ReturnToService=2
MinJobAge=600
KillWait=5
"""
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")  # a job's final states
PARTITION = "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n"
NODE = "NodeName={name} NodeHostname={name} NodeAddr={addr} CPUs={cpus} RealMemory=4000 State=UNKNOWN\n"


def unavailable() -> str | None:
    """Why a local SLURM cannot run here, or None."""
    missing = [b for b in ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol") if shutil.which(b) is None]
    if missing:
        return (f"SLURM not installed ({', '.join(missing)} missing): apt-get install -y --no-install-recommends "
                "slurmctld slurmd slurm-client munge")
    if os.geteuid() != 0:
        return "the local SLURM test cluster runs its daemons as root; these tests run as a normal user"
    return None


@dataclass
class Cluster:
    tmp: Path
    env: dict
    procs: list
    hosts: object = None  # net_hosts.Hosts for start_hosts

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)}: {r.returncode}\n{r.stdout}\n{r.stderr}")
        return r

    def job(self, job_id: str) -> dict:
        """``scontrol show job`` as a dict (the first record: the array's first task for an array)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout.splitlines()
        return dict(f.split("=", 1) for f in out[0].split() if "=" in f) if out else {}

    def jobs(self, job_id: str) -> list[dict]:
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout.splitlines()
        return [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in out]

    def wait(self, job_id: str, timeout: float = 600) -> list[dict]:
        """Wait until every task of ``job_id`` has ended; returns their records."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            jobs = self.jobs(job_id)
            if jobs and all(j["JobState"] in ENDED for j in jobs):
                return jobs
            time.sleep(1)
        raise AssertionError(f"job {job_id} still running after {timeout} s: {self.jobs(job_id)}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in self.tmp.glob("*.log"))


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_conf(tmp: Path, ctld_host: str, nodes: list[tuple[str, str]], cpus: int) -> Path:
    (tmp / "state").mkdir(parents=True)
    for name, _ in nodes:
        (tmp / "spool" / f"slurmd-{name}").mkdir(parents=True)
    conf = tmp / "slurm.conf"
    text = CONF.format(tmp=tmp, ctld_host=ctld_host, ctld_port=_port(), slurmd_port=_port())
    text += "".join(NODE.format(name=n, addr=a, cpus=cpus) for n, a in nodes) + PARTITION
    conf.write_text(text)
    return conf


def _up(cluster: Cluster, n: int) -> Cluster:
    """Wait until all ``n`` nodes are idle; on failure stop what was started and raise."""
    deadline = time.time() + 60
    while time.time() < deadline:
        r = cluster.run("sinfo", "-h", "-N", "-o", "%T", check=False)
        if r.stdout.split() == ["idle"] * n:
            return cluster
        if any(p.poll() is not None for p in cluster.procs):
            break
        time.sleep(0.5)
    logs = cluster.logs() + (cluster.tmp / "daemons.out").read_text()
    stop(cluster)
    raise RuntimeError(f"local SLURM did not come up:\n{logs}")


def start(tmp: Path, cpus: int = 2) -> Cluster:
    """One node, ``localhost``."""
    conf = _write_conf(tmp, "localhost", [("localhost", "127.0.0.1")], cpus)
    env = dict(os.environ, SLURM_CONF=str(conf))
    log = open(tmp / "daemons.out", "w")
    procs = [subprocess.Popen(["slurmctld", "-D", "-i", "-f", str(conf)], env=env, stdout=log, stderr=log)]
    procs.append(subprocess.Popen(["slurmd", "-D", "-N", "localhost", "-f", str(conf)], env=env, stdout=log,
                                  stderr=log))
    return _up(Cluster(tmp, env, procs), 1)


def start_hosts(tmp: Path, names: list[str], cpus: int = 2) -> Cluster:
    """One node per name, each a separate network host (``net_hosts``) running its own slurmd."""
    import net_hosts

    tmp.mkdir(parents=True, exist_ok=True)
    hosts = net_hosts.create(names, tmp)
    cluster = Cluster(tmp, {}, [], hosts)
    try:
        conf = _write_conf(tmp, f"localhost({hosts.gateway})", [(h.name, h.addr) for h in hosts.hosts], cpus)
        cluster.env = dict(os.environ, SLURM_CONF=str(conf))
        log = open(tmp / "daemons.out", "w")
        cluster.procs.append(subprocess.Popen(["slurmctld", "-D", "-i", "-f", str(conf)], env=cluster.env,
                                              stdout=log, stderr=log))
        for h in hosts.hosts:
            cluster.procs.append(subprocess.Popen([*hosts.prefix(h), "slurmd", "-D", "-N", h.name, "-f", str(conf)],
                                                  env=cluster.env, stdout=log, stderr=log))
    except BaseException:
        stop(cluster)
        raise
    return _up(cluster, len(names))


def stop(cluster: Cluster) -> None:
    """Cancel what still runs (a failed test's job), SIGTERM the slurmds, then slurmctld (the PIDs we
    started), wait for them, remove the hosts."""
    if cluster.procs and cluster.procs[0].poll() is None:
        cluster.run("scancel", "--full", "--user=root", check=False)
        deadline = time.time() + 30
        while time.time() < deadline and cluster.run("squeue", "-h", check=False).stdout.strip():
            time.sleep(0.5)
    for p in reversed(cluster.procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    if cluster.hosts is not None:
        cluster.hosts.close()
