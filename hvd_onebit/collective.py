"""OneBitAllreduce: the error-compensated two-stage 1-bit allreduce.

For n ranks and a buffer x of N elements (padded to n equal chunks, see :mod:`hvd_onebit.layout`):

1. *Worker compression*: ``y = x + e_w``; per block a scale ``s = ||y||_2 / sqrt(block)`` and the
   signs of y, packed 8 per byte; ``e_w = y - s * sign(y)`` (sign(0) = +1).
2. *Stage 1, one alltoall*: rank j receives chunk j (signs + scales) from every rank.
3. *Server step* on rank j: ``z = mean_i(s_i * sign_i) + e_s``; compress z the same way;
   ``e_s = z - s' * sign(z)``.
4. *Stage 2, one allgather* of every rank's compressed chunk; every rank decodes all n chunks.
   All ranks end with bit-identical outputs.

Each rank sends about ``2 * (n-1)/n * N/8`` bytes per call, 32x less than an fp32 ring allreduce.
The two error-feedback buffers carry what compression dropped into the next call, so over repeated
calls nothing is lost: the running mean of the outputs converges to the running mean of the true
averages. They are rank-local state (``state_dict`` / ``load_state_dict``).

A call either completes and commits both error buffers, or raises and leaves them untouched: a
non-finite input on any rank travels as a status word in every row of stage 1, so every rank raises
:class:`NonFiniteInputError` after the same collective instead of one rank raising and the others
hanging. :func:`synchronize_all` extends this to several calls (one per bucket of a training step):
all commit, or none does.

One buffer per error, not two (``spare_errors=False``, the lean mode): the compression passes
before each stage write only the rows (the error's new y, or z, is not stored), and once every
rank's status words said the call succeeded, the commit runs each pass again with y (z) updated in
place, which gives the same bits from the same inputs. So the input must not change between
``allreduce_async`` and the end of ``synchronize``. Memory beyond the input and output: the
worker error (``padded`` float32), the server error (``chunk`` float32) and a few rows of
``padded / 8`` bytes; traffic: one more pass over the input and the worker error per call. With
``spare_errors=True`` the passes write the new y and z beside the committed ones and the commit
swaps them: one more ``padded + chunk`` float32, no pass repeated (where compute, not memory,
is short: a CPU).

Two hooks let a caller fuse its own work into the collective's passes over memory, so that work
costs no pass of its own: an :class:`InputProducer` is an input the worker compression computes
in its own pass, and an :class:`Epilogue` is applied to the output by the decode pass that
writes it (only once every rank has succeeded).
"""
from __future__ import annotations

import itertools
import time
import weakref
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence, runtime_checkable

import horovod.torch as hvd
import torch

from . import kernels
from .dtypes import FLOAT_DTYPES
from .layout import Layout
from .transport.base import Transport
from .transport.registry import make_transport

_default_names = itertools.count()
# Default names of objects built on a transport object are counted per transport: the virtual
# ranks of an in-process world share this module, and each must count its own objects.
_default_names_per_transport: "weakref.WeakKeyDictionary[Transport, itertools.count]" = \
    weakref.WeakKeyDictionary()


@runtime_checkable
class InputProducer(Protocol):
    """An input that the worker compression can compute inside its own pass.

    ``like`` is a tensor with the input's number of elements, dtype and device (the output is
    made like it). :meth:`compress` is :func:`hvd_onebit.kernels.worker_compress` of the input,
    computing it in the same pass where it can; :meth:`materialize` computes it alone, with the
    same bits.
    """

    @property
    def like(self) -> torch.Tensor: ...

    def compress(self, y_prev: torch.Tensor, prev_send: torch.Tensor, y_out: torch.Tensor,
                 send: torch.Tensor, layout: Layout, backend: str) -> bool:
        """Like ``kernels.worker_compress(input, y_prev, prev_send, y_out, send, layout,
        backend)``; returns False if the input held a non-finite value."""

    def materialize(self, out: Optional[torch.Tensor] = None,
                    backend: str = "torch") -> torch.Tensor:
        """The input as float32 [numel], or written into ``out`` and returned as ``out``;
        ``backend`` as for the kernels (every backend gives the same bits)."""


@runtime_checkable
class Epilogue(Protocol):
    """Work on the output of a call, done only once the call has succeeded on every rank.

    :meth:`decode_into` decodes and applies it in one pass where it can; :meth:`apply` applies
    it to an output already decoded (used when the output is not float32); the two give the
    same bits.
    """

    def decode_into(self, rows: torch.Tensor, out: torch.Tensor, layout: Layout,
                    backend: str) -> None:
        """Like ``kernels.decode(rows, out, layout, backend)`` followed by ``apply(out)``."""

    def apply(self, out: torch.Tensor) -> None:
        """Apply to ``out``, the decoded output [numel]."""

    def copy_apply(self, src: torch.Tensor, out: torch.Tensor, backend: str) -> None:
        """Like ``out.copy_(src)`` followed by ``apply(out)`` (``src``, ``out``: float32 [numel];
        ``src`` may be ``out``)."""


# Status words in a row (see hvd_onebit.layout): 0.0 for good rows, 1.0 when the sender saw a
# non-finite value (the kernels write those two), STALE when the sender's input was started early
# and changed before its step (see AllreduceHandle.stale).
STALE = 2.0


class StaleInputError(RuntimeError):
    """A rank's input changed after its call was started early (e.g. gradients clipped or
    unscaled between backward and step); raised on every rank, state unchanged, so that every
    rank can start the calls again together."""

    def __init__(self, ranks: list[int]):
        self.ranks = ranks
        super().__init__(f"OneBitAllreduce: the input of rank(s) {ranks} changed after its call "
                         "was started; the call was abandoned on every rank")


class NonFiniteInputError(FloatingPointError):
    """A rank's input to OneBitAllreduce held inf or NaN; raised on every rank, state unchanged."""

    def __init__(self, ranks: list[int], stage: str):
        self.ranks = ranks
        super().__init__(
            f"OneBitAllreduce: non-finite values (inf/nan) {stage} on rank(s) {ranks}; "
            "the call was abandoned on every rank and the error-feedback buffers are unchanged")


@dataclass
class Status:
    """What one stage of one call says about each rank, left on the device: reading it is a
    device-to-host sync, so a step reads every call's and stage's at once (:func:`read_statuses`).

    Attributes:
        bad: bool [k] (any shape with k elements) on the collective's device, or None (k = 0).
        ranks: the rank each flag is about, k of them (a rank may appear more than once).
    """

    bad: Optional[torch.Tensor]
    ranks: list[int]

    @classmethod
    def none(cls) -> "Status":
        """Nothing to report."""
        return cls(None, [])


def read_statuses(stages: Sequence[Sequence[Status]]) -> list[list[int]]:
    """Per stage, the sorted ranks any of its statuses flagged, with one device-to-host read for
    all of them (none when no status holds a flag): the step's one host sync."""
    live = [(i, st) for i, group in enumerate(stages) for st in group if st.ranks]
    bad: list[set[int]] = [set() for _ in stages]
    if live:
        flags = torch.cat([st.bad.reshape(-1).to(torch.bool) for _, st in live]).tolist()
        at = 0
        for i, st in live:
            bad[i].update(r for r, f in zip(st.ranks, flags[at:at + len(st.ranks)]) if f)
            at += len(st.ranks)
    return [sorted(b) for b in bad]


@dataclass
class AllreduceHandle:
    """An allreduce started by :meth:`OneBitAllreduce.allreduce_async`; pass it to ``synchronize``
    (or, with other calls that must succeed or fail together, to :func:`synchronize_all`)."""

    out: torch.Tensor
    out32: torch.Tensor
    stage1: object = None  # transport handle of the alltoall, None without communication
    stage2: object = None  # transport handle of the allgather, once started
    recv: Optional[torch.Tensor] = None  # stage 1's received rows
    gathered: Optional[torch.Tensor] = None  # stage 2's received rows
    local: Optional[torch.Tensor] = None  # no communication: the input, the output once committed
    local_bad: Optional[torch.Tensor] = None  # one rank: the input held inf/NaN (a device flag)
    source: object = None  # the input (tensor or producer), compressed again at the commit
    decoded: bool = False  # stage 2's rows already decoded into out32 (see _decode)
    # Set by the caller before synchronizing when the input it started from is out of date: the
    # server row then carries STALE, so every rank abandons the call (StaleInputError) together.
    stale: bool = False
    stale_from: Optional[Status] = None  # which servers' rows said STALE (set by _wait_stage2)
    started: float = field(default_factory=time.perf_counter)
    done: bool = False


class TransactionalCollective:
    """What a collective shares with every other one :func:`synchronize_all` drives: finishing one
    call alone, and claiming a handle once. Subclasses implement the phases (``_wait_stage1``,
    ``_start_stage2``, ``_wait_stage2``, ``_commit``, ``_drain``, ``_release``)."""

    def synchronize(self, handle, epilogue: Optional[Epilogue] = None) -> torch.Tensor:
        """Finish an allreduce: the remaining stages and the decode. Returns the output tensor.

        ``epilogue`` is applied to the output once the call has succeeded on every rank, fused
        into the decode pass where it can; a failed call applies nothing. Passing it here, not
        at the start, lets the caller prepare it while stage 1 is on the wire.

        Raises:
            NonFiniteInputError: on every rank, if any rank's input (or a server's average) held
                inf or NaN; the output, the error feedback and ``epilogue``'s tensors are
                untouched.
        """
        return synchronize_all([(self, handle)], [epilogue])[0]

    def _claim(self, handle) -> None:
        if handle.done:
            raise RuntimeError("this allreduce handle was already synchronized")
        handle.done = True


class OneBitAllreduce(TransactionalCollective):
    """Mean over ranks of a fixed-size buffer, sent as 1-bit signs with two-sided error feedback.

    Args:
        numel: elements per call (N); every rank must pass the same value (checked here, with
            one small allgather, so a mismatch is a clear error on every rank, not a hang).
        process_set: Horovod process set to reduce over (with a ``transport`` name).
        block_size: elements per scale, a multiple of 8. ``None`` (default): one scale per chunk
            (N/n elements). Smaller blocks cost 4 bytes each on the wire and track the
            magnitude of the data more closely; below a few hundred elements the scales start
            to weigh on the 32x saving.
        transport: "horovod" (default; Gloo, MPI or NCCL), "mpi" (mpi4py on Horovod's MPI
            communicator; CPU tensors; needs a job launched with MPI), both over ``process_set``,
            or "torch" (torch.distributed: Gloo on CPU, NCCL on CUDA; the global process set);
            or a :class:`~hvd_onebit.transport.base.Transport` object, which then gives the size
            and rank and ``process_set`` is not used (e.g.
            :class:`~hvd_onebit.transport.inprocess.InProcessTransport`: ranks as threads of
            one process).
        backend: kernels: "auto" (native C++ on CPU, torch elsewhere), "native" or "torch".
        device: where the buffers live; inputs must be on it. Default CPU.
        name: prefix of the collective op names; must be identical on every rank and unique
            among OneBitAllreduce objects in flight at the same time. Default: a counter (per
            transport object, if one is given), which is right when every rank constructs its
            objects in the same order.
        defer_check: start the cross-rank layout check here but finish it (and raise on a
            mismatch, on every rank) at the first call, so construction does not wait for the
            collectives already queued in Horovod.
        spare_errors: keep a second worker and server error buffer, written by the passes and
            adopted at the commit, instead of repeating both passes at the commit (see the
            module's docstring): +1x the buffer's float32 bytes, one pass less per call.

    Inputs are float32, float16 or bfloat16 of ``numel`` elements; the math is fp32 and the
    output has the input's dtype and shape. With one rank the output equals the input exactly.
    """

    def __init__(self, numel: int, process_set: hvd.ProcessSet = hvd.global_process_set, *,
                 block_size: Optional[int] = None, transport: str | Transport = "horovod",
                 backend: str = "auto", device: torch.device | str = "cpu",
                 name: Optional[str] = None, defer_check: bool = False,
                 spare_errors: bool = False):
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
            raise ValueError(f"numel must be a non-negative int, got {numel!r}")
        self.spare_errors = bool(spare_errors)
        if isinstance(transport, str):
            self.process_set = process_set
            self.size = process_set.size()
            self.rank = process_set.rank()
            names = _default_names
        elif isinstance(transport, Transport):
            self.process_set = None
            self.size = transport.size
            self.rank = transport.rank
            names = _default_names_per_transport.setdefault(transport, itertools.count())
        else:
            raise TypeError("transport must be a transport's name or a Transport object, got "
                            f"{type(transport).__name__}")
        self.device = torch.device(device)
        self.layout = Layout.build(numel, self.size, block_size)
        self.block_size = block_size
        self.name = name if name is not None else f"hvd_onebit.{next(names)}"
        self.backend = kernels.resolve_backend(backend, self.device)
        if self.size == 1:
            self.transport = None
        elif isinstance(transport, str):
            self.transport = make_transport(transport, process_set, self.device)
        else:
            self.transport = transport

        L = self.layout
        f32 = dict(dtype=torch.float32, device=self.device)
        u8 = dict(dtype=torch.uint8, device=self.device)
        # The worker error, factored as the last call's y and sent rows (e = y - s * sign(y));
        # zero y and zero scales mean e = 0. One y, updated in place at the commit (see the
        # module's docstring); the rows are small and kept twice (the last sent, the next).
        # Every buffer is written here (zeros, not empty): the pages are touched now, not in the
        # first call, which would otherwise page-fault ~4 bytes per element.
        self._worker_y = torch.zeros(L.padded, **f32)
        self._worker_y_next = torch.zeros(L.padded, **f32) if self.spare_errors else None
        self._sent = torch.zeros(L.n * L.row_bytes, **u8)
        self._send = torch.zeros(L.n * L.row_bytes, **u8)
        # The server error, factored the same way: the last call's z and the row it sent.
        self._server_z = torch.zeros(L.chunk, **f32)
        self._server_z_next = torch.zeros(L.chunk, **f32) if self.spare_errors else None
        self._server_sent = torch.zeros(L.row_bytes, **u8)
        self._server_row = torch.zeros(L.row_bytes, **u8)
        self._in_flight = False

        self.wire_bytes = 0  # bytes this rank sent in the last call, both stages
        self.total_wire_bytes = 0
        self.last_seconds = 0.0  # wall time of the last call, start to output
        self.calls = 0
        self._pending_check = None
        if self.transport is not None:
            self._pending_check = self.transport.allgather_ints_async(
                self._layout_signature(), name=f"{self.name}.check")
            if not defer_check:
                self._finish_layout_check()

    # ---- validation -----------------------------------------------------------------------------

    def _layout_signature(self) -> list[int]:
        device_code = {"cpu": 0, "cuda": 1}.get(self.device.type, 2)
        return [self.layout.numel, self.block_size or 0, device_code]

    def _finish_layout_check(self) -> None:
        if self._pending_check is None:
            return
        handle, self._pending_check = self._pending_check, None
        everyone = self.transport.allgather_ints_wait(handle)
        mine = self._layout_signature()
        if any(other != mine for other in everyone):
            detail = ", ".join(f"rank {r}: numel={o[0]} block_size={o[1] or None} "
                               f"device={['cpu', 'cuda', 'other'][o[2]]}"
                               for r, o in enumerate(everyone))
            raise ValueError(f"OneBitAllreduce {self.name!r}: ranks disagree on the buffer ({detail})")

    def _check_input(self, tensor: torch.Tensor | InputProducer,
                     out: Optional[torch.Tensor]) -> None:
        if not isinstance(tensor, torch.Tensor) and isinstance(tensor, InputProducer):
            tensor = tensor.like
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor or an InputProducer, got "
                            f"{type(tensor).__name__}")
        if tensor.numel() != self.layout.numel:
            raise ValueError(f"OneBitAllreduce {self.name!r} was built for {self.layout.numel} "
                             f"elements, got a tensor of {tensor.numel()} ({tuple(tensor.shape)})")
        if tensor.dtype not in FLOAT_DTYPES:
            raise TypeError(f"OneBitAllreduce takes float32, float16 or bfloat16, got {tensor.dtype}")
        if tensor.device != self.device and not (
                tensor.device.type == self.device.type and self.device.index is None):
            raise ValueError(f"OneBitAllreduce {self.name!r} lives on {self.device}, "
                             f"got a tensor on {tensor.device}")
        if tensor.is_sparse:
            raise TypeError("OneBitAllreduce takes dense tensors")
        if out is not None and (out.numel() != tensor.numel() or out.dtype != tensor.dtype
                                or not out.is_contiguous()):
            raise ValueError("out must be a contiguous tensor of the input's size and dtype")
        if self._in_flight:
            raise RuntimeError(f"OneBitAllreduce {self.name!r} already has a call in flight; "
                               "synchronize it first")

    # ---- the collective -------------------------------------------------------------------------

    def allreduce(self, tensor: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Mean of ``tensor`` over the process set, via 1-bit compression with error feedback.

        Args:
            tensor: [any shape] with ``numel`` elements; float32, float16 or bfloat16.
            out: optional contiguous destination of the same size and dtype; may be ``tensor``.
        Returns:
            The approximate mean, the input's shape and dtype, bit-identical on every rank.
        Raises:
            NonFiniteInputError: on every rank, if any rank's input held inf or NaN.
        """
        return self.synchronize(self.allreduce_async(tensor, out))

    def allreduce_async(self, tensor: torch.Tensor | InputProducer,
                        out: Optional[torch.Tensor] = None) -> AllreduceHandle:
        """Compress ``tensor`` and start stage 1; finish with :meth:`synchronize`.

        ``tensor`` may also be an :class:`InputProducer`, which then computes the input inside
        the compression pass; ``out`` may be a tensor it reads (outputs are written only by
        :meth:`synchronize`). The input (what a producer reads) must not change until
        :meth:`synchronize` returns: the commit compresses it again to store the new error.
        """
        self._finish_layout_check()
        self._check_input(tensor, out)
        src = None if isinstance(tensor, torch.Tensor) else tensor
        like = src.like if src is not None else tensor
        if out is None:
            out = torch.empty_like(like, memory_format=torch.contiguous_format)
        if src is not None:
            x32 = None
        else:
            flat = tensor.reshape(-1)
            x32 = flat if flat.dtype == torch.float32 and flat.is_contiguous() else flat.float()
        out32 = (out.view(-1) if out.dtype == torch.float32
                 else torch.empty(out.numel(), dtype=torch.float32, device=out.device))
        handle = AllreduceHandle(out=out, out32=out32)
        if self.transport is None or self.layout.numel == 0:
            # One rank, or nothing to send: the mean is the input, with the same contract: read
            # now, written only when the call (and its group) commits.
            if x32 is None:
                x32 = src.materialize()
            elif x32.data_ptr() == tensor.data_ptr():
                x32 = x32.clone()
            handle.local = x32
            handle.local_bad = ~torch.isfinite(x32).all().reshape(1)  # read with the others'
            self._in_flight = True
            return handle
        L = self.layout
        handle.source = src if src is not None else x32
        # the rows only (y is stored at the commit), or y beside the committed one
        self._compress(handle.source, y_out=self._worker_y_next)
        # Sent even when this rank's input was bad: the status word tells every peer.
        handle.stage1 = self.transport.alltoall_async(self._send.view(L.n, L.row_bytes),
                                                      name=f"{self.name}.alltoall")
        self._in_flight = True
        return handle

    def _compress(self, source, y_out: Optional[torch.Tensor]) -> None:
        """The worker compression of ``source`` (a tensor or an InputProducer) into ``_send``,
        from the committed error (``_worker_y``, ``_sent``); y into ``y_out`` (None: not
        stored)."""
        L = self.layout
        if isinstance(source, torch.Tensor):
            kernels.worker_compress(source, self._worker_y, self._sent, y_out, self._send, L,
                                    self.backend)
        else:
            source.compress(self._worker_y, self._sent, y_out, self._send, L, self.backend)

    # ---- the phases of a call, driven by synchronize_all ------------------------------------------

    def _wait_stage1(self, handle: AllreduceHandle) -> Status:
        """Wait for stage 1; return each rank's input status (the same on every rank: each row
        carries its sender's status), left on the device."""
        if handle.stage1 is None:
            if handle.local_bad is None:
                return Status.none()
            return Status(handle.local_bad, [self.rank])
        stage1, handle.stage1 = handle.stage1, None
        handle.recv = self.transport.wait(stage1).reshape(-1)
        return self._statuses(handle.recv)

    def _start_stage2(self, handle: AllreduceHandle) -> None:
        """Server step (its rows only: nothing committed yet), then start stage 2. Run whatever
        stage 1 said, so that no decision waits for the device: a bad input makes a bad row."""
        if handle.recv is None:
            return
        L = self.layout
        kernels.server_compress(handle.recv, self._server_z, self._server_sent,
                                self._server_z_next, self._server_row, L, self.backend)
        if handle.stale:
            kernels.row_status(self._server_row, L, 1).fill_(STALE)
        handle.stage2 = self.transport.allgather_async(self._server_row.view(1, L.row_bytes),
                                                       name=f"{self.name}.allgather")

    def _wait_stage2(self, handle: AllreduceHandle) -> Status:
        """Wait for stage 2; return each server's status (not finite: its average, or an input
        it averaged; the same everywhere), left on the device."""
        if handle.stage2 is None:
            return Status.none()
        stage2, handle.stage2 = handle.stage2, None
        handle.gathered = self.transport.wait(stage2).reshape(-1)
        status = kernels.row_status(handle.gathered, self.layout, self.layout.n)
        handle.stale_from = Status(status == STALE, list(range(self.layout.n)))
        return Status(status != 0, list(range(self.layout.n)))

    def _drain(self, handle: AllreduceHandle) -> None:
        """Wait out whatever of this call is still on the wire, ignoring its result: a call
        abandoned by its group leaves no collective in flight under its names."""
        for attr in ("stage1", "stage2"):
            pending = getattr(handle, attr)
            setattr(handle, attr, None)
            if pending is not None:
                self.transport.wait(pending)

    def _decode(self, handle: AllreduceHandle) -> torch.Tensor:
        """Decode stage 2's rows into the float32 output without committing anything (for a
        caller that must hear from other collectives before it commits: see
        :mod:`hvd_onebit.hierarchical`); :meth:`_commit` then skips its own decode."""
        kernels.decode(handle.gathered, handle.out32, self.layout, self.backend)
        handle.decoded = True
        return handle.out32

    def _commit(self, handle: AllreduceHandle, epilogue: Optional[Epilogue]) -> None:
        """Store the new error feedback (both passes again, y and z in place: the same bits as
        the rows sent), then decode (with ``epilogue`` fused where possible). In this order:
        the input (e.g. the momentum a producer reads) may be the output."""
        L = self.layout
        applied = False
        if handle.gathered is not None:
            if self.spare_errors:
                self._worker_y, self._worker_y_next = self._worker_y_next, self._worker_y
                self._server_z, self._server_z_next = self._server_z_next, self._server_z
            else:
                self._compress(handle.source, y_out=self._worker_y)
                kernels.server_compress(handle.recv, self._server_z, self._server_sent,
                                        self._server_z, self._server_row, L, self.backend)
            self._sent, self._send = self._send, self._sent
            self._server_sent, self._server_row = self._server_row, self._server_sent
            applied = (epilogue is not None and not handle.decoded
                       and handle.out32.data_ptr() == handle.out.data_ptr())
            if applied:
                epilogue.decode_into(handle.gathered, handle.out32, L, self.backend)
            elif not handle.decoded:
                kernels.decode(handle.gathered, handle.out32, L, self.backend)
            self.wire_bytes = L.wire_bytes
            self.total_wire_bytes += L.wire_bytes
        elif handle.local is not None:
            handle.out32.copy_(handle.local)
        if handle.out32.data_ptr() != handle.out.data_ptr():
            handle.out.view(-1).copy_(handle.out32)
        if epilogue is not None and not applied:
            epilogue.apply(handle.out)
        handle.recv = handle.gathered = handle.local = handle.source = None
        self.last_seconds = time.perf_counter() - handle.started
        self.calls += 1

    def _release(self) -> None:
        self._in_flight = False

    def _statuses(self, rows: torch.Tensor) -> Status:
        """The status word of each of the n received rows, by rank (read later, with the other
        calls' and stages': one device-to-host read per step)."""
        return Status(kernels.row_status(rows, self.layout, self.layout.n) != 0,
                      list(range(self.layout.n)))

    # ---- error-feedback state ---------------------------------------------------------------------

    @property
    def worker_error(self) -> torch.Tensor:
        """e_w: float32 [padded], this rank's worker error feedback (a fresh tensor)."""
        return kernels.worker_error(self._worker_y, self._sent, self.layout)

    @property
    def server_error(self) -> torch.Tensor:
        """e_s: float32 [chunk], this rank's server error for the chunk it serves (a fresh tensor)."""
        return kernels.server_error(self._server_z, self._server_sent, self.layout)

    def error_contribution(self) -> torch.Tensor:
        """float32 [padded]: this rank's share of what error feedback has yet to deliver,
        ``e_w / n`` plus its server error at its chunk's place; summed over the ranks it is
        ``mean_i e_w^i + concat_j e_s^j`` (see ``CompressedStep.flush_error_feedback``)."""
        e = self.worker_error.mul_(1.0 / self.size)
        chunk = self.layout.chunk
        e[self.rank * chunk:(self.rank + 1) * chunk].add_(self.server_error)
        return e

    def reset(self) -> None:
        """Zero both error-feedback buffers (e.g. after the world size changed)."""
        self._worker_y.zero_()
        self._sent.zero_()
        self._server_z.zero_()
        self._server_sent.zero_()

    def state_dict(self) -> dict:
        """This rank's error feedback, with the layout it belongs to."""
        return {"numel": self.layout.numel, "size": self.size, "rank": self.rank,
                "block_size": self.block_size,
                "worker_error": self.worker_error, "server_error": self.server_error}

    def load_state_dict(self, state: dict) -> None:
        """Restore error feedback saved by :meth:`state_dict` on the same rank and layout."""
        expect = {"numel": self.layout.numel, "size": self.size, "rank": self.rank,
                  "block_size": self.block_size}
        got = {k: state.get(k) for k in expect}
        if got != expect:
            raise ValueError(f"error-feedback state was saved for {got}, this object is {expect}")
        # Factored form of a given e: y = e with rows that decode to +0, so y - (+0) = e.
        self._worker_y.copy_(state["worker_error"])
        kernels.set_identity_rows(self._sent, self.layout, self.layout.n)
        self._server_z.copy_(state["server_error"])
        kernels.set_identity_rows(self._server_sent, self.layout, 1)


def synchronize_all(calls: Sequence[tuple[OneBitAllreduce, AllreduceHandle]],
                    epilogues: Optional[Sequence[Optional[Epilogue]]] = None,
                    clock: Optional[dict] = None) -> list[torch.Tensor]:
    """Finish several started allreduces as one transaction: every call commits, or none does.

    A training step spans several buckets, each its own call; a step must never be half applied.
    Stage 1 of every call is waited for before any output is written, and the statuses in the
    rows (every rank's, in every row) tell every rank the same thing, so the decision to commit
    or abandon is the same on every rank without another collective. Stage 2 of a call starts
    as soon as its stage 1 is in, whatever it said (a bad input only makes bad server rows);
    stage 2 can only fail if a server's average (or an input it averaged) was not finite, and is
    agreed the same way. Every status stays on the device until all stages of all calls are
    in, and is then read at once: one device-to-host sync per step, whatever the number of
    calls. On failure nothing is written (outputs, error feedback, ``epilogues``' tensors),
    every started collective has been waited out, and the calls are ready for the next step.

    Args:
        calls: (collective, handle) pairs, in the same order on every rank.
        epilogues: per call, an optional :class:`Epilogue` applied to its output in the decode
            pass, only once every call has succeeded.
        clock: if given, seconds spent here are added to its "wait" (blocked on the
            transport), "server" (server steps) and "decode" (decode and commit) entries.
    Returns:
        The outputs, in the order of ``calls``.
    Raises:
        NonFiniteInputError: on every rank, naming the ranks whose values were not finite.
        StaleInputError: on every rank, when a rank marked its call ``stale`` (and no input
            was non-finite); nothing was changed.
    """
    clock = clock if clock is not None else {}
    tick = time.perf_counter

    def timed(key: str, fn, *args):
        start = tick()
        try:
            return fn(*args)
        finally:
            clock[key] = clock.get(key, 0.0) + tick() - start

    epilogues = list(epilogues) if epilogues is not None else [None] * len(calls)
    if len(epilogues) != len(calls):
        raise ValueError(f"{len(epilogues)} epilogues for {len(calls)} calls")
    for comm, handle in calls:
        comm._claim(handle)
    try:
        inputs: list[Status] = []
        for comm, handle in calls:
            inputs.append(timed("wait", comm._wait_stage1, handle))
            timed("server", comm._start_stage2, handle)
        servers = [timed("wait", comm._wait_stage2, handle) for comm, handle in calls]
        stale = [getattr(handle, "stale_from", None) or Status.none() for _, handle in calls]
        bad_inputs, bad_servers, stale_ranks = read_statuses([inputs, servers, stale])
        if bad_inputs:
            raise NonFiniteInputError(bad_inputs, "in the input")
        if stale_ranks:
            raise StaleInputError(stale_ranks)
        if bad_servers:
            raise NonFiniteInputError(bad_servers, "in the server average")
        for (comm, handle), epilogue in zip(calls, epilogues):
            timed("decode", comm._commit, handle, epilogue)
    except BaseException:
        for comm, handle in calls:
            try:
                comm._drain(handle)
            except Exception:  # the transport itself failed (a lost rank): nothing to wait for
                pass
        raise
    finally:
        for comm, _ in calls:
            comm._release()
    return [handle.out for _, handle in calls]
