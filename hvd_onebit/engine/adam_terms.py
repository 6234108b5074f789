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
from ..dtypes import check_converted
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
    preconditioned (numbers given), over its denominator (its frozen variance's) and clamped at
    ``numbers.input_bound`` (Adam's bound on ``|m_hat| / sqrt(v_hat)`` at the step taken, times
    bc1: ``m`` is not bias-corrected). Parameters at one step count of one group share one."""

    beta1: float
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
        self.views = BucketViews(state)

    def clear(self) -> None:
        """Forget the buckets' weight and variance views (new buckets, or the state
        replaced)."""
        self.views.clear()

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
                     ) -> StepNumbers:
        """``p``'s numbers at the step it takes now."""
        state = self.state[p]
        step = int(self.variance.host_step_of(p, state)) + 1
        return numbers(step, state["frozen_variance_step"])

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
            numbers, made = self.numbers_of(g), {}  # StepNumbers -> its InputTerms
            for p in g["params"]:
                if p in owner:
                    n = self._numbers_for(p, numbers)
                    t = made.get(n)
                    terms[p] = t if t is not None else made.setdefault(n, InputTerms(n.beta1, n))
        return terms

    def momentum_input(self, b: Bucket, terms: Mapping[torch.Tensor, InputTerms],
                       grads: Mapping) -> object:
        """Bucket ``b``'s allreduce input: its local momentum ``beta1 * m + (1 - beta1) * g``
        (over its denominator when preconditioned), computed inside the compression pass where
        one beta1 serves the whole bucket."""
        sizes = b.sizes
        pieces = [b.piece(i, grads[p]) for i, p in enumerate(b.params)]
        seg_terms = [terms[p] for p in b.params]
        pre = {}
        if self.preconditioned:
            numbers = [t.numbers for t in seg_terms]
            pre = dict(variances=self.views.variances(b),
                       sqrt_bc2s=[n.sqrt_bc2 for n in numbers], eps=[n.eps for n in numbers],
                       bounds=[n.input_bound for n in numbers])
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
        return ParamUpdate(p.detach(), self.state[p]["exp_avg_sq"],
                           self._numbers_for(p, self.numbers_of(group)))

    def plan(self, param_groups: list[dict], buckets: list[Bucket], owner: set
             ) -> tuple[list[AdamUpdate], list[tuple]]:
        """Adam's update with the frozen variance, one :class:`AdamUpdate` per bucket, for the
        collective to apply in its decode pass once every rank has succeeded. Parameters with an
        ``exp_avg_mask`` are returned apart, as (group, param, mask): their momentum must be
        masked first (preconditioned, the decode pass still turns their average back into a
        momentum: it gets their variance and no weight)."""
        numbers: dict = {}  # parameter -> its StepNumbers (none: left alone)
        masked = []
        for group in param_groups:
            of = self.numbers_of(group)
            for p, mask in zip(group["params"], group_masks(group)):
                if p not in owner:
                    continue
                if mask is not None:
                    masked.append((group, p, mask))
                    if not self.preconditioned:
                        continue
                numbers[p] = self._numbers_for(p, of)
        held = {p for _, p, _ in masked}  # their momentum is converted, their weight left alone
        return [self._bucket_update(b, numbers, held) for b in buckets], masked

    def _bucket_update(self, b: Bucket, numbers: Mapping, held: set) -> AdamUpdate:
        """Bucket ``b``'s :class:`AdamUpdate` from its parameters' numbers (a parameter without
        numbers is left alone; one ``held`` has no weight): :func:`bucket_update` with the
        bucket's views kept from step to step."""
        weights = self.views.weights(b)
        if held:
            weights = [None if p in held else w for p, w in zip(b.params, weights)]
        return assemble_update(b, [numbers.get(p) for p in b.params], weights,
                               self.views.variances(b), self.preconditioned)

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
    return assemble_update(
        b, [None if x is None else x.numbers for x in t],
        [None if x is None or x.weight is None else b.piece(i, x.weight) for i, x in enumerate(t)],
        [None if x is None else b.piece(i, x.variance) for i, x in enumerate(t)], preconditioned)


def assemble_update(b: Bucket, numbers: list[Optional[StepNumbers]], weights: list,
                    variances: list, preconditioned: bool = False) -> AdamUpdate:
    """The :class:`AdamUpdate` of bucket ``b`` from each segment's numbers (None: the segment
    is left alone, whatever its weight and variance), weight part (None: its momentum only
    converted) and variance part."""
    n = numbers
    return AdamUpdate(
        weights=[None if x is None else w for x, w in zip(n, weights)],
        variances=[None if x is None else v for x, v in zip(n, variances)],
        sizes=b.sizes, steps=[0.0 if x is None else x.step for x in n],
        decays=[1.0 if x is None else x.decay for x in n],
        sqrt_bc2s=[1.0 if x is None else x.sqrt_bc2 for x in n],
        eps=[0.0 if x is None else x.eps for x in n],
        bounds=[math.inf if x is None else x.bound for x in n], preconditioned=preconditioned)


class BucketViews:
    """Each bucket's segments' parts of its parameters' frozen variances (``exp_avg_sq``) and
    weights, as the fused passes read them, made once per bucket and kept from step to step: a
    step of a model of thousands of tensors then makes no tensor per parameter (each one more
    object for the garbage collector to go over). A view is made again where the state holds
    another ``exp_avg_sq`` (a refresh or a zero-variance fill writes into the same one), or the
    parameter other memory or strides (``p.data = ...``); until then the old ones are held (a
    model moved after the optimizer was built frees its old weights at the next compressed
    step, as the Adam state it left behind goes with the optimizer).

    Args:
        state: Adam's per-parameter state.
    """

    def __init__(self, state: Mapping):
        self.state = state
        # bucket index -> (the bucket, its parameters' exp_avg_sq, the segments' parts)
        self._variances: dict[int, tuple] = {}
        # bucket index -> (the bucket, its parameters' data pointers and strides, the parts)
        self._weights: dict[int, tuple] = {}

    def clear(self) -> None:
        """Forget them all (new buckets, or a state replaced)."""
        self._variances, self._weights = {}, {}

    def variances(self, b: Bucket) -> list[torch.Tensor]:
        """Bucket ``b``'s segments' parts of their frozen variances."""
        made = self._variances.get(b.index)
        state = self.state
        if made is not None and made[0] is b and all(
                state[p]["exp_avg_sq"] is v for p, v in zip(b.params, made[1])):
            return made[2]
        full = [state[p]["exp_avg_sq"] for p in b.params]
        made = self._variances[b.index] = (b, full, [b.piece(i, v) for i, v in enumerate(full)])
        return made[2]

    def weights(self, b: Bucket) -> list[torch.Tensor]:
        """Bucket ``b``'s segments' parts of their parameters' data (detached)."""
        made = self._weights.get(b.index)
        if made is not None and made[0] is b and all(
                p.data_ptr() == at and p.stride() == stride
                for p, (at, stride) in zip(b.params, made[1])):
            return made[2]
        check_converted(b.params)  # new memory: maybe another dtype
        made = self._weights[b.index] = (b, [(p.data_ptr(), p.stride()) for p in b.params],
                                         [b.piece(i, p.detach()) for i, p in enumerate(b.params)])
        return made[2]
