"""A full-precision step: the gradients allreduced by Horovod, then an update from their exact
average. The warmup's step (:class:`~hvd_onebit.phases.warmup.Warmup`) and a variance refresh
step (:class:`~hvd_onebit.phases.refresh.RefreshPhase`) are the two kinds; :func:`take` drives
either, with or without a GradScaler.

After Horovod's allreduce the gradients are the same bits on every rank (an inf anywhere makes
the average inf everywhere), so a step whose averaged gradients are not finite is skipped by
every rank alike without another collective.
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional, Protocol

from ..state.telemetry import Telemetry
from .amp import ScalerView
from .warmup import Warmup, all_finite


class FullPrecisionStep(Protocol):
    """One kind of full-precision step, taken on Horovod's averaged gradients."""

    what: str  # how the skip warning names it

    def begin(self) -> None:
        """Before the gradients are waited for: forget the last step's figures."""

    def apply(self, closure: Optional[Callable[[], float]]):
        """The update on the averaged gradients (finite), counted. Returns the closure's loss."""

    def account(self) -> None:
        """Record this step's communication, taken or skipped."""


def take(kind: FullPrecisionStep, allreduce: Warmup, telemetry: Telemetry,
         closure: Optional[Callable[[], float]], make_hook: Callable,
         scaler: Optional[ScalerView]):
    """One step of ``kind``: Horovod's synchronize (``allreduce``), the scaler's prologue, then
    ``kind.apply`` unless an averaged gradient is non-finite (every rank skips alike), then
    ``kind.account()``. Returns the closure's loss (None when skipped)."""
    allreduce.wait_seconds = 0.0
    telemetry.last_step_breakdown = {}
    kind.begin()
    allreduce.synchronize_for_step(make_hook)
    if scaler is not None:
        scaler.unscale()
        finite = not scaler.found_inf()
    else:
        finite = all_finite(allreduce.averaged_gradients())
        if not finite:
            warnings.warn(f"hvd_onebit: {kind.what} skipped on every rank: non-finite averaged "
                          "gradients")
    if finite:
        loss = kind.apply(closure)
    else:
        telemetry.skipped_steps += 1
        loss = None
    kind.account()
    return loss
