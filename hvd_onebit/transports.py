"""Transports: the two collectives the 1-bit allreduce needs, over Horovod or over mpi4py.

A transport moves bytes and nothing else: ``alltoall`` of n equal rows (stage 1) and ``allgather``
of one row (stage 2), each with an async start and a wait. Horovod's is the default and runs on
whatever Horovod runs on (Gloo, MPI or NCCL; CPU or GPU tensors). The mpi4py one issues
MPI_Ialltoall / MPI_Iallgather on (a duplicate of) the communicator Horovod uses, bypassing
Horovod's background thread and its negotiation round; it needs a job launched with MPI.
"""
from __future__ import annotations

import time
from typing import Any

import horovod.torch as hvd
import torch

TRANSPORTS = ("horovod", "mpi")


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
# spinning waiters take CPU time from the ranks still compressing, and every rank then waits for
# the slowest one. Measured with 4 ranks on 2 cores: 300-580k context switches/s and 60-80% system
# time in the compression phase. So poll, then sleep with a doubling back-off from a few
# microseconds (short ops stay fast) to a cap that bounds the added latency per wait.
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

        base = _mpi_communicator(process_set)
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


def _mpi_communicator(process_set: hvd.ProcessSet):
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
            f"thread calls MPI too), but this job has {names.get(level, level)}; unset "
            "HOROVOD_MPI_THREADS_DISABLE, use an MPI built with thread support, or "
            "transport='horovod'")
    return base


def check_transport(kind: str, process_set: hvd.ProcessSet, device: torch.device) -> None:
    """Raise (the same error on every rank) if transport ``kind`` cannot run in this job on
    ``device``; collective-free, so it can run at construction."""
    if kind not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {kind!r}")
    if kind == "mpi":
        if torch.device(device).type != "cpu":
            raise ValueError(f"transport='mpi' moves CPU tensors only, the parameters are on "
                             f"{device}; use transport='horovod' on GPU")
        _mpi_communicator(process_set)


def make_transport(kind: str, process_set: hvd.ProcessSet):
    """Build the transport named ``kind`` ("horovod" or "mpi") for ``process_set``."""
    if kind == "horovod":
        return HorovodTransport(process_set)
    if kind == "mpi":
        return MPITransport(process_set)
    raise ValueError(f"transport must be one of {TRANSPORTS}, got {kind!r}")
