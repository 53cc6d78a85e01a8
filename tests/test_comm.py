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
# comm.py itself; gpu_checks.py calls NCCL directly on purpose, to show it refuses a CPU tensor
ALLOWED = {Path("train/parallel/comm.py"), Path("bench/gpu_checks.py")}


def collective_calls(source: str) -> list[tuple[int, str]]:
    """(line, name) of each use of a torch.distributed collective in ``source``, whatever it is imported as."""
    tree = ast.parse(source)
    modules, direct = set(), set()  # names bound to torch.distributed; collectives imported by name
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    modules.add(a.asname)
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                if node.module == "torch" and a.name == "distributed":
                    modules.add(a.asname or a.name)
                elif node.module == "torch.distributed" and (a.name in COLLECTIVES or a.name == "*"):
                    direct.add(a.asname or a.name)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
            base = ast.unparse(node.value)
            if base in modules or base == "torch.distributed":
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
