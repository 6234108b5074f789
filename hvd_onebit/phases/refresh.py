"""A variance refresh step (``variance_refresh``): a full-precision step inside the compression
phase, as the optimizer drives it.

Which steps: :meth:`~hvd_onebit.state.schedule.Schedule.refresh_next` (the step count and the
freeze step, alike on every rank: no collective). The gradients travel through Horovod's
allreduce, as in the warmup, but all of them start when the step synchronizes (Horovod's
synchronize starts the allreduces no hook started): a gradient clipped or unscaled in place
after backward, as the compressed steps allow, is averaged as it is then, never raced by an
allreduce already reading it. A refresh step has no overlap.
The averaged gradients are the same bits on every rank, so a non-finite one is skipped by every
rank alike, nothing changed; otherwise the engine takes Adam's step from them with the variance
updated (:meth:`~hvd_onebit.engine.CompressedStep.refresh`, which also carries the error feedback
over). It is one kind of full-precision step, driven as the warmup's is, with or without a
GradScaler (:mod:`hvd_onebit.phases.full_precision`). Its bytes are counted as the warmup counts
its own (the ring allreduce's), plus a fold's.
"""
from __future__ import annotations

import logging
import warnings
from typing import Optional

import torch

from ..comm.protocol import NonFiniteInputError
from ..config import OneBitConfig
from ..engine import CompressedStep
from ..low_precision import is_low_precision
from ..optimizer_view import OptimizerView
from ..param_groups import groups_by_param
from ..state.schedule import Schedule
from ..state.telemetry import Telemetry
from .full_precision import GradientAllreduce
from .gradients import as_adam_takes_it, sparse_gradient_error

logger = logging.getLogger("hvd_onebit")


class RefreshPhase:
    """One optimizer's refresh steps: the engine's refresh on the gradients the warmup's
    allreduce averaged (``allreduce``: its wait and its bytes)."""

    def __init__(self, view: OptimizerView, schedule: Schedule, telemetry: Telemetry,
                 engine: CompressedStep, allreduce: GradientAllreduce, config: OneBitConfig):
        self._view = view
        self._schedule = schedule
        self._telemetry = telemetry
        self._engine = engine
        self._allreduce = allreduce
        self._mode = config.refresh.error_feedback if config.refresh is not None else None
        self._extra_bytes = 0  # this step's bytes beyond the gradients' allreduce (a fold's)

    # ---- a FullPrecisionStep (hvd_onebit.phases.full_precision) ------------------------------

    what = "refresh step"

    def begin(self) -> None:
        self._extra_bytes = 0

    def apply(self) -> None:
        """The refresh on the averaged gradients (finite), counted and logged."""
        view, engine = self._view, self._engine
        self._extra_bytes = 0
        engine.ensure_ready(view.adam.active_parameters())
        groups = groups_by_param(view.adam.param_groups)
        grads = {p: self.averaged_grad(p, groups[p]) for p in engine.params}
        steps = self._schedule.steps
        try:
            self._extra_bytes = engine.refresh(view.adam.param_groups, grads, self._mode)
        except NonFiniteInputError as exc:  # a fold's: the same on every rank, nothing changed
            self._telemetry.skipped_steps += 1
            warnings.warn(f"hvd_onebit: refresh step skipped on every rank: {exc}")
            return
        self._schedule.count_step()
        self._telemetry.count_refresh(steps)
        logger.debug("hvd_onebit: variance refreshed at step %d (refresh %d)", steps + 1,
                     self._telemetry.refreshes)

    def account(self) -> None:
        self._telemetry.account(self._allreduce.step_bytes() + self._extra_bytes,
                                self._allreduce.wait_seconds)

    def averaged_grad(self, p: torch.Tensor, group: dict) -> Optional[torch.Tensor]:
        """p's averaged gradient as Adam takes it in (Horovod's op already applied by its
        allreduce): float32 for low-precision parameters, ``maximize``, Adam's L2 decay."""
        g = p.grad
        if g is None:
            return None
        if g.is_sparse:
            raise sparse_gradient_error(self._view, p)
        if is_low_precision(p):
            g = g.float()
        return as_adam_takes_it(self._view, p, group, g)
