"""``torch.amp.GradScaler`` through ``step()``: every rank unscales, agrees on overflow, and
skips (or not) together.

The optimizer sets ``_step_supports_amp_scaling``, so ``GradScaler.step()`` always calls its
step() and passes itself instead of skipping step() on the ranks that overflowed (which would
leave the others waiting in a collective).

Warmup (and a variance refresh step, which travels as the warmup does): gradients are
allreduced first, so the inf check sees the averaged gradients, identical on every rank. Compression: the check is local, the allreduce's status word makes the skip
decision common, and a skipped step marks every rank's scaler as having seen an inf, so all
scalers back off alike and their scales never drift apart.
"""
from __future__ import annotations

from typing import Callable, Optional

from ..state.telemetry import Telemetry
from .compression import CompressionPhase
from .warmup import Warmup, closure_loss


def amp_step(scaler, per_opt: dict, unscale: Callable[[], None], compressing: bool,
             warmup: Warmup, compression: CompressionPhase, telemetry: Telemetry,
             closure: Optional[Callable[[], float]], make_hook: Callable):
    """One step under ``scaler``, the GradScaler that called step(); ``per_opt``: its record of
    this optimizer; ``unscale``: ``scaler.unscale_`` of this optimizer; ``warmup``: the
    full-precision step (the warmup's, or a refresh step's ``RefreshPhase``, which offers the
    same methods), taken when ``compressing`` is False. Returns the loss."""
    from torch.amp.grad_scaler import OptState

    compression.overlap.remember_scaler(scaler)
    if not compressing:
        warmup.wait_seconds = 0.0
        warmup.synchronize_for_step(make_hook)
        if per_opt["stage"] is OptState.READY:
            unscale()
        if sum(float(t) for t in per_opt["found_inf_per_device"].values()):
            telemetry.skipped_steps += 1
            loss = None
        else:
            loss = warmup.adam_step(closure)
        warmup.account()
        return loss
    if per_opt["stage"] is OptState.READY:
        unscale()
    loss = closure_loss(closure)
    # Unscaling in place leaves no trace on the gradients' version counters: what the hooks
    # assumed about the scaler is checked instead.
    early = compression.overlap.current
    if not compression.step(changed=early is not None and early.scaler is not scaler):
        for flag in per_opt["found_inf_per_device"].values():
            flag.fill_(1.0)
    compression.end_step()
    return loss
