"""The data of Adam's fused passes: what the prologue (:class:`MomentumTerms`) and the epilogue
(:class:`UpdateTerms`) are made of, validated once.

:mod:`~hvd_onebit.kernels.fused_adam` gives them their kernels (``MomentumInput``,
``AdamUpdate``) and :mod:`~hvd_onebit.kernels.fused_reference` their torch twins; both import
these types, neither imports the other's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..step_bound import as_float32


@dataclass
class MomentumTerms:
    """An allreduce input given as Adam's momentum update, ``x = beta1 * m + (1 - beta1) * g``
    (over the frozen denominator with ``variances``): its data, as
    :class:`~hvd_onebit.kernels.fused_adam.MomentumInput` describes it.
    """

    momentum: torch.Tensor
    grads: list[Optional[torch.Tensor]]
    sizes: list[int]
    beta1: float
    variances: Optional[list[torch.Tensor]] = None
    sqrt_bc2s: Optional[Sequence[float]] = None
    eps: Optional[Sequence[float]] = None
    bounds: Optional[Sequence[float]] = None

    def __post_init__(self):
        if self.variances is not None:
            self.bounds = ([math.inf] * len(self.sizes) if self.bounds is None
                           else [as_float32(float(b)) for b in self.bounds])
            if any(not b >= 0 for b in self.bounds):
                raise ValueError(f"input bounds must be >= 0, got {self.bounds}")

    def native_precondition_args(self) -> tuple:
        """(variances, sqrt_bc2s, eps, bounds) as the native kernels take them: empty lists when
        the input is not preconditioned."""
        if self.variances is None:
            return [], [], [], []
        return (list(self.variances), list(map(float, self.sqrt_bc2s)),
                list(map(float, self.eps)), list(map(float, self.bounds)))

    @property
    def like(self) -> torch.Tensor:
        """A tensor of x's size, dtype and device (the momentum): the output is shaped like it."""
        return self.momentum


@dataclass
class UpdateTerms:
    """Adam's use of the averaged momentum: its data, as
    :class:`~hvd_onebit.kernels.fused_adam.AdamUpdate` describes it.
    """

    weights: list[Optional[torch.Tensor]]
    variances: list[Optional[torch.Tensor]]
    sizes: list[int]
    steps: list[float]
    decays: list[float]
    sqrt_bc2s: Optional[Sequence[float]] = None
    eps: Optional[Sequence[float]] = None
    bounds: Optional[Sequence[float]] = None
    preconditioned: bool = False

    def __post_init__(self):
        if self.sqrt_bc2s is None:
            self.sqrt_bc2s = [1.0] * len(self.sizes)
        if self.eps is None:
            self.eps = [0.0] * len(self.sizes)
        if self.bounds is None:
            self.bounds = [math.inf] * len(self.sizes)
        else:
            rounded: dict = {}  # a bucket's parameters share a few bounds: each rounded once
            self.bounds = [rounded[b] if b in rounded else rounded.setdefault(b, as_float32(float(b)))
                           for b in self.bounds]
            if any(not b >= 0 for b in self.bounds):
                raise ValueError(f"step bounds must be >= 0, got {self.bounds}")

    def native_args(self) -> tuple:
        """(weights, variances, sizes, steps, decays, sqrt_bc2s, eps, bounds, preconditioned)
        as the native kernels take them: the scalars as Python floats, one per parameter."""
        return (self.weights, self.variances, self.sizes, list(map(float, self.steps)),
                list(map(float, self.decays)), list(map(float, self.sqrt_bc2s)),
                list(map(float, self.eps)), list(map(float, self.bounds)),
                bool(self.preconditioned))
