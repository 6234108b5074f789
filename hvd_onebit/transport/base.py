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
    nodes_from = "the launcher"  # who decides which ranks share a node, for the warnings

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
        """The sum over ranks of each tensor (flat), the same bits on every rank, and the bytes
        this rank sent. Every element is added in rank order: rank j adds the j-th of n equal
        pieces of every rank's tensor (an alltoall), and an allgather gathers the sums. Each
        rank sends ``2 (n-1)/n`` of a tensor's bytes, as a ring allreduce, and holds about two
        tensors' worth beside it, not n; below :data:`SMALL_SUM_BYTES` one allgather of every
        rank's whole tensor, summed in the same order, takes one round trip instead of two."""
        n = self.size
        small = [t.numel() * t.element_size() < SMALL_SUM_BYTES for t in tensors]
        pieces = [-(-t.numel() // n) for t in tensors]
        handles = []
        for i, (t, is_small, piece) in enumerate(zip(tensors, small, pieces)):
            flat = t.reshape(-1)
            if is_small:
                handles.append(self._stages.allgather_async(_as_bytes(flat.view(1, -1)),
                                                            name=f"{name}{i}"))
                continue
            if piece * n != flat.numel():
                flat = torch.cat([flat, flat.new_zeros(piece * n - flat.numel())])
            handles.append(self._stages.alltoall_async(_as_bytes(flat.view(n, piece)),
                                                       name=f"{name}{i}"))
        gathers = []
        for i, (t, h) in enumerate(zip(tensors, handles)):
            rows = self._stages.wait(h).view(t.dtype).view(n, -1)
            total = rows[0].clone()
            for r in range(1, n):
                total.add_(rows[r])
            gathers.append(total if small[i] else self._stages.allgather_async(
                _as_bytes(total.view(1, -1)), name=f"{name}{i}.sums"))
        out = [g if small[i] else self._stages.wait(g).view(t.dtype).reshape(-1)[:t.numel()]
               for i, (t, g) in enumerate(zip(tensors, gathers))]
        sent = sum(t.numel() * t.element_size() * (n - 1) if is_small
                   else 2 * (n - 1) * piece * t.element_size()
                   for t, is_small, piece in zip(tensors, small, pieces))
        return out, sent

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


# Below this many bytes an exact sum is one allgather (one round trip), above it an alltoall
# and an allgather (2 (n-1)/n of the bytes, two tensors' memory instead of n)
SMALL_SUM_BYTES = 1 << 16


def _as_bytes(rows: torch.Tensor) -> torch.Tensor:
    """[r, k] of any dtype as the [r, k * itemsize] uint8 rows the stage transports carry."""
    return rows.contiguous().view(torch.uint8).view(rows.shape[0], -1)


def process_set_size(process_set) -> int:
    """Ranks in a Horovod ``process_set`` now (elastic jobs change it); 1 on a rank outside it."""
    if process_set is None or not process_set.included():
        return 1
    return process_set.size()
