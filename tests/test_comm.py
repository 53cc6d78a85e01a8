"""Collectives: one helper module (train/parallel/comm.py) puts every tensor on the device its backend serves.

A GPU run uses NCCL, which serves CUDA tensors only; a CPU tensor all-reduced there fails at the
first optimizer step. CPU runs (gloo) cannot show that, so the guard is structural: no module of
longsft but ``train/parallel/comm.py`` may call a ``torch.distributed`` collective.
"""

import ast
from pathlib import Path

import pytest
import torch
from conftest import ROOT

COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "broadcast_object_list",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier",
    "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv", "P2POp", "gather", "scatter",
    "gather_object", "scatter_object_list", "send_object_list", "recv_object_list", "all_reduce_coalesced"}
SCANNED = ("train", "eval", "launch", "bench")
# comm.py itself; gpu_checks.py calls NCCL directly on purpose, to show it refuses a CPU tensor; alst.py is
# DeepSpeed's ALST recipe reproduced as the comparator (its loss all-gather as ALST's example writes it)
ALLOWED = {Path("train/parallel/comm.py"), Path("bench/gpu_checks.py"), Path("bench/alst.py")}


def _collective_module(name: str) -> bool:
    """torch.distributed, any module under it (``nn.functional``, ``distributed_c10d``), or deepspeed.comm."""
    return name == "torch.distributed" or name.startswith("torch.distributed.") or name == "deepspeed.comm"


def collective_calls(source: str) -> list[tuple[int, str]]:
    """(line, name) of each use of a torch.distributed collective in ``source``, whatever it is imported as."""
    tree = ast.parse(source)
    modules, direct = set(), set()  # names bound to torch.distributed; collectives imported by name
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _collective_module(a.name) and a.asname:
                    modules.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                if _collective_module(node.module) and (a.name in COLLECTIVES or a.name == "*"):
                    direct.add(a.asname or a.name)
                elif _collective_module(f"{node.module}.{a.name}"):
                    modules.add(a.asname or a.name)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
            base = ast.unparse(node.value)
            if base in modules or _collective_module(base):
                found.append((node.lineno, f"{base}.{node.attr}"))
        elif isinstance(node, ast.Name) and node.id in direct and isinstance(node.ctx, ast.Load):
            found.append((node.lineno, node.id))
    return sorted(found)


def test_the_scanner_sees_every_spelling():
    bad = ("import torch\nimport torch.distributed as dist\nfrom torch import distributed as D\n"
           "from torch.distributed import all_gather as ag\n"
           "stats = torch.tensor([1.0])\n"
           "dist.all_reduce(stats)\n"  # the reintroduced CPU-tensor collective of the trainer
           "torch.distributed.barrier()\nD.broadcast(stats, 0)\nag([stats], stats)\n"
           "dist.P2POp(dist.isend, stats, 1)\n")
    names = [n for _, n in collective_calls(bad)]
    assert names == ["dist.all_reduce", "torch.distributed.barrier", "D.broadcast", "ag", "dist.P2POp", "dist.isend"]
    other = ("import torch.distributed.nn.functional as dnnf\nfrom torch.distributed import distributed_c10d as c10d\n"
             "from deepspeed import comm as dsc\nimport deepspeed.comm\nfrom torch.distributed.nn import all_gather\n"
             "dnnf.all_gather(x)\nc10d.broadcast(x, 0)\ndsc.all_reduce(x)\ndeepspeed.comm.barrier()\nall_gather(x)\n"
             "torch.distributed.nn.functional.all_reduce(x)\n")
    assert [n for _, n in collective_calls(other)] == ["dnnf.all_gather", "c10d.broadcast", "dsc.all_reduce",
                                                       "deepspeed.comm.barrier", "all_gather",
                                                       "torch.distributed.nn.functional.all_reduce"]
    assert collective_calls("import torch.distributed as dist\ndist.is_initialized()\ndist.get_rank()\n") == []


def test_only_the_comm_module_calls_collectives():
    offenders = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel in ALLOWED:
                continue
            offenders += [f"{rel}:{line}: {name}" for line, name in collective_calls(path.read_text())]
    assert not offenders, ("collectives outside train/parallel/comm.py (route them through it, so their tensors are made "
                           "on the backend's device):\n" + "\n".join(offenders))
    assert collective_calls((ROOT / "train" / "parallel" / "comm.py").read_text()), "the scanner no longer sees comm.py's calls"


def test_a_cpu_tensor_on_nccl_is_refused_with_the_fix():
    from longsft.train.parallel.comm import check_device, device_type_for

    assert device_type_for("nccl") == "cuda" and device_type_for("gloo") is None
    with pytest.raises(RuntimeError, match="ring block is on cpu but the nccl process group only serves cuda"):
        check_device(torch.zeros(2), "nccl", "ring block")
    check_device(torch.zeros(2), "gloo")
    check_device(torch.zeros(2, device="meta"), "gloo")


def test_values_come_back_as_numbers_without_a_group():
    from longsft.train.parallel import comm

    assert comm.all_reduce(torch.tensor([1.5, 2.0])) == [1.5, 2.0]
    assert comm.max_over_ranks(7) == 7 and comm.all_gather_objects({"a": 1}) == [{"a": 1}]
