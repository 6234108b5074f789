"""The stage protocol: what the 1-bit collectives and the one who drives them agree on.

A collective's call runs in stages that a driver (:func:`hvd_onebit.comm.transaction.
synchronize_all`, or the hierarchical collective driving its inner flat one) interleaves across
several calls, so that a training step of several buckets commits all of them or none:

1. ``allreduce_async(input, out)`` starts stage 1 (the worker compression and the alltoall) and
   returns a handle;
2. ``claim(handle)`` marks it taken (a handle is synchronized once);
3. ``wait_stage1(handle) -> Status``: stage 1 is in; every rank's input status, on the device;
4. ``start_stage2(handle)``: the server step and the allgather, whatever stage 1 said;
5. ``wait_stage2(handle) -> Status``: stage 2 is in; every server's status;
6. ``commit(handle, epilogue)``: only once every status of every call said the step succeeded:
   store the error feedback, decode (the epilogue fused into the decode where it can);
   or ``drain(handle)`` on failure: wait out what is still on the wire, commit nothing;
7. ``release()`` in every case: the collective may start its next call.

:class:`StagedCollective` writes this down; :class:`InputProducer` and :class:`Epilogue` are the
two hooks through which a caller fuses its own work into the collective's passes; the status
words and the errors every rank raises alike are here too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

import torch

from ..dtypes import FLOAT_DTYPES
from ..layout import Layout

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

    def compress(self, y_prev: torch.Tensor, prev_scales: torch.Tensor, y_out: torch.Tensor,
                 send: torch.Tensor, layout: Layout, backend: str) -> bool:
        """Like ``kernels.worker_compress(input, y_prev, prev_scales, y_out, send, layout,
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


def check_input(name: str, numel: int, device: torch.device, in_flight: bool,
                tensor: Any, out: Optional[torch.Tensor]) -> None:
    """Raise, naming collective ``name``, unless ``tensor`` (or an :class:`InputProducer`'s
    ``like``) and ``out`` are what a call on ``numel`` elements on ``device`` takes, with no
    call in flight."""
    if not isinstance(tensor, torch.Tensor) and isinstance(tensor, InputProducer):
        tensor = tensor.like
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} takes a torch.Tensor or an InputProducer, got "
                        f"{type(tensor).__name__}")
    if tensor.numel() != numel:
        raise ValueError(f"{name} was built for {numel} elements, got a tensor of "
                         f"{tensor.numel()} ({tuple(tensor.shape)})")
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} takes float32, float16 or bfloat16, got {tensor.dtype}")
    if tensor.device != device and not (
            tensor.device.type == device.type and device.index is None):
        raise ValueError(f"{name} lives on {device}, got a tensor on {tensor.device}")
    if tensor.is_sparse:
        raise TypeError(f"{name} takes dense tensors, got a {tensor.layout} one")
    if out is not None and (out.numel() != tensor.numel() or out.dtype != tensor.dtype
                            or not out.is_contiguous()):
        raise ValueError(f"{name}: out must be a contiguous tensor of the input's size and dtype "
                         f"({tensor.numel()} x {tensor.dtype}), got {tuple(out.shape)} x "
                         f"{out.dtype}{'' if out.is_contiguous() else ', not contiguous'}")
    if in_flight:
        raise RuntimeError(f"{name} already has a call in flight; synchronize it first")


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
        bad: one value per rank [k] (any shape with k elements, bool or float, e.g. the rows'
            status words read in place) on the collective's device, or None (k = 0): a non-zero
            value (NaN included) flags its rank.
        ranks: the rank each value is about, k of them (a rank may appear more than once).
        only: if given, only the values equal to it flag their rank (e.g. ``STALE``): a
            status word read for one meaning among several, with no comparison on the device.
    """

    bad: Optional[torch.Tensor]
    ranks: list[int]
    only: Optional[float] = None

    @classmethod
    def none(cls) -> "Status":
        """Nothing to report."""
        return cls(None, [])

    def flags(self, values: Sequence[float]) -> list[int]:
        """The ranks that ``values`` (:attr:`bad` read on the host) flag."""
        if self.only is None:
            return [r for r, v in zip(self.ranks, values) if v != 0]  # NaN != 0 too
        return [r for r, v in zip(self.ranks, values) if v == self.only]


def read_statuses(stages: Sequence[Sequence[Status]]) -> list[list[int]]:
    """Per stage, the sorted ranks any of its statuses flagged, with one device-to-host read for
    all of them (none when no status holds a flag): the step's one host sync."""
    live = [(i, st) for i, group in enumerate(stages) for st in group if st.ranks]
    bad: list[set[int]] = [set() for _ in stages]
    if live:
        values = torch.cat([st.bad.reshape(-1).to(torch.float32) for _, st in live]).tolist()
        at = 0
        for i, st in live:
            bad[i].update(st.flags(values[at:at + len(st.ranks)]))
            at += len(st.ranks)
    return [sorted(b) for b in bad]


@runtime_checkable
class StagedCollective(Protocol):
    """The stages a driver calls, in the order of the module's docstring. Implemented by
    :class:`~hvd_onebit.comm.flat.OneBitAllreduce` and
    :class:`~hvd_onebit.comm.hierarchical.HierarchicalOneBitAllreduce`."""

    def allreduce_async(self, tensor: Any, out: Optional[torch.Tensor] = None) -> Any:
        """Start a call on ``tensor`` (a tensor or an :class:`InputProducer`); its handle."""

    def claim(self, handle: Any) -> None:
        """Mark ``handle`` taken; raises if it was synchronized already."""

    def wait_stage1(self, handle: Any) -> Status:
        """Wait for stage 1; each rank's input status (the same on every rank)."""

    def start_stage2(self, handle: Any) -> None:
        """The server step and stage 2, run whatever stage 1 said."""

    def wait_stage2(self, handle: Any) -> Status:
        """Wait for stage 2; each server's status (the same on every rank)."""

    def commit(self, handle: Any, epilogue: Optional[Epilogue]) -> None:
        """Store the new error feedback and write the output (with ``epilogue``)."""

    def drain(self, handle: Any) -> None:
        """Wait out whatever of the call is still on the wire, committing nothing."""

    def release(self) -> None:
        """The call is over, committed or drained: the collective may start another."""
