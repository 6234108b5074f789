"""The mpi4py transport: MPI_Ialltoall / MPI_Iallgather on a duplicate of Horovod's communicator.

It bypasses Horovod's background thread and its negotiation round; it needs a job launched with
MPI, MPI initialised with MPI_THREAD_MULTIPLE, and CPU tensors (:func:`check_mpi_transport`).
"""
from __future__ import annotations

import horovod.torch as hvd
import torch


class _MPIRequest:
    def __init__(self, request, result: torch.Tensor):
        self.request = request
        self.result = result


class MPITransport:
    """Stage collectives through mpi4py on a duplicate of Horovod's MPI communicator (CPU only).

    Args:
        process_set: Horovod process set; its ``mpi_comm`` is used when it has one, else
            ``MPI.COMM_WORLD``. Its size and rank must match Horovod's, or construction fails.
    """

    name = "mpi"

    def __init__(self, process_set: hvd.ProcessSet = hvd.global_process_set):
        from mpi4py import MPI

        base = mpi_communicator(process_set)
        self.size = process_set.size()
        self.rank = process_set.rank()
        self._MPI = MPI
        self.comm = base.Dup()  # our own context: never matches Horovod's messages

    def _check(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu":
            raise ValueError("transport='mpi' moves CPU tensors only; use transport='horovod' on GPU")

    def alltoall_async(self, rows: torch.Tensor, name: str) -> _MPIRequest:
        self._check(rows)
        out = torch.empty_like(rows)
        req = self.comm.Ialltoall([rows.numpy(), self._MPI.BYTE], [out.numpy(), self._MPI.BYTE])
        return _MPIRequest(req, out)

    def allgather_async(self, row: torch.Tensor, name: str) -> _MPIRequest:
        self._check(row)
        out = torch.empty((self.size, row.shape[-1]), dtype=row.dtype)
        req = self.comm.Iallgather([row.numpy(), self._MPI.BYTE], [out.numpy(), self._MPI.BYTE])
        return _MPIRequest(req, out)

    def wait(self, handle: _MPIRequest) -> torch.Tensor:
        handle.request.Wait()
        return handle.result

    def allgather_ints(self, values: list[int], name: str) -> list[list[int]]:
        return [list(v) for v in self.comm.allgather(list(values))]

    def allgather_ints_async(self, values: list[int], name: str) -> list[list[int]]:
        return self.allgather_ints(values, name)  # small and rare: done at once

    def allgather_ints_wait(self, handle: list[list[int]]) -> list[list[int]]:
        return handle


def check_mpi_transport(process_set: hvd.ProcessSet, device: torch.device | str) -> None:
    """Raise (the same error on every rank, without a collective) if transport='mpi' cannot
    serve this job on ``device``."""
    if torch.device(device).type != "cpu":
        raise ValueError(f"transport='mpi' moves CPU tensors only, the parameters are on "
                         f"{device}; use transport='horovod' on GPU")
    mpi_communicator(process_set)


def mpi_communicator(process_set: hvd.ProcessSet):
    """The MPI communicator behind ``process_set``, or a clear error saying why MPI cannot serve.

    Checked locally (no collective), so every rank raises the same error at construction.
    """
    try:
        from mpi4py import MPI
    except ImportError as exc:  # pragma: no cover - mpi4py is a declared dependency
        raise RuntimeError("transport='mpi' needs mpi4py") from exc
    base = getattr(process_set, "mpi_comm", None) or MPI.COMM_WORLD
    size, rank = process_set.size(), process_set.rank()
    if base.Get_size() != size or base.Get_rank() != rank:
        raise RuntimeError(
            "transport='mpi' needs the job launched with MPI (mpirun, or horovodrun --mpi): "
            f"the MPI communicator has size {base.Get_size()} and rank {base.Get_rank()}, "
            f"Horovod's process set has size {size} and rank {rank}")
    # Horovod's background thread calls MPI while this transport calls it from the training
    # thread: anything below MPI_THREAD_MULTIPLE makes that undefined behaviour.
    level = MPI.Query_thread()
    if size > 1 and level != MPI.THREAD_MULTIPLE:
        names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
                 MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED"}
        raise RuntimeError(
            "transport='mpi' needs MPI initialised with MPI_THREAD_MULTIPLE (Horovod's background "
            f"thread calls MPI too), but this job has {names.get(level, level)}; let Horovod "
            "initialise MPI (or set mpi4py.rc.thread_level = 'multiple' before importing "
            "mpi4py.MPI), use an MPI built with thread support, or transport='horovod'")
    return base
