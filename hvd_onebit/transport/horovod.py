"""The Horovod transport (the default), the sleeping wait on a Horovod handle, and
:class:`HorovodJob`: the compression phase's transport in a Horovod job."""
from __future__ import annotations

import time
from typing import Any

import horovod.torch as hvd
import torch

from ..layout import ring_allreduce_bytes
from .base import JobTransport, process_set_size


class HorovodTransport:
    """Stage collectives through ``hvd.alltoall_async`` / ``hvd.allgather_async``.

    Horovod never fuses alltoalls, so the caller sends each stage as one fused byte buffer.
    Op names must be unique among ops in flight and identical across ranks.
    """

    name = "horovod"

    def __init__(self, process_set: hvd.ProcessSet = hvd.global_process_set):
        self.process_set = process_set
        self.size = process_set.size()
        self.rank = process_set.rank()

    def alltoall_async(self, rows: torch.Tensor, name: str) -> Any:
        """rows: [n, row_bytes] uint8; row j goes to rank j."""
        return hvd.alltoall_async(rows, name=name, process_set=self.process_set)

    def allgather_async(self, row: torch.Tensor, name: str) -> Any:
        """row: [1, row_bytes] uint8; every rank receives [n, row_bytes]."""
        return hvd.allgather_async(row, name=name, process_set=self.process_set)

    def wait(self, handle: Any) -> torch.Tensor:
        sleep_until_done(handle)
        out = hvd.synchronize(handle)
        return out[0] if isinstance(out, tuple) else out  # alltoall returns (output, splits)

    def allgather_ints(self, values: list[int], name: str) -> list[list[int]]:
        """Every rank's ``values`` (same length on all ranks), in rank order."""
        return self.allgather_ints_wait(self.allgather_ints_async(values, name))

    def allgather_ints_async(self, values: list[int], name: str) -> Any:
        row = torch.tensor([values], dtype=torch.int64)
        return hvd.allgather_async(row, name=name, process_set=self.process_set)

    def allgather_ints_wait(self, handle: Any) -> list[list[int]]:
        return self.wait(handle).tolist()


# Waiting for a Horovod handle. hvd.synchronize() spins on sched_yield() until the background
# thread finishes the op; when ranks outnumber cores (or share them with data loaders), those
# spinning waiters take CPU time from the ranks still compressing (as context switches and
# system time), and every rank then waits for the slowest one. So poll, then sleep with a
# doubling back-off from a few microseconds (short ops stay fast) to a cap that bounds the added
# latency per wait.
_POLL_FIRST_S = 20e-6
_POLL_CAP_S = 500e-6


def sleep_until_done(handle: Any) -> None:
    """Block until the Horovod op behind ``handle`` has finished, sleeping rather than spinning.

    Adds at most ``_POLL_CAP_S`` (0.5 ms) to a wait; ``hvd.synchronize(handle)`` afterwards
    returns at once with the result (or raises the op's error).
    """
    delay = _POLL_FIRST_S
    while not hvd.poll(handle):
        time.sleep(delay)
        delay = min(2 * delay, _POLL_CAP_S)


def exact_allreduces(tensors: list[torch.Tensor], name: str, process_set: hvd.ProcessSet,
                     average: bool = False, in_place: bool = False) -> list[torch.Tensor]:
    """Horovod's full-precision allreduce of each tensor (the sum, or with ``average`` the
    mean), all started before any is waited for, each waited for by sleeping: the same bits on
    every rank. ``in_place``: the results are written into ``tensors`` (returned)."""
    op = hvd.Average if average else hvd.Sum
    start = hvd.allreduce_async_ if in_place else hvd.allreduce_async
    handles = [start(t, op=op, name=f"{name}{i}", process_set=process_set)
               for i, t in enumerate(tensors)]
    for h in handles:
        sleep_until_done(h)
    return [hvd.synchronize(h) for h in handles]


class HorovodJob(JobTransport):
    """The compression phase's transport in a Horovod job: the 1-bit stages on the transport
    named ``kind`` over ``process_set`` (built per collective: "torch" carries the device's
    Gloo or NCCL), full-precision sums and means through Horovod's allreduce, the
    node layout from Horovod's local and cross ranks.

    Args:
        kind: "horovod", "mpi", "torch" or "auto" (decided per device, as
            :func:`~hvd_onebit.transport.registry.resolve_transport` does).
        process_set: the Horovod process set the phase reduces over.
    """

    nodes_from = ("Horovod: under MPI one machine is one node whatever horovodrun's -H says; "
                  "horovodrun --gloo follows -H")

    exact_average = True

    def __init__(self, kind: str, process_set: hvd.ProcessSet = hvd.global_process_set):
        self.name = kind
        self.process_set = process_set

    @property
    def size(self) -> int:
        return process_set_size(self.process_set)

    @property
    def rank(self) -> int:
        """This rank in the process set; 0 outside it, where the job is this rank alone (as
        :attr:`size` counts it, and as Horovod's optimizer steps there, without averaging)."""
        return self.process_set.rank() if self.process_set.included() else 0

    def stages(self, device: torch.device):
        """The stage transport on ``device``, built now for one collective with the process
        set's ranks as they are (an elastic job changes them); none for one rank."""
        from .registry import make_transport

        if self.process_set.size() > 1:
            return make_transport(self.name, self.process_set, torch.device(device))
        return Alone()

    def kind(self, device: torch.device) -> str:
        from .registry import resolve_transport

        return resolve_transport(self.name, self.process_set, device)

    def exact_sum(self, tensors: list[torch.Tensor], name: str
                  ) -> tuple[list[torch.Tensor], int]:
        """Horovod's allreduce (a ring: each chunk is reduced once, then copied)."""
        sums = exact_allreduces(tensors, name, self.process_set)
        return sums, sum(ring_allreduce_bytes(4 * t.numel(), self.size) for t in tensors)

    def exact_mean_(self, tensors: list[torch.Tensor], name: str) -> int:
        exact_allreduces(tensors, name, self.process_set, average=True, in_place=True)
        return sum(ring_allreduce_bytes(t.numel() * t.element_size(), self.size)
                   for t in tensors)

    def node_places(self) -> tuple[int, list[list[int]]]:
        """This rank's global rank, and (cross rank = node, local rank) of every rank; one
        allgather."""
        mine = torch.tensor([[hvd.cross_rank(), hvd.local_rank()]], dtype=torch.int64)
        return hvd.rank(), hvd.allgather(mine, name="hvd_onebit.topology").tolist()

    def gather_failures(self, failure: str) -> list[str]:
        """One allgather on torch.distributed's default group (set up with the torch
        transport, the only one the node's shared memory runs beside)."""
        import torch.distributed as dist

        failures: list = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
        return failures


class Alone:
    """The stages of a process set of one rank: a collective there sends nothing."""

    name = "alone"
    size = 1
    rank = 0

    def alltoall_async(self, rows: torch.Tensor, name: str) -> Any:
        raise RuntimeError("one rank sends nothing")

    allgather_async = alltoall_async

    def wait(self, handle: Any) -> torch.Tensor:
        raise RuntimeError("one rank sends nothing")

    def allgather_ints(self, values: list[int], name: str) -> list[list[int]]:
        return [list(values)]

    def allgather_ints_async(self, values: list[int], name: str) -> Any:
        return [list(values)]

    def allgather_ints_wait(self, handle: Any) -> list[list[int]]:
        return handle
