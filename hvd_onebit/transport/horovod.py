"""The Horovod transport (the default) and the sleeping wait on a Horovod handle."""
from __future__ import annotations

import time
from typing import Any

import horovod.torch as hvd
import torch


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
