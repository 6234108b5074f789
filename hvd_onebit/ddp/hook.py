"""The DDP face's communication hook: DDP's own allreduce while gradients are averaged (the
warmup, variance refresh steps), the local gradient without communicating in the compression
phase, where the momentum travels in 1 bit from step() instead."""
from __future__ import annotations

from typing import Callable

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

ALREADY_HOOKED = (
    "hvd_onebit.ddp.DistributedOptimizer registers its own communication hook on the DDP model, "
    "and DDP allows one; this model already has one (register_comm_hook was called on it). "
    "Wrap a model without a hook")


def check_unhooked(model) -> None:
    """Raise a ValueError if ``model`` (a DDP module) has a communication hook already."""
    if getattr(model, "_comm_hooks", None):
        raise ValueError(ALREADY_HOOKED)


class CommHook:
    """One optimizer's hook on its DDP model, and what it counts.

    Args:
        group: the process group DDP averages over.
        averaging: whether the coming step takes averaged gradients (decided from the step count,
            alike on every rank, so every rank's hook does the same).
    """

    def __init__(self, group, averaging: Callable[[], bool]):
        self.group = group
        self._averaging = averaging
        self.local_buckets = 0  # DDP buckets handed back without communicating, over the run

    def register(self, model) -> None:
        """Register on ``model`` (a DDP module); raises a ValueError if it has a hook already."""
        check_unhooked(model)
        try:
            model.register_comm_hook(state=None, hook=self.communicate)
        except RuntimeError as exc:  # a builtin hook, registered on the reducer alone
            if "once" in str(exc):
                raise ValueError(ALREADY_HOOKED) from exc
            raise

    def communicate(self, state, bucket):
        """DDP's hook (``state`` is unused: this object holds its own). No annotations: DDP
        checks them against its own types."""
        if self._averaging():
            return allreduce_hook(self.group, bucket)
        self.local_buckets += 1
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done
