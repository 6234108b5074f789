"""freeze_step="auto" through ``hvd.broadcast_optimizer_state``: the record of the variance goes
with the state it belongs to.

Horovod's recipe for a resume loads the checkpoint on rank 0 and sends it on with
``hvd.broadcast_optimizer_state``, which sends each parameter's state and the param groups'
options. The auto freeze's record of the variance (the monitor's copy of ``v_hat`` and the
figures of its checks) is neither, yet the figures travel: the saved param group 0 carries them
in its record (:data:`~hvd_onebit.state.schedule.RECORD_KEY`, a JSON string, written by
:func:`offer`), and the broadcast writes that option into every rank's live param group 0.

A rank whose record is not that of the state it now holds is stale
(:meth:`~hvd_onebit.state.schedule.Schedule.record_stale`). At the next full-precision step the
ranks agree, in the sum they already take (:func:`hvd_onebit.phases.full_precision.take`):
where some rank is stale, and every rank finds the received figures to be those of the state it
holds (:func:`usable`; on the first rank also its own record, which is not stale), every rank
takes them and the first rank's copy of the variance (:func:`adopt`: one exact sum of the
copy, the other ranks adding zeros), so every rank decides the freeze at the step the
uninterrupted run would. Otherwise every rank restarts its record, alike, with a warning.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from typing import Callable, Optional

import torch

from .schedule import RECORD_KEY, Schedule

FIGURES_KEY = "auto_freeze_record"  # the figures' entry in param group 0's record


def offer(schedule: Schedule) -> Optional[dict]:
    """The figures of this rank's record, for the state it holds now (step count and count of
    loads beside them), to travel in the saved param group 0; None where it has none to offer
    (not "auto", decided, or stale)."""
    monitor = schedule.monitor
    if monitor is None or schedule.freeze_step is not None or monitor.decision is not None \
            or schedule.record_stale():
        return None
    return dict(monitor.figures(), steps=schedule.steps, loads=schedule.loads)


def received(schedule: Schedule) -> Optional[dict]:
    """The figures another rank's saved state wrote into this rank's live param group 0, or None
    where there are none that read; the history as the monitor keeps it, (step, change)
    pairs."""
    try:
        figures = json.loads(schedule.first_group()[RECORD_KEY])[FIGURES_KEY]
        int(figures["steps"]), int(figures["loads"]), int(figures["snapshot_step"])
        history = [(int(step), float(change)) for step, change in figures["history"]]
        readable = isinstance(figures["options"], dict)
    except (KeyError, TypeError, ValueError):
        return None
    return dict(figures, history=history) if readable else None


def usable(schedule: Schedule, first: bool) -> bool:
    """Whether this rank can take the received figures: they are for the state it holds now (its
    step count and count of loads) and of its monitor's options; on the first rank, whose copy
    of the variance every rank takes, they are also its own record's, which is not stale. True
    where there is no record to take (not "auto", or decided)."""
    monitor = schedule.monitor
    if monitor is None or schedule.freeze_step is not None:
        return True
    figures = received(schedule)
    if figures is None or (int(figures["steps"]), int(figures["loads"])) != \
            (schedule.steps, schedule.loads) or figures["options"] != asdict(monitor.options):
        return False
    if not first:
        return True
    own = monitor.figures()
    copy = monitor.snapshot
    return not schedule.record_stale() and own["snapshot_step"] == figures["snapshot_step"] \
        and own["history"] == figures["history"] \
        and (copy is None) == (own["snapshot_step"] < 0) \
        and (copy is None or [t.numel() for t in copy] == [v.numel() for v in _variances(
            schedule)])


def adopt(schedule: Schedule, first: bool,
          from_first: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> None:
    """On every rank together, where :func:`usable` held on every rank: take the received
    figures and the first rank's copy of the variance (``from_first``: the first rank's tensors
    on every rank, bit for bit)."""
    figures = received(schedule)
    copy = None
    if int(figures["snapshot_step"]) >= 0:
        mine = schedule.monitor.snapshot if first else [
            torch.zeros(v.numel(), dtype=torch.float32, device=v.device)
            for v in _variances(schedule)]
        copy = from_first(mine)
    schedule.adopt_record(figures, copy)


def _variances(schedule: Schedule) -> list[torch.Tensor]:
    """Each parameter's ``exp_avg_sq``, in the order the monitor keeps its copy."""
    return [v for v, _, _ in schedule.variances()]
