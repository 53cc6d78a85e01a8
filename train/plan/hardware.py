"""The hardware a plan is for: GPUs (or CPU ranks) per node, their memory, the host's memory."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from longsft.train.common.errors import ConfigError

GIB = 2**30


@dataclass
class Hardware:
    """Where the run goes. ``host_gib`` is per node (None: not checked)."""

    gpus_per_node: int = 8
    nodes: int = 1
    gpu_gib: float = 79.0  # what PyTorch reports for an "80 GB" card (79.1-79.6 GiB), less nothing else
    host_gib: float | None = None
    reserve_gib: float = 1.0  # CUDA context, cuBLAS/cuDNN workspaces
    # NCCL's buffers per communicator. On NVSwitch nodes (HGX H100/H200) NCCL's NVLS buffers make each one
    # larger: run with NCCL_NVLS_ENABLE=0, or add the difference to reserve_gib (``--reserve-gib``)
    nccl_gib_per_communicator: float = 0.25
    fragmentation: float = 0.10  # caching-allocator slack, a share of the working set
    cuda: bool = True  # False: the CPU validation (no flash workspace, no margins)

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    def check(self) -> None:
        """Each value in range; the message names its command-line flag."""
        for flag, value, low in (("--gpus-per-node", self.gpus_per_node, 1), ("--nodes", self.nodes, 1)):
            if value < low:
                raise ConfigError(f"{flag} {value}: must be >= {low} (the planner sizes GPU memory)")
        for flag, value in (("--gpu-gib", self.gpu_gib), ("--host-gib", self.host_gib)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{flag} {value}: must be a positive number of GiB")
        if not (math.isfinite(self.reserve_gib) and self.reserve_gib >= 0):
            raise ConfigError(f"--reserve-gib {self.reserve_gib}: must be >= 0")
        if not 0 <= self.fragmentation < 1:
            raise ConfigError(f"--fragmentation {self.fragmentation}: must be in [0, 1)")


def this_job(world: int, local_world: int) -> Hardware:
    """The hardware this process runs on: its GPU as PyTorch reports it, or on CPU each local rank's
    share of the host memory available now."""
    nodes = max(1, world // max(1, local_world))
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return Hardware(gpus_per_node=world // nodes, nodes=nodes, gpu_gib=total / GIB)
    return Hardware(gpus_per_node=world // nodes, nodes=nodes, gpu_gib=available_host_bytes() / local_world / GIB,
                    cuda=False)


def available_host_bytes() -> float:
    """MemAvailable of /proc/meminfo (Linux), else the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
