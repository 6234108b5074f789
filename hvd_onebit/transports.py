"""Transports: the two collectives the 1-bit allreduce needs, over Horovod, mpi4py or threads.

A transport moves bytes and nothing else: ``alltoall`` of n equal rows (stage 1) and ``allgather``
of one row (stage 2), each with an async start and a wait, plus a small int allgather for the
layout check (:class:`Transport` names exactly that). Horovod's is the default and runs on
whatever Horovod runs on (Gloo, MPI or NCCL; CPU or GPU tensors). The mpi4py one issues
MPI_Ialltoall / MPI_Iallgather on (a duplicate of) the communicator Horovod uses, bypassing
Horovod's background thread and its negotiation round; it needs a job launched with MPI. The
torch.distributed one (Gloo for CPU tensors, NCCL for CUDA) also has no negotiation round and
needs nothing but the ranks' TCP reachability, which a Horovod job already has. The
in-process one (:class:`InProcessWorld`, :class:`InProcessTransport`, :func:`run_threads`) runs n
virtual ranks as threads of one process: tests of any world size without launching a job, and
several ranks on one GPU (NCCL refuses two ranks on one device).
"""
from __future__ import annotations

import os
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, TypeVar, runtime_checkable

import horovod.torch as hvd
import torch

TRANSPORTS = ("auto", "horovod", "mpi", "torch")


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


class _TorchWork:
    def __init__(self, work, result: torch.Tensor):
        self.work = work
        self.result = result


class TorchTransport:
    """Stage collectives through torch.distributed: Gloo for CPU tensors, NCCL for CUDA ones.

    Ops go straight to the process group, with no negotiation round in Horovod's background
    thread: one collective costs about one network round trip plus its bytes. They are matched
    by the order of the calls (every caller here starts them in the same order on every rank).
    The process group is torch.distributed's default group, initialised on first use with the
    ranks of Horovod's global process set (:func:`init_torch_distributed`), or the one the
    script initialised itself if its ranks agree with Horovod's.

    Args:
        process_set: must be Horovod's global process set.
        device: where the tensors live: CPU needs a Gloo group, CUDA an NCCL one.
        members: a subgroup's global ranks, ascending (its group from :func:`torch_subgroups`);
            None: every rank.
    """

    name = "torch"

    def __init__(self, process_set: hvd.ProcessSet = hvd.global_process_set,
                 device: torch.device | str = "cpu", members: Optional[tuple[int, ...]] = None):
        import torch.distributed as dist

        _check_torch_transport(process_set, torch.device(device))
        init_torch_distributed(torch.device(device))
        self._dist = dist
        self.device = torch.device(device)
        if members is None:
            self.group = None
            self.size = dist.get_world_size()
            self.rank = dist.get_rank()
        else:
            self.group = _SUBGROUPS.get(tuple(members))
            if self.group is None:
                raise RuntimeError(f"no torch.distributed group for ranks {tuple(members)}: "
                                   "create the job's groups with torch_subgroups() first")
            self.size = len(members)
            self.rank = list(members).index(dist.get_rank())

    def alltoall_async(self, rows: torch.Tensor, name: str) -> _TorchWork:
        """rows: [n, row_bytes] uint8; row j goes to rank j."""
        out = torch.empty_like(rows)
        return _TorchWork(self._dist.all_to_all_single(out, rows.contiguous(), group=self.group,
                                                       async_op=True), out)

    def allgather_async(self, row: torch.Tensor, name: str) -> _TorchWork:
        """row: [1, row_bytes] uint8; every rank receives [n, row_bytes]."""
        out = torch.empty((self.size * row.shape[0], *row.shape[1:]), dtype=row.dtype,
                          device=row.device)
        return _TorchWork(self._dist.all_gather_into_tensor(out, row.contiguous(),
                                                             group=self.group, async_op=True), out)

    def wait(self, handle: _TorchWork) -> torch.Tensor:
        handle.work.wait()  # Gloo: a condition-variable wait (no spinning); NCCL: a stream wait
        return handle.result

    def allgather_ints(self, values: list[int], name: str) -> list[list[int]]:
        out: list = [None] * self.size
        self._dist.all_gather_object(out, [int(v) for v in values], group=self.group)
        return [list(v) for v in out]

    def allgather_ints_async(self, values: list[int], name: str) -> list[list[int]]:
        return self.allgather_ints(values, name)  # small and rare: done at once

    def allgather_ints_wait(self, handle: list[list[int]]) -> list[list[int]]:
        return handle


# torch.distributed subgroups by their members (global ranks, ascending); made collectively, once
_SUBGROUPS: dict[tuple[int, ...], Any] = {}


def torch_subgroups(groups: list[tuple[int, ...]]) -> None:
    """Create the torch.distributed groups of ``groups`` (each a tuple of global ranks,
    ascending), those not made yet. Every rank must call it with the same list at the same point
    (``dist.new_group`` is a collective of the default group, even for non-members)."""
    import torch.distributed as dist

    for members in groups:
        if tuple(members) not in _SUBGROUPS:
            _SUBGROUPS[tuple(members)] = dist.new_group(list(members))


def _check_torch_transport(process_set: hvd.ProcessSet, device: torch.device) -> None:
    """Raise (the same error on every rank, without a collective) if transport='torch' cannot
    serve this job."""
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("transport='torch' needs torch.distributed, which this torch build "
                           "lacks; use transport='horovod'")
    if process_set.process_set_id != hvd.global_process_set.process_set_id:
        raise ValueError("transport='torch' reduces over all of Horovod's ranks; with a process "
                         "set use transport='horovod'")
    if os.environ.get("HOROVOD_ELASTIC") == "1":
        raise ValueError("transport='torch' cannot follow an elastic job's changing ranks (a "
                         "torch.distributed group has a fixed size); use transport='horovod'")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"transport='torch' moves CPU (Gloo) or CUDA (NCCL) tensors, the "
                         f"parameters are on {device}")
    if dist.is_initialized():
        backend = dist.get_backend()
        if dist.get_world_size() != hvd.size() or dist.get_rank() != hvd.rank():
            raise RuntimeError(
                f"transport='torch': torch.distributed was initialised with rank "
                f"{dist.get_rank()} of {dist.get_world_size()}, Horovod has rank {hvd.rank()} of "
                f"{hvd.size()}; they must agree")
        needed = "nccl" if device.type == "cuda" else "gloo"
        if needed not in str(backend):
            raise RuntimeError(f"transport='torch' with {device.type} tensors needs a "
                               f"{needed} process group; torch.distributed was initialised with "
                               f"{backend}")


# How long every rank may take to reach rank 0's rendezvous when torch.distributed is set up
RENDEZVOUS_TIMEOUT_S = 60.0


class TorchRendezvousError(RuntimeError):
    """Some rank could not reach torch.distributed's rendezvous; raised on every rank alike."""


def init_torch_distributed(device: torch.device | str = "cpu",
                           timeout_s: Optional[float] = None) -> None:
    """Initialise torch.distributed's default group over Horovod's ranks, unless it is already.

    Rank 0 listens on a free port of the address Horovod reaches it at (its
    ``HOROVOD_HOSTNAME``, else its host name's address), or at rank 0's ``MASTER_ADDR`` and
    ``MASTER_PORT`` when both are set, and tells the others through Horovod. Gloo is kept on
    Horovod's interface (``HOROVOD_GLOO_IFACE``). Every rank must call it at the same point.

    Every rank gets ``timeout_s`` (default ``HVD_ONEBIT_RENDEZVOUS_S`` or 60 s) to reach the
    rendezvous; whether all did is then agreed through one Horovod allgather, so a network that
    cannot carry it (a host name that resolves to a loopback address on a cluster, a firewall)
    is a :class:`TorchRendezvousError` on every rank, not a hang.
    """
    import datetime

    import torch.distributed as dist

    if dist.is_initialized():
        return
    if timeout_s is None:
        timeout_s = float(os.environ.get("HVD_ONEBIT_RENDEZVOUS_S", RENDEZVOUS_TIMEOUT_S))
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    iface = os.environ.get("HOROVOD_GLOO_IFACE")
    if iface and iface != "lo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = iface
    addr = None
    if hvd.rank() == 0:
        if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
            addr = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        else:
            host = os.environ.get("HOROVOD_HOSTNAME", "localhost")
            try:
                ip = socket.gethostbyname(host if host != "localhost" else socket.gethostname())
            except OSError:
                ip = "127.0.0.1"
            with socket.socket() as s:
                s.bind((ip, 0))
                addr = (ip, s.getsockname()[1])
    addr = hvd.broadcast_object(addr, root_rank=0, name="hvd_onebit.torch_dist_addr")
    store, error = None, None
    try:
        store = dist.TCPStore(addr[0], addr[1], hvd.size(), hvd.rank() == 0,
                              timeout=datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=True)
    except Exception as exc:  # unreachable, refused, timed out: agreed below
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    flags = hvd.allgather(torch.tensor([[0 if store is not None else 1]], dtype=torch.int32),
                          name="hvd_onebit.torch_dist_joined").flatten().tolist()
    failed = [r for r, f in enumerate(flags) if f]
    if failed:
        raise TorchRendezvousError(
            f"torch.distributed's rendezvous at {addr[0]}:{addr[1]} (rank 0's address) failed "
            f"on rank(s) {failed} within {timeout_s:g} s"
            + (f" (this rank: {error})" if error else "")
            + "; set MASTER_ADDR and MASTER_PORT to an address of rank 0 every rank reaches, "
            "or pass transport='horovod'")
    dist.init_process_group(backend, store=store, rank=hvd.rank(), world_size=hvd.size())


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
            f"thread calls MPI too), but this job has {names.get(level, level)}; let Horovod "
            "initialise MPI (or set mpi4py.rc.thread_level = 'multiple' before importing "
            "mpi4py.MPI), use an MPI built with thread support, or transport='horovod'")
    return base


def resolve_transport(kind: str, process_set: hvd.ProcessSet, device: torch.device | str,
                      hierarchical: bool | str = False) -> str:
    """The transport "auto" stands for in this job: "torch" where torch.distributed can serve
    (all of Horovod's ranks, not elastic, CPU or CUDA tensors, and, if the script initialised
    torch.distributed itself, a group that fits), else "horovod". Other kinds are returned as
    they are. Decided from what every rank sees alike, without a collective. (``hierarchical``
    is accepted for the callers' symmetry; the hierarchical collective runs on either.)"""
    if kind != "auto":
        return kind
    try:
        _check_torch_transport(process_set, torch.device(device))
    except (RuntimeError, ValueError):
        return "horovod"
    return "torch"


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
    if kind == "torch":
        _check_torch_transport(process_set, torch.device(device))


def make_transport(kind: str, process_set: hvd.ProcessSet, device: torch.device | str = "cpu"):
    """Build the transport named ``kind`` ("horovod", "mpi", "torch" or "auto", see
    :func:`resolve_transport`) for ``process_set``."""
    kind = resolve_transport(kind, process_set, device)
    if kind == "horovod":
        return HorovodTransport(process_set)
    if kind == "mpi":
        return MPITransport(process_set)
    if kind == "torch":
        return TorchTransport(process_set, device)
    raise ValueError(f"transport must be one of {TRANSPORTS}, got {kind!r}")


# ---- in-process: n virtual ranks as threads of one process ------------------------------------------

T = TypeVar("T")


@dataclass(eq=False)
class _Op:
    """One collective of an :class:`InProcessWorld`: what each rank sent and what it receives."""

    name: str
    seq: int  # how many ops of this name each rank had started before this one
    size: int
    kinds: dict[int, str] = field(default_factory=dict)  # rank -> "alltoall" | "allgather" | "ints"
    payloads: dict[int, Any] = field(default_factory=dict)
    results: Optional[list[Any]] = None
    error: Optional[str] = None  # set when ranks disagreed on the op
    collected: int = 0

    def label(self) -> str:
        return f"{self.name!r}" + (f" (call {self.seq + 1} of that name)" if self.seq else "")


class InProcessWorld:
    """The shared state of ``size`` virtual ranks running as threads of one process.

    Each rank talks to it through its own :class:`InProcessTransport`. An op is identified by its
    name and by how many ops of that name the rank started before (Horovod matches ops by name;
    the collective reuses its names every call), so ranks may start several ops before waiting
    on any, in any interleaving. An op completes when every rank has joined it; a wait that runs
    past ``timeout`` seconds raises :class:`TimeoutError` naming the op and the ranks that never
    joined, and breaks the world (later waits on unfinished ops raise at once, as a Horovod job
    stops after a lost rank). :meth:`abort` does the same when a rank failed.
    """

    def __init__(self, size: int, timeout: float = 60.0):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"an in-process world needs at least one rank, got {size!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        self.size = size
        self.timeout = timeout
        self._cond = threading.Condition()
        self._ops: dict[tuple[str, int], _Op] = {}
        self._broken: Optional[tuple[type[Exception], str]] = None  # error type, reason

    def abort(self, reason: str, error: type[Exception] = RuntimeError) -> None:
        """Break the world: every wait on an unfinished op raises ``error`` at once, with
        ``reason``."""
        with self._cond:
            if self._broken is None:
                self._broken = (error, reason)
            self._cond.notify_all()

    def join(self, rank: int, name: str, seq: int, kind: str, payload: Any) -> _Op:
        """Rank ``rank`` joins op (name, seq) with ``payload``; the last rank to join computes
        everyone's results. Never blocks on other ranks."""
        with self._cond:
            op = self._ops.get((name, seq))
            if op is None:
                op = self._ops[(name, seq)] = _Op(name, seq, self.size)
            if rank in op.kinds:
                raise RuntimeError(f"in-process transport: rank {rank} joined op {op.label()} twice")
            op.kinds[rank] = kind
            op.payloads[rank] = payload
            if len(op.kinds) == self.size:
                try:
                    op.results = _complete(op)
                except ValueError as exc:
                    op.error = str(exc)
                op.payloads.clear()
                self._cond.notify_all()
            return op

    def wait(self, op: _Op, rank: int) -> Any:
        """Block until ``op`` completes; return ``rank``'s result."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while op.results is None and op.error is None and self._broken is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self.size)) - set(op.kinds))
                    self._broken = (TimeoutError, f"op {op.label()}: rank(s) {missing} never "
                                                  f"joined it within {self.timeout:g} s")
                    self._cond.notify_all()
                    break
                self._cond.wait(left)
            if op.error is not None:
                raise RuntimeError(f"in-process transport: op {op.label()}: {op.error}")
            if op.results is None:
                error, reason = self._broken
                raise error(f"in-process transport: rank {rank} cannot finish op {op.label()}: "
                            f"{reason}")
            result, op.results[rank] = op.results[rank], None
            op.collected += 1
            if op.collected == self.size:
                del self._ops[(op.name, op.seq)]
            return result


def _complete(op: _Op) -> list[Any]:
    """Every rank's result of ``op``, once all have joined; ValueError if they disagree."""
    ranks = range(op.size)
    kinds = {op.kinds[r] for r in ranks}
    if len(kinds) != 1:
        raise ValueError("ranks started different collectives under this name: "
                         + ", ".join(f"rank {r}: {op.kinds[r]}" for r in ranks))
    kind = kinds.pop()
    sent = [op.payloads[r] for r in ranks]
    if kind == "ints":
        if len({len(v) for v in sent}) != 1:
            raise ValueError("ranks sent int lists of different lengths: "
                             + ", ".join(f"rank {r}: {len(v)}" for r, v in enumerate(sent)))
        return [[list(v) for v in sent] for _ in ranks]
    shapes = {(tuple(t.shape[1:]), t.dtype) for t in sent}
    if len(shapes) != 1 or (kind == "alltoall" and {t.shape[0] for t in sent} != {op.size}):
        raise ValueError(f"ranks' {kind} tensors do not fit together: "
                         + ", ".join(f"rank {r}: {tuple(t.shape)} {t.dtype}"
                                     for r, t in enumerate(sent)))
    if kind == "alltoall":  # rank j receives row j of every rank, in rank order
        results = [torch.stack([t[j].to(sent[j].device) for t in sent]) for j in ranks]
    else:
        results = [torch.cat([t.to(sent[j].device) for t in sent]) for j in ranks]
    _finish_device_work(results)
    return results


def _finish_device_work(tensors: list[torch.Tensor]) -> None:
    """Wait for the copies queued on CUDA streams, so that a rank on another thread (another
    current stream) reads finished data. No-op on CPU."""
    for device in {t.device for t in tensors if t.device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()


class InProcessTransport:
    """Rank ``rank`` of an :class:`InProcessWorld`: the :class:`Transport` of a virtual rank.

    Sent tensors are copied when an op starts (the sender may reuse its buffer at once), on their
    own device, CPU or CUDA; results come back on the device the receiving rank sent from. Use
    one transport object per rank and thread.
    """

    name = "inprocess"

    def __init__(self, world: InProcessWorld, rank: int):
        if not 0 <= rank < world.size:
            raise ValueError(f"rank {rank} is outside a world of {world.size}")
        self.world = world
        self.size = world.size
        self.rank = rank
        self._started: Counter[str] = Counter()  # ops started per name, to match repeated names

    def _join(self, kind: str, name: str, payload: Any) -> _Op:
        seq = self._started[name]
        self._started[name] += 1
        return self.world.join(self.rank, name, seq, kind, payload)

    def _snapshot(self, t: torch.Tensor) -> torch.Tensor:
        copy = t.detach().clone(memory_format=torch.contiguous_format)
        _finish_device_work([copy])
        return copy

    def alltoall_async(self, rows: torch.Tensor, name: str) -> _Op:
        """rows: [size, row_bytes]; row j goes to rank j."""
        return self._join("alltoall", name, self._snapshot(rows))

    def allgather_async(self, row: torch.Tensor, name: str) -> _Op:
        """row: [k, ...]; every rank receives every rank's rows, concatenated in rank order."""
        return self._join("allgather", name, self._snapshot(row))

    def wait(self, handle: _Op) -> torch.Tensor:
        return self.world.wait(handle, self.rank)

    def allgather_ints(self, values: list[int], name: str) -> list[list[int]]:
        return self.allgather_ints_wait(self.allgather_ints_async(values, name))

    def allgather_ints_async(self, values: list[int], name: str) -> _Op:
        return self._join("ints", name, [int(v) for v in values])

    def allgather_ints_wait(self, handle: _Op) -> list[list[int]]:
        return self.world.wait(handle, self.rank)


def run_threads(size: int, fn: Callable[[InProcessTransport], T], *, timeout: float = 60.0,
                world: Optional[InProcessWorld] = None) -> list[T]:
    """Run ``fn(transport)`` for ``size`` virtual ranks, one thread each; return their results.

    Args:
        size: number of virtual ranks.
        fn: called on rank r's thread with rank r's :class:`InProcessTransport`.
        timeout: seconds a rank waits for the others in one op (ignored when ``world`` is given).
        world: an existing world of ``size`` ranks, e.g. to reuse it across calls.
    Returns:
        ``[fn result of rank 0, ..., of rank size-1]``.
    Raises:
        The first exception any rank raised (by time: the cause, not the aborts it led to), with a
        note naming the rank. A failing rank aborts the world so the others do not wait for it.
    """
    world = world if world is not None else InProcessWorld(size, timeout)
    if world.size != size:
        raise ValueError(f"the world has {world.size} ranks, asked to run {size}")
    results: list[Any] = [None] * size
    failures: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def body(rank: int) -> None:
        try:
            results[rank] = fn(InProcessTransport(world, rank))
        except BaseException as exc:  # reported to the caller below
            with lock:
                failures.append((rank, exc))
            world.abort(f"rank {rank} failed with {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=body, args=(r,), name=f"hvd_onebit.rank{r}", daemon=True)
               for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        rank, exc = failures[0]
        exc.add_note(f"(raised on virtual rank {rank} of {size})")
        raise exc
    return results
