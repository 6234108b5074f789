"""A full-precision step: the gradients allreduced (by Horovod, or by DDP's reducer), then an
update from their exact average. The warmup's step (:class:`~hvd_onebit.phases.warmup.Warmup`,
:class:`~hvd_onebit.ddp.warmup.DDPWarmup`) and a variance refresh step
(:class:`~hvd_onebit.phases.refresh.RefreshPhase`) are the two kinds; :func:`take` drives
either, with or without a GradScaler.

After the allreduce the gradients are the same bits on every rank (an inf anywhere makes
the average inf everywhere), so every rank finds the same; the ranks still agree on the skip
(one small vector summed), since a script may change a rank's averaged gradients after the
allreduce, and a rank skipping alone would leave the others waiting in its next collective. The
same sum tells every rank whether a script raced an allreduce on some rank
(:mod:`hvd_onebit.phases.in_flight`): then every rank refuses the step, nothing changed.
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional, Protocol

from ..state import sent_record
from ..state.schedule import Schedule
from ..state.telemetry import Telemetry
from .amp import ScalerView
from .gradients import nonfinite_flag


class GradientAllreduce(Protocol):
    """The allreduce of a full-precision step's gradients, as a face's framework runs it."""

    wait_seconds: float  # this step's seconds blocked on it

    def synchronize_for_step(self, make_hook: Callable, scaler=None) -> None:
        """Before the step: wait for the allreduces (unless the script already did);
        ``scaler``: this step's GradScaler, or None."""

    def race(self) -> Optional[str]:
        """What the script did to gradients while their allreduce was in flight, or None."""

    def averaged_gradients(self) -> list:
        """The gradients after the allreduce: the same bits on every rank."""

    def step_bytes(self) -> int:
        """Bytes this rank sent for this step's gradients."""


class Agreement(Protocol):
    """What the ranks decide together around a full-precision step, through the engine."""

    first: bool  # whether this is the first rank

    def ranks_with(self, flags: tuple[bool, ...]) -> tuple[int, ...]:
        """On how many ranks each flag is set (one exact sum of a small vector)."""

    def from_first(self, tensors: list) -> list:
        """The first rank's tensors on every rank (the others pass zeros of the same shapes)."""


class FullPrecisionStep(Protocol):
    """One kind of full-precision step, taken on Horovod's averaged gradients."""

    what: str  # how the skip warning names it

    def begin(self) -> None:
        """Before the gradients are waited for: forget the last step's figures."""

    def apply(self) -> None:
        """The update on the averaged gradients (finite), counted."""

    def account(self) -> None:
        """Record this step's communication, taken or skipped."""


def take(kind: FullPrecisionStep, allreduce: GradientAllreduce, telemetry: Telemetry,
         make_hook: Callable, scaler: Optional[ScalerView], ranks: Agreement,
         schedule: Schedule) -> None:
    """One step of ``kind``: Horovod's synchronize (``allreduce``), the scaler's prologue, then
    ``kind.apply`` unless an averaged gradient is non-finite on any rank (``ranks.ranks_with``;
    every rank skips alike), then ``kind.account()``. Raises on every rank, nothing changed, if
    the script changed gradients in flight on any rank. The same sum tells whether the auto
    freeze's record is stale on any rank
    (:meth:`~hvd_onebit.state.schedule.Schedule.record_stale`): then, before the update, every
    rank takes the record that came with the state where every rank can
    (:mod:`hvd_onebit.state.sent_record`), else restarts its own, so every rank decides the
    freeze from the same one."""
    telemetry.last_step_breakdown = {}
    try:
        _take(kind, allreduce, telemetry, make_hook, scaler, ranks, schedule)
    finally:  # counted; the script's own synchronize() before the next step adds to it
        allreduce.wait_seconds = 0.0


def _take(kind: FullPrecisionStep, allreduce: GradientAllreduce, telemetry: Telemetry,
          make_hook: Callable, scaler: Optional[ScalerView], ranks: Agreement,
          schedule: Schedule) -> None:
    """:func:`take`'s step, its allreduce's wait (``wait_seconds``) counted since the last
    step: a script's synchronize() before step() (Horovod's clipping recipe) waits there."""
    kind.begin()
    allreduce.synchronize_for_step(make_hook, None if scaler is None else scaler.scaler)
    race = allreduce.race()
    if scaler is not None:
        scaler.unscale()
        nonfinite_here = scaler.found_inf()  # a device flag too where the scaler's are on one
    else:  # a flag on the device, read with the agreement (one read for the step)
        nonfinite_here = nonfinite_flag(allreduce.averaged_gradients())
    nonfinite, raced, stale, unusable = ranks.ranks_with((
        False if nonfinite_here is None else nonfinite_here, race is not None,
        schedule.record_stale(),
        not sent_record.usable(schedule, ranks.first)))
    if raced:
        raise RuntimeError(race_message(race, raced))
    if stale and not unusable:
        sent_record.adopt(schedule, ranks.first, ranks.from_first)
    elif stale:
        schedule.restart_monitor()
        warnings.warn(record_restarted_message(schedule.steps, stale))
    finite = nonfinite == 0
    here = finite or not bool(nonfinite_here)  # read again only for a skipped step
    if not finite and scaler is not None and here:
        scaler.skipped()  # another rank's inf: this rank's scaler backs off as that one's does
    elif not finite and scaler is None:
        warnings.warn(f"hvd_onebit: {kind.what} skipped on every rank: non-finite averaged "
                      f"gradients {'here' if not here else 'on another rank'}")
    if finite:
        kind.apply()
    else:
        telemetry.skipped_steps += 1
    kind.account()


def record_restarted_message(steps: int, ranks: int) -> str:
    """The warning every rank gives when the auto freeze's record restarts (:func:`take`)."""
    return (f"hvd_onebit: freeze_step='auto': {ranks} rank(s) hold a state written in without "
            f"its record of the variance (one that rank 0 did not send, or sent without it), "
            f"so every rank starts a new record at step {steps}, alike; the freeze may come "
            f"later than in the run the checkpoint came from. Load the checkpoint on every "
            f"rank, or on rank 0 and send it with hvd.broadcast_optimizer_state(opt, "
            f"root_rank=0), to keep its record")


def race_message(race: Optional[str], ranks: int) -> str:
    """The error every rank raises when a script changed gradients in flight on ``ranks`` ranks
    (``race``: what this rank's script did, None if not this rank's)."""
    what = race if race is not None else "another rank's script changed its gradients"
    return (f"hvd_onebit: the gradients changed while Horovod was averaging them ({what}; on "
            f"{ranks} rank(s)): the ranks would part, so this step was not taken on any rank. "
            "Call optimizer.synchronize() first, then clip or scaler.unscale_(optimizer), then "
            "step inside `with optimizer.skip_synchronize():` (Horovod's recipe); or step "
            "without touching the gradients")
