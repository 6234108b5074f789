"""The :class:`Transport` protocol (what the 1-bit collectives need of a transport) and
:class:`JobTransport` (what the compression phase needs of the job around them)."""
from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

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
        """The received tensor of an op started by one of the two methods above: the caller's
        own (the flat collective's lean commit writes its rows into stage 1's). What was sent
        is read until the op completes; the caller leaves it unchanged until then."""

    def allgather_ints(self, values: list[int], name: str) -> list[list[int]]:
        """Every rank's ``values`` (the same length on all ranks), in rank order."""

    def allgather_ints_async(self, values: list[int], name: str) -> Any:
        """Start :meth:`allgather_ints`; finish it with :meth:`allgather_ints_wait`."""

    def allgather_ints_wait(self, handle: Any) -> list[list[int]]:
        """The result of an :meth:`allgather_ints_async`."""


class JobTransport:
    """A :class:`Transport` with what the compression phase needs of the job beyond the two
    stages: this base serves any transport object (e.g. the in-process one) by itself;
    :class:`~hvd_onebit.transport.horovod.HorovodJob` adds Horovod's full-precision allreduce
    and the node layout; :class:`~hvd_onebit.transport.torch_job.TorchJob` serves a torchrun
    job on a torch.distributed group.

    Args:
        stages: the transport the 1-bit stages travel on.
    """

    exact_average = False  # full-precision averaging (compressor="none") is Horovod's

    def __init__(self, stages: Transport):
        if not isinstance(stages, Transport):
            raise TypeError("transport must be a transport's name or a Transport object, got "
                            f"{type(stages).__name__}")
        self._stages = stages
        self.name = stages.name

    @property
    def size(self) -> int:
        return self._stages.size

    @property
    def rank(self) -> int:
        return self._stages.rank

    def stages(self, device: torch.device) -> Transport:
        """The transport a 1-bit collective on ``device`` runs its stages on."""
        return self._stages

    def kind(self, device: torch.device) -> str:
        """The transport's name on ``device`` (what the hierarchical collective is built on)."""
        return self.name

    def exact_sum(self, tensors: list[torch.Tensor], name: str
                  ) -> tuple[list[torch.Tensor], int]:
        """The sum over ranks of each tensor, the same bits on every rank, and the bytes this
        rank sent: an allgather of each, summed in rank order."""
        handles = [self._stages.allgather_async(t.view(1, -1), name=f"{name}{i}")
                   for i, t in enumerate(tensors)]
        out = []
        for t, h in zip(tensors, handles):
            rows = self._stages.wait(h).view(self.size, -1)
            total = rows[0].clone()
            for r in range(1, self.size):
                total.add_(rows[r])
            out.append(total)
        return out, sum(4 * t.numel() * (self.size - 1) for t in tensors)

    def exact_mean_(self, tensors: list[torch.Tensor], name: str) -> int:
        """The mean over ranks of each tensor, in place; the bytes this rank sent."""
        raise ValueError("compressor='none' averages through Horovod; a transport object "
                         "carries only the 1-bit collective")

    def node_places(self) -> Optional[tuple[int, list[list[int]]]]:
        """This rank's global rank and every rank's (node, local rank) in rank order, or None
        where the transport knows no nodes (the collectives stay flat)."""
        return None

    def gather_failures(self, failure: str) -> list[str]:
        """Every rank's ``failure`` ("" for none), in rank order."""
        raise NotImplementedError(f"transport {self.name!r} has no nodes to agree on")


def process_set_size(process_set) -> int:
    """Ranks in a Horovod ``process_set`` now (elastic jobs change it); 1 on a rank outside it."""
    if process_set is None or not process_set.included():
        return 1
    return process_set.size()
