"""The optimizer's checkpoint: torch's state_dict plus what 1-bit Adam adds under ``"onebit"``.

``state_dict()`` holds what every rank shares (step count, freeze step, momentum, frozen
variance, the auto-freeze record); the error feedback is rank-local and has its own state dict
(:meth:`hvd_onebit.engine.CompressedStep.error_feedback_state_dict`). The record says whether
the error feedback held anything undelivered when it was saved (``"unflushed_error_feedback"``),
so that resuming without it warns (:meth:`hvd_onebit.engine.CompressedStep.expect_error_feedback`).

Param group 0 of the saved state carries the record too (``RECORD_KEY``), less the auto freeze's
copy of the variance (tensors of the parameters' sizes): ``torch.distributed.checkpoint``
keeps a state dict's ``state`` and ``param_groups`` alone, and with that copy a resume from it
still knows what the checkpoint left out. The auto freeze's figures in it let ranks that
``hvd.broadcast_optimizer_state`` sent this state to take the sender's record
(:mod:`hvd_onebit.state.sent_record`). The copy is one JSON string: that checkpointer loads
only the keys the loading optimizer's own state dict has, each nested key apart, so a record
whose keys changed with its contents (a decision made or not, a field added later) would not
load.
"""
from __future__ import annotations

import copy
import json
import warnings
from typing import Optional

from ..config import OneBitConfig
from ..engine import NOT_FROZEN
from ..low_precision import float32_state_in
from ..optimizer_view import OptimizerView
from ..param_groups import check_no_amsgrad
from ..values import described
from .adam_state import init_adam_state
from .schedule import FREEZE_KEY, LOADS_KEY, RECORD_KEY, STEP_KEY, Schedule, carried_record
from .sent_record import FIGURES_KEY, offer
from .telemetry import Telemetry

KEY = "onebit"  # the state_dict entry 1-bit Adam adds; RECORD_KEY: param group 0's copy
AUTO_RECORD_LEFT_OUT = (
    "hvd_onebit: freeze_step='auto': the state was loaded without the checkpoint's record of "
    "the variance (torch.distributed.checkpoint keeps a state dict's state and param_groups "
    "alone), so a new record starts at step {steps}; the freeze may come later than in the run "
    "the checkpoint came from. Save the optimizer's state_dict() with torch.save to keep it")


def state_dict(view: OptimizerView, config: OneBitConfig, schedule: Schedule,
               telemetry: Telemetry, unflushed: bool) -> dict:
    """``unflushed``: whether the rank-local error feedback holds what compression has not
    delivered yet (then this state alone resumes without it)."""
    sd = view.adam.torch_state_dict()
    sd[KEY] = {"freeze_step": schedule.freeze_step, "skipped_steps": telemetry.skipped_steps,
               "step_bound": config.step_bound, "refreshes": telemetry.refreshes,
               "last_refresh_step": telemetry.last_refresh_step,
               "unflushed_error_feedback": bool(unflushed)}
    decision = schedule.decision  # as the state has it (one sent in included)
    carried = dict(sd[KEY], steps=schedule.steps,
                   auto_freeze_left_out=schedule.monitor is not None,
                   auto_freeze_decision=decision)
    carried[FIGURES_KEY] = offer(schedule)
    sd["param_groups"][0][RECORD_KEY] = json.dumps(carried)
    if schedule.monitor is not None:
        sd[KEY]["auto_freeze"] = dict(schedule.monitor.state_dict(), decision=decision)
    return sd


def check_state_shapes(state_dict: dict, params: list, names: dict) -> None:
    """Refuse, before anything is loaded, a state whose moments do not have their parameters'
    shapes (another model's optimizer state): torch.optim would take it and fail in the next
    step, naming neither the parameter nor the checkpoint."""
    ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    for index, (pid, p) in enumerate(zip(ids, params)):
        for key in ("exp_avg", "exp_avg_sq"):
            value = state_dict["state"].get(pid, {}).get(key)
            if hasattr(value, "shape") and tuple(value.shape) != tuple(p.shape):
                raise ValueError(
                    f"the optimizer state loaded is another model's: its {key} for "
                    f"{names.get(p, f'parameter {index}')} has shape {tuple(value.shape)}, the "
                    f"parameter {tuple(p.shape)}; nothing was loaded")


def load_state_dict(view: OptimizerView, config: OneBitConfig, schedule: Schedule,
                    telemetry: Telemetry, state_dict: dict, one_rank: bool = False) -> bool:
    """Load a :func:`state_dict`. A checkpoint taken in the compression phase stays there: its
    variance was frozen at its own ``freeze_step``, which wins over the optimizer's (with a
    warning when they differ, or when the optimizer's is "auto" and the checkpoint's was not).
    A warmup checkpoint takes the optimizer's, or freezes at its own step count when that is
    past the optimizer's (with a warning); with ``freeze_step="auto"`` also the checkpoint's
    record of the variance, so the resumed run decides at the same step as an uninterrupted
    one. A state dict without the 1-bit record is this optimizer's if its step counts agree,
    else torch.optim's, a warmup checkpoint at its Adam step count (:func:`_own_without_record`);
    this optimizer's takes the record param group 0 carries (``RECORD_KEY``) where there is one.
    ``one_rank``: a job of one rank, which steps as Adam (:func:`variance_for_one_rank`), and
    for which the freeze step says nothing. The caller drops its collectives after. Returns
    whether the checkpoint was saved with error feedback not delivered yet (which it does not
    hold)."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise TypeError("hvd_onebit: load_state_dict() takes an optimizer's state_dict() (keys "
                        f"state and param_groups); got {described(state_dict)} (a model's "
                        "state_dict() goes to model.load_state_dict())")
    check_no_amsgrad(state_dict["param_groups"], " in the state dict loaded (set its groups' "
                     "'amsgrad' to False to load it: amsgrad's running maxima are then left out)")
    state_dict = dict(state_dict)
    state_dict["state"] = {pid: {k: v for k, v in entry.items() if k != "max_exp_avg_sq"}
                           for pid, entry in state_dict["state"].items()}
    meta = state_dict.pop(KEY, None)
    carried = carried_record(state_dict["param_groups"])
    state_dict["param_groups"] = [{k: v for k, v in g.items() if k != RECORD_KEY}
                                  for g in state_dict["param_groups"]]
    params = view.adam.parameters()
    check_state_shapes(state_dict, params, view.names)
    wide = float32_state_in(state_dict, params)
    loads = schedule.loads
    view.adam.load_torch_state_dict(state_dict)
    schedule.count_load(loads)
    # torch cast every state tensor to its parameter's dtype: put float32 state back.
    ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    for pid, p in zip(ids, params):
        for key, value in wide.get(pid, {}).items():
            view.adam.state[p][key] = value.to(device=p.device, copy=True)
    saved = None
    if meta is None:
        own = _own_without_record(view, schedule)
        if own and carried is not None and (carried.get("steps"), carried.get("freeze_step")) \
                == (schedule.steps, schedule.freeze_step):
            meta = carried  # what torch.distributed.checkpoint kept of the record
        saved = schedule.freeze_step if own else None
    mine = None if config.auto else config.freeze_step
    if meta is not None:
        telemetry.skipped_steps = int(meta.get("skipped_steps", 0))
        telemetry.refreshes = int(meta.get("refreshes", 0))
        telemetry.last_refresh_step = meta.get("last_refresh_step")
        saved = meta.get("freeze_step")
        _warn_if_other_step_bound(meta, config.step_bound)
    record = meta or {}
    steps = schedule.steps
    say = (lambda text: None) if one_rank else warnings.warn  # one rank: Adam, never frozen
    if saved is not None and steps >= int(saved):
        if mine is not None and int(saved) != mine:
            say(
                f"hvd_onebit: the checkpoint is in the compression phase (step "
                f"{steps}, frozen at freeze_step={saved}); it keeps "
                f"its frozen variance and freeze_step={saved}, not {mine}")
        elif mine is None and not (record.get("auto_freeze")
                                   or record.get("auto_freeze_left_out")):
            say(
                f"hvd_onebit: the checkpoint is in the compression phase (step {steps}, "
                f"frozen at freeze_step={saved}); freeze_step='auto' has nothing left to decide")
        schedule.freeze_step = int(saved)
    elif mine is not None and steps > mine:
        say(
            f"hvd_onebit: the checkpoint is in the warmup at step {steps}, past "
            f"freeze_step={mine}: the variance freezes now, at freeze_step={steps}")
        schedule.freeze_step = steps
    else:
        schedule.freeze_step = mine
    if config.auto and schedule.freeze_step is None and record.get("auto_freeze_left_out"):
        warnings.warn(AUTO_RECORD_LEFT_OUT.format(steps=steps))
    schedule.load_monitor(record.get("auto_freeze")
                          or {"decision": record.get("auto_freeze_decision")})
    init_adam_state(view.adam.param_groups, view.adam.state)
    if one_rank:
        variance_for_one_rank(view)
    return bool(record.get("unflushed_error_feedback", False))


class HandedStates:
    """The records of the state dicts handed out at the optimizer's current step with error
    feedback not yet delivered. torch's ``state_dict()`` hands out the live momenta, not
    copies, so a flush at the same step changes what such a state holds; its record then says
    so too (a framework that takes the state before a hook flushes, as Lightning's
    ``on_save_checkpoint``, saves what it says). Only each record's two dicts are held: in the
    compression phase they hold no tensor (the auto freeze's copy of the variance is gone once
    it decided)."""

    def __init__(self):
        self._step: Optional[int] = None
        self._records: list[tuple[dict, dict]] = []

    def handed(self, state_dict: dict, step: int) -> None:
        if step != self._step:
            self.clear()
            self._step = step
        if state_dict[KEY]["unflushed_error_feedback"]:
            self._records.append((state_dict[KEY], state_dict["param_groups"][0]))

    def clear(self) -> None:
        """Forget the records (a state loaded: the momenta they hold are no longer these)."""
        self._step, self._records = None, []

    def flushed(self, step: int) -> None:
        """The error feedback was folded into the momenta at ``step``. A record a script changed
        in the meantime (its param group's copy removed or rewritten) keeps what it says."""
        if step == self._step:
            for record, group in self._records:
                record["unflushed_error_feedback"] = False
                try:
                    carried = json.loads(group[RECORD_KEY])
                    carried["unflushed_error_feedback"] = False
                    group[RECORD_KEY] = json.dumps(carried)
                except (KeyError, TypeError, ValueError):
                    pass
        self.clear()


def torch_adam_state_dict(state_dict: dict) -> dict:
    """This optimizer's ``state_dict()`` as a ``torch.optim.Adam`` or ``AdamW`` of the same
    parameters takes it (fine-tuning or evaluation on one process): without the 1-bit entries,
    and each variance frozen (or last refreshed) at ``frozen_variance_step`` scaled by
    ``(1 - beta2**step) / (1 - beta2**frozen_variance_step)``, so that Adam's bias correction
    by its step count gives the denominator this optimizer divided by. A warmup state is Adam's
    already. ``state_dict`` is left as it is."""
    out = copy.deepcopy({k: v for k, v in state_dict.items() if k != KEY})
    beta2 = {}
    for group in out["param_groups"]:
        for key in (STEP_KEY, FREEZE_KEY, LOADS_KEY, RECORD_KEY):
            group.pop(key, None)
        beta2.update({pid: float(group["betas"][1]) for pid in group["params"]})
    for pid, entry in out["state"].items():
        _as_adams_variance(entry, beta2[pid])
        entry.pop("frozen_variance_step", None)
    return out


def _as_adams_variance(entry: dict, beta2: float) -> None:
    """A state entry's variance frozen (or last refreshed) at ``frozen_variance_step``, scaled
    so that Adam's bias correction by its step count gives the denominator 1-bit Adam divides
    by, and marked not frozen; an entry never frozen is Adam's already."""
    frozen = int(entry.get("frozen_variance_step", NOT_FROZEN))
    if frozen >= 1:
        step = float(entry["step"])
        factor = (1 - beta2 ** step) / (1 - beta2 ** frozen)
        entry["exp_avg_sq"] = entry["exp_avg_sq"] * factor
        entry["frozen_variance_step"] = NOT_FROZEN


def variance_for_one_rank(view: OptimizerView) -> None:
    """A job of one rank steps as Adam does (nothing to compress): a loaded compression-phase
    state's frozen variances become Adam's own at their step counts, as
    :func:`torch_adam_state_dict` gives them. Adam would otherwise divide by a variance frozen
    early with the bias correction of the step count, a first step several times too large.
    Saved again, the state is a warmup one's variance, which a job of several ranks freezes at
    its step count: the same denominators."""
    for group in view.adam.param_groups:
        for p in group["params"]:
            if p in view.adam.state:
                _as_adams_variance(view.adam.state[p], float(group["betas"][1]))


def _own_without_record(view: OptimizerView, schedule: Schedule) -> bool:
    """A state dict without the 1-bit record (``KEY``). Where its param group still counts as
    many steps as its Adam does, it is this optimizer's state that lost only the record
    (``torch.distributed.checkpoint`` keeps ``state`` and ``param_groups`` alone): it loads as
    it is, with the freeze step it carries, and True is returned. Otherwise it
    is torch.optim's: a plain Adam's (training that started without this optimizer), or one of
    this optimizer's that a torch optimizer loaded and trained on, keeping the 1-bit entries it
    does not know without counting or freezing with them. Then its Adam is the truth: the step
    count is the parameters' Adam step count (the largest: torch's Adam skips a parameter
    without a gradient), its variance is Adam's, not frozen, and None is returned; the caller
    freezes at ``freeze_step``, or now if that is past."""
    steps = int(max((float(s["step"]) for s in view.adam.state.values() if "step" in s),
                    default=0.0))
    carried = schedule.carried_steps()
    if carried == steps:
        return True
    schedule.recount(steps)
    for entry in view.adam.state.values():
        if "frozen_variance_step" in entry:
            entry["frozen_variance_step"] = NOT_FROZEN
    if carried is not None:
        warnings.warn(
            f"hvd_onebit: the state dict holds 1-bit Adam's entries (step {carried}) but not its "
            f"record: another optimizer loaded it and trained on, so it loads as that Adam's "
            f"state, at its step {steps}, its variance not frozen")
    return False


def _warn_if_other_step_bound(meta: dict, mine) -> None:
    """A checkpoint written with another step bound (one from before the bound existed was
    unbounded) loads as it is: the bound acts only on the step, so the momentum and the error
    feedback mean the same under either; say so, since later steps will differ."""
    theirs = meta.get("step_bound") if "step_bound" in meta else None
    if theirs != mine:
        warnings.warn(f"hvd_onebit: the checkpoint was written with step_bound={theirs!r}, this "
                      f"optimizer has step_bound={mine!r}; its momentum and error feedback "
                      "carry over unchanged (the bound acts only on each step)")
