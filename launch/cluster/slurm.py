"""``longsft submit``: check, snapshot and ``sbatch`` a curriculum run or a sweep.

Plain ``sbatch`` rather than submitit: the job is a readable shell script (``launch/slurm/``) that a
user can also submit by hand; it runs ``torchrun`` once per node (submitit pickles a function and
starts one task per GPU, which fits neither torchrun's rendezvous nor DeepSpeed's launcher), and it
requeues itself with ``scontrol``, which needs no Python process outliving the job.

Before anything is queued every config is resolved and checked (keys, values, world size against
``sp_size``). The submission folder ``<run_dir or sweep root>/submit/<time>/`` keeps the sbatch
script, the resolved configs, the exact command and a copy of the code (plus the git commit and
diff when the code is a checkout); the job imports that copy, so editing the checkout after
submitting does not change a queued job.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from longsft.launch.cluster.sweep import check_sweep, task_args
from longsft.train.common.errors import ConfigError
from longsft.train.common.io import atomic_write_text
from longsft.train.config.loader import dump_yaml
from longsft.train.config.recipes import parse_run_args
from longsft.train.config.schema import RunConfig
from longsft.train.parallel.distributed import ParallelDims
from longsft.train.plan.choose import plan
from longsft.train.plan.hardware import GIB, Hardware

PACKAGES = ("train", "eval", "recipes", "ds_configs", "launch")


@dataclass
class Resources:
    nodes: int = 1
    gpus_per_node: int = 8
    nproc_per_node: int | None = None  # default: gpus_per_node, or 1 without GPUs
    cpus_per_task: int | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    job_name: str | None = None
    max_parallel: int | None = None  # array: at most this many tasks at once
    sbatch_args: list[str] = field(default_factory=list)

    @property
    def procs(self) -> int:
        return self.nproc_per_node or self.gpus_per_node or 1


def check_world(cfg: RunConfig, res: Resources, where: str = "") -> None:
    """World size and node placement of the sequence-parallel groups, as ``distributed.init`` checks them."""
    try:
        dims = ParallelDims(res.nodes * res.procs, cfg.parallel.sp_size)
        dims.check_nodes([f"node {r // res.procs}" for r in range(dims.world_size)])
    except ConfigError as e:
        raise ConfigError(f"{where}{e} [--nodes {res.nodes} x {res.procs} processes per node]") from None


def check_fit(cfg: RunConfig, res: Resources, gpu_gib: float, where: str = "") -> str:
    """Plan every stage on the allocation (``longsft plan``); refuse one that does not fit a GPU of
    ``gpu_gib`` before any GPU is booked. Returns the per-stage peaks for the user."""
    hw = Hardware(gpus_per_node=res.procs, nodes=res.nodes, gpu_gib=gpu_gib)
    _, rows = plan(cfg, hw)
    for e in rows:
        if not e.fits:
            raise ConfigError(f"{where}stage {e.stage} needs {e.total / GIB:.1f} GiB per GPU (planned), more than "
                              f"--gpu-gib {gpu_gib:g}; `longsft plan` with the same arguments lists what would fit")
    return f"{where}planned peak per GPU: " + ", ".join(f"{e.stage} {e.total / GIB:.1f} GiB" for e in rows)


def snapshot_code(dest: Path) -> None:
    """Copy the installed package (``longsft.*``) and launch scripts to ``dest/longsft``."""
    pkg = dest / "longsft"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""Snapshot of longsft taken by `longsft submit`."""\n')
    for name in PACKAGES:
        src = Path(str(resources.files(f"longsft.{name}")))
        shutil.copytree(src, pkg / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    src_root = Path(str(resources.files("longsft.train"))).parent
    head = subprocess.run(["git", "-C", str(src_root), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        diff = subprocess.run(["git", "-C", str(src_root), "diff", "HEAD"], capture_output=True, text=True).stdout
        atomic_write_text(dest / "git.txt", f"commit {head.stdout.strip()}\nsource {src_root}\n")
        atomic_write_text(dest / "git.diff", diff)


def sbatch_command(script: Path, args: list[str], res: Resources, sub: Path, array: int | None,
                   command: str = "train") -> list[str]:
    env = {"LONGSFT_PYTHON": sys.executable, "PYTHONPATH": str(sub / "code"),
           "LONGSFT_LAUNCH_DIR": str(sub / "code" / "longsft" / "launch" / "slurm"),
           "NPROC_PER_NODE": str(res.procs), "LONGSFT_SWEEP_COMMAND": command}
    bad = [f"{k}={v}" for k, v in env.items() if "," in v]
    if bad:
        raise ConfigError(f"sbatch --export cannot carry a comma: {bad[0]}; use a path without commas")
    out = "slurm-%A_%a.out" if array is not None else "slurm-%j.out"
    cmd = ["sbatch", "--parsable", f"--nodes={res.nodes}", "--ntasks-per-node=1", f"--output={sub / out}",
           "--export=" + ",".join(["ALL", *(f"{k}={v}" for k, v in env.items())])]
    if res.gpus_per_node:
        cmd.append(f"--gpus-per-node={res.gpus_per_node}")
    for opt, value in (("cpus-per-task", res.cpus_per_task), ("time", res.time), ("partition", res.partition),
                       ("account", res.account), ("job-name", res.job_name)):
        if value is not None:
            cmd.append(f"--{opt}={value}")
    if array is not None:
        cmd.append(f"--array=0-{array - 1}" + (f"%{res.max_parallel}" if res.max_parallel else ""))
    return [*cmd, *res.sbatch_args, str(script), *args]


def submit(args: list[str], res: Resources, sweep: str | None = None, root: str | None = None,
           dry_run: bool = False, command: str = "train", gpu_gib: float | None = None,
           say=print) -> tuple[Path, str | None]:
    """Check, snapshot and submit; returns (submission folder, job id or None for a dry run).

    With ``gpu_gib`` every training config is planned first and one that does not fit is refused.
    """
    if sweep is None:
        cfg = parse_run_args(args)
        check_world(cfg, res)
        if gpu_gib:
            say(check_fit(cfg, res, gpu_gib))
        configs = {"config.yaml": cfg}
        base, script, job_args, array = cfg.run_path, "curriculum.sbatch", list(args), None
    else:
        root = root or f"runs/sweeps/{Path(sweep).stem}"
        tasks = check_sweep(sweep, root, args, command)
        if command == "train":
            for task, cfg in tasks:
                where = f"{sweep}:{task.line} (task {task.name}): "
                check_world(cfg, res, where)
                if gpu_gib:
                    say(check_fit(cfg, res, gpu_gib, where))
        configs = {f"configs/{t.name}.yaml": c for t, c in tasks}
        base, script, array = Path(root), "array.sbatch", len(tasks)
        job_args = [str(Path(sweep).resolve()), str(Path(root).resolve()), *args]
    sub = base / "submit" / time.strftime("%Y%m%d-%H%M%S")
    while sub.exists():
        sub = sub.with_name(sub.name + "-1")
    snapshot_code(sub / "code")
    for name, cfg in configs.items():
        (sub / name).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(sub / name, dump_yaml(cfg))
    if sweep is not None:
        shutil.copy(sweep, sub / "sweep.txt")
        lines = [f"{t.index}\t{t.name}\t{shlex.join(task_args(t, root, args, command))}" for t, _ in tasks]
        atomic_write_text(sub / "tasks.tsv", "\n".join(lines) + "\n")
    script_path = sub / script
    shutil.copy(sub / "code" / "longsft" / "launch" / "slurm" / script, script_path)
    cmd = sbatch_command(script_path, job_args, res, sub, array, command)
    atomic_write_text(sub / "command.sh", shlex.join(cmd) + "\n")
    if dry_run:
        return sub, None
    if shutil.which("sbatch") is None:
        raise ConfigError("sbatch is not on PATH: run `longsft submit` on a SLURM login node "
                          f"(or --dry-run; the prepared submission is in {sub})")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise ConfigError(f"sbatch refused the job: {r.stderr.strip()} (command in {sub / 'command.sh'})")
    job_id = r.stdout.strip().split(";")[0]
    atomic_write_text(sub / "job_id", job_id + "\n")
    return sub, job_id
