"""Adam's terms of one compressed step: what each bucket's allreduce input is made of, and
the update its decode applies (host numbers, prepared while stage 1 is on the wire). The math
lives in :mod:`hvd_onebit.kernels.fused_adam` and :mod:`hvd_onebit.step_bound`; this is the bookkeeping
that feeds it from the param groups and the state.
"""
from __future__ import annotations

import math
from typing import Mapping

import torch

from .. import step_bound
from ..config import group_masks
from ..kernels.fused_adam import AdamUpdate, MomentumInput
from .fusion import Bucket


class AdamTerms:
    """The Adam-terms half of :class:`~hvd_onebit.engine.step.CompressedStep` (a mixin)."""

    @property
    def preconditioned(self) -> bool:
        """Whether the 1-bit collectives carry the preconditioned momentum ``m / denom``
        (``precondition=True`` with the 1-bit compressor)."""
        return self.config.precondition and self.config.compressor == "onebit"

    def _input_terms(self, param_groups: list[dict]) -> dict:
        """Per bucketed parameter: (beta1, and when preconditioned its frozen variance,
        sqrt(bc2), eps and the bound on ``|m| / denom``; else four Nones): what its allreduce
        input is made of. The bound is Adam's on ``|m_hat| / sqrt(v_hat)`` at the step taken,
        times bc1 (``m`` is not bias-corrected): the momentum is kept where Adam's could be."""
        owner = set(self.params)
        terms = {}
        for g in param_groups:
            for p in g["params"]:
                if p not in owner:
                    continue
                if not self.preconditioned:
                    terms[p] = (g["betas"][0], None, None, None, None)
                    continue
                (beta1, beta2), t = g["betas"], int(self._host_step(p)) + 1
                bound = (1 - beta1 ** t) * step_bound.ratio_bound(self.config.step_bound,
                                                                  beta1, beta2, t)
                terms[p] = (beta1,) + self._denominator_terms(p, g) + (bound,)
        return terms

    def _denominator_terms(self, p: torch.Tensor, group: dict) -> tuple:
        """(frozen variance, sqrt(bc2), eps) of ``p``: its denominator, as the update has it."""
        frozen = self.state[p]["frozen_variance_step"]
        bc2 = 1 - group["betas"][1] ** frozen if frozen > 0 else 1.0
        return self.state[p]["exp_avg_sq"], math.sqrt(bc2), float(group["eps"])

    def _input(self, b: Bucket, terms: dict, grads: Mapping) -> object:
        """Bucket ``b``'s allreduce input: its local momentum ``beta1 * m + (1 - beta1) * g``
        (over its denominator when preconditioned), computed inside the compression pass where
        one beta1 serves the whole bucket."""
        sizes = [seg.numel for seg in b.segments]
        pieces = [b.piece(i, grads[seg.param]) for i, seg in enumerate(b.segments)]
        seg_terms = [terms[seg.param] for seg in b.segments]
        pre = {}
        if self.preconditioned:
            pre = dict(variances=[b.piece(i, t[1]) for i, t in enumerate(seg_terms)],
                       sqrt_bc2s=[t[2] for t in seg_terms], eps=[t[3] for t in seg_terms],
                       bounds=[t[4] for t in seg_terms])
        betas = {t[0] for t in seg_terms}
        if len(betas) == 1:
            return MomentumInput(b.momentum, pieces, sizes, betas.pop(), **pre)
        # param groups with different beta1 share the bucket: one member at a time
        for i, seg in enumerate(b.segments):
            one = {k: [v[i]] for k, v in pre.items()}
            MomentumInput(b.momentum_view(i), [pieces[i]], [sizes[i]], seg_terms[i][0],
                          **one).materialize(out=b.work_view(i),
                                             backend=self.config.kernel_backend)
        return b.work

    def _apply_masked(self, masked: list[tuple]) -> None:
        """Parameters with an exp_avg_mask: mask the averaged momentum, then the same update.
        (Held elements, whose denominator is inf, got no update and a zero momentum already.)"""
        for group, p, mask in masked:
            m = self.state[p]["exp_avg"]
            # in place (exp_avg is the bucket's view); the mask may live elsewhere, e.g. where
            # hvd.broadcast_optimizer_state unpickled it
            m.mul_(mask.to(device=m.device, dtype=m.dtype))
            w, v, step, decay, sqrt_bc2, eps, bound = self._update_terms(p, group)
            AdamUpdate([w], [v], [p.numel()], [step], [decay], [sqrt_bc2], [eps],
                       [bound]).apply(m)

    def _update_terms(self, p: torch.Tensor, group: dict) -> tuple:
        """(weight, frozen variance, step, decay, sqrt_bc2, eps, bound) of this step's
        ``w = w * decay + clamp(step * m / (sqrt(v) / sqrt_bc2 + eps), -bound, bound)`` (host
        numbers: no sync; ``bound = lr * B(t)``, :mod:`hvd_onebit.step_bound`)."""
        (beta1, beta2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
        t = int(self._host_step(p)) + 1
        bc1 = 1 - beta1 ** t
        decay = 1 - lr * wd if wd != 0 and self.decoupled(group) else 1.0
        variance, sqrt_bc2, eps = self._denominator_terms(p, group)
        bound = abs(lr) * step_bound.ratio_bound(self.config.step_bound, beta1, beta2, t)
        return p.detach(), variance, -lr / bc1, decay, sqrt_bc2, eps, bound

    def _plan_updates(self, param_groups: list[dict], owner: set
                      ) -> tuple[list[AdamUpdate], list[tuple]]:
        """Adam's update with the frozen variance, one :class:`AdamUpdate` per bucket, for the
        collective to apply in its decode pass once every rank has succeeded. Parameters with an
        ``exp_avg_mask`` are returned apart, as (group, param, mask): their momentum must be
        masked first (preconditioned, the decode pass still turns their average back into a
        momentum: it gets their variance and no weight)."""
        terms: dict = {}
        masked = []
        for group in param_groups:
            for p, mask in zip(group["params"], group_masks(group)):
                if p not in owner:
                    continue
                if mask is not None:
                    masked.append((group, p, mask))
                    if self.preconditioned:
                        terms[p] = (None,) + self._update_terms(p, group)[1:]
                else:
                    terms[p] = self._update_terms(p, group)
        updates = []
        for b in self.buckets:
            t = [terms.get(p) for p in b.params]
            updates.append(AdamUpdate(
                weights=[b.piece(i, x[0]) if x and x[0] is not None else None
                         for i, x in enumerate(t)],
                variances=[b.piece(i, x[1]) if x else None for i, x in enumerate(t)],
                sizes=[seg.numel for seg in b.segments], steps=[x[2] if x else 0.0 for x in t],
                decays=[x[3] if x else 1.0 for x in t], sqrt_bc2s=[x[4] if x else 1.0 for x in t],
                eps=[x[5] if x else 0.0 for x in t],
                bounds=[x[6] if x else math.inf for x in t], preconditioned=self.preconditioned))
        return updates, masked
