"""Adam's terms of one compressed step: what each bucket's allreduce input is made of, and
the update its decode applies (host numbers, prepared while stage 1 is on the wire). The math
lives in :mod:`hvd_onebit.kernels.fused_adam` and :mod:`hvd_onebit.step_bound`; this is the bookkeeping
that feeds it from the param groups and the state.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional

import torch

from .. import step_bound
from ..config import group_masks
from ..kernels.fused_adam import AdamUpdate, MomentumInput
from .fusion import Bucket
from .variance import FrozenVariance


@dataclass(frozen=True, eq=False)
class Denominator:
    """A parameter's Adam denominator ``sqrt(v) * (1 / sqrt_bc2) + eps``, as the fused passes
    take it (they compute it in their own pass: ``+inf`` where ``v == 0``)."""

    variance: torch.Tensor  # exp_avg_sq, frozen between refreshes
    sqrt_bc2: float
    eps: float


@dataclass(frozen=True, eq=False)
class StepNumbers:
    """The host numbers a param group's parameters share at one Adam step count ``t`` (the step
    taken) and one frozen-variance step count (no sync: computed on the host)."""

    beta1: float
    sqrt_bc2: float  # sqrt(1 - beta2 ** frozen), of the denominator
    eps: float
    input_bound: float  # the preconditioned input's clamp: (1 - beta1 ** t) * B(t)
    step: float  # -lr / (1 - beta1 ** t)
    decay: float  # 1 - lr * weight_decay with AdamW's decay, else 1.0
    bound: float  # lr * B(t): the largest step (:mod:`hvd_onebit.step_bound`)


@dataclass(frozen=True, eq=False)
class InputTerms:
    """What a parameter's allreduce input is made of: ``beta1 * m + (1 - beta1) * g``, and when
    preconditioned (a variance given), over its denominator and clamped at
    ``numbers.input_bound`` (Adam's bound on ``|m_hat| / sqrt(v_hat)`` at the step taken, times
    bc1: ``m`` is not bias-corrected)."""

    beta1: float
    variance: Optional[torch.Tensor] = None  # exp_avg_sq, frozen between refreshes
    numbers: Optional[StepNumbers] = None


@dataclass(frozen=True, eq=False)
class ParamUpdate:
    """This step's ``w = w * decay + clamp(step * m / denom, -bound, bound)`` of one parameter,
    with ``numbers``' host numbers. No weight: the decode converts the momentum and updates
    nothing."""

    weight: Optional[torch.Tensor]
    variance: torch.Tensor  # exp_avg_sq, frozen between refreshes
    numbers: StepNumbers


def sqrt_bc2(beta2: float, frozen: int) -> float:
    """``sqrt(1 - beta2 ** frozen)``, Adam's variance bias correction at the frozen step count
    (1.0 before the freeze)."""
    return math.sqrt(1 - beta2 ** frozen if frozen > 0 else 1.0)


def masked_params(param_groups: list[dict], owner: Iterable[torch.Tensor]) -> list[tuple]:
    """(group, param, mask) of every parameter of ``owner`` with an ``exp_avg_mask``."""
    owner = set(owner)
    return [(group, p, mask) for group in param_groups
            for p, mask in zip(group["params"], group_masks(group))
            if mask is not None and p in owner]


def mask_momentum(state: Mapping, p: torch.Tensor, mask: torch.Tensor) -> None:
    """``exp_avg *= mask``, in place (exp_avg is the bucket's view); the mask may live
    elsewhere, e.g. where hvd.broadcast_optimizer_state unpickled it."""
    m = state[p]["exp_avg"]
    m.mul_(mask.to(device=m.device, dtype=m.dtype))


class AdamTerms:
    """Adam's terms read from the param groups and the state, for the fused passes.

    Args:
        state: Adam's per-parameter state.
        variance: the frozen variance (the host step counts).
        decoupled: whether a param group's weight decay is AdamW's.
        bound: the ``step_bound`` option.
        preconditioned: whether the collectives carry ``m / denom``.
        backend: the kernel backend.
    """

    def __init__(self, state: Mapping, variance: FrozenVariance,
                 decoupled: Callable[[dict], bool], bound, preconditioned: bool, backend: str):
        self.state = state
        self.variance = variance
        self.decoupled = decoupled
        self.bound = bound
        self.preconditioned = preconditioned
        self.backend = backend

    def numbers_of(self, group: dict) -> Callable[[int, int], StepNumbers]:
        """``numbers(t, frozen)``: the group's :class:`StepNumbers` at step ``t`` with the
        variance frozen at step ``frozen``, each computed once per call of this (the group's
        options are read now: a scheduler may change them between steps)."""
        (beta1, beta2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
        eps, decoupled = float(group["eps"]), wd != 0 and self.decoupled(group)
        found: dict[tuple, StepNumbers] = {}

        def numbers(t: int, frozen: int) -> StepNumbers:
            key = (t, frozen)
            known = found.get(key)
            if known is None:
                ratio = step_bound.ratio_bound(self.bound, beta1, beta2, t)
                known = found[key] = StepNumbers(
                    beta1=beta1, sqrt_bc2=sqrt_bc2(beta2, frozen),
                    eps=eps, input_bound=(1 - beta1 ** t) * ratio, step=-lr / (1 - beta1 ** t),
                    decay=1 - lr * wd if decoupled else 1.0,
                    bound=math.inf if math.isinf(ratio) else abs(lr) * ratio)  # lr 0: no nan
            return known
        return numbers

    def _numbers_for(self, p: torch.Tensor, numbers: Callable[[int, int], StepNumbers]
                     ) -> tuple[dict, StepNumbers]:
        """``p``'s state and its numbers at the step it takes now."""
        state = self.state[p]
        return state, numbers(int(self.variance.host_step(p)) + 1, state["frozen_variance_step"])

    def denominator(self, p: torch.Tensor, group: dict) -> Denominator:
        """``p``'s denominator, as the update has it."""
        state = self.state[p]
        return Denominator(state["exp_avg_sq"],
                           sqrt_bc2(group["betas"][1], state["frozen_variance_step"]),
                           float(group["eps"]))

    def inputs(self, param_groups: list[dict], owner: set) -> dict[torch.Tensor, InputTerms]:
        """Per parameter of ``owner``: what its allreduce input is made of."""
        terms = {}
        for g in param_groups:
            if not self.preconditioned:
                shared = InputTerms(g["betas"][0])
                terms.update((p, shared) for p in g["params"] if p in owner)
                continue
            numbers = self.numbers_of(g)
            for p in g["params"]:
                if p in owner:
                    state, n = self._numbers_for(p, numbers)
                    terms[p] = InputTerms(n.beta1, state["exp_avg_sq"], n)
        return terms

    def momentum_input(self, b: Bucket, terms: Mapping[torch.Tensor, InputTerms],
                       grads: Mapping) -> object:
        """Bucket ``b``'s allreduce input: its local momentum ``beta1 * m + (1 - beta1) * g``
        (over its denominator when preconditioned), computed inside the compression pass where
        one beta1 serves the whole bucket."""
        sizes = [seg.numel for seg in b.segments]
        pieces = [b.piece(i, grads[seg.param]) for i, seg in enumerate(b.segments)]
        seg_terms = [terms[seg.param] for seg in b.segments]
        pre = {}
        if self.preconditioned:
            pre = dict(variances=[b.piece(i, t.variance) for i, t in enumerate(seg_terms)],
                       sqrt_bc2s=[t.numbers.sqrt_bc2 for t in seg_terms],
                       eps=[t.numbers.eps for t in seg_terms],
                       bounds=[t.numbers.input_bound for t in seg_terms])
        betas = {t.beta1 for t in seg_terms}
        if len(betas) == 1:
            return MomentumInput(b.momentum, pieces, sizes, betas.pop(), **pre)
        # param groups with different beta1 share the bucket: one member at a time
        for i, seg in enumerate(b.segments):
            one = {k: [v[i]] for k, v in pre.items()}
            MomentumInput(b.momentum_view(i), [pieces[i]], [sizes[i]], seg_terms[i].beta1,
                          **one).materialize(out=b.work_view(i), backend=self.backend)
        return b.work

    def update(self, p: torch.Tensor, group: dict) -> ParamUpdate:
        """``p``'s update at this step."""
        state, n = self._numbers_for(p, self.numbers_of(group))
        return ParamUpdate(p.detach(), state["exp_avg_sq"], n)

    def plan(self, param_groups: list[dict], buckets: list[Bucket], owner: set
             ) -> tuple[list[AdamUpdate], list[tuple]]:
        """Adam's update with the frozen variance, one :class:`AdamUpdate` per bucket, for the
        collective to apply in its decode pass once every rank has succeeded. Parameters with an
        ``exp_avg_mask`` are returned apart, as (group, param, mask): their momentum must be
        masked first (preconditioned, the decode pass still turns their average back into a
        momentum: it gets their variance and no weight)."""
        updates: dict = {}
        masked = []
        for group in param_groups:
            numbers = self.numbers_of(group)
            for p, mask in zip(group["params"], group_masks(group)):
                if p not in owner:
                    continue
                if mask is not None:
                    masked.append((group, p, mask))
                    if not self.preconditioned:
                        continue
                state, n = self._numbers_for(p, numbers)
                updates[p] = ParamUpdate(None if mask is not None else p.detach(),
                                         state["exp_avg_sq"], n)
        return [bucket_update(b, updates, self.preconditioned) for b in buckets], masked

    def apply_masked(self, masked: list[tuple]) -> None:
        """Parameters with an exp_avg_mask: mask the averaged momentum, then the same update.
        (Held elements, whose denominator is inf, got no update and a zero momentum already.)"""
        for group, p, mask in masked:
            mask_momentum(self.state, p, mask)
            u = self.update(p, group)
            n = u.numbers
            AdamUpdate([u.weight], [u.variance], [p.numel()], [n.step], [n.decay], [n.sqrt_bc2],
                       [n.eps], [n.bound]).apply(self.state[p]["exp_avg"])


def bucket_update(b: Bucket, updates: Mapping[torch.Tensor, ParamUpdate],
                  preconditioned: bool = False) -> AdamUpdate:
    """The :class:`AdamUpdate` of bucket ``b`` from its parameters' updates (a parameter
    without one is left alone)."""
    t = [updates.get(p) for p in b.params]
    n = [x.numbers if x is not None else None for x in t]
    return AdamUpdate(
        weights=[b.piece(i, x.weight) if x is not None and x.weight is not None else None
                 for i, x in enumerate(t)],
        variances=[b.piece(i, x.variance) if x is not None else None for i, x in enumerate(t)],
        sizes=[seg.numel for seg in b.segments],
        steps=[x.step if x is not None else 0.0 for x in n],
        decays=[x.decay if x is not None else 1.0 for x in n],
        sqrt_bc2s=[x.sqrt_bc2 if x is not None else 1.0 for x in n],
        eps=[x.eps if x is not None else 0.0 for x in n],
        bounds=[x.bound if x is not None else math.inf for x in n], preconditioned=preconditioned)
