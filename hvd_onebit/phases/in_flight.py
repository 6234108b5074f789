"""What a script did to the warmup's gradients while Horovod was averaging them.

In the warmup Horovod's hooks start each gradient's allreduce during backward, on the gradient
tensor itself, and ``synchronize()`` waits for them. A script that changes a gradient in between
(``clip_grad_norm_``, or ``scaler.unscale_(opt)``, before ``opt.synchronize()``) races that
allreduce: each gradient comes back averaged from before or after the change, a different mix on
each rank, and the ranks part silently (Horovod's own optimizer races alike; its recipe
synchronizes first). :class:`InFlight` notices such a race, so that the step refuses it on every
rank instead (:func:`~hvd_onebit.phases.full_precision.take`).

Clipping leaves a trace on the gradients' version counters; a GradScaler's unscale does not, so
it is read from the scaler's own record of the optimizer (:func:`~hvd_onebit.phases.amp.unscaled`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class Started:
    """A gradient as its allreduce started: the tensor Horovod reads and its in-place version."""

    grad: torch.Tensor
    version: int


class InFlight:
    """The gradients whose allreduce a hook started, until the step synchronizes."""

    def __init__(self, name_of: Callable[[torch.Tensor], str]):
        self._name_of = name_of
        self._started: dict[torch.Tensor, Started] = {}

    def started(self, p: torch.Tensor) -> None:
        """A hook started the allreduce of ``p``'s gradient, as it is now."""
        if p.grad is not None:
            self._started[p] = Started(p.grad, p.grad._version)

    def race(self, unscaled: bool, handles: dict) -> Optional[str]:
        """Before the allreduces are waited for: what the script did to the gradients in flight
        (None: nothing), ``unscaled`` whether a GradScaler has unscaled them already,
        ``handles`` Horovod's (a gradient is in flight while its handle is there). Forgets them:
        the next step's hooks start afresh."""
        started, self._started = self._started, {}
        started = {p: s for p, s in started.items() if handles.get(p, (None,))[0] is not None}
        if not started:
            return None
        if unscaled:
            return "scaler.unscale_(optimizer) before optimizer.synchronize()"
        changed = [self._name_of(p) for p, s in started.items()
                   if p.grad is not s.grad or p.grad._version != s.version]
        if not changed:
            return None
        more = f" and {len(changed) - 1} more" if len(changed) > 1 else ""
        return (f"the gradient of {changed[0]!r}{more} changed in place (clipped?) or replaced "
                "before optimizer.synchronize()")
