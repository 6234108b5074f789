"""One optimizer step, dispatched to its kind: a full-precision step (the warmup's or a variance
refresh step, :mod:`hvd_onebit.phases.full_precision`) or a compressed one, each with a
GradScaler's prologue and epilogue around it when one is given (:mod:`hvd_onebit.phases.amp`);
and the hooks and synchronize() of each phase. The face hands it its framework's allreduce of
full-precision steps (Horovod's :class:`~hvd_onebit.phases.warmup.Warmup`, or DDP's) and its
cross-rank check of the parameters."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..config import OneBitConfig
from ..engine import CompressedStep
from ..optimizer_view import OptimizerView
from ..param_groups import check_no_amsgrad
from ..stall import watch
from ..state.checkpoint import variance_for_one_rank
from ..state.schedule import COMPRESSION, Schedule
from ..state.telemetry import Telemetry
from .amp import ScalerView, check_scale_attributes, view_of
from .compression import CompressionPhase
from .full_precision import GradientAllreduce, FullPrecisionStep, take
from .gradients import closure_loss
from .refresh import RefreshPhase


class Phases:
    """The two phases of one optimizer and the choice between them, step by step."""

    def __init__(self, view: OptimizerView, config: OneBitConfig, schedule: Schedule,
                 telemetry: Telemetry, engine: CompressedStep, warmup: GradientAllreduce,
                 check_identical: Callable[[int], None],
                 check_trainable: Callable[[], None] = lambda: None):
        """``warmup``: the allreduce of full-precision steps, and the warmup's own kind of step
        (a :class:`~hvd_onebit.phases.full_precision.FullPrecisionStep`);
        ``check_identical(steps)``: raise on every rank if the parameters differ (check_every);
        ``check_trainable()``: raise if the face cannot train the parameters that take a
        gradient now (checked before each step, which then changes nothing)."""
        self._view = view
        self._config = config
        self._schedule = schedule
        self._telemetry = telemetry
        self._engine = engine
        self.warmup: FullPrecisionStep | GradientAllreduce = warmup
        self._check_identical = check_identical
        self._check_trainable = check_trainable
        self.compression = CompressionPhase(view, schedule, telemetry, engine, config)
        # step() calls taken since construction or the last reset: check_every counts these,
        # not step counts, so every rank checks at the same call even after a load on one rank
        # moved its step count (the check then names the counts instead of waiting on a peer)
        self._calls = 0
        self._calls_built = 0  # step() calls since construction, whatever the resets: the
        self._resets = 0  # stall watch names both counts once there was a reset
        self.refresh = RefreshPhase(view, schedule, telemetry, engine, self.warmup, config)
        self._watch = watch()  # a step() that does not return is told (hvd_onebit.stall)

    # the ranks' agreements around a full-precision step (full_precision.Agreement)
    first = property(lambda self: self._engine.rank == 0)

    def ranks_with(self, flags: tuple[bool, ...]) -> tuple[int, ...]:
        """On how many ranks each flag is set (:meth:`CompressedStep.ranks_with`)."""
        device = next((p.device for p in self._view.adam.parameters()), torch.device("cpu"))
        return self._engine.ranks_with(flags, device)

    def from_first(self, tensors: list) -> list:
        return self._engine.from_first_rank(tensors)

    def compressing(self) -> bool:
        """Whether this step is a compressed one (the compression phase, on several ranks).
        Asked first by every hook and step, so it is where a state written in from outside
        (:meth:`~hvd_onebit.state.schedule.Schedule.moved_outside`) is noticed, before anything
        starts on the old one."""
        if self._schedule.moved_outside():
            self.restart()
        return self._engine.world > 1 and self._schedule.phase == COMPRESSION

    def reset(self) -> None:
        """Every rank at the same point (elastic resets): drop the buckets and collectives
        (:meth:`~hvd_onebit.engine.CompressedStep.reset`) and count check_every's calls from
        here (a joining worker starts at zero). A job left with one rank steps as Adam, so its
        frozen variances become Adam's at their step counts, as a one-rank job's load makes
        them (:func:`~hvd_onebit.state.checkpoint.variance_for_one_rank`); a job that grows
        again freezes them at its step count."""
        self._engine.reset()
        if self._engine.world == 1:
            variance_for_one_rank(self._view)
        self.compression.overlap.end_step()
        self._calls = 0
        self._resets += 1

    def restart(self) -> None:
        """The optimizer state was replaced: the compressed step rebuilds on the new one
        (:meth:`~hvd_onebit.engine.CompressedStep.restart`; nothing new is communicated).
        Buckets the gradient hooks started from the old state (a load between backward and
        step()) are waited out and dropped first: every rank started them, and every rank
        drops them once, here or at its next step, where a state written in is noticed; the
        step then starts every bucket from the new state."""
        self.drop_early()
        self._engine.restart()
        self._schedule.acknowledge()

    def drop_early(self) -> None:
        """Wait out and drop the buckets the gradient hooks started this step: the step starts
        every bucket itself. Every rank at the same point (every rank started them)."""
        self._engine.abandon_early()
        self.compression.overlap.end_step()

    def refreshing(self) -> bool:
        """Whether this step is a variance refresh step (:mod:`hvd_onebit.phases.refresh`): a
        compressed one on the ``variance_refresh`` schedule, taken in full precision."""
        return self.compressing() and self._schedule.refresh_next()

    def compressed_next(self) -> bool:
        """Whether this step is a compressed one: the compression phase, not a refresh step."""
        return self.compressing() and not self._schedule.refresh_next()

    def gradient_hook(self, p, warmup_hook: Callable, *args) -> None:
        """p's gradient accumulated: Horovod's allreduce in the warmup. In the compression phase
        no gradient travels during backward: on the step's last backward pass the gradient
        completes its bucket, which may start its exchange (:mod:`hvd_onebit.overlap`); a
        refresh step's gradients are averaged when the step synchronizes, from what they are
        then, as the compressed steps take them (a gradient clipped in place after backward
        is averaged clipped, not raced by an allreduce already reading it)."""
        if not self.compressing():
            warmup_hook(*args)
            return
        refreshing = self._schedule.refresh_next()  # compressing() just asked: no second ask
        if refreshing:  # Horovod will allreduce these gradients: refuse what it cannot take
            self.warmup.check_layout_once()
        if self._view.count_backward_pass(p) and not refreshing:
            self.compression.overlap.gradient_ready(p)

    def gradients_zeroed(self) -> None:
        """zero_grad(): buckets started from the last backward's hooks belonged to a batch
        the script skips; the next step starts them again and keeps starting early
        (:meth:`~hvd_onebit.overlap.Overlap.gradients_zeroed`). Before a compressed step,
        every parameter expects its backward passes afresh (Horovod's counters; DDP counts
        none), and with nothing in flight a synchronize() before it is spent; with buckets in
        flight it stands until the step, so that the script's next zero_grad() passes too."""
        self.compression.overlap.gradients_zeroed()
        if self.compressed_next():
            self._view.reset_backward_passes()
            if not self._engine.started:
                self._view.synchronized = False

    def synchronize(self, make_hook: Callable) -> None:
        """Warmup and refresh steps: wait for the gradient allreduces. Compression: nothing to
        wait for; as Horovod's, every parameter expects its backward passes afresh (the
        script steps, or zeroes the gradients and skips the batch)."""
        if self.compressed_next():
            self._view.synchronized = True
            self._view.reset_backward_passes()
        else:  # the last step's scaler: whether the script unscaled before synchronize()
            self.warmup.synchronize(make_hook, self.compression.overlap.last_scaler())

    def describe_call(self, what: str) -> str:
        """This rank's call ``what`` as the stall watch names it, with what the ranks must
        have alike: the call's number, the step count and phase, the trainable parameters and
        the first one's name (which of several optimizers, in a job with several)."""
        active = self._view.adam.active_parameters()
        # read only: this runs on the watch's thread, while the step waits
        kind = ("a warmup step" if self._schedule.phase != COMPRESSION else
                "a variance refresh step" if self._schedule.refresh_next() else
                "a compressed step")
        since_reset = (f" ({self._calls} since its collectives were last reset)"
                       if self._resets else "")
        first = f", the first {self._view.name_of(active[0])}" if active else ""
        return (f"rank {self._engine.rank}: {what} (after {self._calls_built} step() calls since "
                f"the optimizer was built{since_reset}, step count {self._schedule.steps}: {kind}, "
                f"{len(active)} trainable parameters of {sum(p.numel() for p in active):,} "
                f"elements{first})")

    def watching(self, what: str):
        """A context in which a call that does not return is told (:mod:`hvd_onebit.stall`)."""
        return self._watch.watching(lambda: self.describe_call(what))

    def watch_begin(self, what: str) -> object:
        """Watch an operation outside step() until :meth:`watch_end` (:mod:`hvd_onebit.stall`)."""
        return self._watch.begin(lambda: self.describe_call(what))

    def watch_end(self, token: object) -> None:
        self._watch.end(token)

    def step(self, closure: Optional[Callable[[], float]], grad_scaler, unscale: Callable,
             make_hook: Callable):
        """One optimizer step; ``grad_scaler`` (passed by GradScaler.step()) or None, with
        ``unscale`` its ``unscale_`` of this optimizer. The closure runs first, as torch's Adam
        runs it before its update: its backward is the step's, its gradients averaged (or
        compressed) as any backward's (Horovod's optimizer would run it after averaging and
        step on its local gradients, parting the ranks). Returns the closure's loss."""
        loss = closure_loss(closure)
        if self._engine.world == 1:
            self._step(grad_scaler, unscale, make_hook)
        else:
            with self.watching("optimizer.step()"):
                self._step(grad_scaler, unscale, make_hook)
        return loss

    def _step(self, grad_scaler, unscale: Callable, make_hook: Callable) -> None:
        try:
            check_scale_attributes(self._view.adam, grad_scaler)
            self._view.adam.check_state(self._engine.state)
            check_no_amsgrad(self._view.adam.param_groups, " (set on a param group after the "
                             "optimizer was built; set it back to False)")
            self._check_trainable()
        except Exception:
            self._engine.abandon_early()
            self.compression.overlap.end_step()
            raise
        scaler = view_of(grad_scaler, self._view.adam.optimizer_id, unscale)
        if not self.compressed_next():
            self.compression.overlap.remember_scaler(grad_scaler)
            kind = self.refresh if self.compressing() else self.warmup
            take(kind, self.warmup, self._telemetry, make_hook, scaler, self, self._schedule)
        else:
            self._compressed_step(grad_scaler, scaler)
        self._calls += 1
        self._calls_built += 1
        every = self._config.check_every
        if every and self._engine.world > 1 and self._calls % every == 0:
            self._check_identical(self._schedule.steps)

    def _compressed_step(self, grad_scaler, scaler: Optional[ScalerView]) -> None:
        """A compressed step, with the scaler's prologue (unscale) and epilogue (a skipped
        step is an inf to every rank's scaler). The hooks of the next step assume this step's
        scaler; whether this step's hooks assumed the right one is checked."""
        overlap = self.compression.overlap
        if scaler is not None:
            overlap.remember_scaler(grad_scaler)
            scaler.unscale()
        early = overlap.current
        overlap.remember_scaler(grad_scaler)
        # Unscaling in place leaves no trace on the gradients' version counters: what the
        # hooks assumed about the scaler is checked instead.
        try:  # taken, skipped or refused: the next backward starts afresh
            taken = self.compression.step(
                changed=early is not None and early.scaler is not grad_scaler)
            if not taken and scaler is not None:
                scaler.skipped()
        finally:
            self.compression.end_step()
