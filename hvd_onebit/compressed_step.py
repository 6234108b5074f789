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
rank has succeeded (:func:`~hvd_onebit.collective.synchronize_all`).
"""
from __future__ import annotations

import math
import time
import warnings
from typing import Callable, Mapping, Optional

import horovod.torch as hvd
import torch
from horovod.torch.mpi_ops import Average, Sum

from .collective import (NonFiniteInputError, OneBitAllreduce, StaleInputError,
                         synchronize_all)
from .hierarchical import HierarchicalOneBitAllreduce, Topology
from .shared_memory import SharedMemoryError
from .config import OneBitConfig, check_one_device, group_masks
from .fusion import Bucket, fuse, param_offsets
from .kernels.fused_adam import AdamUpdate, MomentumInput
from .kernels.fused_reference import frozen_denominator
from .layout import ring_allreduce_bytes
from . import step_bound
from .transport.base import Transport
from .transport.horovod import sleep_until_done
from .transport.registry import resolve_transport

NOT_FROZEN = -1  # state["frozen_variance_step"] before the freeze
# Where a compressed step's time goes, in seconds (CompressedStep.breakdown): the compression
# passes with their stage-1 starts, waiting on the transport, the server steps, the decode
# passes with Adam's update.
BREAKDOWN = ("compress", "wait", "server", "decode")


class CompressedStep:
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

    # ---- the world ---------------------------------------------------------------------------------

    @property
    def world(self) -> int:
        """Ranks taking part now (elastic jobs change it)."""
        if not isinstance(self.transport, str):
            return self.transport.size
        return self.process_set.size() if self.process_set.included() else 1

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
                      spare_errors=self.config.spare_errors(b.momentum.device))
        topology = self.topology()
        if topology is not None:
            transport = resolve_transport(self.transport, self.process_set, b.momentum.device)
            name = f"hvd_onebit.hier{b.index}"
            if self.config.shared_memory_inside_nodes(transport, b.momentum.device):
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

    # ---- rank-local error feedback ------------------------------------------------------------

    def saved_comms(self) -> dict[str, OneBitAllreduce]:
        """The collectives by the key their error feedback is saved under
        ("bucket:numel:dtype"; the world size is checked separately)."""
        return {f"{k[0]}:{k[1]}:{k[2]}": c for k, c in self.comms.items()}

    def error_feedback_state_dict(self) -> dict:
        """This rank's error-feedback buffers (rank-local: save one file per rank)."""
        return {"world_size": self.world, "rank": self.rank, "space": self._error_space,
                "buckets": {k: c.state_dict() for k, c in self.saved_comms().items()}}

    @property
    def _error_space(self) -> str:
        """What the error feedback is measured in: "preconditioned" (``m / denom``) or
        "momentum" (a checkpoint without the entry was written before preconditioning)."""
        return "preconditioned" if self.preconditioned else "momentum"

    def load_error_feedback_state_dict(self, state: dict) -> None:
        """Restore :meth:`error_feedback_state_dict` from the same rank of a same-size job; with
        another world size, rank or layout it is dropped with a warning (errors restart at 0)."""
        if state.get("world_size") != self.world or state.get("rank") != self.rank:
            self._reset_error_feedback(
                f"hvd_onebit: error feedback saved by rank {state.get('rank')} of "
                f"{state.get('world_size')} does not fit rank {self.rank} of "
                f"{self.world}; it is reset to zero")
            return
        saved_space = state.get("space", "momentum")
        if saved_space != self._error_space:
            self._reset_error_feedback(
                f"hvd_onebit: the saved error feedback is in units of the {saved_space} and this "
                f"optimizer compresses the {self._error_space} (precondition="
                f"{self.preconditioned}); it is reset to zero (error feedback restarts, the "
                "momentum is kept)")
            return
        self._pending_error_feedback = state
        if self.buckets is not None:
            self._apply_pending_error_feedback()

    def _reset_error_feedback(self, why: str) -> None:
        """Drop a saved error feedback that cannot apply (``why``, warned) and zero the live one."""
        warnings.warn(why)
        self._pending_error_feedback = None
        for comm in self.comms.values():
            comm.reset()

    def _apply_pending_error_feedback(self) -> None:
        state, self._pending_error_feedback = self._pending_error_feedback, None
        if state is None:
            return
        saved = state.get("buckets", {})
        mine = self.saved_comms()
        if set(saved) != set(mine):
            warnings.warn("hvd_onebit: saved error feedback is for another bucket layout "
                          f"({sorted(saved)} vs {sorted(mine)}); it is reset to zero")
            return
        for key, comm in mine.items():
            try:
                comm.load_state_dict(saved[key])
            except ValueError as exc:  # another topology role or layout
                warnings.warn(f"hvd_onebit: saved error feedback does not fit ({exc}); it is "
                              "reset to zero")
                for c in mine.values():
                    c.reset()
                return

    def flush_error_feedback(self, param_groups: list[dict]) -> int:
        """Fold every rank's worker error and every server's error into the momentum, with one
        exact allreduce, then zero both; returns the bytes this rank sent (0: nothing to flush).

        What compression has not delivered yet: rank i's worker error ``e_w^i`` (padded, full
        size) and server j's error ``e_s^j`` (its chunk). Error feedback adds them to the next
        call's input on its way through, so the next averaged momentum gains, on average,

            e = mean_i e_w^i + concat_j e_s^j

        on top of ``mean_i(beta1 * m + (1 - beta1) * g_i)``. Each rank contributes
        ``e_w^i / n`` plus its own server chunk at its place, and one allreduce (Sum) gives e,
        the same on every rank. Adding ``e / beta1`` to the momentum m (each parameter with its
        group's beta1) makes the next step's average ``beta1 * (m + e / beta1) + (1 - beta1) *
        mean_i g_i``: what error feedback would have delivered, with nothing left behind. The
        momentum stays identical on every rank (each adds the same e), so rank 0's
        ``state_dict()`` is then a complete checkpoint, for any world size. Entries the step
        would leave at zero stay zero: ``exp_avg_mask`` is applied, and elements held fixed
        (frozen variance 0) keep a zero momentum. Preconditioned, the errors are in units of
        ``m / denom``: ``e * denom / beta1`` is added instead (0 where held).

        All or nothing: the new momenta are computed aside, and only if every value of every
        bucket is finite (checked on the allreduced values, the same on every rank) are they
        written and the errors zeroed; otherwise every rank raises
        :class:`~hvd_onebit.collective.NonFiniteInputError` and nothing changed.
        """
        if self.config.compressor != "onebit" or self.buckets is None or self.world == 1:
            return 0
        beta1s = {p: float(g["betas"][0]) for g in param_groups for p in g["params"]}
        groups = {p: g for g in param_groups for p in g["params"]}
        if any(beta1s[p] == 0 for p in self.params):
            raise ValueError("flush_error_feedback needs beta1 > 0: with beta1 = 0 the momentum "
                             "does not carry into the next step, so the error cannot be folded")
        comms = [self.comms[self._key(b)] for b in self.buckets]
        sums = [c.error_contribution() for c in comms]
        sums, nbytes = self._exact_sum(sums)
        new = []
        for b, e in zip(self.buckets, sums):
            m = b.momentum.clone()
            for i, seg in enumerate(b.segments):
                lo, hi = seg.offset, seg.offset + seg.numel
                fold = e[lo:hi]
                if self.preconditioned:  # back to the momentum's units; held elements get 0
                    v, sqrt_bc2, eps = self._denominator_terms(seg.param, groups[seg.param])
                    denom = frozen_denominator(b.piece(i, v).reshape(-1), sqrt_bc2, eps)
                    fold = fold.mul_(denom).masked_fill_(denom == math.inf, 0.0)
                m[lo:hi].add_(fold.div_(beta1s[seg.param]))
            new.append(m)
        bad = [b.index for b, m in zip(self.buckets, new) if not bool(torch.isfinite(m).all())]
        if bad:
            raise NonFiniteInputError(
                [], f"in the error feedback (or the momentum it was folded into) of bucket(s) "
                f"{bad}, seen by flush_error_feedback; nothing was folded")
        for b, m in zip(self.buckets, new):
            b.momentum.copy_(m)
            for p in b.params:
                exp_avg = self.state[p]["exp_avg"]
                exp_avg.masked_fill_(self.state[p]["exp_avg_sq"] == 0, 0.0)  # held elements
        owner = set(self.params)
        for group in param_groups:
            for p, mask in zip(group["params"], group_masks(group)):
                if mask is not None and p in owner:
                    m = self.state[p]["exp_avg"]
                    m.mul_(mask.to(device=m.device, dtype=m.dtype))
        for c in comms:
            c.reset()
        return nbytes

    def _exact_sum(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
        """The sum over ranks of each tensor, the same bits on every rank, and the bytes this
        rank sent: Horovod's allreduce (a ring: each chunk is reduced once, then copied), or
        with a transport object an allgather summed in rank order."""
        if isinstance(self.transport, str):
            handles = [hvd.allreduce_async(t, op=Sum, name=f"hvd_onebit.flush{i}",
                                           process_set=self.process_set)
                       for i, t in enumerate(tensors)]
            for h in handles:
                sleep_until_done(h)
            return [hvd.synchronize(h) for h in handles], sum(
                ring_allreduce_bytes(4 * t.numel(), self.world) for t in tensors)
        handles = [self.transport.allgather_async(t.view(1, -1), name=f"hvd_onebit.flush{i}")
                   for i, t in enumerate(tensors)]
        out = []
        for t, h in zip(tensors, handles):
            rows = self.transport.wait(h).view(self.world, -1)
            total = rows[0].clone()
            for r in range(1, self.world):
                total.add_(rows[r])
            out.append(total)
        return out, sum(4 * t.numel() * (self.world - 1) for t in tensors)

    # ---- the frozen variance ---------------------------------------------------------------------

    def _freeze_variances(self, params: list[torch.Tensor]) -> None:
        """Record the step count each parameter's variance was frozen at (once per parameter),
        reading every such step count and zero-variance count in one device-to-host read (a
        read per parameter would be a sync each on a GPU); the step counts also prime
        :meth:`_host_step`.

        Elements whose frozen variance is exactly zero never saw a gradient in the warmup (a
        dead ReLU unit, an unused embedding row). Adam would divide their momentum by eps, and
        every element receives about its block's scale, so they would jump by
        lr * scale / eps. With ``zero_variance="hold"`` (default) they are held fixed, with a
        warning: their denominator is +inf (see
        :class:`~hvd_onebit.kernels.fused_adam.AdamUpdate`), so the update leaves them alone
        and zeroes their momentum. ``"eps"`` gives them Adam's own
        denominator, eps (their variance becomes the smallest normal float32, whose root is
        far below eps), so they take steps at the step bound; ``"floor"`` gives them the
        smallest non-zero variance of their parameter, so they train like its least active
        elements. Either rewrites ``exp_avg_sq`` once, alike on every rank.
        """
        todo = [p for p in params
                if self.state[p].get("frozen_variance_step", NOT_FROZEN) == NOT_FROZEN]
        if not todo:
            return
        device = self.state[todo[0]]["exp_avg_sq"].device
        f64 = dict(dtype=torch.float64, device=device)
        figures = []  # per parameter: its step count, then its count of zero variances
        for p in todo:
            step = self.state[p]["step"]
            figures.append(step.detach().reshape(()).to(**f64) if isinstance(step, torch.Tensor)
                           else torch.tensor(float(step), **f64))
            figures.append(torch.count_nonzero(self.state[p]["exp_avg_sq"] == 0).to(**f64))
        values = torch.stack(figures).tolist()
        for i, p in enumerate(todo):
            state, step, unseen = self.state[p], values[2 * i], int(values[2 * i + 1])
            state["frozen_variance_step"] = int(step)
            self._remember_step(p, step)
            if unseen and self.config.zero_variance == "hold":
                warnings.warn(
                    f"hvd_onebit: {unseen} of {p.numel()} elements of parameter "
                    f"{self.names.get(p, '?')} received no gradient during the "
                    f"{state['frozen_variance_step']}-step warmup (variance 0); they are held "
                    "fixed in the compression phase")
            elif unseen:
                _fill_zero_variances(state["exp_avg_sq"], self.config.zero_variance)

    def _host_step(self, p: torch.Tensor) -> float:
        """Adam's step count of ``p`` as a host number. A step tensor on a GPU (fused or
        capturable Adam) would cost a device-to-host sync per parameter and step to read, so the
        value is read once and then followed on the host: :meth:`step` increments both. A
        replaced or externally changed tensor (a loaded state dict) is read again."""
        t = self.state[p]["step"]
        if not isinstance(t, torch.Tensor):
            return float(t)
        cached = self._host_steps.get(p)
        if cached is not None and cached[0] is t and cached[1] == t._version:
            return cached[2]
        value = float(t)
        self._remember_step(p, value)
        return value

    def _remember_step(self, p: torch.Tensor, value: float) -> None:
        """Record ``value`` as the host copy of ``p``'s step tensor as it is now (nothing for a
        step held as a Python number)."""
        t = self.state[p]["step"]
        if isinstance(t, torch.Tensor):
            self._host_steps[p] = (t, t._version, value)

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
                comm._claim(h)
                comm._drain(h)
            finally:
                comm._release()

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
        handles = [hvd.allreduce_async_(b.work, op=Average, name=f"hvd_onebit.exact{b.index}",
                                        process_set=self.process_set) for b in self.buckets]
        for h in handles:
            hvd.synchronize(h)
        for b in self.buckets:  # the same averaged values on every rank: the same decision
            if not bool(torch.isfinite(b.work).all()):
                raise NonFiniteInputError([], "in the averaged momentum")
        for b, u in zip(self.buckets, updates):
            b.momentum.copy_(b.work)
            u.apply(b.momentum)
        self._apply_masked(masked)
        return sum(ring_allreduce_bytes(b.numel * b.work.element_size(), self.world)
                   for b in self.buckets)

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
        state = self.state[p]
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


def _fill_zero_variances(v: torch.Tensor, mode: str) -> None:
    """Give the zero entries of the frozen variance ``v`` (in place) a denominator to train
    with: "eps", the smallest normal float32 (``sqrt(v) / sqrt_bc2 + eps`` is then eps); "floor",
    the smallest non-zero entry of ``v`` (the same as "eps" where there is none)."""
    zero = v == 0
    tiny = torch.finfo(torch.float32).tiny
    fill = tiny
    if mode == "floor" and bool((~zero).any()):
        fill = float(v[~zero].min())
    v.masked_fill_(zero, fill)


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
