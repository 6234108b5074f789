"""The torch twins of Adam's fused passes (:mod:`hvd_onebit.kernels.fused_adam`): the reference
the native and Triton kernels are tested against, and what runs where neither can.

The same bits on every device: separate fp32 ``mul``, ``div`` and ``add``, no FMA, as the native
code is built with ``-ffp-contract=off`` and the Triton kernels are launched with
``enable_fp_fusion=False``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..step_bound import as_float32
from .fused_terms import MomentumTerms, UpdateTerms

#: Elements per slice of :func:`apply_update` (and of the prologue's division): bounds its temporaries.
APPLY_SLICE = 1 << 20


def inverse_root_bc2(sqrt_bc2: float) -> float:
    """``1 / sqrt_bc2`` as every kernel takes it: ``sqrt_bc2`` rounded to float32, then the
    float32 quotient, correctly rounded (a float64 quotient of two float32 numbers rounds to the
    float32 one). Computed once per parameter, so the passes over the elements multiply the
    root by it instead of dividing."""
    return as_float32(1.0 / as_float32(float(sqrt_bc2)))


def frozen_denominator(v: torch.Tensor, sqrt_bc2: float, eps: float) -> torch.Tensor:
    """Adam's denominator from a frozen variance ``v`` (float32, any shape): a fresh float32
    tensor ``sqrt(v) * inverse_root_bc2(sqrt_bc2) + eps``, ``+inf`` where ``v == 0`` (an element
    held). The torch reference of what the fused kernels compute in their passes, the
    same bits on every device: torch's float32 sqrt on CPU is MKL's (not always correctly
    rounded, unlike the kernels'), a float64 root rounded to float32 is; the factor is a
    float32 number, so a product by it is one float32 rounding everywhere."""
    root = torch.sqrt(v.double()).float()
    d = root.mul_(inverse_root_bc2(sqrt_bc2)).add_(float(eps))
    return d.masked_fill_(v == 0, math.inf)


def materialize_momentum(src: MomentumTerms, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:meth:`MomentumInput.materialize <hvd_onebit.kernels.fused_adam.MomentumInput.materialize>`
    with torch ops: ``x`` (or ``u``, preconditioned) as float32 [numel], written into ``out``
    (float32) when given. The torch reference of the fused prologue."""
    out = torch.mul(src.momentum.reshape(-1).float(), src.beta1, out=out)
    start = 0
    for i, (g, size) in enumerate(zip(src.grads, src.sizes)):
        seg = out[start:start + size]
        if g is None:
            seg.add_(0.0)  # the kernel adds (1 - beta1) * 0; -0.0 becomes +0.0 as it does there
        else:
            seg.add_(torch.mul(g.reshape(-1).float(), 1 - src.beta1))
        if src.variances is not None:  # x / denom, in slices that bound the temporaries
            v = src.variances[i].reshape(-1)
            for lo in range(0, size, APPLY_SLICE):
                hi = min(size, lo + APPLY_SLICE)
                piece = seg[lo:hi].div_(frozen_denominator(v[lo:hi], float(src.sqrt_bc2s[i]),
                                                           float(src.eps[i])))
                if src.bounds[i] != math.inf:  # clamp_ keeps a NaN, as the kernels do;
                    # an infinite u stays infinite, so the input is reported not finite
                    up, down = piece == math.inf, piece == -math.inf
                    piece.clamp_(-src.bounds[i], src.bounds[i])
                    piece.masked_fill_(up, math.inf).masked_fill_(down, -math.inf)
        start += size
    return out


def apply_update(update: UpdateTerms, m: torch.Tensor) -> None:
    """:meth:`AdamUpdate.apply <hvd_onebit.kernels.fused_adam.AdamUpdate.apply>`: ``update``
    with torch ops, ``m``: the decoded momentum [numel]. The torch reference of the fused
    epilogue. Works through each parameter in slices of ``APPLY_SLICE``
    elements, so its temporaries (the denominator, the update, a float32 copy of a
    low-precision weight) stay small whatever the parameter's size."""
    flat = m.reshape(-1)
    start = 0
    for i, (w, size, step, decay, bound) in enumerate(zip(update.weights, update.sizes,
                                                          update.steps, update.decays,
                                                          update.bounds)):
        if w is not None or (update.preconditioned and update.variances[i] is not None):
            # in m's (row-major) order; a copy only for a non-contiguous (channels-last) weight
            w_flat = w.reshape(-1) if w is not None else None
            for lo in range(0, size, APPLY_SLICE):
                hi = min(size, lo + APPLY_SLICE)
                _apply_slice(update, flat[start + lo:start + hi], w, w_flat, i, lo, hi, step,
                             decay, bound)
            if w is not None and not w.is_contiguous():
                w.copy_(w_flat.view(w.shape))
        start += size

def _apply_slice(update: UpdateTerms, m_here: torch.Tensor, w: Optional[torch.Tensor],
                 w_flat: Optional[torch.Tensor], i: int, lo: int, hi: int, step: float,
                 decay: float, bound: float) -> None:
    """:func:`apply_update` on elements ``[lo, hi)`` of parameter ``i`` (``m_here``: theirs)."""
    d = frozen_denominator(update.variances[i].reshape(-1)[lo:hi], update.sqrt_bc2s[i],
                           update.eps[i])
    held = d == math.inf
    if update.preconditioned:  # m_here holds u: the step from u, then m = u * denom
        q = torch.mul(m_here, step) if w is not None else None
    else:  # (step * m) / d: the CPU's addcdiv_ order. CUDA's addcdiv_ computes
        # w + step * (m / d) and contracts it into an FMA: other bits.
        q = torch.mul(m_here, step).div_(d)
    if q is not None:
        if bound != math.inf:  # clamp_ keeps a NaN step NaN, as the kernels do
            q.clamp_(-bound, bound)
        if update.preconditioned:
            q.masked_fill_(held, 0.0)
        # float16/bfloat16 weights: the update in float32, rounded once
        w_here = w_flat[lo:hi]
        target = w_here if w.dtype == m_here.dtype else w_here.float()
        if decay != 1.0:
            target.mul_(decay)
        target.add_(q)
        if target is not w_here:
            w_here.copy_(target)
    if update.preconditioned:
        m_here.mul_(d)
    m_here.masked_fill_(held, 0.0)
