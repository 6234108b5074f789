"""The sums a refresh gate compares (``variance_refresh={"accept": ...}``,
:mod:`hvd_onebit.engine.refresh_gate`), over one parameter's piece in one pass.

Native (C++) on CPU tensors, the torch twin elsewhere. The terms are the same fp32 values in both;
the native pass adds them into eight float64 lanes in a fixed order, the same bits on every CPU
(its SIMD and scalar paths alike), so every rank decides alike without a collective. The twin
adds with torch's own float64 sums, in another order: the same sums to a few float64 ulps.
"""
from __future__ import annotations

from typing import Optional

import torch

from .backend import native_module, native_ready, pick
from .reference import exact_div

#: Elements per temporary of the torch twin: bounds its memory whatever the bucket size.
CHUNK = 1 << 20


def gate_sums(v: torch.Tensor, g: torch.Tensor, weight: float,
              m: Optional[torch.Tensor] = None, sqrt_bc2: float = 1.0, eps: float = 0.0,
              backend: str = "auto") -> torch.Tensor:
    """float64 [2] (or [4] given ``m``): over the elements where ``v > 0``, ``sum(sqrt(v))``
    and ``sum(sqrt((1 - weight) * v + weight * g^2))``, the variance's roots before and after a
    refresh of this ``weight``; given ``m``, also ``sum(g * u)`` and ``sum((g * u)^2)`` with
    ``u = m / (sqrt(v) / sqrt_bc2 + eps)``, the new gradient along the last step's direction
    and its terms' squares.

    Args:
        v, g, m: float32, one parameter's piece of the variance, the averaged gradient and the
            momentum, ``numel`` elements each (any shape).
        weight: the new ``g^2``'s weight in the variance.
        sqrt_bc2, eps: the denominator's terms before the refresh.
    """
    if g.numel() != v.numel() or (m is not None and m.numel() != v.numel()):
        raise ValueError(f"v, g and m must have as many elements: {v.numel()}, {g.numel()}, "
                         f"{None if m is None else m.numel()}")
    if pick(backend, v.device, native=lambda: native_ready((v, g, m))) == "native":
        return native_module().gate_sums(v, g, m, float(weight), float(sqrt_bc2), float(eps),
                                         True)
    return _twin(v, g, weight, m, sqrt_bc2, eps)


def _twin(v: torch.Tensor, g: torch.Tensor, weight: float, m: Optional[torch.Tensor],
          sqrt_bc2: float, eps: float) -> torch.Tensor:
    """The torch reference of :func:`gate_sums`, :data:`CHUNK` elements at a time."""
    v, g = v.reshape(-1), g.reshape(-1)
    out = torch.zeros(2 if m is None else 4, dtype=torch.float64, device=v.device)
    for lo in range(0, v.numel(), CHUNK):
        vc, gc = v[lo:lo + CHUNK], g[lo:lo + CHUNK]
        held = vc == 0
        root = _root(vc)
        out[0] += root.sum(dtype=torch.float64)  # a held element's root is 0 already
        if m is not None:  # held elements took no step: not in the sum
            along = exact_div(root, float(sqrt_bc2)).add_(eps).reciprocal_().mul_(gc)
            along.mul_(m.reshape(-1)[lo:lo + CHUNK]).masked_fill_(held, 0)
            out[2] += along.sum(dtype=torch.float64)
            out[3] += along.square_().sum(dtype=torch.float64)
            del along
        del root
        new = _root((vc * (1 - weight)).addcmul_(gc, gc, value=weight))
        out[1] += new.masked_fill_(held, 0).sum(dtype=torch.float64)
    return out


def _root(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``sqrt(x)`` correctly rounded, as the native pass takes it (torch's own fp32 sqrt on
    CPU is not always: an ulp off in about a tenth of the elements)."""
    return torch.sqrt(x.double()).float()
