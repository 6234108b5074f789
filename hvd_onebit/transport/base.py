"""The :class:`Transport` protocol: what the 1-bit collectives need of a transport."""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Transport(Protocol):
    """What :class:`~hvd_onebit.comm.flat.OneBitAllreduce` needs from a transport.

    Ops are matched across ranks by ``name`` and, for a name used again, by the order of the
    calls, as Horovod matches them; a rank may start several ops before waiting on any. Callers
    start ops in the same order on every rank, so transports that match by order alone (MPI,
    torch.distributed) serve as well.
    """

    name: str  # the transport's kind, e.g. "horovod"
    size: int  # ranks taking part
    rank: int  # this rank, 0 <= rank < size

    def alltoall_async(self, rows: torch.Tensor, name: str) -> Any:
        """rows: [size, row_bytes] uint8; row j goes to rank j. Waited on with :meth:`wait`."""

    def allgather_async(self, row: torch.Tensor, name: str) -> Any:
        """row: [1, row_bytes] uint8; every rank receives [size, row_bytes], in rank order."""

    def wait(self, handle: Any) -> torch.Tensor:
        """The received tensor of an op started by one of the two methods above."""

    def allgather_ints(self, values: list[int], name: str) -> list[list[int]]:
        """Every rank's ``values`` (the same length on all ranks), in rank order."""

    def allgather_ints_async(self, values: list[int], name: str) -> Any:
        """Start :meth:`allgather_ints`; finish it with :meth:`allgather_ints_wait`."""

    def allgather_ints_wait(self, handle: Any) -> list[list[int]]:
        """The result of an :meth:`allgather_ints_async`."""
