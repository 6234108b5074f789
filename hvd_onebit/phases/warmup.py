"""The warmup phase: exactly ``hvd.DistributedOptimizer`` around the wrapped Adam.

Gradients are allreduced by Horovod in full precision as backward produces them (Horovod's own
hooks), then Adam steps; its variance settles meanwhile. :class:`Warmup` also waits for the
allreduce of a variance refresh step's gradients; :mod:`hvd_onebit.phases.full_precision`
drives both kinds of step.
"""
from __future__ import annotations

import time
import warnings
from typing import Callable, Optional

import torch
from horovod.torch.compression import Compression

from ..engine import CompressedStep
from ..horovod_view import HorovodView
from ..layout import ring_allreduce_bytes
from ..state.schedule import Schedule
from ..state.telemetry import Telemetry
from ..transport.horovod import sleep_until_done
from .amp import unscaled
from .gradients import adam_step
from .in_flight import InFlight


def not_contiguous(names: list[str], when: str) -> ValueError:
    """The error for parameters whose gradients Horovod's allreduce cannot take (a gradient
    takes its parameter's memory layout), named, with the fixes; ``when`` says when it was seen."""
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return ValueError(
        f"hvd_onebit.DistributedOptimizer: Horovod's allreduce needs contiguous tensors, and "
        f"{len(names)} parameter(s) are not ({shown}){when}: make them contiguous before "
        "building the optimizer, and keep them so (a channels_last model: model.to("
        "memory_format=torch.contiguous_format); another: p.data = p.data.contiguous()), or "
        "train the model under torchrun with hvd_onebit.ddp, which takes them")


class Warmup:
    """Horovod's synchronize and step with the wrapped Adam, for one optimizer: the gradients'
    allreduce of every full-precision step, and the warmup's own kind of it."""

    def __init__(self, view: HorovodView, schedule: Schedule, telemetry: Telemetry,
                 engine: CompressedStep):
        self._view = view
        self._schedule = schedule
        self._telemetry = telemetry
        self._engine = engine
        self.wait_seconds = 0.0  # this step's seconds blocked on Horovod's allreduces
        self._in_flight = InFlight(view.name_of)
        self._race: Optional[str] = None  # what the script did to gradients in flight
        self._layout_checked = False  # this step's layouts, checked at its first hook

    def hook(self, p: torch.Tensor, horovod_hook: Callable, *args) -> None:
        """``p``'s warmup hook: Horovod's (which may start its allreduce), watched."""
        self.check_layout_once()
        if not p.is_contiguous():  # changed since the step's first hook (between passes)
            self._check_layout()
        horovod_hook(*args)
        if self._view.handles.get(p, (None,))[0] is not None:
            self._in_flight.started(p)

    def synchronize(self, make_hook: Callable, scaler=None) -> None:
        """Wait for the gradient allreduces; before the warmup's last step, fuse the buckets
        of the compression phase while the allreduce is on the wire. ``scaler``: the GradScaler
        of this step (or the last one's), to tell whether it unscaled the gradients in flight."""
        start = time.perf_counter()
        view = self._view
        self._race = self._in_flight.race(unscaled(scaler, view.adam.optimizer_id), view.handles)
        view.refresh_hooks(make_hook)
        self._layout_checked = False
        self._check_layout()  # before the allreduces started here
        active = view.adam.active_parameters()
        if (self._schedule.last_warmup_step_next() and self._engine.world > 1
                and not self._engine.up_to_date(active)):
            self._engine.fuse(active)
        # Sleep until the allreduces are done, so that Horovod's own wait (a sched_yield spin)
        # finds them finished instead of taking CPU from other ranks. Every one is started
        # first: a parameter used on some ranks only completes when the others start it.
        view.start_remaining_allreduces()
        for handle, _ in list(view.handles.values()):
            if handle is not None and not callable(handle):
                sleep_until_done(handle)
        view.synchronize()
        if view.sparse_as_dense:
            # Horovod hands the averaged gradient back sparse; Adam takes dense gradients only.
            for p in view.requires_update:
                if p.grad is not None and p.grad.is_sparse:
                    p.grad = p.grad.to_dense()
        self.wait_seconds += time.perf_counter() - start

    def check_layout_once(self) -> None:
        """At the first gradient hook of a step whose gradients Horovod will allreduce:
        :meth:`_check_layout`, before any gradient is counted or handed to Horovod."""
        if not self._layout_checked:
            self._check_layout()
            self._layout_checked = True

    def _check_layout(self) -> None:
        """Refuse, by name, parameters whose gradients Horovod's allreduce cannot take (their
        layout changed since construction: ``channels_last``; a gradient takes its parameter's
        layout), before Horovod is handed any gradient of the step: Horovod's own error names
        nothing, and comes once the allreduces of other gradients have started. Every rank
        changes its model alike, so every rank raises at the same point, and a script that
        makes the parameters contiguous again can go on."""
        view = self._view
        bad = [view.name_of(p) for p in view.adam.parameters()  # those Horovod will allreduce
               if p.requires_grad and p in view.requires_update and not p.is_contiguous()]
        if bad:
            raise not_contiguous(bad, " (their layout changed after the optimizer was built)")

    def race(self) -> Optional[str]:
        """What the script did to gradients while their allreduce was in flight (None: nothing),
        seen when the step's allreduces were waited for (:mod:`hvd_onebit.phases.in_flight`);
        told once."""
        race, self._race = self._race, None
        return race

    def synchronize_for_step(self, make_hook: Callable, scaler=None) -> None:
        """Horovod's step() prologue: wait for the gradient allreduces unless told not to. Told
        not to (``skip_synchronize()``) without a ``synchronize()`` since backward, it waits all
        the same, with a warning: a full-precision step on gradients not averaged (a refresh
        step's are averaged here, never before) would part the ranks for good."""
        view = self._view
        if view.should_synchronize:
            if view.synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize(make_hook, scaler)
        elif not view.synchronized:
            warnings.warn("hvd_onebit: optimizer.step() inside optimizer.skip_synchronize() "
                          "without optimizer.synchronize() since backward: the gradients were "
                          "averaged now, as this full-precision step needs (call "
                          "optimizer.synchronize() before the skip_synchronize() block)")
            self.synchronize(make_hook, scaler)
        view.synchronized = False

    def averaged_gradients(self) -> list[torch.Tensor]:
        """The gradients after the allreduce: the same bits on every rank."""
        return [p.grad for p in self._view.adam.parameters() if p.grad is not None]

    # ---- the warmup's step, a FullPrecisionStep (hvd_onebit.phases.full_precision) -----------

    what = "step"

    def begin(self) -> None:
        pass

    def apply(self) -> None:
        """The wrapped Adam's step on the averaged gradients, counted
        (:func:`~hvd_onebit.phases.gradients.adam_step`)."""
        adam_step(self._view, self._schedule)

    def account(self) -> None:
        self._telemetry.account(self.step_bytes(), self.wait_seconds)

    def step_bytes(self) -> int:
        """Bytes a bandwidth-optimal ring allreduce sends per rank for this step's gradients."""
        elem = 2 if self._view.compression.inner is Compression.fp16 else None
        # bfloat16 gradients travel as float32 (WidenBfloat16)
        total = sum(p.numel() * (elem or (4 if p.dtype == torch.bfloat16 else p.element_size()))
                    for p in self._view.requires_update)
        return ring_allreduce_bytes(total, self._engine.world)
