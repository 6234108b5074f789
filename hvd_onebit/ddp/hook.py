"""The DDP face's communication hook: DDP's own averaging while gradients are averaged (the
warmup, variance refresh steps), the local gradient without communicating in the compression
phase, where the momentum travels in 1 bit instead: its buckets start from here as DDP's buckets
become ready (:mod:`hvd_onebit.overlap`), the rest in step().

DDP copies each bucket's result back into ``p.grad`` when backward ends: the values the starts
read, with another version. A callback queued behind DDP's own end-of-backward callback tells the
overlap so (:meth:`~hvd_onebit.overlap.Overlap.settle`); any change after that (a clip, an
unscale that is not the assumed one) is still seen, and the buckets start again in step()."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..overlap import Overlap

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
        overlap: the :class:`~hvd_onebit.overlap.Overlap` told of each local bucket's parameters
            (their gradients are final) and, once DDP has written the last local bucket back into
            the gradients, to settle; None: every bucket starts in step().
    """

    def __init__(self, group, averaging: Callable[[], bool], overlap: Optional[Overlap]):
        self.group = group
        self._averaging = averaging
        self._overlap = overlap
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

    def _average(self, buffer: torch.Tensor) -> torch.futures.Future:
        """DDP's own averaging, bit for bit: each gradient times 1/n, as DDP's reducer scales
        them into the bucket when no hook is registered (torch's ``allreduce_hook`` divides by
        n instead, which rounds otherwise where 1/n is inexact), then the allreduce's sum."""
        buffer.mul_(1.0 / dist.get_world_size(self.group))
        work = dist.all_reduce(buffer, group=self.group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    def communicate(self, state, bucket):
        """DDP's hook (``state`` is unused: this object holds its own). No annotations: DDP
        checks them against its own types."""
        if self._averaging():
            return self._average(bucket.buffer())
        self.local_buckets += 1
        if self._overlap is not None:
            for p in bucket.parameters():
                self._overlap.gradient_ready(p)
            if bucket.is_last():
                # DDP queues its end of backward right after this hook returns; a callback
                # queued from here runs before it, and the one it queues runs after it.
                queue = torch.autograd.Variable._execution_engine.queue_callback
                queue(lambda: queue(self._overlap.settle))
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done
