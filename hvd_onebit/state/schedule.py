"""Which phase a step is in: the step count, the freeze step, and ``freeze_step="auto"``.

Both numbers are kept in param group 0, so that everything that moves optimizer state moves them
too: ``state_dict``/``load_state_dict``, ``hvd.broadcast_optimizer_state`` (a joining elastic
worker must know the phase before its first backward) and elastic commits. The phase is decided
by the step count alone, never by anything else, so every rank is in the same phase.
"""
from __future__ import annotations

import json
from typing import Optional

from ..auto_freeze import VarianceMonitor
from ..config import OneBitConfig
from ..optimizer_view import OptimizerView

STEP_KEY = "onebit_step"  # param_groups[0] entry holding the optimizer step count
FREEZE_KEY = "onebit_freeze_step"  # param_groups[0] entry: the freeze step, -1 while undecided
LOADS_KEY = "onebit_loads"  # param_groups[0] entry: how many states were loaded into it
RECORD_KEY = "onebit_record"  # a saved param group 0's copy of the 1-bit record (JSON)
WARMUP, COMPRESSION = "warmup", "compression"


class Schedule:
    """Step count, freeze step and phase of one optimizer, and its freeze decision."""

    def __init__(self, view: OptimizerView, config: OneBitConfig):
        self._view = view
        self.monitor = VarianceMonitor(config.auto_freeze) if config.auto else None
        self._refresh = config.refresh
        view.adam.param_groups[0].setdefault(STEP_KEY, 0)
        view.adam.param_groups[0].setdefault(LOADS_KEY, 0)  # each rank holds it: it is broadcast
        self._known = self._stamp()  # the state as this optimizer last stepped or loaded it
        self._record_loads = self.loads  # the count of loads the monitor's record belongs to

    @property
    def steps(self) -> int:
        """Optimizer steps taken (skipped steps not counted)."""
        return int(self._view.adam.param_groups[0].get(STEP_KEY, 0))

    def _stamp(self) -> tuple[int, int]:
        """The step count and the count of loaded states: a state written in from outside
        changes one of them (a load raises the count past both ranks' own)."""
        return self.steps, int(self._view.adam.param_groups[0].get(LOADS_KEY, 0))

    def count_step(self) -> None:
        self._view.adam.param_groups[0][STEP_KEY] = self.steps + 1
        self._known = self._stamp()

    def count_load(self, before: int) -> None:
        """A state was loaded, holding its own count of loads; ``before``: this optimizer's count
        before it. The new count is past both, so a rank that receives this state in place
        (``hvd.broadcast_optimizer_state``) sees its own count change even where the step count
        is the same."""
        group = self._view.adam.param_groups[0]
        group[LOADS_KEY] = max(before, int(group.get(LOADS_KEY, 0))) + 1

    @property
    def loads(self) -> int:
        return self._stamp()[1]

    def moved_outside(self) -> bool:
        """Whether the state changed other than through this optimizer's own steps and loads:
        another rank's state was written into this one in place (e.g. rank 0 loaded a
        checkpoint and ``hvd.broadcast_optimizer_state`` sent it; its step count or its count of
        loads differs), so what the compressed step built on the old state (fused momenta,
        frozen denominators, error feedback) is stale."""
        return self._stamp() != self._known

    def acknowledge(self) -> None:
        """The current state is this optimizer's own again (after a load, or once the
        compressed step was told of a change from outside)."""
        self._known = self._stamp()

    def carried_steps(self) -> Optional[int]:
        """The step count param group 0 holds under this optimizer's key; None when it holds
        none (a state torch.optim wrote, not this optimizer)."""
        carried = self._view.adam.param_groups[0].get(STEP_KEY)
        return None if carried is None else int(carried)

    def recount(self, steps: int) -> None:
        """Take ``steps`` as the step count, with the freeze undecided: for a loaded state that
        is torch.optim's own rather than this optimizer's."""
        self._view.adam.param_groups[0][STEP_KEY] = int(steps)
        self.freeze_step = None

    @property
    def freeze_step(self) -> Optional[int]:
        """The step count the variance freezes (or froze) at; None while "auto" is undecided."""
        value = int(self._view.adam.param_groups[0].get(FREEZE_KEY, -1))
        return value if value >= 1 else None

    @freeze_step.setter
    def freeze_step(self, value: Optional[int]) -> None:
        self._view.adam.param_groups[0][FREEZE_KEY] = -1 if value is None else int(value)

    @property
    def phase(self) -> str:
        freeze = self.freeze_step
        return WARMUP if freeze is None or self.steps < freeze else COMPRESSION

    def last_warmup_step_next(self) -> bool:
        """Whether the coming step is the warmup's last (the buckets can be fused meanwhile)."""
        return self.steps + 1 == self.freeze_step

    def refresh_next(self) -> bool:
        """Whether the coming step is a variance refresh step (``variance_refresh``): in the
        compression phase and on the schedule, decided from the step count and the freeze step
        alone, which every rank holds alike (param group 0), so every rank decides alike."""
        return self._refresh is not None and self._refresh.is_refresh(self.steps,
                                                                      self.freeze_step)

    # ---- freeze_step="auto" ------------------------------------------------------------------------

    @property
    def decision(self) -> Optional[dict]:
        """The auto freeze's decision. A rank that was sent a decided state in place
        (``hvd.broadcast_optimizer_state`` after rank 0 loaded a checkpoint, an elastic sync)
        holds its freeze step, and its record in param group 0, but made no decision itself:
        the record's decision is the state's, where it froze at this freeze step."""
        if self.monitor is None:
            return None
        own = self.monitor.decision
        if self.freeze_step is None or (own is not None
                                        and own.get("freeze_step") == self.freeze_step):
            return own
        sent = (carried_record(self._view.adam.param_groups) or {}).get("auto_freeze_decision")
        if isinstance(sent, dict) and sent.get("freeze_step") == self.freeze_step:
            return sent
        return own

    def observe_variance(self) -> None:
        """After a warmup step: with "auto", decide whether the variance has settled. The
        variance is the same on every rank here, so is the decision."""
        if self.monitor is None or self.freeze_step is not None:
            return
        decided = self.monitor.observe(self.steps, self.variances())
        if decided is not None:
            self.freeze_step = decided

    def variances(self):
        """(exp_avg_sq, the parameter's Adam step, beta2) of each parameter, in the monitor's
        order (lazily)."""
        state = self._view.adam.state
        return ((state[p]["exp_avg_sq"], int(state[p]["step"]), g["betas"][1])
                for g in self._view.adam.param_groups for p in g["params"])

    def first_group(self) -> dict:
        """The live param group 0, where the step count and the freeze step are kept."""
        return self._view.adam.param_groups[0]

    def restart_monitor(self) -> None:
        if self.monitor is not None:
            self.monitor.restart()
        self._record_loads = self.loads

    def load_monitor(self, state: dict) -> None:
        """Adopt a checkpoint's record of the variance (after the state it came with)."""
        if self.monitor is not None:
            self.monitor.load_state_dict(state)
        self._record_loads = self.loads

    def adopt_record(self, figures: dict, snapshot) -> None:
        """Take another rank's record of the state held now: its figures and its copy of the
        variance (:mod:`hvd_onebit.state.sent_record`)."""
        self.monitor.adopt(figures, snapshot)
        self._record_loads = self.loads

    def record_stale(self) -> bool:
        """Whether the auto freeze's record of the variance (still undecided) is not that of
        the state now held: a state was written in from outside without it (rank 0 loaded a
        checkpoint, with its record, and ``hvd.broadcast_optimizer_state`` sent the state
        alone). Ranks whose records differ would freeze at different steps: every rank
        restarts its record when any rank's is stale, in the full-precision step's agreement
        (:func:`hvd_onebit.phases.full_precision.take`)."""
        return (self.monitor is not None and self.freeze_step is None
                and self._record_loads != self.loads)


def carried_record(param_groups: list) -> Optional[dict]:
    """The record param group 0 carries (``RECORD_KEY``), or None where it has none that
    reads; the decision's history as the monitor keeps it, (step, change) pairs. It is the
    state's own where its step count and freeze step are the group's: a checkpoint that lacks
    it, loaded into a state dict that has one (``allow_partial_load``), leaves the loading
    optimizer's there."""
    try:
        record = json.loads(param_groups[0][RECORD_KEY])
    except (IndexError, KeyError, TypeError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    decision = record.get("auto_freeze_decision")
    if isinstance(decision, dict) and isinstance(decision.get("history"), list):
        record["auto_freeze_decision"] = dict(
            decision, history=[tuple(entry) for entry in decision["history"]])
    return record
