"""Process groups and parallel degrees. Everything else asks :class:`ParallelDims`.

Naming: "axis" is a direction of the rank grid (dp, sp); "dim" is a tensor dimension.
Ranks are laid out sp-major-inner: ranks ``[k*sp, (k+1)*sp)`` form sequence-parallel group
``k``; ranks with equal ``rank % sp`` form a data-parallel group. ZeRO-3 shards over the whole
world. torchrun numbers ranks node by node, so a group lies inside one node when ``sp_size``
divides the processes per node, and spans whole nodes (its ring crosses the network) when it is a
multiple of them; any other placement is refused (:meth:`ParallelDims.check_nodes`).
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from longsft.train.common.compat import release_deepspeed_groups, set_deepspeed_world_group, skip_inference_comm_build
from longsft.train.common.errors import ConfigError, same_on_every_rank, this_rank_only
from longsft.train.common.io import say
from longsft.train.parallel import comm, netif
from longsft.train.parallel.attention import SPAttention, register
from longsft.train.parallel.context import ONE_RANK, SequenceParallel


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    sp_size: int = 1

    def __post_init__(self):
        if self.sp_size < 1 or self.world_size % self.sp_size:
            raise ConfigError(f"parallel.sp_size={self.sp_size} must divide the world size {self.world_size} "
                              f"(launch with a multiple of {self.sp_size} processes, or change sp_size)")

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    def dp_rank(self, rank: int) -> int:
        return rank // self.sp_size

    def sp_rank(self, rank: int) -> int:
        return rank % self.sp_size

    def sp_group_ranks(self) -> list[list[int]]:
        return [list(range(k * self.sp_size, (k + 1) * self.sp_size)) for k in range(self.dp_size)]

    def dp_group_ranks(self) -> list[list[int]]:
        return [list(range(r, self.world_size, self.sp_size)) for r in range(self.sp_size)]

    def check_nodes(self, hosts: list[str]) -> str:
        """Refuse a sequence-parallel group that holds part of a node and more (``hosts[r]``: rank
        ``r``'s node). Returns how the groups lie, for the log."""
        ranks_on: dict[str, set[int]] = {}
        for r, h in enumerate(hosts):
            ranks_on.setdefault(h, set()).add(r)
        spans = False
        for group in self.sp_group_ranks():
            touched = list(dict.fromkeys(hosts[r] for r in group))  # in rank order
            if len(touched) == 1:
                continue
            spans = True
            split = next((h for h in touched if not ranks_on[h] <= set(group)), None)
            if split is not None:
                on = ", ".join(f"{h} ({_span([r for r in group if hosts[r] == h])})" for h in touched)
                raise ConfigError(
                    f"parallel.sp_size={self.sp_size} splits a node: sequence-parallel group {_span(group)} has "
                    f"ranks on {on}, and {split} also holds ranks outside the group; make sp_size divide the "
                    f"processes per node ({len(ranks_on[split])}: the group stays inside a node) or a multiple of "
                    "them (whole nodes)")
        nodes = len(ranks_on)
        where = "inside a node" if not spans else "across whole nodes (the ring crosses the network)"
        return f"{self.world_size} rank(s) on {nodes} node(s); sequence-parallel groups of {self.sp_size} {where}"


@dataclass
class Dist:
    """This process's place in the job and its groups: ``sp``, its sequence-parallel context (group,
    backend, kernel), and ``attention``, the attention entry bound to it (``with d.attention.active(...)``
    around a forward). Named ``d`` in the code that holds one (``dist`` is ``torch.distributed`` there)."""

    rank: int
    local_rank: int
    dims: ParallelDims
    device: torch.device
    sp: SequenceParallel = ONE_RANK
    attention: SPAttention | None = None
    dp_group: object = None

    @property
    def sp_group(self):
        return self.sp.group

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        return self.dims.dp_rank(self.rank)

    @property
    def sp_rank(self) -> int:
        return self.dims.sp_rank(self.rank)

    def barrier(self) -> None:
        comm.barrier()


def _die_with_launcher() -> None:
    """Under torchrun, ask Linux to kill this rank when its launcher dies (kill -9, preemption):
    torch's workers otherwise live on as orphans, still writing to the run directory."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def cpu_threads(local_world: int) -> int:
    """CPU threads per rank: ``LONGSFT_THREADS`` when set (the SLURM script sets it from the job's
    CPUs), else this process's CPUs over the ranks on this node. torchrun's own ``OMP_NUM_THREADS=1``
    default would leave all but one core idle, so OMP_NUM_THREADS alone is not trusted."""
    given = os.environ.get("LONGSFT_THREADS")
    if given is None:
        return max(1, len(os.sched_getaffinity(0)) // local_world)
    if not given.isdigit() or int(given) < 1:
        raise ConfigError(f"LONGSFT_THREADS={given!r}: expected a whole number of CPU threads per rank, at least 1")
    return int(given)


HUGE_PAGES = "glibc.malloc.hugetlb=1"  # GLIBC_TUNABLES entry: glibc asks for huge pages on the memory it maps


def huge_pages_hint() -> str | None:
    """On a CPU run where glibc maps large tensors with 4 KiB pages although the kernel would give huge
    ones on request (transparent huge pages in ``madvise`` mode): a line saying how to ask. Every
    step's fresh ``[vocab, hidden]`` gradients and ZeRO-3 buffers are new mappings, each page a fault
    (bench/huge_pages.py measures the difference). ``GLIBC_TUNABLES`` is read at process start, so it
    is the launcher's to set (the Makefile and the SLURM script do). None: nothing to gain or already set."""
    import platform

    libc, version = platform.libc_ver()
    if libc != "glibc" or tuple(map(int, version.split(".")[:2])) < (2, 35):  # the tunable came in 2.35
        return None
    if torch.cuda.is_available() or "glibc.malloc.hugetlb" in os.environ.get("GLIBC_TUNABLES", ""):
        return None
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    if "[madvise]" not in mode:  # [always]: every mapping gets them already; [never]: none to have
        return None
    return (f"CPU run with 4 KiB pages for large tensors: export GLIBC_TUNABLES={HUGE_PAGES} before torchrun "
            "(fewer page faults per step, see bench/huge_pages.py; `make` and launch/slurm/curriculum.sbatch set it)")


def setup_env() -> None:
    """Environment that must exist before deepspeed is imported."""
    _die_with_launcher()
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # DeepSpeed's CPU accelerator counts its devices by running `numactl --hardware` on every call
        # (once per gradient bucket) unless LOCAL_SIZE says it: the ranks on this node
        os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if "RANK" not in os.environ:  # plain `python launch/...`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))


def init(sp_size: int, timeout_s: int = 1800, sp_backend: str = "torch", attention_kernel: str = "auto") -> Dist:
    """Initialise torch.distributed (NCCL on GPUs, gloo on CPU) and the dp/sp groups."""
    setup_env()
    world = int(os.environ["WORLD_SIZE"])
    try:
        dims = ParallelDims(world, sp_size)  # validate before any collective
    except ConfigError as e:  # from what every rank knows alike: said once
        raise same_on_every_rank(e) from None
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if local_rank >= gpus:  # NCCL cannot put two ranks on one GPU
            raise this_rank_only(ConfigError(
                f"{os.environ.get('LOCAL_WORLD_SIZE', local_rank + 1)} processes on this node but {gpus} GPU(s): launch "
                f"--nproc_per_node={gpus} (with a parallel.sp_size that divides the world size), or set "
                "CUDA_VISIBLE_DEVICES= to run on the CPU"))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        torch.set_num_threads(cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    netif.setup_gloo_interface(say=say if local_rank == 0 else None)
    if not dist.is_initialized():
        # device_id (one GPU per rank): NCCL binds the communicator to it now, and new groups split from it
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s),
                                device_id=device if backend == "nccl" else None)
    try:
        return _groups(dims, rank, local_rank, device, backend, timeout_s, sp_backend, attention_kernel)
    except BaseException:
        shutdown(failed=True)
        raise


def _groups(dims: ParallelDims, rank: int, local_rank: int, device: torch.device, backend: str, timeout_s: int,
            sp_backend: str, attention_kernel: str) -> Dist:
    """The nodes checked, DeepSpeed's wrapper and the dp/sp groups, on an initialised default group."""
    hosts = _node_names(comm.all_gather_objects((socket.gethostname(), os.environ.get("GROUP_RANK", "0"))))
    try:
        placement = dims.check_nodes(hosts)  # the same verdict on every rank: all raise or none
    except ConfigError as e:
        raise same_on_every_rank(e) from None
    if rank == 0 and len(set(hosts)) > 1:
        say(placement + "; " + ", ".join(f"{h} ranks {_span([r for r, x in enumerate(hosts) if x == h])}"
                                          for h in dict.fromkeys(hosts)))
    import deepspeed

    if backend == "gloo":
        skip_inference_comm_build()
    timeout = timedelta(seconds=timeout_s)
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout)  # wraps the group (its timeout unused)
    # torch gives a new group NCCL's 10-minute default, not the default group's: every group gets ours,
    # DeepSpeed's clone of the world (its ZeRO-3 gradient reductions) included
    set_deepspeed_world_group(dist.new_group(list(range(dims.world_size)), timeout=timeout))
    d = Dist(rank=rank, local_rank=local_rank, dims=dims, device=device)
    for ranks in dims.sp_group_ranks():  # every rank creates every group, in the same order
        g = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            d.sp = SequenceParallel(g, tuple(ranks), ranks.index(rank), sp_backend, attention_kernel)
    for ranks in dims.dp_group_ranks():
        g = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            d.dp_group = g
    d.attention = register(d.sp)
    return d


def _node_names(pairs: list[tuple[str, str]]) -> list[str]:
    """Each rank's node: its host name, or ``host/node<GROUP_RANK>`` where torchrun agents share a name."""
    nodes = set(pairs)
    if len({h for h, _ in nodes}) == len(nodes):
        return [h for h, _ in pairs]
    return [f"{h}/node{g}" for h, g in pairs]


def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)) \
        else ",".join(map(str, ranks))


def shutdown(failed: bool = False) -> None:
    """Destroy every process group while the interpreter is still whole: groups left to its exit can
    abort the process there (gloo: SIGABRT, "terminate called without an active exception", after the
    error was already said). After a failure (``failed``) NCCL's communicators are aborted, not
    destroyed: a peer may never reach the collective a graceful destroy would wait for. Gloo has no
    such wait to skip: its groups finish queued work either way (when the peers exit, at worst)."""
    if not dist.is_initialized():
        return
    if failed and dist.get_backend() == "nccl":
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()
    else:
        dist.destroy_process_group()
    # ... and let go of every reference to them (DeepSpeed's, and transformers' registry's through the SP
    # attention entry): a group object alive at the interpreter's exit is torn down there, same SIGABRT
    release_deepspeed_groups()
    if "transformers" in sys.modules:
        register(ONE_RANK)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
