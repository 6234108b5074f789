"""One compressed step's exchange over the buckets: the buckets started early (from gradient
hooks), the 1-bit average of every bucket as one transaction, started again when an early
start's input went stale, or (``compressor="none"``) the exact average.
"""
from __future__ import annotations

import time
from typing import Mapping

import torch

from ..comm.protocol import NonFiniteInputError, StaleInputError
from ..comm.transaction import synchronize_all
from ..kernels.fused_adam import MomentumInput
from ..transport.base import JobTransport
from .adam_terms import AdamTerms
from .collectives import Collectives
from .fusion import FusedBuckets

# Where a compressed step's time goes, in seconds (CompressedStep.breakdown): the compression
# passes with their stage-1 starts, waiting on the transport, the server steps, the decode
# passes with Adam's update.
BREAKDOWN = ("compress", "wait", "server", "decode")


class Averaging:
    """The buckets' averages of one step, and the buckets started before it.

    Args:
        fused: the buckets.
        collectives: their 1-bit collectives.
        terms: Adam's terms (the inputs, the updates).
        transport: the compression phase's transport (the exact average).
    """

    def __init__(self, fused: FusedBuckets, collectives: Collectives, terms: AdamTerms,
                 transport: JobTransport):
        self.fused = fused
        self.collectives = collectives
        self.terms = terms
        self.transport = transport
        self.early: list = []  # handles of the buckets started before step(), in start order
        self._early_terms = None  # their input terms, computed once per step
        self.breakdown: dict[str, float] = dict.fromkeys(BREAKDOWN, 0.0)  # this step's seconds
        self.restarts = 0  # steps started again because an early start's input went stale
        self.early_starts = 0  # buckets started before step(), over the run

    def begin(self) -> None:
        """A new step: no bucket started, the time breakdown at zero."""
        self.drop()
        self.breakdown = dict.fromkeys(BREAKDOWN, 0.0)

    def drop(self) -> None:
        """Forget the buckets started early (after a reset: nothing is in flight)."""
        self.early = []
        self._early_terms = None

    def start_next(self, param_groups: list[dict], grads: Mapping) -> None:
        """Start the next bucket's exchange: its momentum update inside the compression pass,
        then stage 1."""
        b = self.fused.buckets[len(self.early)]
        start = time.perf_counter()
        if self._early_terms is None:  # once per step, not once per bucket
            self._early_terms = self.terms.inputs(param_groups, set(self.fused.params))
        x = self.terms.momentum_input(b, self._early_terms, grads)
        self.early.append(self.collectives.of(b).allreduce_async(x, out=b.momentum))
        self.early_starts += 1
        self.breakdown["compress"] += time.perf_counter() - start

    def abandon(self) -> None:
        """Wait out the buckets started early and drop them (error feedback and momenta are
        unchanged). Every rank must do it at the same point."""
        early, self.early = self.early, []
        if not early:  # nothing started (the buckets may not even be fused)
            return
        _drain([self.collectives.of(b) for b in self.fused.buckets], early)

    def onebit(self, param_groups: list[dict], owner: set, grads: Mapping, stale: bool) -> int:
        """Every bucket's 1-bit average, committed with Adam's update on every rank or on none;
        the bytes this rank sent."""
        early, self.early = self.early, []
        buckets = self.fused.buckets
        comms = [self.collectives.of(b) for b in buckets]
        for h in early:
            h.stale = stale
        terms: dict = {}  # the input terms as the options are now, once a bucket starts here

        def start(position: int):
            b = buckets[position]
            begun = time.perf_counter()
            if not terms:  # not when every bucket started early: a pass over every parameter
                terms.update(self.terms.inputs(param_groups, owner))
            # Decoded straight into exp_avg: outputs are written only once every bucket on every
            # rank has succeeded, so a skipped step leaves the momentum untouched.
            handle = comms[position].allreduce_async(self.terms.momentum_input(b, terms, grads),
                                                     out=b.momentum)
            self.breakdown["compress"] += time.perf_counter() - begun
            return handle

        handles = list(early)
        try:  # a parameter that cannot step (its state removed, converted to float64) raises
            for i in range(len(early), len(buckets)):  # on every rank: nothing left in flight
                handles.append(start(i))
            updates, masked = self.terms.plan(param_groups, buckets, owner)  # while stage 1 travels
        except Exception:
            _drain(comms, handles)
            raise
        try:
            synchronize_all(list(zip(comms, handles)), updates, clock=self.breakdown)
        except StaleInputError:
            # Every rank saw it in the same rows: every rank starts every bucket again, in order.
            self.restarts += 1
            handles = [start(i) for i in range(len(buckets))]
            synchronize_all(list(zip(comms, handles)), updates, clock=self.breakdown)
        self.terms.apply_masked(masked)
        # bytes this rank sent: the 1-bit rows, and (hierarchical) the full-precision shards
        # inside its node
        return sum(c.wire_bytes + getattr(c, "intra_bytes", 0) for c in comms)

    def exact(self, param_groups: list[dict], owner: set, grads: Mapping) -> int:
        """compressor="none": the momenta averaged in full precision (Adam with a frozen
        variance), through Horovod; the bytes this rank sent."""
        self.early = []
        buckets = self.fused.buckets
        terms = self.terms.inputs(param_groups, owner)
        inputs = [self.terms.momentum_input(b, terms, grads) for b in buckets]
        updates, masked = self.terms.plan(param_groups, buckets, owner)
        for b, x in zip(buckets, inputs):
            if isinstance(x, MomentumInput):
                x.materialize(out=b.work, backend=self.terms.backend)
        nbytes = self.transport.exact_mean_([b.work for b in buckets], "hvd_onebit.exact")
        for b in buckets:  # the same averaged values on every rank: the same decision
            if not bool(torch.isfinite(b.work).all()):
                raise NonFiniteInputError([], "in the averaged momentum")
        for b, u in zip(buckets, updates):
            b.momentum.copy_(b.work)
            u.apply(b.momentum)
        self.terms.apply_masked(masked)
        return nbytes


def _drain(comms: list, handles: list) -> None:
    """Wait out calls in flight and drop them (error feedback and momenta unchanged)."""
    for comm, h in zip(comms, handles):
        try:
            comm.claim(h)
            comm.drain(h)
        finally:
            comm.release()
