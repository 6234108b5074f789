"""Starting buckets during backward (``overlap=True``): the compression phase's speculation.

In the compression phase no gradient is communicated; on the step's last backward pass each
gradient completes its bucket's momentum, and a bucket whose gradients are all final starts its
compression and stage 1 from the gradient hook, while backward goes on. Buckets start in one
order on every rank (ordered transports need it), planned from the last parameter.

A start is a speculation on the gradients staying as backward made them. What each start read
is recorded (:class:`EarlyStarts`); ``step()`` compares (:meth:`Overlap.stale`), and a stale
step starts every bucket again on every rank (see :class:`~hvd_onebit.engine.
CompressedStep`), after which this rank stops starting early, unless the gradients were
zeroed in between (a batch skipped after its backward, :meth:`Overlap.gradients_zeroed`) or a
backward pass more accumulated onto them (:meth:`Overlap.pass_again`). A
GradScaler used in the last step is assumed in this one: the hooks unscale as
``GradScaler.unscale_`` does, because unscaling in place leaves no trace on the gradients'
version counters.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Callable, Optional

import torch

from .engine import CompressedStep
from .config import OneBitConfig
from .optimizer_view import OptimizerView
from .param_groups import groups_by_param
from .phases.amp import has_scale, inverse_scale

GRADIENT_IN_PARTS = (
    "hvd_onebit: a parameter's gradient was completed more than once with no forward between "
    "(activation checkpointing with use_reentrant=True over a parameter used in several "
    "checkpointed segments, or two backward calls after one forward each), so the buckets "
    "cannot start before the last backward ends: from now on this rank starts them in step() "
    "(overlap off; the steps are the same). use_reentrant=False keeps the overlap; overlap=False "
    "silences this.")


class EarlyStarts:
    """One step's bookkeeping of the buckets started from gradient hooks. What each start read
    is kept per parameter in flat lists by its place among the bucketed parameters: a few
    objects a step, not a few per parameter (on a model of thousands of tensors each would be
    one more object for the garbage collector to go over, again and again)."""

    def __init__(self, groups: dict, engine: CompressedStep, scaler=None):
        self.groups = groups  # parameter -> its param group
        self.scaler = scaler  # the GradScaler the gradients are assumed scaled by, or None
        # GradScaler.unscale_'s own factor
        self.inv_scale = None if scaler is None else inverse_scale(scaler)
        self.params = engine.params  # the bucketed parameters, by place
        self.order = engine.start_order  # their places in the order their buckets start
        self.position = engine.positions  # parameter -> the buckets holding a part of it
        self.index = engine.indices  # parameter -> its place among the bucketed ones
        self.missing = [len(b.params) for b in engine.buckets]  # gradients not final yet
        n = len(self.params)  # a parameter a group lists twice has two places
        # By place: whether its bucket started, and what the start read of it: its gradient
        # tensor (identity and in-place version) and its own version and memory (Adam's L2
        # decay reads it; ``p.data = ...`` moves no version)
        self.started = bytearray(n)
        self.grads: list = [None] * n
        self.grad_versions: list = [None] * n
        self.param_versions = [0] * n
        self.param_memory = [0] * n
        # param group id -> (the group, the options each start that read it saw, options_of)
        self.options: dict[int, tuple[dict, list]] = {}
        # Gradients in one storage (views of DDP's buckets with gradient_as_bucket_view, the
        # pieces of a concatenation's gradient) share its version counter: each gradient
        # accumulated into it moves the counter by one. The gradients made final in each
        # storage, each parameter counted once a step (a pass more is a change), and the count
        # when each start read its own.
        self.accumulated: dict = {}  # storage -> gradients made final in it
        self.counted = bytearray(n)  # by place: whether its gradient accumulated is counted
        self.counted_others: set = set()  # the same for parameters not bucketed
        self.seen = [0] * n  # by place: accumulated of its storage when its bucket started
        self.failed = False  # a start raised: the rest start in step()
        self.zeroed = False  # zero_grad() since the starts: a skipped batch's, not a pattern
        self.accumulating = False  # a backward pass more accumulates onto the started gradients

    @property
    def any_started(self) -> bool:
        return any(self.started)

    def started_places(self) -> list[int]:
        """The places of the parameters whose buckets started, in the order of their first
        start."""
        started = self.started
        return [i for i in self.order if started[i]]

    def unstarted(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Those of ``params`` (the bucketed parameters now) whose buckets did not start."""
        if params is self.params:  # the layout the starts were made in: by place
            return [p for p, started in zip(params, self.started) if not started]
        started = {self.params[i] for i in self.started_places()}
        return [p for p in params if p not in started]

    def count(self, p: torch.Tensor, i: Optional[int]) -> bool:
        """Whether p's gradient (at place ``i``, None: not bucketed) is to be counted as
        accumulated into its storage: once a step."""
        if i is None:
            if p in self.counted_others:
                return False
            self.counted_others.add(p)
            return True
        if self.counted[i]:
            return False
        self.counted[i] = 1
        return True

    def record(self, params: list[torch.Tensor]) -> None:
        """What the start of a bucket of ``params`` reads: each gradient (identity, version),
        each parameter's version, and their groups' options (:func:`options_of`)."""
        options: dict = {}  # group id -> its options now: once per group and start
        for q in params:
            i, g, group = self.index[q], q.grad, self.groups[q]
            self.started[i] = 1
            self.grads[i] = g
            self.grad_versions[i] = None if g is None else g._version
            self.param_versions[i] = q._version
            self.param_memory[i] = q.data_ptr()
            self.seen[i] = self.accumulated.get(storage_of(g), 0)
            key = id(group)
            if key not in options:
                now = options[key] = options_of(group)
                kept = self.options.setdefault(key, (group, []))[1]
                if now not in kept:
                    kept.append(now)


# What changed, in words: a gradient's version, a parameter's, then each of options_of's fields.
CHANGES = ("a gradient changed in place (e.g. clipped or unscaled)",
           "a parameter changed in place (or given other memory: p.data = ...)",
           "beta1 changed (e.g. a scheduler that sets betas, such as OneCycleLR, stepped)",
           "weight_decay changed", "maximize changed",
           "beta2 changed (the preconditioned input reads its bias correction and bound)",
           "eps changed (the preconditioned input's denominator reads it)",
           "decoupled_weight_decay changed (Adam's L2 decay goes into the gradient, AdamW's not)")


# What changed when the gradients were zeroed at two steps in a row (see Overlap.skipped).
ZEROED = ("zero_grad() was called between backward and step() at two steps in a row (or another "
          "optimizer's backward, a GAN's generator's through this discriminator, made these "
          "gradients: set requires_grad=False on this model's parameters for that backward)")


def options_of(group: dict) -> tuple:
    """The options a bucket's input is computed from, in :data:`CHANGES`' order: beta1,
    weight_decay, maximize, beta2 and eps (the preconditioned input's denominator and
    bound), decoupled_weight_decay (where the group has it)."""
    beta1, beta2 = group["betas"]
    return (_option(beta1), _option(group["weight_decay"]), bool(group.get("maximize")),
            _option(beta2), _option(group["eps"]), group.get("decoupled_weight_decay"))


def storage_of(g: Optional[torch.Tensor]) -> Optional[int]:
    """The storage ``g`` lives in (its views share one version counter), by where it starts in
    memory, or None (no gradient, or a sparse one: Horovod's sparse_as_dense densifies it).
    Computed from ``g``'s own data pointer and offset: ``g.untyped_storage()`` would make a
    Python object that lives as long as the storage, one more per gradient and step."""
    if g is None or g.layout is not torch.strided:
        return None
    if g.numel() == 0:  # its data pointer is 0, whatever storage it is a view of
        return g.untyped_storage().data_ptr()
    return g.data_ptr() - g.storage_offset() * g.element_size()


def _option(value):
    """An option as options_of compares it: a number, or a tensor with its in-place version (one
    changed in place, ``betas[1].fill_(...)``, is another value)."""
    return (value, value._version) if isinstance(value, torch.Tensor) else value


class Overlap:
    """The early starts of one optimizer, step after step."""

    def __init__(self, view: OptimizerView, config: OneBitConfig, engine: CompressedStep,
                 local_grad: Callable):
        self._view = view
        self._enabled = config.overlap
        self._engine = engine
        self._local_grad = local_grad  # (p, group, inv_scale) -> the gradient the engine takes
        self._decided = False  # whether this step's early starts were set up (or refused)
        self.current: Optional[EarlyStarts] = None  # this step's, if buckets start early
        self.off_reason: Optional[str] = None  # why this rank stopped starting buckets early
        self.skips_in_a_row = 0  # steps in a row whose early starts zero_grad() made stale
        self._scaler_ref = None  # weakref to the GradScaler of the last step, if one was used

    def remember_scaler(self, scaler) -> None:
        """The GradScaler of this step (None: none), assumed by the next step's hooks."""
        self._scaler_ref = None if scaler is None else weakref.ref(scaler)

    def last_scaler(self):
        """The GradScaler remembered (:meth:`remember_scaler`), or None."""
        return None if self._scaler_ref is None else self._scaler_ref()

    def turn_off(self, reason: str) -> None:
        self.off_reason = reason

    def gradient_in_parts(self) -> None:
        """A parameter's gradient was completed again in the same backward pass (its hook ran
        twice with no forward between): activation checkpointing with ``use_reentrant=True``
        runs a backward per checkpointed segment, and a parameter used in several segments
        takes its gradient in parts. Starting its bucket at the first part reads a partial
        gradient: step() finds it stale and starts every bucket again, as for any change (the
        same bits). From then on this rank starts the buckets in step(), with one warning."""
        if self.off_reason is None:
            self.turn_off("a gradient completed in parts within one backward")
            warnings.warn(GRADIENT_IN_PARTS)

    def end_step(self) -> None:
        """The step is over: the next one decides afresh."""
        self._decided = False
        self.current = None

    def _set_up(self) -> Optional[EarlyStarts]:
        """At the step's first ready gradient: whether buckets start early this time (overlap
        on, and the buckets up to date: step() rebuilds them otherwise)."""
        self._decided = True
        engine, active = self._engine, self._view.adam.active_parameters()
        if not (self._enabled and self.off_reason is None and engine.up_to_date(active)):
            return None
        engine.ensure_ready(active, checked=True)
        if not engine.can_start_early:
            return None
        engine.begin_step()
        groups = groups_by_param(self._view.adam.param_groups)
        scaler = self._scaler_ref() if self._scaler_ref is not None else None
        if scaler is not None and not has_scale(scaler):
            scaler = None
        self.current = EarlyStarts(groups, engine, scaler)
        return self.current

    def gradient_ready(self, p: torch.Tensor) -> None:
        """p's gradient is final for this step: start every bucket, in order, whose gradients
        are all final. What each start read is recorded, so step() can tell if it changed."""
        early = self.current if self._decided else self._set_up()
        if early is None:
            return
        i = early.index.get(p)
        storage = storage_of(p.grad)
        if storage is not None and early.count(p, i):
            early.accumulated[storage] = early.accumulated.get(storage, 0) + 1
        if early.failed or i is None:
            return
        if early.started[i]:  # its bucket started from an earlier backward: that batch was
            # skipped, however its gradients were zeroed (model.zero_grad()), unless this pass
            # accumulates onto them
            early.zeroed = early.zeroed or not early.accumulating
            return
        engine = self._engine
        for k in early.position[p]:
            early.missing[k] -= 1
        try:
            while (engine.next_to_start < len(early.missing)
                   and early.missing[engine.next_to_start] == 0):
                params = engine.bucket_params(engine.next_to_start)
                grads = {q: self._local_grad(q, early.groups[q], early.inv_scale)
                         for q in params}
                early.record(params)
                engine.start_bucket(self._view.adam.param_groups, grads)
        except Exception:
            # e.g. a sparse gradient: step() computes the rest and raises the error itself, on
            # every rank, after waiting out what started
            early.failed = True

    def gradients_zeroed(self) -> None:
        """zero_grad() between backward and step(): the batch is skipped. What started early
        is then stale, and the next step starts it again, as for any change; unlike a change
        the script makes every step (a clip), an occasional skip is no reason to stop starting
        early (:meth:`skipped`). Where nothing started yet, the step's bookkeeping starts
        afresh (nothing is in flight)."""
        if self.current is not None and self.current.any_started:
            self.current.zeroed = True
        elif self._decided:
            self.end_step()

    def pass_again(self) -> None:
        """A training forward of a pass more than the step before had (DDP's sync on in each
        pass, no ``no_sync()``; called from the forward, so before its backward, if any):
        where nothing the started buckets read has changed since (their gradients not zeroed
        in place), its backward accumulates onto their gradients, and the step starts them
        again quietly, as a step with another count of passes, not as a batch skipped."""
        early = self.current
        if early is not None and early.any_started and not early.zeroed and self.stale() is None:
            early.accumulating = True

    def skipped(self, zeroed: bool) -> bool:
        """At a step: whether its early starts were a skipped batch's (``zeroed``), counting
        such steps in a row. A second in a row is a script that zeroes the gradients between
        backward and step() every time; that is a change like any other (False)."""
        self.skips_in_a_row = self.skips_in_a_row + 1 if zeroed else 0
        return zeroed and self.skips_in_a_row < 2

    def stale(self) -> Optional[str]:
        """What a bucket started early read that has changed since, in words (gradients
        clipped or unscaled in place, replaced, options changed): then it is started again.
        None: nothing changed."""
        early = self.current
        if early is None:
            return None
        options = {}  # group id -> what changed in its options since a start read them, or None
        for key, (group, kept) in early.options.items():
            now = options_of(group)
            options[key] = next((w for then in kept for w, a, b in zip(CHANGES[2:], now, then)
                                 if a != b), None)
        for i in early.started_places():
            q = early.params[i]
            g = q.grad
            if g is not early.grads[i]:
                what = "a gradient was replaced"
            elif g is not None and g._version != early.grad_versions[i] + (
                    early.accumulated.get(storage_of(g), 0) - early.seen[i]):
                what = CHANGES[0]  # beyond the others' accumulation into its storage since
            elif q._version != early.param_versions[i] or q.data_ptr() != early.param_memory[i]:
                what = CHANGES[1]
            else:
                what = options[id(early.groups[q])]
            if what is not None:
                return ZEROED if early.zeroed else what
        return None
