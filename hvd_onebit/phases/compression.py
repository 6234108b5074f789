"""The compression phase, as the optimizer drives it: local gradients into the engine.

The variance is frozen; each rank's gradient goes, as Adam would take it in (L2 decay,
``maximize``, Horovod's averaging op applied), into the compressed step
(:class:`~hvd_onebit.engine.CompressedStep`), which averages the momentum in 1 bit and
applies Adam's update. A step whose inputs some rank found non-finite is skipped by every rank,
with nothing changed anywhere.
"""
from __future__ import annotations

import time
import warnings
from typing import Callable, Mapping, Optional

import torch

from ..comm.protocol import NonFiniteInputError
from ..engine import CompressedStep
from ..low_precision import is_low_precision
from ..optimizer_view import OptimizerView
from ..overlap import Overlap
from ..param_groups import groups_by_param
from ..state.schedule import Schedule
from ..state.telemetry import Telemetry
from .gradients import as_adam_takes_it, sparse_gradient_error

SCALER_CHANGED = "a GradScaler was used this step and not the last, or the reverse"


def stale_warning(what: str) -> str:
    """The warning when buckets started during backward are started again: ``what`` changed
    between backward and step()."""
    return (f"hvd_onebit: what the compressed step reads changed between backward and step(): "
            f"{what}. The buckets started during backward were started again, and from now on "
            "this rank starts them in step() (overlap off). Leave the gradients and the "
            "options as backward left them to keep the overlap, or pass overlap=False.")


class CompressionPhase:
    """One optimizer's compressed steps."""

    def __init__(self, view: OptimizerView, schedule: Schedule, telemetry: Telemetry,
                 engine: CompressedStep, config):
        self._view = view
        self._schedule = schedule
        self._telemetry = telemetry
        self._engine = engine
        self.overlap = Overlap(view, config, engine, self.local_grad)

    def local_grad(self, p: torch.Tensor, group: dict,
                   inv_scale: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """p's gradient as the compressed step takes it in; ``inv_scale``: the gradient is
        still scaled by a GradScaler, unscale it first (the bits of GradScaler.unscale_: one
        float32 product, rounded to the gradient's dtype)."""
        g = p.grad
        if g is None:
            return None
        if g.is_sparse:
            if not self._view.sparse_as_dense:
                raise sparse_gradient_error(self._view, p)
            g = g.to_dense()
        if inv_scale is not None:
            g = torch.mul(g.float(), inv_scale).to(g.dtype)
        if is_low_precision(p):  # the momentum is float32: so is the gradient it takes in
            g = g.float()
        if self._view.sums_gradients:  # Horovod's Sum: the update sees the sum over ranks
            g = g * self._engine.world
        return as_adam_takes_it(self._view, p, group, g)

    def step(self, changed: bool = False) -> bool:
        """One compressed step, counted when taken. Returns False when it was skipped because
        some rank had non-finite values. ``changed``: the gradients were changed since backward,
        whether it shows or not (a GradScaler assumed or not assumed by the hooks)."""
        engine, overlap = self._engine, self.overlap
        early = overlap.current
        if early is None:
            engine.begin_step()
        try:  # before anything more starts: what raises here raises on every rank, and the
            # buckets the hooks started are waited out first (a state entry removed, a bad
            # gradient)
            stale, grads = self._prepare(early, changed)
        except Exception:
            engine.abandon_early()
            raise
        start = time.perf_counter()
        telemetry = self._telemetry
        try:
            nbytes = engine.step(self._view.adam.param_groups, grads, stale=stale)
        except NonFiniteInputError as exc:
            telemetry.skipped_steps += 1
            telemetry.account(0, time.perf_counter() - start)
            warnings.warn(f"hvd_onebit: step skipped on every rank: {exc}")
            return False
        finally:
            telemetry.last_step_breakdown = dict(engine.breakdown)
        telemetry.account(nbytes, time.perf_counter() - start)
        self._schedule.count_step()
        return True

    def _prepare(self, early, changed: bool) -> tuple[bool, "LocalGrads"]:
        """The buckets for the trainable set, whether the early starts are stale (said, and
        the overlap turned off, unless quietly so), and the gradients of the buckets that start
        here, computed."""
        engine, overlap = self._engine, self.overlap
        active = self._view.adam.active_parameters()
        ready = engine.up_to_date(active)
        # the trainable set changed since the hooks started buckets of the old one (requires_grad
        # set between backward and step() on every rank): those are waited out and dropped, and
        # every bucket of the new set starts here
        relaid = not ready and engine.started > 0
        if relaid:
            engine.abandon_early()
        engine.ensure_ready(active, checked=ready)
        what = None if relaid else (
            SCALER_CHANGED if changed and engine.started > 0 else overlap.stale())
        stale = what is not None
        # a skipped batch: started again, quietly (unless zero_grad() comes every step)
        skipped = overlap.skipped(early is not None and early.zeroed)
        quiet = skipped or (early is not None and early.accumulating)  # a pass more
        if stale and overlap.off_reason is None and not quiet:
            overlap.turn_off(f"changed between backward and step(): {what}")
            warnings.warn(stale_warning(what))
        unstarted = (engine.params if stale or relaid or early is None
                     else early.unstarted(engine.params))
        grads = LocalGrads(self.local_grad, groups_by_param(self._view.adam.param_groups))
        for p in unstarted:
            grads[p]
        return stale, grads

    def end_step(self) -> None:
        """After a compressed step, taken or skipped: the next backward starts afresh."""
        self._view.reset_backward_passes()
        self._view.synchronized = False
        self.overlap.end_step()


class LocalGrads(Mapping):
    """Each parameter's local gradient (:meth:`CompressionPhase.local_grad`), computed on first
    access: a step started again after a stale early start reads the ones it did not need."""

    def __init__(self, local_grad: Callable, groups: dict):
        self._local_grad = local_grad
        self._groups = groups
        self._done: dict = {}

    def __getitem__(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        if p not in self._done:
            self._done[p] = self._local_grad(p, self._groups[p])
        return self._done[p]

    def __iter__(self):
        return iter(self._groups)

    def __len__(self) -> int:
        return len(self._groups)
