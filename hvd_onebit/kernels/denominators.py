"""Adam's denominators from a variance, and a variance refresh's moments with its ratio of old
to new denominators.

A refresh (:mod:`hvd_onebit.engine.refresh`) updates the momentum and the variance from the
averaged gradient and carries the preconditioned error feedback from the old denominators into
the new ones. :func:`refresh_moments` does it for one parameter's piece in one pass (the old
denominator, both moments, the ratio); :func:`denominators` and :func:`divide_by_denominators`
are its two ends, for a piece whose moments change otherwise. Native (C++) on CPU tensors, the
torch twin elsewhere, with the same bits: the twin is the torch ops the native pass fuses
(``lerp_``, ``mul_``, ``addcmul_``, whose CPU kernels round as one FMA each where the native
pass does), a correctly rounded root and division, and one float32 ``1 / sqrt_bc2`` per
piece.
"""
from __future__ import annotations

from typing import Optional

import torch

from .backend import native_module, native_ready, pick
from .fused_reference import frozen_denominator

#: Elements per slice of the torch twin: bounds its temporaries (a float64 root among them).
TWIN_SLICE = 1 << 18


def denominators(v: torch.Tensor, out: torch.Tensor, sqrt_bc2: float, eps: float,
                 backend: str = "auto") -> torch.Tensor:
    """``out = sqrt(v) * (1 / sqrt_bc2) + eps``, ``+inf`` where ``v == 0`` (an element held
    fixed; ``1 / sqrt_bc2``: :func:`~hvd_onebit.kernels.fused_reference.inverse_root_bc2`).

    Args:
        v: float32 [numel], contiguous: the variance (exp_avg_sq).
        out: float32 [numel], contiguous, not overlapping ``v``.
        sqrt_bc2: ``sqrt(1 - beta2^t)``, the variance's bias correction.
        eps: Adam's eps.
    Returns:
        ``out``.
    """
    return _run(v, out, sqrt_bc2, eps, False, backend)


def divide_by_denominators(ratio: torch.Tensor, v: torch.Tensor, sqrt_bc2: float, eps: float,
                           backend: str = "auto") -> torch.Tensor:
    """``ratio = ratio / (sqrt(v) * (1 / sqrt_bc2) + eps)`` in place, every non-finite quotient
    set to ``+0``: old denominators (from :func:`denominators`) over new ones, 0 where either is
    infinite. Arguments as :func:`denominators`'; returns ``ratio``."""
    return _run(v, ratio, sqrt_bc2, eps, True, backend)


def refresh_moments(m: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    ratio: Optional[torch.Tensor], beta1: float, weight: float,
                    sqrt_bc2_old: float, sqrt_bc2_new: float, eps: float,
                    backend: str = "auto") -> None:
    """One piece of a variance refresh, in place: ``ratio = d_old`` (when given), then
    ``m = m.lerp(g, 1 - beta1)`` and ``v = (1 - weight) * v + weight * g^2``, then
    ``ratio = d_old / d_new`` with every non-finite quotient ``+0`` (an element held before or
    after), ``d = sqrt(v) * (1 / sqrt_bc2) + eps`` before and after.

    Args:
        m, v, g: float32 [numel] (any shape of numel elements): the momentum, the variance and
            the averaged gradient of one parameter's piece.
        ratio: float32 [numel], not overlapping the others, or None (no denominators).
        beta1: Adam's first-moment decay.
        weight: the new ``g^2``'s weight in the variance (``1 - beta2^k`` for a gap of k steps).
        sqrt_bc2_old, sqrt_bc2_new: the variance's bias corrections' roots before and after.
        eps: Adam's eps.
    """
    if not (m.numel() == v.numel() == g.numel()) or (ratio is not None
                                                     and ratio.numel() != m.numel()):
        raise ValueError(f"m, v, g and ratio must have as many elements: {m.numel()}, "
                         f"{v.numel()}, {g.numel()}, {None if ratio is None else ratio.numel()}")
    if pick(backend, v.device, native=lambda: native_ready((m, v, g, ratio))) == "native":
        native_module().refresh_moments(m, v, g, ratio, float(beta1), float(weight),
                                        float(sqrt_bc2_old), float(sqrt_bc2_new), float(eps),
                                        True)
        return
    _refresh_twin(m, v, g, ratio, beta1, weight, sqrt_bc2_old, sqrt_bc2_new, eps)


def _refresh_twin(m: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  ratio: Optional[torch.Tensor], beta1: float, weight: float,
                  sqrt_bc2_old: float, sqrt_bc2_new: float, eps: float) -> None:
    """The torch reference of :func:`refresh_moments`: its passes one by one."""
    if ratio is not None:
        _twin(v, ratio, sqrt_bc2_old, eps, False)
    m.lerp_(g, 1 - beta1)
    v.mul_(1 - weight).addcmul_(g, g, value=weight)
    if ratio is not None:
        _twin(v, ratio, sqrt_bc2_new, eps, True)


def _run(v: torch.Tensor, out: torch.Tensor, sqrt_bc2: float, eps: float, divide: bool,
         backend: str) -> torch.Tensor:
    if v.numel() != out.numel():
        raise ValueError(f"out has {out.numel()} elements, v {v.numel()}")
    if pick(backend, v.device, native=lambda: native_ready((v, out))) == "native":
        native_module().denominators(v, out, float(sqrt_bc2), float(eps), divide, True)
        return out
    return _twin(v, out, sqrt_bc2, eps, divide)


def _twin(v: torch.Tensor, out: torch.Tensor, sqrt_bc2: float, eps: float,
          divide: bool) -> torch.Tensor:
    """The torch reference of the native pass, in slices of TWIN_SLICE elements."""
    flat_v, flat_out = v.reshape(-1), out.view(-1)
    for lo in range(0, flat_v.numel(), TWIN_SLICE):
        d = frozen_denominator(flat_v[lo:lo + TWIN_SLICE], sqrt_bc2, eps)
        target = flat_out[lo:lo + d.numel()]
        if divide:
            torch.nan_to_num_(target.div_(d), nan=0.0, posinf=0.0, neginf=0.0)
        else:
            target.copy_(d)
    return out
