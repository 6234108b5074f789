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

The sums are taken on the exactly averaged gradient and the variance, which are the same bits
on every rank, so every rank decides alike without a collective; they are read back in one
device-to-host transfer per refresh. Temporaries: :data:`CHUNK` elements at a time.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch

CHUNK = 1 << 20  # elements per temporary: bounds the gate's memory whatever the bucket size


def root_sums(v: torch.Tensor, g: torch.Tensor, weight: float) -> torch.Tensor:
    """float64 [2]: over the elements where ``v > 0``, ``sum(sqrt(v))`` and
    ``sum(sqrt((1 - weight) * v + weight * g^2))``, the variance's roots before and after a
    refresh of this ``weight`` (``v``, ``g``: one parameter's piece, same shape)."""
    v, g = v.reshape(-1), g.reshape(-1)
    out = torch.zeros(2, dtype=torch.float64, device=v.device)
    for lo in range(0, v.numel(), CHUNK):
        vc, gc = v[lo:lo + CHUNK], g[lo:lo + CHUNK]
        new = (vc * (1 - weight)).addcmul_(gc, gc, value=weight).sqrt_()
        out[0] += vc.sqrt().sum(dtype=torch.float64)  # a held element's root is 0 already
        out[1] += new.masked_fill_(vc == 0, 0).sum(dtype=torch.float64)
    return out


def declined(sums: Mapping[torch.Tensor, torch.Tensor],
             sqrt_bc2_old: Mapping[torch.Tensor, float],
             sqrt_bc2_new: Mapping[torch.Tensor, float]) -> list[torch.Tensor]:
    """The parameters whose refresh would raise their mean denominator: ``sums[p]`` from
    :func:`root_sums` (added over ``p``'s pieces), the bias corrections' roots before and after.
    One read of every sum to the host."""
    keys = list(sums)
    if not keys:
        return []
    values = torch.stack([sums[p] for p in keys]).tolist()
    return [p for p, (old, new) in zip(keys, values)
            if new / sqrt_bc2_new[p] > old / sqrt_bc2_old[p]]


def seed_held(v: torch.Tensor, g: torch.Tensor, weight: float) -> None:
    """In place: the held elements of ``v`` (exactly 0) take ``weight * g^2``, the rest stay."""
    v, g = v.reshape(-1), g.reshape(-1)
    for lo in range(0, v.numel(), CHUNK):
        vc, gc = v[lo:lo + CHUNK], g[lo:lo + CHUNK]
        vc.addcmul_(gc * (vc == 0), gc, value=weight)


def pieces_by_parameter(buckets: Iterable, state: Mapping, grads: Mapping) -> dict:
    """Per parameter with a gradient: its (variance, gradient) pieces over the buckets."""
    out: dict = {}
    for b in buckets:
        for i, seg in enumerate(b.segments):
            g = grads.get(seg.param)
            if g is not None:
                out.setdefault(seg.param, []).append(
                    (b.piece(i, state[seg.param]["exp_avg_sq"]), b.piece(i, g)))
    return out
