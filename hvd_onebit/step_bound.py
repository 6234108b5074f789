"""The bound on a compression-phase step: Adam's own largest step, applied to the frozen variance.

Adam cannot take an arbitrarily long step. With ``m_t = (1-b1) sum_k b1^(t-k) g_k`` and
``v_t = (1-b2) sum_k b2^(t-k) g_k^2``, Cauchy-Schwarz on the pairs ``(b1/sqrt(b2))^(t-k)`` and
``sqrt(b2)^(t-k) g_k`` gives, for every element and every step t,

    |m_t| <= (1-b1) * sqrt(sum_{j<t} (b1^2/b2)^j) * sqrt(v_t / (1-b2)),

so the bias-corrected ratio Adam divides by is bounded:

    |m_hat_t| / sqrt(v_hat_t) <= B(t) = (1-b1)/(1-b1^t) * sqrt((1-(b1^2/b2)^t) / (1-b1^2/b2))
                                        * sqrt((1-b2^t) / (1-b2)),

``B(1) = 1`` (Adam's first step is a sign step) and ``B(t) -> (1-b1) / sqrt((1-b2)(1-b1^2/b2))``,
7.27 for the default betas. Once the variance is frozen nothing enforces this any more: an
element whose gradient outgrows its frozen variance (a ReLU unit that wakes up, dropout, max-pool
switching) divides a large momentum by a small denominator, and one scale per chunk of the 1-bit
allreduce hands every small-variance element its chunk's magnitude. The compression phase
therefore clamps each element's step ``(lr / bc1) * m / denom`` to ``lr * B(t)``: never longer
than the longest step Adam itself could take at that step count. The clamp lives in the fused
decode+update pass (which already computes ``denom``); the momentum and the error feedback are
left as they are, so averaging stays exact and the error feedback keeps what the clamp held back.

``step_bound`` (an option of :func:`hvd_onebit.DistributedOptimizer`):

* ``"adam"`` (default): the bound ``B(t)`` above, at the step being taken;
* a positive number c: a fixed bound ``lr * c``;
* ``None``: no bound (the unbounded frozen-variance step of the paper), for comparison.
"""
from __future__ import annotations

import math
import struct
from typing import Mapping, Optional, Union

import torch

from .values import is_number

ADAM = "adam"
StepBound = Union[str, float, None]


def adam_ratio_bound(beta1: float, beta2: float, step: int) -> float:
    """B(step): the largest ``|m_hat| / sqrt(v_hat)`` torch's Adam can produce at ``step`` (>= 1)
    with these betas; ``inf`` where none exists (``beta2 == 0``)."""
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    if beta2 <= 0.0:
        return math.inf
    r = beta1 * beta1 / beta2
    terms = float(step) if r == 1.0 else (1.0 - r ** step) / (1.0 - r)
    return ((1.0 - beta1) / (1.0 - beta1 ** step) * math.sqrt(terms)
            * math.sqrt((1.0 - beta2 ** step) / (1.0 - beta2)))


def validate(step_bound: StepBound) -> StepBound:
    """``step_bound`` as given, or a ValueError naming what is wrong."""
    if step_bound is None or step_bound == ADAM:
        return step_bound
    if not is_number(step_bound) or step_bound <= 0:
        raise ValueError(f"step_bound must be 'adam', None or a positive finite number, got "
                         f"{step_bound!r}")
    return float(step_bound)


def ratio_bound(step_bound: StepBound, beta1: float, beta2: float, step: int) -> float:
    """The bound on ``|m_hat| / denom`` for a step taken at Adam step count ``step``."""
    if step_bound is None:
        return math.inf
    if step_bound == ADAM:
        return adam_ratio_bound(beta1, beta2, step)
    return float(step_bound)


def as_float32(x: float) -> float:
    """``x`` rounded to the nearest float32 (every twin then clamps at the same number); on the
    host, without a tensor (a step rounds one per parameter). Beyond float32's range: inf."""
    if not math.isfinite(x):
        return x
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _frozen_parameters(param_groups: list[dict], state: Mapping[torch.Tensor, dict]):
    """(parameter, beta1, beta2, its state, its float64 frozen denominator, its trained-element
    mask) for every parameter past its freeze: what both diagnostics below read."""
    for group in param_groups:
        (beta1, beta2), eps = group["betas"], float(group["eps"])
        for p in group["params"]:
            s = state.get(p, {})
            frozen = s.get("frozen_variance_step", -1)
            if frozen is None or frozen < 1 or "exp_avg" not in s:
                continue
            v = s["exp_avg_sq"].detach().double().reshape(-1)
            yield p, beta1, beta2, s, v.sqrt() / math.sqrt(1 - beta2 ** frozen) + eps, v > 0


def _fraction_at(pairs, step_bound: StepBound) -> Optional[float]:
    """Over (ratios, limit, trained mask) triples: the share of trained elements at the limit."""
    if step_bound is None:
        return None
    hit = total = 0
    for ratio, limit, live in pairs:
        hit += int((ratio[live] >= limit).sum())
        total += int(live.sum())
    return hit / total if total else None


def clamped_fraction(param_groups: list[dict], state: Mapping[torch.Tensor, dict],
                     step_bound: StepBound = ADAM) -> Optional[float]:
    """The fraction of trained (not held) elements whose last compressed step met the bound.

    Read from the state after a compressed step: ``exp_avg`` holds that step's averaged momentum
    and ``step`` its count, so ``|m| / bc1 / denom >= B(step)`` is where the clamp engaged (the
    same test the fused pass applies, in float64 here: a diagnostic, not the update). None
    before the freeze or without a bound."""
    def pairs():
        for p, beta1, beta2, s, denom, live in _frozen_parameters(param_groups, state):
            t = int(float(s["step"]))
            m = s["exp_avg"].detach().double().reshape(-1)
            yield (m.abs() / (1 - beta1 ** t) / denom,
                   ratio_bound(step_bound, beta1, beta2, t), live)
    return _fraction_at(pairs(), step_bound)


def input_clamped_fraction(param_groups: list[dict], state: Mapping[torch.Tensor, dict],
                           step_bound: StepBound = ADAM) -> Optional[float]:
    """The fraction of this rank's trained (not held) elements whose preconditioned momentum
    ``|beta1 * m + (1 - beta1) * g| / denom`` will meet the input bound ``bc1 * B(t)`` in the
    coming compressed step: call it after backward, before ``step()`` (it reads ``p.grad``; a
    diagnostic in float64, not the kernel's arithmetic). None before the freeze or unbounded."""
    def pairs():
        for p, beta1, beta2, s, denom, live in _frozen_parameters(param_groups, state):
            t = int(float(s["step"])) + 1
            x = beta1 * s["exp_avg"].detach().double().reshape(-1)
            if p.grad is not None:
                x = x + (1 - beta1) * p.grad.detach().double().reshape(-1)
            yield (x.abs() / denom,
                   (1 - beta1 ** t) * ratio_bound(step_bound, beta1, beta2, t), live)
    return _fraction_at(pairs(), step_bound)
