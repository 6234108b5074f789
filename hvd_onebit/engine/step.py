"""CompressedStep: 1-bit Adam's compression phase as an engine of its own.

It owns everything the phase adds to Adam: the fused momentum buckets (each parameter's
``exp_avg`` becomes a view into one), one :class:`~hvd_onebit.OneBitAllreduce` per bucket with its
rank-local error feedback, and the all-or-nothing commit of a step across buckets. The frozen
variance's denominators are not stored: the decode pass computes them from ``exp_avg_sq``. It
reads Adam's state and param groups, and writes only through the step it commits; it knows
nothing of Horovod's optimizer class, so it runs as well on the in-process transport (n ranks
as threads) as inside ``horovodrun``.

One step, per bucket (see :mod:`hvd_onebit.kernels.fused_adam`): the local momentum
``beta1 * m + (1 - beta1) * g`` is computed inside the worker compression; stage 1 of every
bucket is started before any is finished; the update terms are prepared while stage 1 is on the
wire; the decode of each averaged momentum applies Adam's update
``w = w * decay - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)``, only once every bucket on every
rank has succeeded (:func:`~hvd_onebit.comm.transaction.synchronize_all`).
"""
from __future__ import annotations

import time
import warnings
from typing import Callable, Mapping, Optional

import horovod.torch as hvd
import torch

from ..comm.flat import OneBitAllreduce
from ..comm.hierarchical import HierarchicalOneBitAllreduce
from ..comm.protocol import NonFiniteInputError, StaleInputError
from ..comm.topology import Topology
from ..comm.transaction import synchronize_all
from ..config import OneBitConfig, check_one_device
from ..job import shared_memory_inside_nodes, spare_errors
from ..kernels.fused_adam import MomentumInput
from ..layout import ring_allreduce_bytes
from ..transport.shared_memory import SharedMemoryError
from ..transport.base import Transport
from ..transport.horovod import exact_allreduces
from ..transport.registry import resolve_transport
from .fusion import Bucket, fuse, param_offsets
from .adam_terms import AdamTerms
from .error_feedback import ErrorFeedbackLifecycle
from .refresh import VarianceRefresh
from .variance import FrozenVariance

# Where a compressed step's time goes, in seconds (CompressedStep.breakdown): the compression
# passes with their stage-1 starts, waiting on the transport, the server steps, the decode
# passes with Adam's update.
BREAKDOWN = ("compress", "wait", "server", "decode")

def process_set_size(process_set: Optional[hvd.ProcessSet]) -> int:
    """Ranks in ``process_set`` now (elastic jobs change it); 1 on a rank outside it."""
    if process_set is None or not process_set.included():
        return 1
    return process_set.size()

class CompressedStep(ErrorFeedbackLifecycle, FrozenVariance, AdamTerms, VarianceRefresh):
    """The compression phase over an Adam optimizer's parameters and state.

    Args:
        config: the validated 1-bit options.
        state: Adam's per-parameter state (``exp_avg``, ``exp_avg_sq``, ``step``,
            ``frozen_variance_step``), read and written in place.
        decoupled: whether a param group's weight decay is AdamW's (decoupled) or Adam's (L2).
        process_set: the Horovod process set to reduce over (with ``transport`` a name).
        transport: "horovod" or "mpi" (over ``process_set``), or a
            :class:`~hvd_onebit.transport.base.Transport` instance (e.g. the in-process one).
        names: parameter names for messages.
    """

    def __init__(self, config: OneBitConfig, state: Mapping[torch.Tensor, dict],
                 decoupled: Callable[[dict], bool],
                 process_set: Optional[hvd.ProcessSet] = hvd.global_process_set,
                 transport: str | Transport | None = None,
                 names: Optional[Mapping[torch.Tensor, str]] = None):
        self.config = config
        self.state = state
        self.decoupled = decoupled
        self.process_set = process_set
        self.transport = config.transport if transport is None else transport
        if not isinstance(self.transport, str) and config.compressor != "onebit":
            raise ValueError("compressor='none' averages through Horovod; a transport object "
                             "carries only the 1-bit collective")
        self.names = names if names is not None else {}
        self.buckets: Optional[list[Bucket]] = None
        self.params: list[torch.Tensor] = []  # the bucketed parameters, in the order given to fuse()
        self.comms: dict[tuple, OneBitAllreduce] = {}
        # Each parameter's step count on the host, keyed by the step tensor and its version:
        # reading a device tensor's value every step would be a host sync per parameter.
        self._host_steps: dict[torch.Tensor, tuple] = {}
        self._momentum_views: dict[torch.Tensor, torch.Tensor] = {}  # exp_avg in the flat buffer
        self._variance_scanned_for: Optional[list[Bucket]] = None
        self._pending_error_feedback: Optional[dict] = None
        self._generation = 0  # bumped by reset(): the collectives' key
        self._topology: Topology | bool | None = None  # None: not decided yet; False: flat
        self._early: list = []  # handles of the buckets started before step(), in start order
        self._early_terms: Optional[dict] = None  # their _input_terms, computed once per step
        self.breakdown: dict[str, float] = dict.fromkeys(BREAKDOWN, 0.0)  # this step's seconds
        self.restarts = 0  # steps started again because an early start's input went stale
        self.early_starts = 0  # buckets started before step(), over the run
        self.last_refresh_declined = 0  # parameters the last refresh left their variance

    # ---- the world ---------------------------------------------------------------------------------

    @property
    def world(self) -> int:
        """Ranks taking part now (elastic jobs change it)."""
        if not isinstance(self.transport, str):
            return self.transport.size
        return process_set_size(self.process_set)

    @property
    def rank(self) -> int:
        if not isinstance(self.transport, str):
            return self.transport.rank
        return self.process_set.rank()

    # ---- buckets and collectives ---------------------------------------------------------------

    def up_to_date(self, active: list[torch.Tensor]) -> bool:
        """Whether the buckets and collectives fit the trainable set ``active`` and the world."""
        return self.buckets is not None and all(
            self._key(b) in self.comms for b in self.buckets
            if self.config.compressor == "onebit") and len(active) == len(self.params) and all(
            a is b for a, b in zip(active, self.params)) and all(
            self.state[p]["exp_avg"].data_ptr() == view.data_ptr()
            for p, view in self._momentum_views.items())

    def fuse(self, active: list[torch.Tensor]) -> None:
        """(Re)build the fused momentum buckets (``exp_avg`` becomes views into them) and their
        collectives. The optimizer calls it during the last warmup step's allreduce wait where
        it can, so the first compressed step does not pay for allocating and touching them."""
        check_one_device(active)
        # Backward produces gradients roughly in the reverse of the parameters' order, so the
        # buckets are planned from the last parameter: the first bucket is the first one whose
        # gradients are all ready, and buckets start in order (see start_bucket).
        order = active[::-1]
        flat, self.buckets = fuse(order, [self.state[p]["exp_avg"] for p in order],
                                  self.config.bucket_numel)
        self.params = list(active)
        self._momentum_views = {p: flat[off:off + p.numel()].view_as(p)
                                for p, off in zip(order, param_offsets(order))}
        for p, view in self._momentum_views.items():
            self.state[p]["exp_avg"] = view
        # Error feedback belongs to a bucket layout and a world size; a change starts from zero.
        wanted = {self._key(b) for b in self.buckets}
        self.comms = {k: c for k, c in self.comms.items() if k in wanted}
        for b in self.buckets:
            key = self._key(b)
            if key not in self.comms and self.config.compressor == "onebit":
                self.comms[key] = self._collective(b)
        self._apply_pending_error_feedback()

    def _collective(self, b: Bucket):
        """The 1-bit collective of bucket ``b``: hierarchical (nodes) or flat."""
        common = dict(block_size=self.config.block_size, backend=self.config.kernel_backend,
                      device=b.momentum.device, defer_check=True,
                      spare_errors=spare_errors(self.config.memory, b.momentum.device))
        topology = self.topology()
        if topology is not None:
            transport = resolve_transport(self.transport, self.process_set, b.momentum.device)
            name = f"hvd_onebit.hier{b.index}"
            if shared_memory_inside_nodes(self.config.intra_node, transport, b.momentum.device):
                comm, failure = None, ""
                try:
                    comm = HierarchicalOneBitAllreduce(b.numel, topology, name=name,
                                                       transport=transport, **common,
                                                       intra="shared_memory")
                except SharedMemoryError as exc:  # the same on every rank of this node
                    failure = str(exc)
                if self.config.intra_node == "shared_memory":
                    # asked for: every rank raises if any node failed (none waits for it)
                    _raise_if_any_failed(failure)
                if comm is not None:
                    return comm
                # each node chooses for itself: the stages between nodes are the same either way
                warnings.warn(f"hvd_onebit: this node's stages use the network: {failure}")
            return HierarchicalOneBitAllreduce(b.numel, topology, name=name,
                                               transport=transport, **common)
        return OneBitAllreduce(b.numel, self.process_set, transport=self.transport,
                               name=f"hvd_onebit.bucket{b.index}", **common)

    def topology(self) -> Optional[Topology]:
        """The nodes' layout when the 1-bit stage is hierarchical in this world, else None.

        ``hierarchical="auto"`` is on when there are several nodes of several ranks each, all
        alike; the decision rests on one allgather of every rank's (node, local rank), so it is
        the same on every rank. Kept until :meth:`reset` (an elastic reset re-decides)."""
        if self._topology is None:
            mode = self.config.hierarchical
            if mode is False or not isinstance(self.transport, str) or self.world == 1:
                self._topology = False
            else:
                try:
                    topo = Topology.from_horovod()
                except ValueError as exc:
                    if mode is True:
                        raise
                    warnings.warn(f"hvd_onebit: hierarchical='auto' stays flat: {exc}")
                    topo = None
                if mode == "auto" and topo is not None and (topo.nodes == 1 or topo.per_node == 1):
                    topo = None
                self._topology = topo if topo is not None else False
        return self._topology or None

    def ensure_ready(self, active: list[torch.Tensor]) -> None:
        """Buckets for the current trainable set, and the frozen variance scanned once per set."""
        if not self.up_to_date(active):
            self.fuse(active)
        if self._variance_scanned_for is not self.buckets:
            self._freeze_variances(self.params)
            self._variance_scanned_for = self.buckets

    def reset(self) -> None:
        """Drop the buckets, denominators and collectives (with their error feedback); the next
        step rebuilds them. Every rank must call it at the same point."""
        self.buckets = None
        self._variance_scanned_for = None
        self.params = []
        self.comms.clear()
        self._host_steps.clear()
        self._momentum_views = {}
        self._topology = None
        self._early = []
        self._early_terms = None
        self._generation += 1

    def _key(self, b: Bucket) -> tuple:
        return (b.index, b.numel, str(b.momentum.dtype).replace("torch.", ""), self.world,
                self._generation)

    # ---- the step -------------------------------------------------------------------------------

    # ---- starting buckets early ------------------------------------------------------------------

    @property
    def can_start_early(self) -> bool:
        """Whether buckets may be started before :meth:`step` (from gradient hooks): the flat
        1-bit collective over several ranks. (compressor="none" averages through Horovod's
        allreduce in step(); the hierarchical collective is started there too.)"""
        return (self.config.compressor == "onebit" and self.world > 1
                and self.buckets is not None and self.topology() is None)

    def bucket_params(self, position: int) -> list[torch.Tensor]:
        """The parameters of the bucket at ``position`` in start order."""
        return self.buckets[position].params

    @property
    def next_to_start(self) -> int:
        """Buckets start in one order on every rank (transports that match collectives by the
        order of the calls need it): the position of the next one to start."""
        return len(self._early)

    def start_bucket(self, param_groups: list[dict],
                     grads: Mapping[torch.Tensor, Optional[torch.Tensor]]) -> None:
        """Start the next bucket's exchange now: its momentum update inside the compression pass,
        then stage 1. :meth:`step` finishes it. ``grads`` as for :meth:`step` (only this
        bucket's parameters are read)."""
        b = self.buckets[self.next_to_start]
        start = time.perf_counter()
        if self._early_terms is None:  # once per step, not once per bucket
            self._early_terms = self._input_terms(param_groups)
        x = self._input(b, self._early_terms, grads)
        self._early.append(self.comms[self._key(b)].allreduce_async(x, out=b.momentum))
        self.early_starts += 1
        self.breakdown["compress"] += time.perf_counter() - start

    @property
    def started(self) -> int:
        """Buckets started for the coming step and not finished yet."""
        return len(self._early)

    def abandon_early(self) -> None:
        """Wait out the buckets started early and drop them (the step is not taken; error
        feedback and momenta are unchanged). Every rank must do it at the same point."""
        early, self._early = self._early, []
        for b, h in zip(self.buckets, early):
            comm = self.comms[self._key(b)]
            try:
                comm.claim(h)
                comm.drain(h)
            finally:
                comm.release()

    def begin_step(self) -> None:
        """A new step: no bucket started, the time breakdown at zero."""
        self._early = []
        self._early_terms = None
        self.breakdown = dict.fromkeys(BREAKDOWN, 0.0)

    # ---- the step -------------------------------------------------------------------------------

    def step(self, param_groups: list[dict], grads: Mapping[torch.Tensor, Optional[torch.Tensor]],
             stale: bool = False) -> int:
        """One compressed step of every bucketed parameter; returns the bytes this rank sent.

        Buckets started early (:meth:`start_bucket`) are finished; the others start here.

        Args:
            param_groups: Adam's param groups (lr, betas, eps, weight_decay, exp_avg_mask).
            grads: each bucketed parameter's local gradient (float32 for low-precision
                parameters; Adam's L2 decay, ``maximize`` and the averaging op already applied),
                or None where this rank computed none. Read only for buckets not yet started,
                or all of them when the step starts again.
            stale: the inputs of the buckets started early are out of date on this rank (the
                gradients or options changed since). Every rank then abandons them together and
                the step starts every bucket again from ``grads``: the result is the same as
                if nothing had started early.
        Raises:
            NonFiniteInputError: on every rank when any rank's momentum (or a server's average)
                was not finite; then nothing was changed anywhere.
        """
        early, self._early = self._early, []
        owner = set(self.params)
        if self.config.compressor == "onebit":
            nbytes = self._onebit_average(early, param_groups, owner, grads, stale)
        else:
            terms = self._input_terms(param_groups)
            inputs = [self._input(b, terms, grads) for b in self.buckets]
            nbytes = self._exact_average(inputs, param_groups, owner)
        for p in owner:
            value = self._host_step(p)
            self.state[p]["step"] += 1
            self._remember_step(p, value + 1)
        return nbytes

    def _onebit_average(self, early: list, param_groups: list[dict], owner: set,
                        grads: Mapping, stale: bool) -> int:
        comms = [self.comms[self._key(b)] for b in self.buckets]
        for h in early:
            h.stale = stale
        terms = self._input_terms(param_groups)

        def start(position: int):
            b = self.buckets[position]
            begun = time.perf_counter()
            # Decoded straight into exp_avg: outputs are written only once every bucket on every
            # rank has succeeded, so a skipped step leaves the momentum untouched.
            handle = comms[position].allreduce_async(self._input(b, terms, grads), out=b.momentum)
            self.breakdown["compress"] += time.perf_counter() - begun
            return handle

        handles = early + [start(i) for i in range(len(early), len(self.buckets))]
        updates, masked = self._plan_updates(param_groups, owner)  # while stage 1 is on the wire
        try:
            synchronize_all(list(zip(comms, handles)), updates, clock=self.breakdown)
        except StaleInputError:
            # Every rank saw it in the same rows: every rank starts every bucket again, in order.
            self.restarts += 1
            handles = [start(i) for i in range(len(self.buckets))]
            synchronize_all(list(zip(comms, handles)), updates, clock=self.breakdown)
        self._apply_masked(masked)
        # bytes this rank sent: the 1-bit rows, and (hierarchical) the full-precision shards
        # inside its node
        return sum(c.wire_bytes + getattr(c, "intra_bytes", 0) for c in comms)

    def _exact_average(self, inputs: list, param_groups: list[dict], owner: set) -> int:
        """compressor="none": the momenta averaged in full precision (Adam with a frozen
        variance), through Horovod."""
        updates, masked = self._plan_updates(param_groups, owner)
        for b, x in zip(self.buckets, inputs):
            if isinstance(x, MomentumInput):
                x.materialize(out=b.work, backend=self.config.kernel_backend)
        exact_allreduces([b.work for b in self.buckets], "hvd_onebit.exact", self.process_set,
                         average=True, in_place=True)
        for b in self.buckets:  # the same averaged values on every rank: the same decision
            if not bool(torch.isfinite(b.work).all()):
                raise NonFiniteInputError([], "in the averaged momentum")
        for b, u in zip(self.buckets, updates):
            b.momentum.copy_(b.work)
            u.apply(b.momentum)
        self._apply_masked(masked)
        return sum(ring_allreduce_bytes(b.numel * b.work.element_size(), self.world)
                   for b in self.buckets)


def _raise_if_any_failed(failure: str) -> None:
    """Raise SharedMemoryError on every rank if any rank's ``failure`` is not empty (one
    allgather on torch.distributed's default group)."""
    import torch.distributed as dist

    failures: list = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    failed = {rank: f for rank, f in enumerate(failures) if f}
    if failed:
        raise SharedMemoryError(f"intra_node='shared_memory' failed on rank(s) {sorted(failed)}: "
                                f"{next(iter(failed.values()))}")

