"""The in-process transport: n virtual ranks as threads of one process.

:class:`InProcessWorld` is their shared state, :class:`InProcessTransport` one rank's
:class:`~hvd_onebit.transport.base.Transport`, :func:`run_threads` runs a function on every rank.
Tests of any world size without launching a job, and several ranks on one GPU (NCCL refuses two
ranks on one device).
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TypeVar

import torch

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

    Sent tensors are read in place when the last rank joins the op, as a real transport reads
    them while the op is on the wire: the sender leaves them unchanged until its wait returns.
    Results come back on the device the receiving rank sent from, CPU or CUDA. Use one
    transport object per rank and thread.
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

    def _sent(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as the op reads it, once the work queued on this thread's stream (which wrote
        it) is done: the rank that completes the op reads it from another thread."""
        t = t.detach()
        _finish_device_work([t])
        return t

    def alltoall_async(self, rows: torch.Tensor, name: str) -> _Op:
        """rows: [size, row_bytes]; row j goes to rank j."""
        return self._join("alltoall", name, self._sent(rows))

    def allgather_async(self, row: torch.Tensor, name: str) -> _Op:
        """row: [k, ...]; every rank receives every rank's rows, concatenated in rank order."""
        return self._join("allgather", name, self._sent(row))

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
