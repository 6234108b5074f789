"""Which parameters a refresh updates, with ``variance_refresh={"accept": "lowering"}``.

A refresh moves the variance towards Adam's. Where the gradients fade after the freeze that
lowers the denominators, and the steps grow back to Adam's length. Where they grow, it raises
them: the steps shrink from the frozen variance's (often clamped at Adam's own step bound) to
Adam's. On a zoo of model families the first kind is where a refresh pays and the second is
where a frozen variance beats Adam and a refresh loses that gain (README, Results).

``"lowering"`` keeps a parameter's variance update only where it lowers the parameter's mean
denominator over its trained elements, ``mean(sqrt(v) / sqrt(bc2))`` over ``v > 0``; otherwise
the parameter's variance and its bias-correction count stay as they were (the momentum is
updated from the exact average either way). One decision per parameter, not per element: a
per-element minimum would follow every low sample of ``g^2`` down and lengthen the steps of
elements whose gradient is pure noise. Elements with a zero variance (held) take their first
variance from the refresh even when their parameter declines it, so they still leave the held
set at the first refresh that sees their gradient.

``"hypergradient"`` reverses that choice for a parameter whose last step overshot: where the new
gradient opposes the momentum's step ``u = m / d``, ``sum(g * u)`` below :data:`OVERSHOOT_Z`
standard errors of no alignment, only an update that raises the mean denominator is taken.

The sums (:func:`~hvd_onebit.kernels.gate_sums`, one pass per piece) are taken on the exactly
averaged gradient and the variance, which are the same bits on every rank, in an order that is
the same on every rank, so every rank decides alike without a collective; they are read back in
one device-to-host transfer per refresh.
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping

import torch

# "hypergradient": an overshoot counts only where sum(g u) < -OVERSHOOT_Z * sqrt(sum((g u)^2)),
# i.e. the gradient's anti-alignment with the step is this many standard errors from none
OVERSHOOT_Z = 5.0


def declined(sums: Mapping[torch.Tensor, torch.Tensor],
             sqrt_bc2_old: Mapping[torch.Tensor, float],
             sqrt_bc2_new: Mapping[torch.Tensor, float]) -> list[torch.Tensor]:
    """The parameters whose refresh would move their mean denominator the wrong way:
    ``sums[p]`` from :func:`~hvd_onebit.kernels.gate_sums` (added over ``p``'s pieces), the
    bias corrections' roots before and after. With two sums ("lowering") every rise is wrong; with four
    ("hypergradient") a rise is wrong unless the last step overshot (``sum(g u)`` below
    ``-OVERSHOOT_Z`` times the root of ``sum((g u)^2)``), and then a fall is wrong instead.
    One read of every sum to the host."""
    keys = list(sums)
    if not keys:
        return []
    values = torch.stack([sums[p] for p in keys]).tolist()
    out = []
    for p, (old, new, *along) in zip(keys, values):
        rises = new / sqrt_bc2_new[p] > old / sqrt_bc2_old[p]
        overshot = bool(along) and along[0] < -OVERSHOOT_Z * math.sqrt(along[1])
        if rises != overshot:
            out.append(p)
    return out


def pieces_by_parameter(buckets: Iterable, state: Mapping, grads: Mapping,
                        momentum: bool = False) -> dict:
    """Per parameter with a gradient: its (variance, gradient) pieces over the buckets, or
    (variance, gradient, momentum) given ``momentum``."""
    out: dict = {}
    for b in buckets:
        for i, seg in enumerate(b.segments):
            g = grads.get(seg.param)
            if g is not None:
                st = state[seg.param]
                piece = (b.piece(i, st["exp_avg_sq"]), b.piece(i, g))
                if momentum:
                    piece += (b.piece(i, st["exp_avg"]),)
                out.setdefault(seg.param, []).append(piece)
    return out
