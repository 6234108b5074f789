"""Buffer fusion: many parameters' momenta laid back to back in a few large flat buffers.

1-bit compression only pays off on large messages: every call has a fixed cost (two collectives,
a negotiation round in Horovod, kernel start-up) and Horovod never fuses alltoalls. So the
optimizer keeps each parameter's ``exp_avg`` as a *view* into a flat bucket, and one
OneBitAllreduce per bucket moves all of them: two collectives per bucket per step, not per
parameter. Each bucket also has a same-shaped *work* buffer where the local momentum
``beta1 * m + (1 - beta1) * g`` is written before the allreduce, so ``exp_avg`` itself is only
overwritten once every rank has succeeded. The 1-bit path computes that local momentum inside
its compression kernel instead, so the work buffer is only allocated when a path needs it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Bucket:
    """Parameters sharing one flat momentum buffer (one dtype, one device)."""

    index: int
    params: list[torch.Tensor]
    offsets: list[int]
    numel: int
    momentum: torch.Tensor  # [numel], exp_avg of every member, back to back
    _work: Optional[torch.Tensor] = None

    @property
    def work(self) -> torch.Tensor:
        """[numel], like momentum: a buffer for the local momentum, allocated on first use."""
        if self._work is None:
            self._work = torch.empty_like(self.momentum)
        return self._work

    def momentum_view(self, i: int) -> torch.Tensor:
        """exp_avg of member ``i``, shaped like its parameter, sharing the bucket's storage."""
        p, off = self.params[i], self.offsets[i]
        return self.momentum[off:off + p.numel()].view_as(p)

    def work_view(self, i: int) -> torch.Tensor:
        p, off = self.params[i], self.offsets[i]
        return self.work[off:off + p.numel()].view_as(p)


def plan_buckets(params: list[torch.Tensor], bucket_numel: int) -> list[list[int]]:
    """Group parameter indices into buckets of at most ``bucket_numel`` elements.

    Parameters keep their order; a bucket holds one (device, dtype); a parameter larger than
    ``bucket_numel`` gets a bucket of its own. A small parameter (at most 1/16 of
    ``bucket_numel``) joins the open bucket even where it overflows it, so a bias never gets a
    bucket (and two collectives) of its own behind a full one. Deterministic, so every rank plans
    the same buckets.
    """
    small = bucket_numel // 16
    if bucket_numel <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_numel} elements")
    buckets: list[list[int]] = []
    open_bucket: dict[tuple, int] = {}  # (device, dtype) -> index into buckets
    sizes: list[int] = []
    for i, p in enumerate(params):
        key = (p.device, p.dtype)
        b = open_bucket.get(key)
        if b is None or (sizes[b] + p.numel() > bucket_numel and p.numel() > small):
            buckets.append([])
            sizes.append(0)
            b = open_bucket[key] = len(buckets) - 1
        buckets[b].append(i)
        sizes[b] += p.numel()
    return buckets


def fuse(params: list[torch.Tensor], momenta: list[torch.Tensor],
         bucket_numel: int) -> list[Bucket]:
    """Copy ``momenta`` (one per parameter) into fresh flat buckets; return the buckets.

    A bucket's buffer has its members' momentum dtype (float32 for float16 and bfloat16
    parameters, whose optimizer state is float32). The caller replaces each parameter's
    ``exp_avg`` with ``bucket.momentum_view(i)``.
    """
    out = []
    for index, members in enumerate(plan_buckets(params, bucket_numel)):
        ps = [params[i] for i in members]
        offsets, total = [], 0
        for p in ps:
            offsets.append(total)
            total += p.numel()
        like = momenta[members[0]]
        momentum = torch.empty(total, dtype=like.dtype, device=like.device)
        bucket = Bucket(index=index, params=ps, offsets=offsets, numel=total, momentum=momentum)
        for j, i in enumerate(members):
            bucket.momentum_view(j).copy_(momenta[i])
        out.append(bucket)
    return out
