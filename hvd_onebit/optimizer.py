"""hvd_onebit.DistributedOptimizer: 1-bit Adam as a drop-in for ``hvd.DistributedOptimizer``.

Two phases, decided by the number of optimizer steps taken so far (never by anything else):

* **Warmup** (the first ``freeze_step`` steps): exactly ``hvd.DistributedOptimizer`` around the
  wrapped Adam. Gradients are allreduced by Horovod in full precision as backward produces them,
  then Adam steps. Adam's variance ``exp_avg_sq`` settles during this phase.
* **Compression** (every step after): the variance is frozen and becomes a fixed preconditioner, so
  the update is linear in the momentum and the momentum can be communicated with 1-bit error
  feedback. Gradients are not communicated at all. Each rank computes its local momentum
  ``m_i = beta1 * m + (1 - beta1) * g_i`` (``g_i`` with Adam's L2 decay); the momenta of all
  parameters, fused into a few flat buckets, go through :class:`~hvd_onebit.OneBitAllreduce`; then
  ``p -= lr * (m / bc1) / (sqrt(v / bc2) + eps)`` with ``bc1 = 1 - beta1^t`` advancing and ``bc2``
  frozen with ``v``, plus AdamW's decoupled decay. These are torch.optim.Adam's formulas, so the
  phase change is continuous. The phase is run by :class:`~hvd_onebit.compressed_step.CompressedStep`;
  on CPU it is two passes over the momentum: the local momentum is computed inside the compression
  kernel and the decode of the average applies the update (:mod:`hvd_onebit.kernels.fused_adam`).

The choice of ``freeze_step`` is the main knob: 15-25% of the total steps is the published guidance.
Too short a warmup freezes a variance that has not settled and training can diverge; a longer one
costs full-precision communication for longer. ``freeze_step="auto"`` ends the warmup once the
variance has settled (:mod:`hvd_onebit.auto_freeze`).

A rank that sees inf/NaN in its gradients makes every rank skip the step: the bad value travels in
the allreduce's status word, so the decision is agreed within the same collective and nothing is
modified (momentum, error feedback, parameters) in any bucket, never one rank skipping while others
wait.

This module is the Horovod-facing wrapper: phase and step count, hooks, warmup, GradScaler, state
dicts. Options are validated once, at construction (:class:`~hvd_onebit.config.OneBitConfig`).
"""
from __future__ import annotations

import os
import time
import warnings
import weakref
from typing import Callable, Iterable, Mapping, Optional

import horovod.torch as hvd
import torch
from horovod.torch.compression import Compression
from horovod.torch.mpi_ops import Adasum, Average, Sum
from horovod.torch.optimizer import _DistributedOptimizer

from . import elastic
from .auto_freeze import VarianceMonitor
from .collective import NonFiniteInputError
from .compressed_step import NOT_FROZEN, CompressedStep
from .config import DEFAULT_BUCKET_MB, OneBitConfig, validate_masks
from .consistency import check_parameters_identical, check_same_parameters
from .layout import ring_allreduce_bytes
from .low_precision import (WidenBfloat16, adam_step_float32, float32_state_in, is_low_precision,
                            state_dtype)
from .transport.horovod import sleep_until_done
from .transport.registry import resolve_transport
from .transport.rendezvous import TorchRendezvousError, init_torch_distributed

STEP_KEY = "onebit_step"  # param_groups[0] entry holding the optimizer step count
FREEZE_KEY = "onebit_freeze_step"  # param_groups[0] entry: the freeze step, -1 while undecided


def _scalar_step(group: dict, p: torch.Tensor) -> torch.Tensor:
    """A zero ``step`` tensor exactly as torch.optim.Adam creates it lazily."""
    from torch.optim.optimizer import _get_scalar_dtype

    if group.get("capturable") or group.get("fused"):
        return torch.zeros((), dtype=_get_scalar_dtype(is_fused=group.get("fused")), device=p.device)
    return torch.tensor(0.0, dtype=_get_scalar_dtype())


class _OneBitMixin:
    """Methods layered over Horovod's ``_DistributedOptimizer`` and the wrapped Adam class.

    The public factory :func:`DistributedOptimizer` builds a class whose bases are the wrapped
    optimizer's class, with Horovod's methods and then these, the same way Horovod builds its own.
    """

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, sparse_as_dense, process_set,
                 config: OneBitConfig):
        # bfloat16 gradients cross Horovod's allreduce (which refuses bfloat16) as float32.
        _DistributedOptimizer.__init__(self, params, named_parameters, WidenBfloat16(compression),
                                       backward_passes_per_step, op, gradient_predivide_factor,
                                       groups, sparse_as_dense, process_set)
        self.config = config
        self.param_groups[0].setdefault(STEP_KEY, 0)
        # A checkpoint past its freeze keeps its own freeze_step (see load_state_dict).
        self.freeze_step = None if config.auto else config.freeze_step
        self._monitor = VarianceMonitor(config.auto_freeze) if config.auto else None
        self.compressor = config.compressor
        self.block_size = config.block_size
        device = next((p.device for g in self.param_groups for p in g["params"]),
                      torch.device("cpu"))
        # "auto" is decided here, from what every rank sees alike
        self.transport = resolve_transport(config.transport, process_set, device,
                                           config.hierarchical)
        self.kernel_backend = config.kernel_backend
        self.bucket_size_mb = config.bucket_size_mb
        self.check_every = config.check_every
        self._engine = CompressedStep(config, self.state, self._decoupled, process_set,
                                      transport=self.transport, names=self._parameter_names)
        # Telemetry, readable by training scripts and the CLI.
        self.last_step_bytes = 0  # bytes this rank sent in the last step (warmup: ring estimate)
        self.total_bytes = 0
        self.last_step_comm_seconds = 0.0  # seconds blocked on communication in the last step
        self.total_comm_seconds = 0.0
        self.skipped_steps = 0  # compression-phase steps skipped for non-finite values
        # seconds of the last compressed step by part (CompressedStep.BREAKDOWN); {} in warmup
        self.last_step_breakdown: dict[str, float] = {}
        self._warmup_wait = 0.0
        self._early: Optional[_EarlyStarts] | bool = None  # this step's early starts (see hooks)
        self._overlap_off: Optional[str] = None  # why this rank stopped starting buckets early
        self._scaler_ref = None  # weakref to the GradScaler of the last step, if one was used
        self._init_state()
        if self._world > 1 and os.environ.get("HOROVOD_ELASTIC") != "1":
            # Elastic workers join running jobs, so a collective here could not be matched.
            check_same_parameters(self.param_groups, self._parameter_names, self.process_set)
        if self.transport == "torch" and config.compressor == "onebit" and self._world > 1:
            # Set up now, on every rank together, so a network that cannot carry it fails at
            # construction, not at the freeze; "auto" then stays with Horovod (the failure is
            # agreed, so every rank does).
            try:
                init_torch_distributed(device)
            except TorchRendezvousError as exc:
                if config.transport != "auto":
                    raise
                warnings.warn(f"hvd_onebit: transport='auto' uses Horovod: {exc}")
                self.transport = "horovod"
                self._engine.transport = "horovod"
        if config.hierarchical is not False and config.intra_node == "shared_memory":
            config.shared_memory_inside_nodes(self.transport, device)  # raises where it cannot

    # ---- state ------------------------------------------------------------------------------------

    def _init_state(self) -> None:
        # Create Adam's state now, with Adam's own initial values, rather than lazily at the first
        # step: hvd.broadcast_optimizer_state would otherwise run a step to create it, and on this
        # optimizer a step communicates and counts.
        # Every key exists from the start, with the same types on every rank and in every phase:
        # hvd.broadcast_optimizer_state (an elastic sync) matches entries by name, so a worker
        # joining in the compression phase must already hold "frozen_variance_step".
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = _scalar_step(group, p)
                    like = dict(dtype=state_dtype(p), memory_format=torch.preserve_format)
                    state["exp_avg"] = torch.zeros_like(p, **like)
                    state["exp_avg_sq"] = torch.zeros_like(p, **like)
                state.setdefault("frozen_variance_step", NOT_FROZEN)

    @property
    def _world(self) -> int:
        """Ranks in the process set now (elastic jobs change it)."""
        return self.process_set.size() if self.process_set.included() else 1

    @property
    def _completed_steps(self) -> int:
        # Kept in param group 0 so that everything that moves optimizer state moves it too:
        # state_dict/load_state_dict, hvd.broadcast_optimizer_state (a joining elastic worker
        # must know the phase before its first backward) and elastic commits.
        return int(self.param_groups[0].get(STEP_KEY, 0))

    @_completed_steps.setter
    def _completed_steps(self, value: int) -> None:
        self.param_groups[0][STEP_KEY] = int(value)

    @property
    def freeze_step(self) -> Optional[int]:
        """The step count the variance freezes (or froze) at; None while ``freeze_step="auto"``
        has not decided. Kept in param group 0, like the step count."""
        value = int(self.param_groups[0].get(FREEZE_KEY, -1))
        return value if value >= 1 else None

    @freeze_step.setter
    def freeze_step(self, value: Optional[int]) -> None:
        self.param_groups[0][FREEZE_KEY] = -1 if value is None else int(value)

    @property
    def freeze_decision(self) -> Optional[dict]:
        """``freeze_step="auto"``: how the step was chosen (``freeze_step``, ``reason``, the
        ``change`` that triggered it and the ``history`` of (step, change) checks); None before
        the decision and with a fixed ``freeze_step``."""
        return self._monitor.decision if self._monitor is not None else None

    @property
    def phase(self) -> str:
        """"warmup" until ``freeze_step`` steps have been taken, then "compression"."""
        freeze = self.freeze_step
        return "warmup" if freeze is None or self._completed_steps < freeze else "compression"

    @property
    def steps(self) -> int:
        """Optimizer steps taken (skipped steps not counted)."""
        return self._completed_steps

    def _compressing(self) -> bool:
        return self._world > 1 and self.phase == "compression"

    @property
    def compressed_step(self) -> CompressedStep:
        """The compression-phase engine: buckets, 1-bit collectives, error feedback."""
        return self._engine

    def telemetry(self) -> dict:
        """Phase, step count and communication counters as a plain dict."""
        return {"phase": self.phase, "steps": self._completed_steps,
                "skipped_steps": self.skipped_steps, "last_step_bytes": self.last_step_bytes,
                "total_bytes": self.total_bytes,
                "last_step_comm_seconds": self.last_step_comm_seconds,
                "total_comm_seconds": self.total_comm_seconds,
                "last_step_breakdown": dict(self.last_step_breakdown)}

    def state_dict(self) -> dict:
        sd = super(self.__class__, self).state_dict()
        sd["onebit"] = {"freeze_step": self.freeze_step, "skipped_steps": self.skipped_steps,
                        "step_bound": self.config.step_bound}
        if self._monitor is not None:
            sd["onebit"]["auto_freeze"] = self._monitor.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a :meth:`state_dict`. A checkpoint taken in the compression phase stays there:
        its variance was frozen at its own ``freeze_step``, which wins over this optimizer's
        (with a warning when they differ). A warmup checkpoint takes this optimizer's; with
        ``freeze_step="auto"`` it also takes the checkpoint's record of the variance, so the
        resumed run decides at the same step as an uninterrupted one."""
        state_dict = dict(state_dict)
        meta = state_dict.pop("onebit", None)
        params = [p for g in self.param_groups for p in g["params"]]
        wide = float32_state_in(state_dict, params)
        _DistributedOptimizer.load_state_dict(self, state_dict)
        # torch cast every state tensor to its parameter's dtype: put float32 state back.
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for pid, p in zip(ids, params):
            for key, value in wide.get(pid, {}).items():
                self.state[p][key] = value.to(device=p.device, copy=True)
        mine = None if self.config.auto else self.config.freeze_step
        saved = None
        if meta is not None:
            self.skipped_steps = int(meta.get("skipped_steps", 0))
            saved = meta.get("freeze_step")
            _warn_if_other_step_bound(meta, self.config.step_bound)
        if saved is not None and self._completed_steps >= int(saved):
            if mine is not None and int(saved) != mine:
                warnings.warn(
                    f"hvd_onebit: the checkpoint is in the compression phase (step "
                    f"{self._completed_steps}, frozen at freeze_step={saved}); it keeps "
                    f"its frozen variance and freeze_step={saved}, not {mine}")
            self.freeze_step = int(saved)
        else:
            self.freeze_step = mine
        if self._monitor is not None:
            self._monitor.load_state_dict((meta or {}).get("auto_freeze") or {})
        self._engine.state = self.state  # torch replaced the state dict itself
        self._init_state()
        self.reset_collectives()  # exp_avg tensors were replaced: re-fuse at the next step

    def reset_collectives(self) -> None:
        """Drop the fused buckets, the frozen denominators and every 1-bit collective (with its
        error feedback); the next compressed step rebuilds them. Every rank must call it at the
        same point (elastic resets do, through :mod:`hvd_onebit.elastic`), so that the rebuilt
        collectives match across ranks."""
        self._engine.reset()
        self._early = None

    def add_param_group(self, param_group: dict) -> None:
        constructed = "config" in self.__dict__
        if constructed and self.phase == "compression":
            raise ValueError(
                "cannot add parameters after the variance was frozen (step "
                f"{self._completed_steps} >= freeze_step {self.freeze_step}): Adam's variance "
                "for them was never estimated. Add them during the warmup.")
        super(self.__class__, self).add_param_group(param_group)
        if constructed:  # new parameters need Adam state
            self._init_state()

    # ---- rank-local error feedback ------------------------------------------------------------

    def error_feedback_state_dict(self) -> dict:
        """This rank's error-feedback buffers (rank-local: save one file per rank).

        ``state_dict()`` holds what every rank shares (steps, momentum, frozen variance); the
        error feedback differs on every rank and only makes sense for the same world size.
        """
        return self._engine.error_feedback_state_dict()

    def load_error_feedback_state_dict(self, state: dict) -> None:
        """Restore :meth:`error_feedback_state_dict` from the same rank of a same-size job.

        With another world size, rank or layout the saved errors cannot apply: they are dropped
        with a warning and error feedback restarts from zero (training continues correctly, the
        first compressed steps are just a little less accurate).
        """
        self._engine.load_error_feedback_state_dict(state)

    def flush_error_feedback(self) -> int:
        """Fold every rank's outstanding error feedback into the momentum and zero it.

        One full-precision allreduce of the momentum's size (each rank sends
        ``2 (n-1)/n * 4`` bytes per element); see
        :meth:`~hvd_onebit.compressed_step.CompressedStep.flush_error_feedback` for the math.
        Afterwards the momentum is identical on every rank and no error is rank-local, so rank
        0's ``state_dict()`` alone is a complete checkpoint that resumes on any world size.
        Every rank must call it at the same point. In the warmup, on one rank and with
        ``compressor="none"`` there is no error feedback and it does nothing.

        Returns:
            The bytes this rank sent (0 when there was nothing to flush).
        Raises:
            NonFiniteInputError: on every rank, when an error or the momentum it would be folded
                into is not finite; nothing was changed.
        """
        if not self._compressing() or self.compressor != "onebit":
            return 0
        self._engine.ensure_ready(self._active_params())  # applies error feedback just loaded
        start = time.perf_counter()
        nbytes = self._engine.flush_error_feedback(self.param_groups)
        self.total_bytes += nbytes
        self.total_comm_seconds += time.perf_counter() - start
        return nbytes

    # ---- hooks and synchronize ---------------------------------------------------------------------

    def _make_hook(self, p):
        warmup_hook = _DistributedOptimizer._make_hook(self, p)

        def hook(*ignore):
            if not self._compressing():
                return warmup_hook(*ignore)
            # Compression phase: no gradient is communicated. On the last backward pass of the
            # step, the gradient completes its bucket's momentum, which may then start its
            # exchange while backward goes on.
            if self._allreduce_delay[p] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before "
                    "call to step(). Increase backward_passes_per_step to accumulate gradients "
                    "locally.")
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] == 0:
                self._gradient_ready(p)

        return hook

    # ---- starting buckets during backward ----------------------------------------------------------

    def _early_starts(self) -> Optional[_EarlyStarts]:
        """This step's early-start bookkeeping, set up at its first ready gradient; None when
        buckets start in step() this time (overlap off, or the buckets must be rebuilt first,
        which step() does)."""
        if self._early is None:
            self._early = False
            engine = self._engine
            active = self._active_params()
            if self.config.overlap and self._overlap_off is None and engine.up_to_date(active):
                engine.ensure_ready(active)
                if engine.can_start_early:
                    engine.begin_step()
                    groups = {p: g for g in self.param_groups for p in g["params"]}
                    # A GradScaler used last step is assumed this step too: the hooks see
                    # scaled gradients and unscale them as GradScaler.unscale_ will (step()
                    # checks the assumption).
                    scaler = self._scaler_ref() if self._scaler_ref is not None else None
                    if scaler is not None and scaler._scale is None:
                        scaler = None
                    self._early = _EarlyStarts(groups, engine, scaler)
        return self._early or None

    def _gradient_ready(self, p: torch.Tensor) -> None:
        """p's gradient is final for this step: start every bucket, in order, whose gradients
        are all final. What each start read is recorded, so step() can tell if it changed."""
        early = self._early_starts()
        if early is None or early.failed or p not in early.position:
            return
        engine = self._engine
        for i in early.position[p]:
            early.missing[i] -= 1
        try:
            while (engine.next_to_start < len(early.missing)
                   and early.missing[engine.next_to_start] == 0):
                params = engine.bucket_params(engine.next_to_start)
                grads = {q: self._local_grad(q, early.groups[q], early.inv_scale)
                         for q in params}
                for q in params:
                    early.read[q] = self._inputs_of(q, early.groups[q])
                engine.start_bucket(self.param_groups, grads)
        except Exception:
            # e.g. a sparse gradient: step() computes the rest and raises the error itself, on
            # every rank, after waiting out what started
            early.failed = True

    def _inputs_of(self, p: torch.Tensor, group: dict) -> tuple:
        """What p's part of its bucket's input is computed from: its gradient tensor (identity
        and in-place version), its own version (Adam's L2 decay reads it) and the options."""
        g = p.grad
        return (g, None if g is None else g._version, p._version, group["betas"][0],
                group["weight_decay"], bool(group.get("maximize")))

    def _stale_early_starts(self) -> bool:
        """Whether anything a bucket started early read has changed since (gradients clipped
        or unscaled in place, replaced, options changed): then it is started again."""
        early = self._early or None
        if early is None:
            return False
        for q, then in early.read.items():
            now = self._inputs_of(q, early.groups[q])
            if now[0] is not then[0] or now[1:] != then[1:]:
                return True
        return False

    def _refresh_hooks(self) -> None:
        """Follow requires_grad changes: hook newly trainable parameters, drop frozen ones."""
        if not (self.process_set.included() and hvd.size() > 1):
            return
        hooked = {id(p) for p in self._requires_update}
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in hooked:
                    grad_acc = p.expand_as(p).grad_fn.next_functions[0][0]
                    grad_acc.register_hook(self._make_hook(p))
                    self._grad_accs.append(grad_acc)
                    self._requires_update.add(p)
                    self._allreduce_delay.setdefault(p, self.backward_passes_per_step)
                    self._parameter_names.setdefault(p, f"allreduce.late.{len(self._grad_accs)}")
        for p in [p for p in self._requires_update if not p.requires_grad]:
            self._requires_update.discard(p)

    def synchronize(self) -> None:
        """Warmup: wait for the gradient allreduces (as Horovod). Compression: nothing to wait for."""
        if self._compressing():
            self._synchronized = True
            return
        start = time.perf_counter()
        self._refresh_hooks()
        if (self._completed_steps + 1 == self.freeze_step and self._world > 1
                and not self._engine.up_to_date(self._active_params())):
            self._engine.fuse(self._active_params())  # while the last allreduce is on the wire
        # Sleep until the allreduces the backward hooks started are done, so that Horovod's own
        # wait (a sched_yield spin) finds them finished instead of taking CPU from other ranks.
        for handle, _ in list(self._handles.values()):
            if handle is not None and not callable(handle):
                sleep_until_done(handle)
        _DistributedOptimizer.synchronize(self)
        if self.sparse_as_dense:
            # Horovod hands the averaged gradient back sparse; Adam takes dense gradients only.
            for p in self._requires_update:
                if p.grad is not None and p.grad.is_sparse:
                    p.grad = p.grad.to_dense()
        self._warmup_wait += time.perf_counter() - start

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles or self._engine.started:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(). This is "
                                 "prohibited as it can cause a race condition.")
        super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    # ---- step ----------------------------------------------------------------------------------

    # Tells torch.amp.GradScaler to hand this optimizer the skip decision (it then always calls
    # step(), passing itself) instead of skipping step() on the ranks that overflowed and leaving
    # the others waiting in a collective.
    _step_supports_amp_scaling = True

    def step(self, closure: Optional[Callable[[], float]] = None, grad_scaler=None):
        """One optimizer step: Horovod + Adam in warmup, 1-bit momentum Adam afterwards.

        ``grad_scaler`` is passed by ``torch.amp.GradScaler.step()`` itself (it does so for
        optimizers whose step() takes it): the optimizer then unscales and decides whether to
        skip, so the decision can be the same on every rank (see :meth:`_amp_step`).
        """
        if grad_scaler is not None:
            loss = self._amp_step(closure, grad_scaler)
        elif not self._compressing():
            self._warmup_wait = 0.0
            self.last_step_breakdown = {}
            self._scaler_ref = None
            loss = self._warmup_step(closure)
            self._account(self._warmup_bytes(), self._warmup_wait)
        else:
            loss = self._closure_loss(closure)
            early = self._early or None
            self._scaler_ref = None
            if self._compression_step(changed=early is not None and early.scaler is not None):
                self._completed_steps += 1
            self._end_compression_step()
        if self.check_every and self._world > 1 and self._completed_steps % self.check_every == 0:
            check_parameters_identical(self.param_groups, self.process_set,
                                       self._completed_steps, self.check_every)
        return loss

    @staticmethod
    def _closure_loss(closure):
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _end_compression_step(self) -> None:
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._synchronized = False
        self._early = None

    def _amp_step(self, closure, scaler):
        """GradScaler: every rank unscales, agrees on overflow, and skips (or not) together.

        Warmup: gradients are allreduced first, so the inf check sees the averaged gradients,
        identical on every rank. Compression: the check is local, the allreduce's status word
        makes the skip decision common, and a skipped step marks every rank's scaler as having
        seen an inf, so all scalers back off alike and their scales never drift apart.
        """
        from torch.amp.grad_scaler import OptState

        per_opt = scaler._per_optimizer_states[id(self)]
        self._scaler_ref = weakref.ref(scaler)
        if not self._compressing():
            self._warmup_wait = 0.0
            self._synchronize_for_step()
            if per_opt["stage"] is OptState.READY:
                scaler.unscale_(self)
            if sum(float(t) for t in per_opt["found_inf_per_device"].values()):
                self.skipped_steps += 1
                loss = None
            else:
                loss = self._adam_step(closure)
                self._completed_steps += 1
                self._observe_variance()
            self._account(self._warmup_bytes(), self._warmup_wait)
            return loss
        if per_opt["stage"] is OptState.READY:
            scaler.unscale_(self)
        loss = self._closure_loss(closure)
        # Unscaling in place leaves no trace on the gradients' version counters: what the hooks
        # assumed about the scaler is checked instead.
        early = self._early or None
        if self._compression_step(changed=early is not None and early.scaler is not scaler):
            self._completed_steps += 1
        else:
            for flag in per_opt["found_inf_per_device"].values():
                flag.fill_(1.0)
        self._end_compression_step()
        return loss

    def _synchronize_for_step(self) -> None:
        """Horovod's step() prologue: wait for the gradient allreduces unless told not to."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False

    def _warmup_step(self, closure):
        """Horovod's step (synchronize, then the wrapped Adam), skipping non-finite gradients.

        After the allreduce the gradients are the same on every rank (an inf anywhere makes the
        average inf everywhere), so every rank takes the same decision without a collective.
        """
        self._synchronize_for_step()
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not _all_finite(grads):
            self.skipped_steps += 1
            warnings.warn("hvd_onebit: step skipped on every rank: non-finite averaged gradients")
            return None
        loss = self._adam_step(closure)
        self._completed_steps += 1
        self._observe_variance()
        return loss

    def _observe_variance(self) -> None:
        """freeze_step="auto", after a warmup step: decide whether the variance has settled.
        The variance is the same on every rank here, so is the decision."""
        if self._monitor is None or self.freeze_step is not None:
            return
        variances = ((self.state[p]["exp_avg_sq"], int(self.state[p]["step"]), g["betas"][1])
                     for g in self.param_groups for p in g["params"])
        decided = self._monitor.observe(self._completed_steps, variances)
        if decided is not None:
            self.freeze_step = decided

    def restart_variance_monitor(self) -> None:
        """freeze_step="auto": forget the variance record (the next check starts a new one).
        Every rank must call it at the same point; elastic syncs do."""
        if self._monitor is not None:
            self._monitor.restart()

    def _adam_step(self, closure):
        """The wrapped Adam's step on the averaged gradients; float16 and bfloat16 parameters
        step in float32 with their float32 state (:mod:`hvd_onebit.low_precision`)."""
        loss = self._closure_loss(closure)
        low = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise self._sparse_gradient_error(p)
                if is_low_precision(p):
                    low.append((p, group))
        stashed = [p.grad for p, _ in low]
        for p, _ in low:
            p.grad = None  # torch's Adam skips parameters without a gradient
        try:
            super(self.__class__, self).step()
        finally:
            for (p, _), g in zip(low, stashed):
                p.grad = g
        for p, group in low:
            adam_step_float32(p, self.state[p], group, self._decoupled(group))
        return loss

    def _account(self, nbytes: int, seconds: float) -> None:
        self.last_step_bytes = nbytes
        self.total_bytes += nbytes
        self.last_step_comm_seconds = seconds
        self.total_comm_seconds += seconds

    def _warmup_bytes(self) -> int:
        """Bytes a bandwidth-optimal ring allreduce sends per rank for this step's gradients."""
        elem = 2 if self._compression.inner is Compression.fp16 else None
        # bfloat16 gradients travel as float32 (WidenBfloat16)
        total = sum(p.numel() * (elem or (4 if p.dtype == torch.bfloat16 else p.element_size()))
                    for p in self._requires_update)
        return ring_allreduce_bytes(total, self._world)

    # ---- compression phase ---------------------------------------------------------------------

    def _active_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def _local_grad(self, p: torch.Tensor, group: dict,
                    inv_scale: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """p's gradient as the compressed step takes it in; ``inv_scale``: the gradient is
        still scaled by a GradScaler, unscale it first (the bits of GradScaler.unscale_: one
        float32 product, rounded to the gradient's dtype)."""
        g = p.grad
        if g is None:
            return None
        if g.is_sparse:
            if not self.sparse_as_dense:
                raise self._sparse_gradient_error(p)
            g = g.to_dense()
        if inv_scale is not None:
            g = torch.mul(g.float(), inv_scale).to(g.dtype)
        if is_low_precision(p):  # the momentum is float32: so is the gradient it takes in
            g = g.float()
        if self.op == Sum:  # Horovod's Sum: the update sees the sum over ranks, not the mean
            g = g * self._world
        if group.get("maximize"):
            g = -g
        wd = group["weight_decay"]
        if wd != 0 and not self._decoupled(group):
            g = g.add(p.detach().to(g.dtype), alpha=wd)
        return g

    def _sparse_gradient_error(self, p: torch.Tensor) -> TypeError:
        return TypeError(f"parameter {self._parameter_names.get(p, '?')} has a sparse gradient; "
                         "Adam needs dense gradients: pass sparse_as_dense=True")

    def _decoupled(self, group: dict) -> bool:
        return bool(group.get("decoupled_weight_decay", isinstance(self, torch.optim.AdamW)))

    def _compression_step(self, changed: bool = False) -> bool:
        """Returns False when the step was skipped because some rank had non-finite values.
        ``changed``: the gradients were changed since backward, whether it shows or not."""
        engine = self._engine
        early = self._early or None
        if early is None:
            engine.begin_step()
        engine.ensure_ready(self._active_params())
        stale = (changed and engine.started > 0) or self._stale_early_starts()
        if stale and self._overlap_off is None:
            self._overlap_off = "gradients changed between backward and step()"
            warnings.warn(
                "hvd_onebit: the gradients changed between backward and step() (e.g. clipped, "
                "or a GradScaler used this step and not the last, or the reverse); the buckets "
                "started during backward were started again, and from now on this rank starts "
                "them in step() (overlap off). Leave the gradients as backward made them to "
                "keep the overlap, or pass overlap=False.")
        started = set() if stale or early is None else set(early.read)
        groups = {p: group for group in self.param_groups for p in group["params"]}
        grads = _LocalGrads(self._local_grad, groups)
        try:  # before anything more starts: a bad gradient raises here, on every rank
            for p in engine.params:
                if p not in started:
                    grads[p]
        except Exception:
            engine.abandon_early()
            raise
        start = time.perf_counter()
        try:
            nbytes = engine.step(self.param_groups, grads, stale=stale)
        except NonFiniteInputError as exc:
            self.skipped_steps += 1
            self._account(0, time.perf_counter() - start)
            warnings.warn(f"hvd_onebit: step skipped on every rank: {exc}")
            return False
        finally:
            self.last_step_breakdown = dict(engine.breakdown)
        self._account(nbytes, time.perf_counter() - start)
        return True


class _LocalGrads(Mapping):
    """Each parameter's local gradient (:meth:`_OneBitMixin._local_grad`), computed on first
    access: a step started again after a stale early start reads the ones it did not need."""

    def __init__(self, local_grad: Callable, groups: dict):
        self._local_grad = local_grad
        self._groups = groups
        self._done: dict = {}

    def __getitem__(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        if p not in self._done:
            self._done[p] = self._local_grad(p, self._groups[p])
        return self._done[p]

    def __iter__(self):
        return iter(self._groups)

    def __len__(self) -> int:
        return len(self._groups)


class _EarlyStarts:
    """One step's bookkeeping of the buckets started from gradient hooks."""

    def __init__(self, groups: dict, engine: CompressedStep, scaler=None):
        self.groups = groups  # parameter -> its param group
        self.scaler = scaler  # the GradScaler the gradients are assumed scaled by, or None
        # GradScaler.unscale_'s own factor
        self.inv_scale = (None if scaler is None
                          else scaler._scale.double().reciprocal().float())
        self.position: dict = {}  # parameter -> the buckets holding a part of it
        for i, b in enumerate(engine.buckets):
            for p in b.params:
                self.position.setdefault(p, []).append(i)
        self.missing = [len(b.params) for b in engine.buckets]  # gradients not final yet
        self.read: dict = {}  # parameter -> what its bucket's start read (_inputs_of)
        self.failed = False  # a start raised: the rest start in step()


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether no tensor holds inf or NaN: one vectorised read pass, no allocation per tensor.

    The float32 (or float64) sum is inf/NaN when an element is; it can also overflow when the
    values are near float32's limit, and such gradients are as good as non-finite anyway (the step
    is skipped).
    """
    if not tensors:
        return True
    # Summed in float32 at least: a float16 sum overflows at 65504 where the values are finite.
    sums = [(t.coalesce().values() if t.is_sparse else t).sum(
        dtype=torch.float32 if is_low_precision(t) else None) for t in tensors]
    return bool(torch.isfinite(torch.stack(sums)).all())


def _warn_if_other_step_bound(meta: dict, mine) -> None:
    """A checkpoint written with another step bound (one from before the bound existed was
    unbounded) loads as it is: the bound acts only on the step, so the momentum and the error
    feedback mean the same under either; say so, since later steps will differ."""
    theirs = meta.get("step_bound") if "step_bound" in meta else None
    if theirs != mine:
        warnings.warn(f"hvd_onebit: the checkpoint was written with step_bound={theirs!r}, this "
                      f"optimizer has step_bound={mine!r}; its momentum and error feedback "
                      "carry over unchanged (the bound acts only on each step)")


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[Iterable[tuple[str, torch.Tensor]]] = None,
                         compression=Compression.none,
                         backward_passes_per_step: int = 1,
                         op=Average,
                         gradient_predivide_factor: float = 1.0,
                         groups=None,
                         sparse_as_dense: bool = False,
                         process_set: hvd.ProcessSet = hvd.global_process_set,
                         *,
                         freeze_step: int | str,
                         auto_freeze: Optional[dict] = None,
                         compressor: str = "onebit",
                         block_size: Optional[int] = None,
                         transport: str = "auto",
                         kernel_backend: str = "auto",
                         bucket_size_mb: float = DEFAULT_BUCKET_MB,
                         check_every: int = 0,
                         flush_on_commit: bool = False,
                         hierarchical: bool | str = False,
                         overlap: bool = True,
                         memory: str = "auto",
                         intra_node: str = "auto",
                         step_bound: str | float | None = "adam",
                         zero_variance: str = "hold",
                         precondition: bool = True):
    """Wrap a ``torch.optim.Adam`` or ``AdamW`` for 1-bit Adam over Horovod.

    The arguments up to ``process_set`` mean what they mean for ``hvd.DistributedOptimizer`` and
    govern the warmup; ``compression``, ``groups`` and ``gradient_predivide_factor`` only affect
    the warmup's gradient allreduce.

    Args:
        optimizer: a ``torch.optim.Adam`` or ``torch.optim.AdamW`` (amsgrad off) over float32,
            float16 or bfloat16 parameters on one device. Its lr, betas, eps and weight_decay are
            read from the param groups at every step, so LR schedulers and per-group settings
            work in both phases. Adam's state for float16 and bfloat16 parameters is float32
            (a float16 variance underflows); bfloat16 gradients travel as float32 in the warmup.
        freeze_step: warmup length in optimizer steps (positive int). The variance is frozen
            after this many steps. Guidance: 15-25% of the total steps. Or "auto": freeze once
            the variance has settled (:mod:`hvd_onebit.auto_freeze`); ``opt.freeze_step`` is
            None until then, then the step chosen (``opt.freeze_decision`` says why).
        auto_freeze: with ``freeze_step="auto"``, a dict of some of ``window`` (10),
            ``tolerance`` (0.1), ``patience`` (2), ``min_steps`` (50), ``max_steps`` (10000):
            every ``window`` steps the relative L1 change of the bias-corrected variance over
            the last ``window`` steps is measured; the warmup ends at the first check, at or
            after ``min_steps``, where it was below ``tolerance`` at ``patience`` checks in a
            row, and after ``max_steps`` at the latest.
        compressor: "onebit" (default) or "none", which averages the momentum in full precision
            in the compression phase: Adam with a frozen variance, for comparisons.
        block_size: elements per scale in the 1-bit allreduce, a positive multiple of 8
            (None: one per chunk).
        transport: how the compression phase's two stages travel: "torch" (torch.distributed,
            Gloo on CPU or NCCL on CUDA, set up over Horovod's ranks when the optimizer is
            built: no negotiation round, so each stage costs about one round trip less than
            through Horovod; with ``hierarchical``, one subgroup per node and per local rank;
            not for elastic jobs or process sets), "horovod"
            (Horovod's alltoall and allgather, negotiated with rank 0 by its background thread;
            whatever Horovod runs on), "mpi" (mpi4py; MPI jobs, CPU tensors), or "auto"
            (default): "torch" where it can serve, else "horovod". ``opt.transport`` says which.
        kernel_backend: "auto", "native" (C++, CPU) or "torch".
        bucket_size_mb: momentum fused per OneBitAllreduce, in MiB of fp32 (default 64). Each
            bucket costs two collectives per step; several let compression of one bucket
            overlap the transfer of the previous.
        check_every: every K steps, compare a checksum of the parameters across ranks and raise
            on every rank if they diverged (0, the default: never). One small allgather.
        flush_on_commit: in Horovod elastic jobs, call :meth:`flush_error_feedback` at every
            ``state.commit()``, so the committed state holds every rank's error feedback (one
            full-precision allreduce of the momentum per commit in the compression phase).
        hierarchical: True, False (default) or "auto" (on with several nodes of several ranks
            each). The momentum is reduce-scattered in full precision inside each node, the
            1-bit two-stage allreduce runs among the ranks with the same local rank, and an
            allgather inside the node completes it: between nodes each node sends 1/L of the
            1-bit rows flat 1-bit would (L ranks per node). Error feedback belongs to the
            rank's role in the topology; a checkpoint's is reset, with a warning, when the
            topology changes.
        overlap: in the compression phase, start each bucket's exchange from the gradient
            hooks, as soon as backward has produced all its gradients (on the last of
            ``backward_passes_per_step`` passes), so that its compression and stage 1 run while
            backward goes on; step() finishes the rest. Buckets start in one order on every
            rank, planned from the last parameter (the first gradients backward produces). The
            result is bit-identical to ``overlap=False``, which starts every bucket in step().
            With a GradScaler the hooks unscale as ``GradScaler.unscale_`` does. If the
            gradients change between backward and step() (clipping), that step starts its
            buckets again (all ranks together) and this rank stops starting them early, with a
            warning. The flat 1-bit collective only
            (``compressor="none"`` and ``hierarchical`` start in step()).

        memory: "auto" (default), "lean" or "fast". Each bucket's collective keeps a worker
            error (1x the bucket's float32 bytes) and a server error (1/n of it). "lean": one of
            each; the compression passes before the stages write only the rows, and the commit
            runs them again to store the new errors in place (one more pass per step), so the
            compression phase adds about 1 + 1/n + 1/16 of the parameters' float32 bytes beyond
            Adam's own. "fast": a spare of each, written by the passes and adopted at the
            commit: one pass less per step, 1x the parameters more. "auto": lean on CUDA (GPU
            memory is short, its passes run at memory speed), fast elsewhere.
        intra_node: how the hierarchical collective's full-precision stages travel inside a
            node: "shared_memory" (a segment in ``/dev/shm`` the node's ranks map: no copies
            through the kernel; CPU parameters with transport "torch"), "network" (the
            transport's own links, e.g. NCCL's NVLink on GPUs, or emulated links between ranks)
            or "auto" (default): shared memory where it can serve, else the network; a node
            whose ranks cannot share memory uses the network, with a warning.
        step_bound: "adam" (default), a positive number, or None. In the compression phase
            each element's step ``lr / bc1 * m / denom`` is clamped to ``lr * B``: with "adam",
            B is the longest step Adam itself can take at that step count (1 at step 1, 7.27
            in the limit for the default betas; :mod:`hvd_onebit.step_bound` derives it), so an
            element whose gradient outgrows its frozen variance cannot run away; a number is a
            fixed B; None takes the unbounded step of the paper (frozen-variance steps can then
            diverge on CNNs with dropout, max-pool and ReLU). The momentum and the error
            feedback are not clamped, only the step. ``compressor="none"`` is bounded alike.
        zero_variance: elements whose variance is exactly 0 at the freeze (no gradient in the
            whole warmup: dead ReLU inputs, unused embedding rows): "hold" (default) keeps them
            fixed for the rest of the run, with a warning; "eps" divides their momentum by
            Adam's eps (steps at the step bound); "floor" gives them the smallest non-zero
            variance of their parameter.
        precondition: True (default): the 1-bit allreduce carries each element's momentum over
            its frozen denominator, ``m / (sqrt(v / bc2) + eps)``, the quantity the update
            uses, instead of the momentum itself. The denominators are the same bits on every
            rank, so the average is the same; but one scale per chunk of the sign compression
            then fits elements of any variance alike (on the momentum itself, an element with a
            small variance receives its chunk's large magnitude and divides it by its small
            denominator), and the error feedback is kept in the update's units. The
            compression pass reads the frozen variance once more; bytes on the wire do not
            change. False: the paper's compression of the momentum, for comparison.

    A param group may carry ``exp_avg_mask``: a tensor broadcastable to each of its parameters, or
    a list with one tensor (or None) per parameter. In the compression phase the averaged
    momentum is multiplied by it in place, so masked entries (e.g. padding rows) stay zero.

    Returns:
        An optimizer of the wrapped class with Horovod's ``synchronize()`` and
        ``skip_synchronize()``, plus ``phase``, ``steps``, ``freeze_step``, ``freeze_decision``,
        ``flush_error_feedback()``, ``telemetry()`` and the counters
        ``last_step_bytes``, ``total_bytes``, ``last_step_comm_seconds``, ``total_comm_seconds``.
    """
    if not isinstance(optimizer, torch.optim.Adam):
        raise TypeError("hvd_onebit.DistributedOptimizer wraps torch.optim.Adam or "
                        f"torch.optim.AdamW; got {type(optimizer).__module__}."
                        f"{type(optimizer).__name__}")
    if any(g.get("amsgrad") for g in optimizer.param_groups):
        raise ValueError("amsgrad=True is not supported: 1-bit Adam freezes the variance, "
                         "which amsgrad's running maximum would contradict")
    config = OneBitConfig(freeze_step=freeze_step, compressor=compressor, block_size=block_size,
                          transport=transport, kernel_backend=kernel_backend,
                          bucket_size_mb=bucket_size_mb, check_every=check_every,
                          auto_freeze=auto_freeze, flush_on_commit=flush_on_commit,
                          hierarchical=hierarchical, overlap=overlap, memory=memory,
                          intra_node=intra_node, step_bound=step_bound,
                          zero_variance=zero_variance, precondition=precondition)
    if op == Adasum or op not in (Average, Sum):
        raise ValueError("hvd_onebit.DistributedOptimizer supports op=hvd.Average or hvd.Sum")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be a positive int, got "
                         f"{backward_passes_per_step!r}")
    validate_masks(optimizer.param_groups)
    config.check_environment([p for g in optimizer.param_groups for p in g["params"]], process_set)

    attrs = dict(_DistributedOptimizer.__dict__)
    attrs.update({k: v for k, v in _OneBitMixin.__dict__.items()
                  if k not in ("__dict__", "__weakref__")})
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), attrs)
    opt = cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
              op, gradient_predivide_factor, groups, sparse_as_dense, process_set, config)
    elastic.register_state_handler(opt)
    return opt
