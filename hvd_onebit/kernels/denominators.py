"""Adam's denominators from a variance, and a variance refresh's ratio of old to new ones.

A refresh (:mod:`hvd_onebit.engine.refresh`) carries the preconditioned error feedback from the
old denominators into the new ones: one pass writes the old denominators, the variance is
updated, a second pass divides them by the new ones. Native (C++) on CPU tensors, the torch twin
elsewhere; both correctly rounded (fp32 sqrt and division), so the same bits.
"""
from __future__ import annotations

import torch

from .backend import native_module, native_ready, pick
from .fused_reference import frozen_denominator

#: Elements per slice of the torch twin: bounds its temporaries (a float64 root among them).
TWIN_SLICE = 1 << 18


def denominators(v: torch.Tensor, out: torch.Tensor, sqrt_bc2: float, eps: float,
                 backend: str = "auto") -> torch.Tensor:
    """``out = sqrt(v) / sqrt_bc2 + eps``, ``+inf`` where ``v == 0`` (an element held fixed).

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
    """``ratio = ratio / (sqrt(v) / sqrt_bc2 + eps)`` in place, every non-finite quotient set to
    ``+0``: old denominators (from :func:`denominators`) over new ones, 0 where either is
    infinite. Arguments as :func:`denominators`'; returns ``ratio``."""
    return _run(v, ratio, sqrt_bc2, eps, True, backend)


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
