"""CompressedStep: 1-bit Adam's compression phase, the orchestration of its parts (each with its
own state, handed what it needs): :class:`FusedBuckets`, :class:`Collectives`,
:class:`ErrorFeedback`, :class:`FrozenVariance`, :class:`AdamTerms`, :class:`Averaging` (a step
as one transaction over every bucket) and :class:`VarianceRefresh`. Without Horovod's optimizer
class, it runs as well on the in-process transport (ranks as threads) as in ``horovodrun``.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

import torch

from ..config import OneBitConfig
from ..job import shared_memory_inside_nodes, spare_errors
from ..transport.base import JobTransport, Transport
from ..transport.registry import job_transport
from .adam_terms import AdamTerms
from .averaging import Averaging
from .collectives import Collectives
from .error_feedback import ErrorFeedback
from .fusion import FusedBuckets
from .host_options import HostOptions
from .refresh import VarianceRefresh
from .variance import FrozenVariance

ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq")


def missing_state(state: Mapping, params: list, names: Mapping) -> Optional[str]:
    """The refusal naming the first of ``params`` whose Adam state lacks one of
    :data:`ADAM_KEYS`, or None. In the compression phase that state is the momentum and the
    frozen variance: torch's Adam would start a removed entry from zeros, which here would hold
    the parameter fixed (a zero variance) or step it on a momentum the other ranks lack."""
    for p in params:
        entry = state.get(p)  # not state[p]: a defaultdict would insert an entry
        lacking = [k for k in ADAM_KEYS if entry is None or k not in entry]
        if lacking:
            name = names.get(p) or f"of shape {tuple(p.shape)}"
            return (f"hvd_onebit: the Adam state of parameter {name} lacks {', '.join(lacking)} "
                    "in the compression phase (an entry removed: opt.state.pop(p), "
                    "opt.state[p] = {}, opt.state.clear()): its momentum and frozen variance "
                    "are gone. Restore a saved state with load_state_dict() on every rank, "
                    "change the entries' values in place, or build the optimizer again to start "
                    "Adam afresh")
    return None


class CompressedStep:
    """The compression phase over an Adam optimizer's parameters and state.

    Args:
        config: the validated 1-bit options, read here once into the parts.
        state: Adam's per-parameter state (``exp_avg``, ``exp_avg_sq``, ``step``,
            ``frozen_variance_step``), read and written in place.
        decoupled: whether a param group's weight decay is AdamW's (decoupled) or Adam's (L2).
        process_set: the Horovod process set of a transport given by name (None: the global one).
        transport: a :class:`~hvd_onebit.transport.base.JobTransport` (``phases.setup.connect``
            builds one), a transport's name, or a Transport object (e.g. the in-process one);
            None: ``config.transport``.
        names: parameter names for messages.
    """

    def __init__(self, config: OneBitConfig, state: Mapping[torch.Tensor, dict],
                 decoupled: Callable[[dict], bool], process_set=None,
                 transport: str | Transport | JobTransport | None = None,
                 names: Optional[Mapping[torch.Tensor, str]] = None):
        self.state = state
        self.transport = job_transport(config.transport if transport is None else transport,
                                       process_set)
        onebit = config.compressor == "onebit"
        if not onebit and not self.transport.exact_average:
            raise ValueError("compressor='none' averages through Horovod; a transport object "
                             "carries only the 1-bit collective")
        backend = config.kernel_backend
        self.fused = FusedBuckets(state, config.bucket_numel, names)
        self.variance = FrozenVariance(state, config.zero_variance, config.refresh is not None,
                                       names if names is not None else {})
        self.terms = AdamTerms(state, self.variance, decoupled, config.step_bound,
                               config.precondition and onebit, backend)
        self.collectives = Collectives(
            self.transport, onebit=onebit, block_size=config.block_size, backend=backend,
            hierarchical=config.hierarchical, intra_node=config.intra_node,
            spare_errors=lambda device: spare_errors(config.memory, device),
            shared_memory=lambda transport, device: shared_memory_inside_nodes(
                config.intra_node, transport, device))
        self.error_feedback = ErrorFeedback(state, self.fused, self.collectives, self.terms,
                                            self.transport)
        self.refresher = VarianceRefresh(config.refresh, backend, self.fused, self.collectives,
                                         self.variance, self.terms, self.error_feedback)
        self.averaging = Averaging(self.fused, self.collectives, self.terms, self.transport)
        self.options = HostOptions()  # tensor options (lr, betas) read once per step

    world = property(lambda self: self.transport.size, doc="Ranks taking part now.")
    rank = property(lambda self: self.transport.rank)
    buckets = property(lambda self: self.fused.buckets)
    params = property(lambda self: self.fused.params, doc="The bucketed parameters, in order.")
    positions = property(lambda self: self.fused.position,
                         doc="Each bucketed parameter's bucket indices, in order.")
    indices = property(lambda self: self.fused.index, doc="Each bucketed parameter's place.")
    start_order = property(lambda self: self.fused.start_order,
                           doc="The places, in the order of each parameter's first bucket.")
    comms = property(lambda self: self.collectives.comms)
    preconditioned = property(lambda self: self.terms.preconditioned)
    breakdown = property(lambda self: self.averaging.breakdown, doc="This step's seconds.")
    restarts = property(lambda self: self.averaging.restarts)
    early_starts = property(lambda self: self.averaging.early_starts)
    # buckets started for the coming step, the position of the next (one order on every rank)
    started = next_to_start = property(lambda self: len(self.averaging.early))

    @property
    def hierarchical(self) -> Optional[bool]:
        """Whether the 1-bit stage is hierarchical; None until the first compressed step."""
        return self.collectives.decided_hierarchical

    def topology(self):
        """The nodes' layout when the 1-bit stage is hierarchical, else None."""
        return self.collectives.topology()

    def saved_comms(self) -> dict:
        return self.collectives.saved()

    def up_to_date(self, active: list[torch.Tensor]) -> bool:
        """Whether the buckets and collectives fit the trainable set ``active`` and the world
        (not where a parameter's Adam state was removed: :meth:`fuse` then refuses it)."""
        return self.fused.fits(active) and self.collectives.covers(self.fused.buckets)

    def _check_state(self, params: list[torch.Tensor]) -> None:
        refusal = missing_state(self.state, params, self.variance.names)
        if refusal is not None:
            raise RuntimeError(refusal)

    def fuse(self, active: list[torch.Tensor]) -> None:
        """(Re)build the buckets and their collectives (during the last warmup allreduce)."""
        self._check_state(active)
        self.fused.fuse(active)
        self.terms.clear()
        self.collectives.fit(self.fused.buckets)
        self.error_feedback.apply_pending()

    def ensure_ready(self, active: list[torch.Tensor], checked: bool = False) -> None:
        """Buckets for the current trainable set, and the frozen variance scanned once per set
        (``checked``: :meth:`up_to_date` just said they fit)."""
        if not checked and not self.up_to_date(active):
            self.fuse(active)
        self.variance.freeze_once(self.params, self.fused.buckets)

    def restart(self) -> None:
        """The optimizer state was replaced (a load, or another rank's state broadcast into
        this one): re-fuse the momenta and scan the frozen variance again at the next step, and
        start the error feedback from zero (a saved one given since or after is applied at the
        fusing), keeping the collectives. Local: one rank may call it alone, and the ranks'
        sequence of collectives stays the same."""
        self.fused.clear()
        self.terms.clear()
        self.error_feedback.zeroed()
        self.variance.clear()
        self.averaging.drop()

    def reset(self) -> None:
        """Drop the buckets and collectives (with their error feedback); the next step rebuilds
        them. Every rank must call it at the same point."""
        self.restart()
        self.collectives.reset()

    @property
    def can_start_early(self) -> bool:
        """Whether buckets may start before :meth:`step`, from gradient hooks: the flat 1-bit
        collective over several ranks."""
        return (self.collectives.onebit and self.world > 1 and self.buckets is not None
                and self.topology() is None)

    def bucket_params(self, position: int) -> list[torch.Tensor]:
        return self.buckets[position].params

    def start_bucket(self, param_groups: list[dict], grads: Mapping) -> None:
        """Start the next bucket's exchange now (``grads`` as for :meth:`step`)."""
        try:
            self.averaging.start_next(self.options.of(param_groups), grads)
        except KeyError:
            self._check_state(self.params)
            raise

    def abandon_early(self) -> None:
        """Wait out the buckets started early and drop them (the step is not taken)."""
        self.averaging.abandon()

    def begin_step(self) -> None:
        """A new step: no bucket started, the time breakdown at zero."""
        self.averaging.begin()

    def step(self, param_groups: list[dict], grads: Mapping[torch.Tensor, Optional[torch.Tensor]],
             stale: bool = False) -> int:
        """One compressed step of every bucketed parameter; returns the bytes this rank sent.

        Args:
            param_groups: Adam's param groups (lr, betas, eps, weight_decay, exp_avg_mask).
            grads: each bucketed parameter's local gradient (float32 for low-precision
                parameters; Adam's L2 decay, ``maximize`` and the averaging op applied), or None
                where this rank computed none; read for the buckets not started early.
            stale: the buckets started early read inputs now out of date on this rank: every
                rank abandons them together and starts every bucket again from ``grads``.
        Raises:
            NonFiniteInputError: on every rank when any rank's momentum (or a server's average)
                was not finite; then nothing was changed anywhere.
        """
        owner, param_groups = set(self.params), self.options.of(param_groups)
        if self.collectives.onebit:
            try:
                nbytes = self.averaging.onebit(param_groups, owner, grads, stale)
            except KeyError:  # an entry of Adam's state removed: say which
                self._check_state(self.params)
                raise
            if self.world > 1:
                self.error_feedback.committed()
        else:
            nbytes = self.averaging.exact(param_groups, owner, grads)
        self.variance.count_step(owner)
        return nbytes

    def ranks_with(self, flags: Sequence, device: torch.device) -> tuple[int, ...]:
        """On how many ranks each of ``flags`` is set: one exact sum of one small vector through
        the transport, for decisions every rank must take alike from what only it has seen.
        A flag is a bool or a 0-dim tensor on ``device``, written into the vector unread (the
        sum's result is the one read); the vector is filled on the device (a tensor built from
        a Python list copies from the host, which on a GPU waits for the stream)."""
        if self.world == 1:
            return tuple(int(f) for f in flags)
        vector = torch.zeros(len(flags), device=device)
        for i, f in enumerate(flags):
            if isinstance(f, torch.Tensor):
                vector[i] = f
            elif f:
                vector[i] = 1.0
        (counts,), _ = self.transport.exact_sum([vector], "hvd_onebit.agree")
        return tuple(int(c) for c in counts.tolist())

    def from_first_rank(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The first rank's ``tensors`` on every rank, bit for bit, where every other rank
        passes zeros of the same shapes: one exact sum (``x + 0`` is ``x``)."""
        if self.world == 1:
            return list(tensors)
        sums, _ = self.transport.exact_sum(list(tensors), "hvd_onebit.from_first")
        return sums

    def refresh(self, param_groups: list[dict], grads: Mapping,
                error_feedback: str = "rescale") -> int:
        """A variance refresh step (:meth:`VarianceRefresh.run`); the bytes this rank sent."""
        return self.refresher.run(self.options.of(param_groups), grads, error_feedback)

    def flush_error_feedback(self, param_groups: list[dict]) -> int:
        """Fold every rank's errors into the momentum (:meth:`ErrorFeedback.flush`)."""
        return self.error_feedback.flush(self.options.of(param_groups))

    def error_feedback_state_dict(self) -> dict:
        return self.error_feedback.state_dict()

    def load_error_feedback_state_dict(self, state: dict) -> None:
        self.error_feedback.load_state_dict(state)

    @property
    def unflushed(self) -> bool:
        """Whether the error feedback holds what compression has not delivered yet (a
        checkpoint without it, or without a flush first, drops that)."""
        return self.error_feedback.undelivered

    def expect_error_feedback(self, step: Optional[int]) -> None:
        """A checkpoint at ``step`` saved with unflushed errors was loaded: warn at the next
        fusing unless this rank's are loaded first (:meth:`ErrorFeedback.expect_saved`);
        None: expect none (a load that drops them by design, as an elastic restore)."""
        self.error_feedback.expect_saved(step)
