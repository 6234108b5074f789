"""``torch.amp.GradScaler`` through ``step()``: every rank unscales, agrees on overflow, and
skips (or not) together; and the one place GradScaler's internals are read.

The optimizer sets ``_step_supports_amp_scaling``, so ``GradScaler.step()`` always calls its
step() and passes itself instead of skipping step() on the ranks that overflowed (which would
leave the others waiting in a collective). Around the step the scaler is a prologue and an
epilogue (:class:`ScalerView`):

* a full-precision step (the warmup's, a variance refresh step's): gradients are allreduced
  first, so the prologue's unscale and inf check see the averaged gradients, identical on every
  rank; the step is skipped where the scaler found an inf;
* a compressed step: the prologue unscales (the check is local), the allreduce's status word
  makes the skip decision common, and the epilogue marks a skipped step as an inf on every
  rank's scaler, so all scalers back off alike and their scales never drift apart.

GradScaler keeps no public API for what this needs (its record of an optimizer, its found-inf
flags, its scale): :class:`ScalerView` and :func:`inverse_scale` read them, nothing else does.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch


class ScalerView:
    """What one step needs of the GradScaler that called it, for one optimizer."""

    def __init__(self, scaler, optimizer_id: int, unscale: Callable[[], None]):
        self.scaler = scaler
        self._record = scaler._per_optimizer_states[optimizer_id]  # GradScaler's, of this optimizer
        self._unscale = unscale  # scaler.unscale_(optimizer)

    def unscale(self) -> None:
        """The prologue: unscale the gradients unless the script did (``scaler.unscale_``)."""
        from torch.amp.grad_scaler import OptState

        if self._record["stage"] is OptState.READY:
            self._unscale()

    def found_inf(self) -> bool | torch.Tensor:
        """Whether unscaling found an inf or NaN (on any device of this optimizer): with every
        flag on one device, a 0-dim tensor there, not read (on a GPU a read is a sync; a
        full-precision step reads it with the ranks' agreement); else a bool."""
        flags = list(self._record["found_inf_per_device"].values())
        if len({t.device for t in flags}) == 1:
            return torch.stack([t.reshape(()) for t in flags]).sum() > 0
        return bool(sum(float(t) for t in flags))

    def skipped(self) -> None:
        """The epilogue of a skipped step: the scaler sees an inf, so it backs off as every
        other rank's does."""
        for flag in self._record["found_inf_per_device"].values():
            flag.fill_(1.0)


# What GradScaler.step() sets on an optimizer whose step() shows no grad_scaler argument
SCALE_ATTRIBUTES = ("grad_scale", "found_inf")

SCALE_ATTRIBUTES_REFUSED = (
    "hvd_onebit: GradScaler.step() reached this optimizer's step() through a wrapper that hides "
    "its grad_scaler argument (Accelerate's fp16 wraps step(), for one), so GradScaler handed "
    "over its scale and this rank's own overflow flag as attributes (grad_scale, found_inf). "
    "Every rank must skip a compressed step together and back its scale off alike, which needs "
    "the scaler itself: call scaler.step(opt) on the optimizer hvd_onebit returned, or give the "
    "wrapper step()'s signature (functools.wraps(opt.step)); docs/ddp.md shows it for "
    "Accelerate. Nothing was stepped")


def check_scale_attributes(adam, grad_scaler) -> None:
    """Refuse a step that GradScaler drives through attributes on ``adam`` (a
    :class:`~hvd_onebit.optimizer_view.WrappedAdam`; see :data:`SCALE_ATTRIBUTES_REFUSED`),
    ``grad_scaler`` not given: it would skip or not by each rank's own gradients. The
    attributes go with the refusal, and quietly with ``grad_scaler`` given (GradScaler removes
    them only after a step that returns, and torch's Adam would take them for its own), so the
    next step through the optimizer's own step() is taken."""
    found = [name for name in SCALE_ATTRIBUTES if adam.attribute(name) is not None]
    for name in found:  # with grad_scaler given: left by a step whose closure raised
        adam.drop_attribute(name)
    if grad_scaler is None and found:
        raise RuntimeError(SCALE_ATTRIBUTES_REFUSED)


def has_scale(scaler) -> bool:
    """Whether ``scaler`` has scaled a loss yet (before that it has no scale to undo)."""
    return scaler._scale is not None


def inverse_scale(scaler) -> torch.Tensor:
    """The factor ``GradScaler.unscale_`` multiplies the gradients by, computed as it does."""
    return scaler._scale.double().reciprocal().float()


def unscaled(scaler, optimizer_id: int) -> bool:
    """Whether ``scaler`` (or None) has unscaled the optimizer's gradients since its last
    ``update()`` (``scaler.unscale_(optimizer)``)."""
    from torch.amp.grad_scaler import OptState

    record = None if scaler is None else scaler._per_optimizer_states.get(optimizer_id)
    return record is not None and record["stage"] is OptState.UNSCALED


def view_of(scaler, optimizer_id: int, unscale: Callable[[], None]) -> Optional[ScalerView]:
    """A :class:`ScalerView` of ``scaler``, or None without one."""
    return None if scaler is None else ScalerView(scaler, optimizer_id, unscale)
