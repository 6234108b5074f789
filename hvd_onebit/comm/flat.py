"""OneBitAllreduce: the error-compensated two-stage 1-bit allreduce among all ranks (flat).

For n ranks and a buffer x of N elements (padded to n equal chunks, see :mod:`hvd_onebit.layout`):

1. *Worker compression*: ``y = x + e_w``; per block a scale ``s = ||y||_2 / sqrt(block)`` and the
   signs of y, packed 8 per byte; ``e_w = y - s * sign(y)`` (sign(0) = +1).
2. *Stage 1, one alltoall*: rank j receives chunk j (signs + scales) from every rank.
3. *Server step* on rank j: ``z = mean_i(s_i * sign_i) + e_s``; compress z the same way;
   ``e_s = z - s' * sign(z)``.
4. *Stage 2, one allgather* of every rank's compressed chunk; every rank decodes all n chunks.
   All ranks end with bit-identical outputs.

Per call a rank sends ``2 * (n-1)/n * N/8`` bytes of signs, 4 per block of scales: ~30x under fp32.
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
``allreduce_async`` and the end of ``synchronize``. Memory beyond the input and output: held
from call to call, the worker error (``padded`` float32) and the server error (``chunk``
float32), each with its rows' scales; during a call, the rows on the wire, at most two sets of
``padded / 8`` bytes at once (the commit writes the worker's rows again into stage 1's
received rows, once the server's pass has read them); traffic: one more pass over the input
and the worker error per call. With
``spare_errors=True`` the passes write the new y and z beside the committed ones and the commit
swaps them: one more ``padded + chunk`` float32, no pass repeated (where compute, not memory,
is short: a CPU).

Two hooks let a caller fuse its own work into the collective's passes over memory, so that work
costs no pass of its own: an :class:`InputProducer` is an input the worker compression computes
in its own pass, and an :class:`Epilogue` is applied to the output by the decode pass that
writes it (only once every rank has succeeded); both are in :mod:`hvd_onebit.comm.protocol`.
"""
from __future__ import annotations

import itertools
import time
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch

from .. import kernels
from ..layout import Layout
from ..transport.base import Transport
from ..transport.registry import job_transport
from .flat_error import FlatErrorFeedback
from .protocol import STALE, Epilogue, InputProducer, Status, check_input
from .transaction import TransactionalCollective

_default_names = itertools.count()
# Default names of objects built on a transport object are counted per transport: the virtual
# ranks of an in-process world share this module, and each must count its own objects.
_default_names_per_transport: "weakref.WeakKeyDictionary[Transport, itertools.count]" = \
    weakref.WeakKeyDictionary()


@dataclass
class AllreduceHandle:
    """An allreduce started by :meth:`OneBitAllreduce.allreduce_async`; pass it to ``synchronize``
    (or, with other calls that must succeed or fail together, to :func:`synchronize_all`)."""

    out: torch.Tensor
    out32: torch.Tensor
    stage1: object = None  # transport handle of the alltoall, None without communication
    stage2: object = None  # transport handle of the allgather, once started
    # The rows this rank sends: the worker's n until stage 1 is in, the server's one until
    # stage 2 is in (lean: until the commit, which writes it again); with spare errors, their
    # scales, which the commit adopts.
    send: Optional[torch.Tensor] = None
    server_row: Optional[torch.Tensor] = None
    sent_scales: Optional[torch.Tensor] = None
    served_scales: Optional[torch.Tensor] = None
    recv: Optional[torch.Tensor] = None  # stage 1's received rows
    gathered: Optional[torch.Tensor] = None  # stage 2's received rows
    local: Optional[torch.Tensor] = None  # no communication: the input, the output once committed
    local_bad: Optional[torch.Tensor] = None  # one rank: the input held inf/NaN (a device flag)
    source: object = None  # the input (tensor or producer), compressed again at the commit
    decoded: bool = False  # stage 2's rows already decoded into out32 (see decode_only)
    # Set by the caller before synchronizing when the input it started from is out of date: the
    # server row then carries STALE, so every rank abandons the call (StaleInputError) together.
    stale: bool = False
    stale_from: Optional[Status] = None  # which servers' rows said STALE (set by wait_stage2)
    started: float = field(default_factory=time.perf_counter)
    done: bool = False


class OneBitAllreduce(TransactionalCollective):
    """Mean over ranks of a fixed-size buffer, sent as 1-bit signs with two-sided error feedback.

    Args:
        numel: elements per call (N); every rank must pass the same value (checked here, with
            one small allgather, so a mismatch is a clear error on every rank, not a hang).
        process_set: Horovod process set to reduce over (with a ``transport`` name; None:
            the global one).
        block_size: elements per scale, a multiple of 8. ``None`` (default): one scale per chunk
            (N/n elements). Smaller blocks cost 4 bytes each on the wire and track the
            magnitude of the data more closely; below a few hundred elements the scales start
            to weigh on the 32x saving.
        transport: "horovod" (default; Gloo, MPI or NCCL), "mpi" (mpi4py on Horovod's MPI
            communicator; CPU tensors; needs a job launched with MPI), both over ``process_set``,
            or "torch" (torch.distributed: Gloo on CPU, NCCL on CUDA; the global process set),
            resolved once to that transport's object; or a Transport object, which gives the
            size and rank (e.g. ``InProcessTransport``: ranks as threads of one process).
        backend: kernels: "auto" (native on CPU, Triton on CUDA if installed, else torch).
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

    def __init__(self, numel: int, process_set=None, *, block_size: Optional[int] = None,
                 transport: str | Transport = "horovod", backend: str = "auto",
                 device: torch.device | str = "cpu", name: Optional[str] = None,
                 defer_check: bool = False, spare_errors: bool = False):
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
            raise ValueError(f"numel must be a non-negative int, got {numel!r}")
        self.spare_errors = bool(spare_errors)
        self.device = torch.device(device)
        named = transport is None or isinstance(transport, str)  # over process_set's ranks
        self.process_set, stages = None, transport
        if named:
            job = job_transport(transport, process_set)
            self.process_set, stages = job.process_set, job.stages(self.device)
        if not isinstance(stages, Transport):
            raise TypeError("transport must be a transport's name or a Transport object, got "
                            f"{type(stages).__name__}")
        self.size, self.rank = stages.size, stages.rank
        names = (_default_names if named
                 else _default_names_per_transport.setdefault(stages, itertools.count()))
        self.layout = Layout.build(numel, self.size, block_size)
        self.block_size = block_size
        self.name = name if name is not None else f"hvd_onebit.{next(names)}"
        self.backend = kernels.resolve_backend(backend, self.device)
        self.transport = stages if self.size > 1 else None
        self.errors = FlatErrorFeedback(self.layout, self.size, self.rank, block_size,
                                        self.backend, self.device, self.spare_errors)
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

        ``tensor`` may also be an ``InputProducer``, which then computes the input inside
        the compression pass; ``out`` may be a tensor it reads (outputs are written only by
        :meth:`synchronize`). The input (what a producer reads) must not change until
        :meth:`synchronize` returns: the commit compresses it again to store the new error.
        """
        self._finish_layout_check()
        check_input(f"OneBitAllreduce {self.name!r}", self.layout.numel, self.device,
                    self._in_flight, tensor, out)
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
        # the rows only (y is stored at the commit), or y beside the committed one; the rows
        # are the call's (the pass writes every byte of them)
        handle.send = torch.empty(L.n * L.row_bytes, dtype=torch.uint8, device=self.device)
        self._compress(handle.source, y_out=self.errors.worker_y_next, send=handle.send)
        if self.spare_errors:
            handle.sent_scales = kernels.row_scales(handle.send, L, L.n).clone()
        # Sent even when this rank's input was bad: the status word tells every peer.
        handle.stage1 = self.transport.alltoall_async(handle.send.view(L.n, L.row_bytes),
                                                      name=f"{self.name}.alltoall")
        self._in_flight = True
        return handle

    def _compress(self, source, y_out: Optional[torch.Tensor], send: torch.Tensor) -> None:
        """The worker compression of ``source`` (a tensor or an InputProducer) into the rows
        ``send``, from the committed error (``worker_y``, ``sent_scales``); y into ``y_out``
        (None: not stored)."""
        e = self.errors
        compress = (source.compress if not isinstance(source, torch.Tensor) else
                    lambda *args: kernels.worker_compress(source, *args))
        compress(e.worker_y, e.sent_scales, y_out, send, self.layout, self.backend)

    # ---- the phases of a call, driven by synchronize_all ------------------------------------------

    def wait_stage1(self, handle: AllreduceHandle) -> Status:
        """Wait for stage 1; return each rank's input status (the same on every rank: each row
        carries its sender's status), left on the device."""
        if handle.stage1 is None:
            if handle.local_bad is None:
                return Status.none()
            return Status(handle.local_bad, [self.rank])
        stage1, handle.stage1 = handle.stage1, None
        handle.recv = self.transport.wait(stage1).reshape(-1)
        handle.send = None  # sent
        # each row's status word, by rank, read in place later with the other calls' and
        # stages' (nothing writes the received rows before the commit)
        n = self.layout.n
        return Status(kernels.row_status(handle.recv, self.layout, n), list(range(n)))

    def start_stage2(self, handle: AllreduceHandle) -> None:
        """Server step (its rows only: nothing committed yet), then start stage 2. Run whatever
        stage 1 said, so that no decision waits for the device: a bad input makes a bad row."""
        if handle.recv is None:
            return
        L = self.layout
        e = self.errors
        handle.server_row = torch.empty(L.row_bytes, dtype=torch.uint8, device=self.device)
        kernels.server_compress(handle.recv, e.server_z, e.server_scales, e.server_z_next,
                                handle.server_row, L, self.backend)
        if self.spare_errors:
            handle.served_scales = kernels.row_scales(handle.server_row, L, 1).clone()
        if handle.stale:
            kernels.row_status(handle.server_row, L, 1).fill_(STALE)
        handle.stage2 = self.transport.allgather_async(handle.server_row.view(1, L.row_bytes),
                                                       name=f"{self.name}.allgather")

    def wait_stage2(self, handle: AllreduceHandle) -> Status:
        """Wait for stage 2; return each server's status (not finite: its average, or an input
        it averaged; the same everywhere), left on the device."""
        if handle.stage2 is None:
            return Status.none()
        stage2, handle.stage2 = handle.stage2, None
        handle.gathered = self.transport.wait(stage2).reshape(-1)
        if self.spare_errors:
            handle.server_row = None  # sent; the lean commit writes it again
        status = kernels.row_status(handle.gathered, self.layout, self.layout.n)
        handle.stale_from = Status(status, list(range(self.layout.n)), only=STALE)
        return Status(status, list(range(self.layout.n)))

    def drain(self, handle: AllreduceHandle) -> None:
        """Wait out whatever of this call is still on the wire, ignoring its result: a call
        abandoned by its group leaves no collective in flight under its names."""
        for attr in ("stage1", "stage2"):
            pending = getattr(handle, attr)
            setattr(handle, attr, None)
            if pending is not None:
                self.transport.wait(pending)
        handle.send = handle.server_row = handle.sent_scales = handle.served_scales = None
        handle.recv = handle.gathered = handle.local = handle.source = None

    def decode_only(self, handle: AllreduceHandle) -> torch.Tensor:
        """Decode stage 2's rows into the float32 output without committing anything (for a
        caller that must hear from other collectives before it commits: see
        :mod:`hvd_onebit.comm.hierarchical`); :meth:`commit` then skips its own decode."""
        kernels.decode(handle.gathered, handle.out32, self.layout, self.backend)
        handle.decoded = True
        return handle.out32

    def commit(self, handle: AllreduceHandle, epilogue: Optional[Epilogue]) -> None:
        """Store the new error feedback (both passes again, y and z in place: the same bits as
        the rows sent), then decode (with ``epilogue`` fused where possible). In this order:
        the input (e.g. the momentum a producer reads) may be the output."""
        L = self.layout
        applied = False
        if handle.gathered is not None:
            e = self.errors
            if self.spare_errors:
                e.adopt_spares()
                e.adopt_scales(handle.sent_scales, handle.served_scales)
            else:
                # The server's pass first, into the row it sent; then the worker's, into stage
                # 1's received rows (the transport's, now read): no allocation between the
                # first write to the errors and the last, and two sets of rows at most.
                served, sent, handle.recv = handle.server_row, handle.recv, None
                kernels.server_compress(sent, e.server_z, e.server_scales, e.server_z, served, L,
                                        self.backend)
                self._compress(handle.source, y_out=e.worker_y, send=sent)
                e.adopt_scales(kernels.row_scales(sent, L, L.n), kernels.row_scales(served, L, 1))
                del sent, served
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
        handle.send = handle.server_row = handle.sent_scales = handle.served_scales = None
        self.last_seconds = time.perf_counter() - handle.started
        self.calls += 1

    def release(self) -> None:
        self._in_flight = False

    # ---- its error feedback, kept by ``self.errors`` ---------------------------------------------

    @property
    def worker_error(self) -> torch.Tensor:
        """e_w: float32 [padded], this rank's worker error feedback (a fresh tensor)."""
        return self.errors.worker_error

    @property
    def server_error(self) -> torch.Tensor:
        """e_s: float32 [chunk], the server error of this rank's chunk (a fresh tensor)."""
        return self.errors.server_error

    def error_contribution(self) -> torch.Tensor:
        return self.errors.contribution()

    def reset(self) -> None:
        """Zero both error-feedback buffers (e.g. after the world size changed)."""
        self.errors.reset()

    def scale_error_feedback(self, ratio: torch.Tensor) -> None:
        """Multiply both errors elementwise by ``ratio`` (float32 [numel]), e.g. old denominator
        over new at a variance refresh (:meth:`FlatErrorFeedback.scale`). Between calls only."""
        if self._in_flight:
            raise RuntimeError("scale_error_feedback during a call")
        self.errors.scale(ratio)

    def state_dict(self) -> dict:
        """This rank's error feedback, with the layout it belongs to."""
        return self.errors.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` saved on the same rank and layout."""
        self.errors.load_state_dict(state)
