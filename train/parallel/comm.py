"""Every collective longsft itself calls, in one place.

A process group's backend serves tensors of one device type: NCCL only CUDA tensors (a CPU
tensor fails with "No backend type associated with device type cpu"), gloo here CPU ones. So
small values (step statistics, validation sums, "any rank stopped?", "most chunks on any rank")
are built here, on :func:`device`, and come back as Python numbers; activations (ring K/V blocks,
Ulysses all-to-all, document ids) must already be on it, and :func:`check_device` says so with the
fix rather than letting the backend fail deep inside a step. ``tests/test_comm.py`` fails when any
other module of longsft calls a ``torch.distributed`` collective. DeepSpeed's own collectives
(ZeRO-3 gathers and reductions) are DeepSpeed's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from longsft.train.common.errors import ConfigError, DataError, same_on_every_rank

T = TypeVar("T")


def active() -> bool:
    """A process group of more than one rank exists."""
    return dist.is_initialized() and dist.get_world_size() > 1


def device_type_for(backend: str) -> str | None:
    """The tensor device type a backend serves (None: any, e.g. gloo serves CPU and CUDA)."""
    return "cuda" if backend.lower() == "nccl" else None


def device(group=None) -> torch.device:
    """Where a collective's tensor must live for ``group`` (the default group if None)."""
    if device_type_for(str(dist.get_backend(group))) == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_device(t: torch.Tensor, backend: str, what: str = "tensor") -> None:
    """Raise, naming the tensor, when ``backend`` cannot serve ``t``'s device."""
    want = device_type_for(backend)
    if want is not None and t.device.type != want:
        raise RuntimeError(f"{what} is on {t.device} but the {backend} process group only serves {want} tensors: "
                           f"create it on the rank's device (longsft.train.parallel.comm.device())")


def _checked(t: torch.Tensor, group, what: str) -> torch.Tensor:
    check_device(t, str(dist.get_backend(group)), what)
    return t


def all_reduce(values: Sequence[float] | torch.Tensor, op: str = "sum", group=None,
               dtype: torch.dtype = torch.float64) -> list[float]:
    """Sum (or ``op="max"``) small values over ``group``; every rank gets the same list.

    The values travel in a ``dtype`` tensor made on :func:`device`, whatever device they came from.
    Without a process group they come back as they are.
    """
    if isinstance(values, torch.Tensor):
        values = values.detach().flatten().tolist()
    if not active():
        return [float(v) for v in values]
    t = torch.tensor(list(values), dtype=dtype, device=device(group))
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op], group=group)
    return t.tolist()


def max_over_ranks(n: int, group=None) -> int:
    """The largest ``n`` of any rank (e.g. loss chunks or MLP tiles, so every rank calls ZeRO-3 equally often)."""
    return int(all_reduce([n], "max", group, dtype=torch.int64)[0])


def all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape on every rank), in group rank order."""
    t = _checked(t.contiguous(), group, "all_gather input")
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    return parts


def all_to_all(send: torch.Tensor, group) -> torch.Tensor:
    """``send`` [group size, ...]: slice i goes to rank i; returns [group size, ...], slice j from rank j."""
    send = _checked(send.contiguous(), group, "all_to_all input")
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


class Pending:
    """Tensors on their way from the previous ring rank; :meth:`wait` returns them once arrived."""

    def __init__(self, works: list, send: list[torch.Tensor], recv: list[torch.Tensor]):
        self.works, self.send, self.recv = works, send, recv  # send: alive until the transfer is done

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        self.send = []
        return self.recv


def ring_shift_start(tensors: list[torch.Tensor], ranks: Sequence[int], rank_index: int, group) -> Pending:
    """Start sending ``tensors`` to the next rank of ``ranks`` and receiving the previous rank's
    (global ranks, ring order); compute may go on until :meth:`Pending.wait`. ``tensors`` must not
    change before then."""
    n = len(ranks)
    nxt, prv = ranks[(rank_index + 1) % n], ranks[(rank_index - 1) % n]
    send = [_checked(t.contiguous(), group, "ring block") for t in tensors]
    recv = [torch.empty_like(t) for t in send]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in send] + [dist.P2POp(dist.irecv, r, prv, group) for r in recv]
    return Pending(dist.batch_isend_irecv(ops), send, recv)


def ring_shift(tensors: list[torch.Tensor], ranks: Sequence[int], rank_index: int, group) -> list[torch.Tensor]:
    """Send ``tensors`` to the next rank of ``ranks`` and receive the previous rank's (global ranks, ring order)."""
    return ring_shift_start(tensors, ranks, rank_index, group).wait()


def rank() -> int:
    """This process's rank in the job (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    """Every rank waits for every other (NCCL: on this rank's GPU, named, not guessed)."""
    if dist.is_initialized():
        on_gpu = device_type_for(str(dist.get_backend())) == "cuda"
        dist.barrier(device_ids=[torch.cuda.current_device()] if on_gpu else None)


def all_gather_objects(obj: object) -> list:
    """Every rank's ``obj``, in rank order (a list of one without a process group). Objects are
    pickled by torch.distributed between the job's own ranks only."""
    if not active():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: object, src: int = 0, group=None) -> object:
    """``obj`` of rank ``src`` on every rank (pickled between the job's own ranks only). A gloo
    ``group`` carries it on the CPU; the default group's backend decides otherwise."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


@contextlib.contextmanager
def waiting_group(hours: float = 24) -> Iterator[object]:
    """A gloo group whose timeout outlasts a long wait of the other ranks on rank 0 (a token cache build;
    the job's groups fail after ``parallel.timeout_minutes``), made by every rank (a collective) and
    destroyed after the block, so no group outlives the job's. None without a process group."""
    if not active():
        yield None
        return
    group = dist.new_group(backend="gloo", timeout=timedelta(hours=hours))
    try:
        yield group
    finally:
        dist.destroy_process_group(group)


def decided_by_rank_zero(decide: Callable[[], T], group=None) -> T:
    """``decide()`` run on rank 0 alone, its answer on every rank (one broadcast over ``group``): one
    choice where ranks' own views could differ (a shared filesystem seen through each node's cache).

    Rank 0's error reaches every rank instead of leaving them waiting: a user error (ConfigError,
    DataError, OSError) as the same error, marked as rank 0's (:func:`same_on_every_rank`); any other as
    a RuntimeError naming it. Rank 0 raises its own error. Without a process group: ``decide()``.
    """
    if not active():
        return decide()
    result, failure = (None, None), None
    if rank() == 0:
        try:
            result = (decide(), None)
        except (DataError, ConfigError) as e:
            failure, result = e, (None, (type(e).__name__, (str(e),)))
        except OSError as e:
            failure, result = e, (None, ("OSError", (e.errno, e.strerror, e.filename)))
        except BaseException as e:  # noqa: BLE001 (re-raised below): the other ranks must not wait for ever
            failure, result = e, (None, ("RuntimeError", (f"rank 0 failed: {type(e).__name__}: {e}",)))
    value, error = broadcast_object(result, group=group)
    if failure is not None:
        raise failure
    if error is not None:
        if rank() != 0:  # rank 0 reports it: let it, as torchrun stops every rank at the first exit
            time.sleep(1.0)
        kind, args = error
        raise same_on_every_rank({"DataError": DataError, "ConfigError": ConfigError, "OSError": OSError}.get(
            kind, RuntimeError)(*args))
    return value
