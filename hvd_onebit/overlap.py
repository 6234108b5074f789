"""Starting buckets during backward (``overlap=True``): the compression phase's speculation.

In the compression phase no gradient is communicated; on the step's last backward pass each
gradient completes its bucket's momentum, and a bucket whose gradients are all final starts its
compression and stage 1 from the gradient hook, while backward goes on. Buckets start in one
order on every rank (ordered transports need it), planned from the last parameter.

A start is a speculation on the gradients staying as backward made them. What each start read
is recorded (:class:`EarlyStarts`); ``step()`` compares (:meth:`Overlap.stale`), and a stale
step starts every bucket again on every rank (see :class:`~hvd_onebit.engine.
CompressedStep`), after which this rank stops starting early, unless the gradients were
zeroed in between (a batch skipped after its backward, :meth:`Overlap.gradients_zeroed`). A
GradScaler used in the last step is assumed in this one: the hooks unscale as
``GradScaler.unscale_`` does, because unscaling in place leaves no trace on the gradients'
version counters.
"""
from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch

from .engine import CompressedStep
from .config import OneBitConfig
from .optimizer_view import OptimizerView
from .param_groups import groups_by_param
from .phases.amp import has_scale, inverse_scale


class EarlyStarts:
    """One step's bookkeeping of the buckets started from gradient hooks."""

    def __init__(self, groups: dict, engine: CompressedStep, scaler=None):
        self.groups = groups  # parameter -> its param group
        self.scaler = scaler  # the GradScaler the gradients are assumed scaled by, or None
        # GradScaler.unscale_'s own factor
        self.inv_scale = None if scaler is None else inverse_scale(scaler)
        self.position: dict = {}  # parameter -> the buckets holding a part of it
        for i, b in enumerate(engine.buckets):
            for p in b.params:
                self.position.setdefault(p, []).append(i)
        self.missing = [len(b.params) for b in engine.buckets]  # gradients not final yet
        self.read: dict = {}  # parameter -> what its bucket's start read (inputs_of)
        # Gradients in one storage (views of DDP's buckets with gradient_as_bucket_view, the
        # pieces of a concatenation's gradient) share its version counter: each gradient
        # accumulated into it moves the counter by one. The gradients made final in each
        # storage, each parameter counted once a step (a pass more is a change), and the count
        # when each start read its own.
        self.accumulated: dict = {}  # storage -> gradients made final in it
        self.counted: set = set()  # parameters whose gradient accumulated is counted
        self.seen: dict = {}  # parameter -> accumulated of its storage when its bucket started
        self.failed = False  # a start raised: the rest start in step()
        self.zeroed = False  # zero_grad() since the starts: a skipped batch's, not a pattern


# What changed, in words, for each field of inputs_of after the gradient tensor's identity.
CHANGES = ("a gradient changed in place (e.g. clipped or unscaled)",
           "a parameter changed in place",
           "beta1 changed (e.g. a scheduler that sets betas, such as OneCycleLR, stepped)",
           "weight_decay changed", "maximize changed",
           "beta2 changed (the preconditioned input reads its bias correction and bound)",
           "eps changed (the preconditioned input's denominator reads it)")


# What changed when the gradients were zeroed at two steps in a row (see Overlap.skipped).
ZEROED = "zero_grad() was called between backward and step() at two steps in a row"


def inputs_of(p: torch.Tensor, group: dict) -> tuple:
    """What p's part of its bucket's input is computed from: its gradient tensor (identity and
    in-place version), its own version (Adam's L2 decay reads it) and the options (beta2 and
    eps: the preconditioned input's denominator and bound)."""
    g = p.grad
    beta1, beta2 = group["betas"]
    return (g, None if g is None else g._version, p._version, _option(beta1),
            _option(group["weight_decay"]), bool(group.get("maximize")), _option(beta2),
            _option(group["eps"]))


def storage_of(g: Optional[torch.Tensor]) -> Optional[int]:
    """The storage ``g`` lives in (its views share one version counter), or None (no gradient,
    or a sparse one: Horovod's sparse_as_dense densifies it)."""
    return None if g is None or g.layout is not torch.strided else g.untyped_storage().data_ptr()


def _option(value):
    """An option as inputs_of compares it: a number, or a tensor with its in-place version (one
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
        engine.ensure_ready(active)
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
        storage = storage_of(p.grad)
        if storage is not None and p not in early.counted:
            early.counted.add(p)
            early.accumulated[storage] = early.accumulated.get(storage, 0) + 1
        if early.failed or p not in early.position:
            return
        if p in early.read:  # its bucket started from an earlier backward: that batch was
            early.zeroed = True  # skipped, however its gradients were zeroed (model.zero_grad())
            return
        engine = self._engine
        for i in early.position[p]:
            early.missing[i] -= 1
        try:
            while (engine.next_to_start < len(early.missing)
                   and early.missing[engine.next_to_start] == 0):
                params = engine.bucket_params(engine.next_to_start)
                grads = {q: self._local_grad(q, early.groups[q], early.inv_scale)
                         for q in params}
                for q in params:
                    early.read[q] = inputs_of(q, early.groups[q])
                    early.seen[q] = early.accumulated.get(storage_of(q.grad), 0)
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
        if self.current is not None and self.current.read:
            self.current.zeroed = True
        elif self._decided:
            self.end_step()

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
        for q, then in early.read.items():
            now = inputs_of(q, early.groups[q])
            if now[0] is then[0]:  # the others' accumulation into its storage since then
                later = early.accumulated.get(storage_of(q.grad), 0) - early.seen[q]
                then = (then[0], then[1] + later, *then[2:])
            what = ("a gradient was replaced" if now[0] is not then[0] else
                    next((w for w, a, b in zip(CHANGES, now[1:], then[1:]) if a != b), None))
            if what is not None:
                return ZEROED if early.zeroed else what
        return None
