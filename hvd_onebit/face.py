"""What both faces offer alike, over the parts they delegate to (the schedule, the telemetry,
the engine, the phases, the view of the optimizer, the config): the phase and step count, the
telemetry and its counters, checkpoints and the error feedback's lifecycle.

Each face builds its optimizer class from the wrapped Adam class and a dict of methods;
:func:`face_attributes` gives a face class's methods together with :class:`SharedFace`'s, so the
faces hold only what their framework makes different.
"""
from __future__ import annotations

import gc
import time
import weakref
from typing import Optional

import torch

from .engine import CompressedStep
from .param_groups import check_no_amsgrad
from .state import checkpoint
from .state.adam_state import init_adam_state
from .state.schedule import COMPRESSION
from .state.telemetry import COUNTERS


def _counter(name: str) -> property:
    return property(lambda self: getattr(self._telemetry, name),
                    doc=f"This rank's {name.replace('_', ' ')} (see telemetry()).")


class SharedFace:
    """Methods of both faces; an instance holds ``_schedule``, ``_telemetry``, ``_engine``,
    ``_phases``, ``_view``, ``_handed`` (:class:`~hvd_onebit.state.checkpoint.HandedStates`)
    and ``config``."""

    # ---- what a training script reads ------------------------------------------------------------

    @property
    def phase(self) -> str:
        """"warmup" until ``freeze_step`` steps have been taken, then "compression"."""
        return self._schedule.phase

    @property
    def steps(self) -> int:
        """Optimizer steps taken (skipped steps not counted)."""
        return self._schedule.steps

    @property
    def freeze_step(self) -> Optional[int]:
        """The step count the variance freezes (or froze) at; None while ``freeze_step="auto"``
        has not decided."""
        return self._schedule.freeze_step

    @property
    def freeze_decision(self) -> Optional[dict]:
        """``freeze_step="auto"``: how the step was chosen (``freeze_step``, ``reason``, the
        ``change`` that triggered it and the ``history`` of (step, change) checks); None before
        the decision and with a fixed ``freeze_step``."""
        return self._schedule.decision

    @property
    def compressed_step(self) -> CompressedStep:
        """The compression-phase engine: buckets, 1-bit collectives, error feedback."""
        return self._engine

    def telemetry(self) -> dict:
        """Phase, step count and communication counters as a plain dict, and ``hierarchical``:
        whether the 1-bit stage is (what ``hierarchical="auto"`` chose), None until the first
        compressed step."""
        return {**self._telemetry.as_dict(self.phase, self.steps),
                "hierarchical": self._engine.hierarchical}

    # ---- checkpoints and the error-feedback lifecycle ----------------------------------------------

    def state_dict(self) -> dict:
        self._view.adam.check_state(self._engine.state)
        sd = checkpoint.state_dict(self._view, self.config, self._schedule, self._telemetry,
                                   unflushed=self._engine.unflushed)
        self._handed.handed(sd, self.steps)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a :meth:`state_dict` (see :func:`hvd_onebit.state.checkpoint.load_state_dict`:
        a compression-phase checkpoint keeps its own freeze step). One saved with error feedback
        not flushed warns at the next compressed step unless
        :meth:`load_error_feedback_state_dict` gives this rank's first."""
        unflushed = checkpoint.load_state_dict(self._view, self.config, self._schedule,
                                               self._telemetry, state_dict,
                                               one_rank=self._engine.world == 1)
        self._phases.restart()  # exp_avg tensors were replaced: re-fuse at the next step
        self._engine.expect_error_feedback(self.steps if unflushed else None)
        self._handed.clear()

    def reset_collectives(self) -> None:
        """Drop the fused buckets, the frozen denominators and every 1-bit collective (with its
        error feedback); the next compressed step rebuilds them. Every rank must call it at the
        same point (elastic resets do, through :mod:`hvd_onebit.elastic`)."""
        self._phases.reset()

    def restart_variance_monitor(self) -> None:
        """freeze_step="auto": forget the variance record (the next check starts a new one).
        Every rank must call it at the same point; elastic syncs do."""
        self._schedule.restart_monitor()

    def add_param_group(self, param_group: dict) -> None:
        # (self may be a wrapper forwarding to the optimizer: Lightning's)
        constructed = getattr(self, "_view", None) is not None
        if constructed and self.phase == COMPRESSION:
            raise ValueError(
                f"cannot add parameters after the variance was frozen (step {self.steps} >= "
                f"freeze_step {self.freeze_step}): Adam's variance for them was never "
                "estimated. Add them during the warmup.")
        check_no_amsgrad([param_group], " in a param group added")
        if not constructed:  # torch's constructor adding the groups: self is the built class's
            super(self.__class__, self).add_param_group(param_group)
            return
        adam = self._view.adam
        adam.add_param_group(param_group)
        init_adam_state(adam.param_groups, adam.state)  # new parameters need Adam state

    def error_feedback_state_dict(self) -> dict:
        """This rank's error-feedback buffers (rank-local: save one file per rank)."""
        return self._engine.error_feedback_state_dict()

    def load_error_feedback_state_dict(self, state: dict) -> None:
        """Restore :meth:`error_feedback_state_dict` from the same rank of a same-size job,
        before or after :meth:`load_state_dict` of the optimizer state saved with it; with
        another world size, rank, layout or step count they are dropped with a warning. They
        apply at the next step: on an optimizer that has stepped, the compressed step rebuilds
        there, as after a state loaded. Every rank loads its own at the same point (between a
        backward and step() it waits out the buckets the hooks started, as a state load does)."""
        if self._engine.buckets is not None:
            self._phases.restart()
        self._engine.load_error_feedback_state_dict(state)

    def flush_error_feedback(self) -> int:
        """Fold every rank's error feedback into the momentum (one full-precision allreduce),
        so that rank 0's ``state_dict()`` alone resumes on any world size; a no-op in the
        warmup, on one rank and with ``compressor="none"``. Every rank calls it at the same
        point (between a backward and step(), the buckets the hooks started are waited out and
        the step starts them again, where the overlap is alike on every rank). Returns the
        bytes this rank sent; raises NonFiniteInputError on every rank, changing nothing
        (:meth:`~hvd_onebit.engine.CompressedStep.flush_error_feedback`)."""
        if not self._phases.compressing() or self.config.compressor != "onebit":
            return 0
        if self._engine.started:  # between backward and step(): those buckets read the errors
            self._phases.drop_early()  # the flush folds, so the step starts them again
        self._engine.ensure_ready(self._view.adam.active_parameters())  # applies loaded errors
        start = time.perf_counter()
        with self._phases.watching("flush_error_feedback()"):
            nbytes = self._engine.flush_error_feedback(self.param_groups)
        self._telemetry.add(nbytes, time.perf_counter() - start)
        self._handed.flushed(self.steps)
        return nbytes

    def __reduce_ex__(self, protocol):
        """Refused: the optimizer holds its job's connections, buckets and hooks, which neither
        pickle nor copy (nor does what holds it: a scheduler, a trainer object); its checkpoint
        is ``state_dict()``."""
        raise TypeError(NOT_PICKLED)


class SteppedInstead:
    """A step pre-hook left on the optimizer a face wrapped: the face's optimizer is a new one
    beside it, with its own state, so a script (or a library holding the first one, such as
    Accelerate's ``prepare``) that steps the first one trains plain Adam without the phases, and
    in the compression phase on each rank's own gradients. Refused, before anything changes."""

    def __init__(self, face: str, wrapper, advice: str):
        self.face = face
        self.wrapper = weakref.ref(wrapper)  # once it is gone, the Adam is the script's again
        self.advice = advice

    def __call__(self, optimizer, args, kwargs) -> None:
        if self.wrapper() is not None:
            gc.collect()  # a dropped wrapper's parts refer to each other: only this frees it
        if self.wrapper() is None:
            return
        raise ValueError(
            f"this {type(optimizer).__name__} was wrapped by {self.face}, and the wrapper "
            f"is the optimizer to step: opt = {self.face}(opt, ...), then opt.step(). "
            f"Stepped itself it trains plain Adam, without 1-bit Adam's phases. {self.advice}"
            f"Nothing was changed by this step")


def guard_wrapped(optimizer: torch.optim.Optimizer, face: str, wrapper, advice: str) -> None:
    """Refuse ``optimizer.step()`` while ``wrapper``, what ``face`` built over it, lives
    (:class:`SteppedInstead`); ``advice`` ends the error's first part."""
    optimizer.register_step_pre_hook(SteppedInstead(face, wrapper, advice))


NOT_PICKLED = (
    "an hvd_onebit optimizer is not pickled or copied whole (torch.save(opt), copy.deepcopy(opt)): "
    "it holds its job's connections and hooks. Save opt.state_dict() (and "
    "opt.error_feedback_state_dict() to keep each rank's errors) and load them into an optimizer "
    "built the same way")


for _name in COUNTERS:  # the counters, each also an attribute: last_step_bytes, total_bytes, ...
    setattr(SharedFace, _name, _counter(_name))


def face_attributes(face: type) -> dict:
    """The attributes of a built optimizer class: :class:`SharedFace`'s, then ``face``'s own."""
    attrs = {}
    for cls in (SharedFace, face):
        attrs.update({k: v for k, v in cls.__dict__.items()
                      if k not in ("__dict__", "__weakref__")})
    return attrs
