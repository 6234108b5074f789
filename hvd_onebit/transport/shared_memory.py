"""The hierarchical collective's stages inside a node, through the node's shared memory (CPU).

Ranks of one node that exchange full-precision shards over TCP loopback pay for every byte twice
in kernel copies, on the same cores that compute. Here the node's ranks map one shared segment
instead (a file in ``/dev/shm``, its memory allocated up front, unlinked as soon as every rank
has mapped it):

    inputs:  [per_node, per_node * shard] float32: row j is local rank j's whole (padded) input
    output:  [per_node, shard] float32: row i is local rank i's averaged shard

and an exchange is a write into this rank's row followed by a barrier of the node's ranks (a
one-element Gloo allreduce on the node's torch.distributed subgroup, so a lost rank ends in
Gloo's timeout, not a hang). What a rank receives is a view of the segment, read in place.

Reuse without a second barrier: a rank writes its input row for call k+1 only after the output
barrier of call k, which no rank passes before it has read every input row of call k; it writes
its output row of call k+1 only after the input barrier of call k+1, which no rank passes before
it has finished call k (read the output).
"""
from __future__ import annotations

import contextlib
import os
import uuid
from typing import Any, Optional, Sequence

import torch

from .torch_distributed import TorchTransport

#: Where the segments are created: a RAM-backed file system (``HVD_ONEBIT_SHM_DIR`` overrides).
DEFAULT_SHM_DIR = "/dev/shm"


def shm_dir() -> str:
    return os.environ.get("HVD_ONEBIT_SHM_DIR", DEFAULT_SHM_DIR)


class SharedMemoryError(RuntimeError):
    """The node's ranks could not share a segment (raised on every rank of the node alike)."""


class _Barrier:
    """A barrier of the node's ranks in flight; ``result`` is what the exchange received."""

    def __init__(self, work: Any, result: torch.Tensor):
        self.work = work
        self.result = result


class SharedMemoryTransport:
    """Alltoall of float32 shards and allgather of one shard among the ranks of one node, through
    a shared segment (see the module's docstring). The interface of the hierarchical
    collective's intra-node stages (``alltoall_async``, ``allgather_async``, ``wait``).

    Args:
        members: the node's global ranks, ascending (a torch.distributed subgroup already made
            with :func:`~hvd_onebit.transport.torch_distributed.torch_subgroups`).
        shard: float32 elements per shard; each rank's input is ``len(members)`` shards.
        name: shown in errors.

    Raises:
        SharedMemoryError: on every rank of the node, if any of them could not map the segment.
    """

    name = "shared-memory"

    def __init__(self, members: Sequence[int], shard: int, name: str = "hvd_onebit.shm"):
        import torch.distributed as dist

        self._dist = dist
        self._group = TorchTransport(members=tuple(members))  # the node's subgroup
        self.size = self._group.size
        self.rank = self._group.rank
        self.shard = shard
        self.label = name
        L = self.size
        numel = L * L * shard + L * shard
        created, why = self._create_path(numel) if self.rank == 0 else ("", "")
        try:
            segment, reasons = self._map(created, why, numel)
        finally:  # every rank has mapped it, failed to, or the node's exchange broke (a rank
            if created:  # lost): nothing is left behind
                with contextlib.suppress(FileNotFoundError):  # not the error that got here
                    os.unlink(created)
        failed = {r: w for r, w in enumerate(reasons) if w}
        if failed:
            raise SharedMemoryError(f"{name}: the node's ranks cannot share {4 * numel} bytes "
                                    f"in {shm_dir()} (local rank: reason) {failed}")
        self.inputs = segment[:L * L * shard].view(L, L * shard)
        self.output = segment[L * L * shard:].view(L, shard)
        self._token = torch.zeros(1)

    def _map(self, created: str, why: str, numel: int) -> tuple[Optional[torch.Tensor], list]:
        """The segment local rank 0 ``created`` (or ``why`` not), mapped on every rank of the
        node: this rank's mapping (None where it failed) and each rank's reason ("" mapped)."""
        L = self.size
        paths: list = [None] * L
        self._dist.all_gather_object(paths, (created, why), group=self._group.group)
        path, why = paths[0]
        segment = None
        if path:
            try:
                segment = torch.from_file(path, shared=True, size=numel, dtype=torch.float32)
                why = ""
            except (RuntimeError, OSError) as exc:
                why = f"{type(exc).__name__}: {exc}"
        reasons: list = [None] * L
        self._dist.all_gather_object(reasons, why, group=self._group.group)
        return segment, reasons

    @staticmethod
    def _create_path(numel: int) -> tuple[str, str]:
        """(path, "") of a new zero-filled file of ``numel`` float32 in :func:`shm_dir`, its
        memory allocated now, or ("", why) if it cannot be made. Allocated rather than merely
        sized: a RAM file system that runs out of room under a mapped file kills the process
        that touches the missing page (SIGBUS), e.g. in a container's small /dev/shm."""
        path = os.path.join(shm_dir(), f"hvd_onebit-{os.getpid()}-{uuid.uuid4().hex}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            return "", f"cannot create it: {exc}"
        try:
            os.posix_fallocate(fd, 0, 4 * numel)
        except OSError as exc:
            os.unlink(path)
            return "", f"cannot allocate it: {exc}"
        finally:
            os.close(fd)
        return path, ""

    def input_row(self) -> torch.Tensor:
        """float32 [size * shard]: this rank's input row; an input written here is not copied."""
        return self.inputs[self.rank]

    def output_row(self) -> torch.Tensor:
        """float32 [shard]: this rank's output row; a shard decoded here is not copied."""
        return self.output[self.rank]

    def _barrier(self, result: torch.Tensor) -> _Barrier:
        return _Barrier(self._dist.all_reduce(self._token, group=self._group.group,
                                              async_op=True), result)

    def alltoall_async(self, rows: torch.Tensor, name: str) -> _Barrier:
        """rows: float32 [size, shard], row j for local rank j (the input row, or copied there).
        Received: [size, shard], row j from local rank j (a strided view of the segment)."""
        mine = self.input_row().view(self.size, self.shard)
        if rows.data_ptr() != mine.data_ptr():
            mine.copy_(rows)
        received = self.inputs.view(self.size, self.size, self.shard)[:, self.rank]
        return self._barrier(received)

    def allgather_async(self, row: torch.Tensor, name: str) -> _Barrier:
        """row: float32 [1, shard] (the output row, or copied there); every rank receives
        [size, shard] in local-rank order (the segment's output rows)."""
        mine = self.output_row()
        if row.data_ptr() != mine.data_ptr():
            mine.copy_(row.reshape(-1))
        return self._barrier(self.output)

    def wait(self, handle: _Barrier) -> torch.Tensor:
        handle.work.wait()
        return handle.result
