"""A variance refresh (``variance_refresh``): Adam's full-precision step inside the compression
phase, over the fused buckets, with the error feedback carried into the new denominators.

The caller (:mod:`hvd_onebit.phases.refresh`) has the gradients averaged exactly (Horovod's
allreduce, as in the warmup) and checked finite; they are the same bits on every rank, so every
rank takes the same step, and the momentum stays identical everywhere. Per parameter:

    m = beta1 * m + (1 - beta1) * g        (in place: exp_avg stays a view into its bucket)
    v = (1 - a) * v + a * g^2              (in place)
    t += 1
    w = w * decay + clamp(-lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(bc2) + eps), +-bound)

Bias correction as Adam's, per running average: m is updated at every step, so its correction
counts every step (t). v skips the compressed steps. With ``variance_update="gap"`` (default) a
refresh k steps after v's last update stands for those k steps, a = 1 - beta2^k, so v's weights
still sum to 1 - beta2^t and bc2 = 1 - beta2^t, Adam's own: v estimates Adam's variance however
far apart the refreshes are. With "single" (0/1 Adam's) a = 1 - beta2 and bc2 = 1 - beta2^n,
n counting v's updates (the warmup's steps plus the refreshes). Either count is kept in
``frozen_variance_step``, which the following compressed steps read
(:meth:`~hvd_onebit.engine.adam_terms.AdamTerms.denominator`) and checkpoints carry.
Using t with single updates would under-correct v and lengthen every later step.
``exp_avg_mask`` multiplies the new momentum before the update; the step bound is the compressed
step's; an element with a zero variance after the refresh stays held (a +0 momentum, no
update), one whose gradient gave it a variance trains from now on.

Error feedback: with ``precondition=True`` the 1-bit collectives compress ``u = m / d`` and their
errors are in units of the denominator d the variance had. ``"rescale"`` (default) multiplies
each error element by ``d_old / d_new`` (:meth:`scale_error_feedback` of the collectives), so
the momentum it stands for, ``e * d``, is unchanged; where either denominator is infinite (a held
element) the error is 0. No bytes. ``"fold"`` folds every rank's errors into the momentum first
(:meth:`~hvd_onebit.engine.error_feedback.ErrorFeedback.flush`, one more
full-precision allreduce) and the errors restart from 0. Errors of the momentum itself
(``precondition=False``) need neither.

Passes: per piece of a bucket one native pass takes the old denominators, both moments and their
ratio (:func:`~hvd_onebit.kernels.refresh_moments`); each collective then scales its factored
errors in place (:func:`~hvd_onebit.kernels.rescale_error`); Adam's update is one more.
Memory: one float32 buffer of a bucket at a time (the ratio).
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch

from .. import kernels
from ..param_groups import groups_by_param
from ..variance_refresh import RefreshSchedule
from .adam_terms import AdamTerms, bucket_update, mask_momentum, masked_params
from .collectives import Collectives
from .error_feedback import ErrorFeedback
from .fusion import FusedBuckets
from .variance import FrozenVariance


class VarianceRefresh:
    """A refresh step over the buckets (see the module docstring).

    Args:
        options: the ``variance_refresh`` options (``variance_update``).
        backend: the kernel backend.
        fused: the buckets.
        collectives: their collectives (the errors rescaled).
        variance: the frozen variance (its counts and host step counts).
        terms: Adam's terms (denominators, the update).
        error_feedback: folded first with ``error_feedback="fold"``.
    """

    def __init__(self, options: Optional[RefreshSchedule], backend: str, fused: FusedBuckets,
                 collectives: Collectives, variance: FrozenVariance, terms: AdamTerms,
                 error_feedback: ErrorFeedback):
        self.options = options
        self.backend = backend
        self.fused = fused
        self.collectives = collectives
        self.variance = variance
        self.terms = terms
        self.error_feedback = error_feedback
        self.state = variance.state

    def run(self, param_groups: list[dict], grads: Mapping[torch.Tensor, Optional[torch.Tensor]],
            error_feedback: str = "rescale") -> int:
        """One refresh step of every bucketed parameter; the buckets must be ready. ``grads``:
        each parameter's averaged gradient as Adam takes it in (float32 for low-precision
        parameters; L2 decay, ``maximize`` and Horovod's op applied), finite and the same on
        every rank; None (no gradient on any rank): the momentum decays as in a compressed
        step, the variance and its count stay as they are (as Adam's do for a parameter
        without a gradient). Returns the bytes this rank sent here (a fold's; 0 otherwise).

        Raises:
            NonFiniteInputError: on every rank, from a fold that met a non-finite error;
                nothing was changed.
        """
        nbytes = 0
        if error_feedback == "fold":
            nbytes = self.error_feedback.flush(param_groups)
        groups = groups_by_param(param_groups)
        owner = list(self.fused.params)
        old = {p: self.terms.denominator(p, groups[p]).sqrt_bc2 for p in owner}  # before
        # Per parameter, how much of the variance's running average the new g^2 takes: "gap"
        # weighs it as the k steps since the last update (frozen_variance_step is then that
        # update's step count, and bc2 counts steps); "single" as one update (it counts them).
        weight = {}
        for p in owner:
            if grads.get(p) is None:  # no gradient anywhere: v and its count stay, as Adam's do
                continue
            state, beta2 = self.state[p], groups[p]["betas"][1]
            last = max(int(state["frozen_variance_step"]), 0)
            if self.options.variance_update == "gap":
                t = int(self.variance.host_step(p)) + 1
                weight[p] = 1 - beta2 ** max(t - last, 1)
                state["frozen_variance_step"] = t
            else:
                weight[p] = 1 - beta2
                state["frozen_variance_step"] = last + 1
        new = {p: self.terms.denominator(p, groups[p]).sqrt_bc2 for p in owner}
        rescale = (error_feedback == "rescale" and self.terms.preconditioned
                   and bool(self.collectives.comms))
        for b in self.fused.buckets:
            self._moments(b, groups, grads, weight, old, new, rescale)
        for _, p, mask in masked_params(param_groups, owner):
            mask_momentum(self.state, p, mask)
        updates = {p: self.terms.update(p, groups[p]) for p in owner}
        for b in self.fused.buckets:
            bucket_update(b, updates).copy_apply(b.momentum, b.momentum, self.backend)
        self.variance.count_step(owner)
        return nbytes

    def _moments(self, b, groups: dict, grads: Mapping, weight: dict, old: dict, new: dict,
                 rescale: bool) -> None:
        """Bucket ``b``'s momentum and variance updated, and with ``rescale`` its collective's
        errors carried from the old denominators into the new."""
        backend = self.backend
        # old / new denominator; 0 where either is inf (inf/x, x/inf, inf/inf)
        ratio = (torch.empty(b.numel, dtype=torch.float32, device=b.momentum.device)
                 if rescale else None)
        for i, seg in enumerate(b.segments):
            p = seg.param
            beta1, w = groups[p]["betas"][0], weight.get(p)
            m = b.piece(i, self.state[p]["exp_avg"])
            v = b.piece(i, self.state[p]["exp_avg_sq"])
            g = b.piece(i, grads.get(p))
            part = None if ratio is None else ratio[seg.offset:seg.offset + seg.numel]
            eps = float(groups[p]["eps"])
            if g is None:  # the momentum decays as in a compressed step; v stays
                m.mul_(beta1)
                if part is not None:
                    flat_v = v.reshape(-1)
                    kernels.denominators(flat_v, part, old[p], eps, backend)
                    kernels.divide_by_denominators(part, flat_v, new[p], eps, backend)
            else:  # both moments and the ratio in one pass
                kernels.refresh_moments(m, v, g, part, beta1, w, old[p], new[p], eps, backend)
        if rescale:
            self.collectives.of(b).scale_error_feedback(ratio)
