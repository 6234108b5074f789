"""hvd_onebit.DistributedOptimizer: 1-bit Adam as a drop-in for ``hvd.DistributedOptimizer``.

Two phases, decided by the number of optimizer steps taken (never by anything else): the
**warmup**, exactly ``hvd.DistributedOptimizer`` around the wrapped Adam
(:mod:`hvd_onebit.phases.warmup`), then the **compression** phase: the variance frozen, only the
momentum travelling, in 1 bit with error feedback (:mod:`hvd_onebit.phases.compression`, the
engine :mod:`hvd_onebit.engine`). This module is the face Horovod users see: the
factory, the class it builds (the wrapped Adam class, Horovod's ``_DistributedOptimizer``, then
:class:`OneBitFace`), and short delegations to the modules that own each concern.
"""
from __future__ import annotations

import time
from typing import Callable, Iterable, Optional

import horovod.torch as hvd
import torch
from horovod.torch.compression import Compression
from horovod.torch.mpi_ops import Adasum, Average, Sum
from horovod.torch.optimizer import _DistributedOptimizer

from . import elastic
from .engine import CompressedStep
from .config import DEFAULT_BUCKET_MB, OneBitConfig, check_wrapped, validate_masks
from .horovod_view import HorovodView
from .low_precision import WidenBfloat16
from .phases import setup
from .state import checkpoint
from .state.adam_state import init_adam_state
from .state.schedule import COMPRESSION


def _counter(name: str) -> property:
    return property(lambda self: getattr(self._telemetry, name),
                    doc=f"This rank's {name.replace('_', ' ')} (see telemetry()).")


class OneBitFace:
    """Methods layered over Horovod's ``_DistributedOptimizer`` and the wrapped Adam class."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, sparse_as_dense, process_set,
                 config: OneBitConfig):
        # bfloat16 gradients cross Horovod's allreduce (which refuses bfloat16) as float32.
        _DistributedOptimizer.__init__(self, params, named_parameters, WidenBfloat16(compression),
                                       backward_passes_per_step, op, gradient_predivide_factor,
                                       groups, sparse_as_dense, process_set)
        self.config = config
        self._view = HorovodView(self, type(self))
        parts = setup.build(self._view, config, process_set)
        self._schedule, self._telemetry = parts.schedule, parts.telemetry
        self._engine, self._phases, self.transport = parts.engine, parts.phases, parts.transport

    # ---- what a training script reads ------------------------------------------------------------

    @property
    def phase(self) -> str:
        """"warmup" until ``freeze_step`` steps have been taken, then "compression"."""
        return self._schedule.phase

    @property
    def steps(self) -> int:
        """Optimizer steps taken (skipped steps not counted)."""
        return self._schedule.steps

    @property
    def freeze_step(self) -> Optional[int]:
        """The step count the variance freezes (or froze) at; None while ``freeze_step="auto"``
        has not decided."""
        return self._schedule.freeze_step

    @property
    def freeze_decision(self) -> Optional[dict]:
        """``freeze_step="auto"``: how the step was chosen (``freeze_step``, ``reason``, the
        ``change`` that triggered it and the ``history`` of (step, change) checks); None before
        the decision and with a fixed ``freeze_step``."""
        return self._schedule.decision

    @property
    def compressed_step(self) -> CompressedStep:
        """The compression-phase engine: buckets, 1-bit collectives, error feedback."""
        return self._engine

    last_step_bytes = _counter("last_step_bytes")
    total_bytes = _counter("total_bytes")
    last_step_comm_seconds = _counter("last_step_comm_seconds")
    total_comm_seconds = _counter("total_comm_seconds")
    skipped_steps = _counter("skipped_steps")
    refreshes = _counter("refreshes")
    last_step_breakdown = _counter("last_step_breakdown")

    def telemetry(self) -> dict:
        """Phase, step count and communication counters as a plain dict."""
        return self._telemetry.as_dict(self.phase, self.steps)

    # ---- checkpoints and the error-feedback lifecycle ----------------------------------------------

    def state_dict(self) -> dict:
        return checkpoint.state_dict(self._view, self.config, self._schedule, self._telemetry)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a :meth:`state_dict` (see :func:`hvd_onebit.state.checkpoint.load_state_dict`:
        a compression-phase checkpoint keeps its own freeze step)."""
        checkpoint.load_state_dict(self._view, self.config, self._schedule, self._telemetry,
                                   state_dict)
        self.reset_collectives()  # exp_avg tensors were replaced: re-fuse at the next step

    def reset_collectives(self) -> None:
        """Drop the fused buckets, the frozen denominators and every 1-bit collective (with its
        error feedback); the next compressed step rebuilds them. Every rank must call it at the
        same point (elastic resets do, through :mod:`hvd_onebit.elastic`)."""
        self._engine.reset()
        self._phases.compression.overlap.end_step()

    def restart_variance_monitor(self) -> None:
        """freeze_step="auto": forget the variance record (the next check starts a new one).
        Every rank must call it at the same point; elastic syncs do."""
        self._schedule.restart_monitor()

    def add_param_group(self, param_group: dict) -> None:
        constructed = "config" in self.__dict__
        if constructed and self.phase == COMPRESSION:
            raise ValueError(
                f"cannot add parameters after the variance was frozen (step {self.steps} >= "
                f"freeze_step {self.freeze_step}): Adam's variance for them was never "
                "estimated. Add them during the warmup.")
        super(self.__class__, self).add_param_group(param_group)
        if constructed:  # new parameters need Adam state
            init_adam_state(self.param_groups, self.state)

    def error_feedback_state_dict(self) -> dict:
        """This rank's error-feedback buffers (rank-local: save one file per rank)."""
        return self._engine.error_feedback_state_dict()

    def load_error_feedback_state_dict(self, state: dict) -> None:
        """Restore :meth:`error_feedback_state_dict` from the same rank of a same-size job; with
        another world size, rank or layout they are dropped with a warning."""
        self._engine.load_error_feedback_state_dict(state)

    def flush_error_feedback(self) -> int:
        """Fold every rank's error feedback into the momentum (one full-precision allreduce),
        so that rank 0's ``state_dict()`` alone resumes on any world size; a no-op in the
        warmup, on one rank and with ``compressor="none"``. Every rank calls it at the same
        point. Returns the bytes this rank sent; raises NonFiniteInputError on every rank,
        changing nothing (:meth:`~hvd_onebit.engine.CompressedStep.flush_error_feedback`)."""
        if not self._phases.compressing() or self.config.compressor != "onebit":
            return 0
        self._engine.ensure_ready(self._view.active_parameters())  # applies loaded errors
        start = time.perf_counter()
        nbytes = self._engine.flush_error_feedback(self.param_groups)
        self._telemetry.add(nbytes, time.perf_counter() - start)
        return nbytes

    # ---- Horovod's hooks, synchronize and zero_grad -------------------------------------------------

    def _make_hook(self, p):
        warmup_hook = _DistributedOptimizer._make_hook(self, p)
        return lambda *args: self._phases.gradient_hook(p, warmup_hook, *args)

    def synchronize(self) -> None:
        """Warmup: wait for the gradient allreduces (as Horovod). Compression: nothing to wait for."""
        self._phases.synchronize(self._make_hook)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles or self._engine.started:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(). This is "
                                 "prohibited as it can cause a race condition.")
        super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    # ---- step ----------------------------------------------------------------------------------

    # GradScaler then hands this optimizer the skip decision (hvd_onebit.phases.amp).
    _step_supports_amp_scaling = True

    def step(self, closure: Optional[Callable[[], float]] = None, grad_scaler=None):
        """One optimizer step: Horovod + Adam in warmup, 1-bit momentum Adam afterwards.
        ``grad_scaler`` is passed by ``torch.amp.GradScaler.step()`` itself."""
        return self._phases.step(closure, grad_scaler,
                                 lambda: grad_scaler.unscale_(self), self._make_hook)


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
                         precondition: bool = True,
                         variance_refresh=None):
    """Wrap a ``torch.optim.Adam`` or ``AdamW`` for 1-bit Adam over Horovod.

    The arguments up to ``process_set`` mean what they mean for ``hvd.DistributedOptimizer`` and
    govern the warmup; ``compression``, ``groups`` and ``gradient_predivide_factor`` only affect
    the warmup's gradient allreduce. ``optimizer``: a ``torch.optim.Adam`` or ``AdamW`` (amsgrad
    off) over float32, float16 or bfloat16 parameters on one device; its lr, betas, eps and
    weight_decay are read from the param groups at every step, so LR schedulers and per-group
    settings work in both phases.

    The keyword-only arguments are the 1-bit options, each explained with its trade-offs in
    :class:`~hvd_onebit.config.OneBitConfig`: ``freeze_step`` (warmup steps, or "auto"; 15-25%
    of the run is the guidance), ``auto_freeze``, ``compressor`` ("onebit" or "none"),
    ``block_size``, ``transport`` ("auto", "torch", "horovod", "mpi"), ``kernel_backend``,
    ``bucket_size_mb``, ``check_every``, ``flush_on_commit``, ``hierarchical``, ``overlap``,
    ``memory``, ``intra_node``, ``step_bound`` (each compression-phase step clamped at the
    longest step Adam could take), ``zero_variance`` and ``precondition`` (the 1-bit collectives
    carry the momentum over its frozen denominator), ``variance_refresh`` (None, "doubling" or a
    dict: full-precision refresh steps of the variance inside the compression phase, on 0/1
    Adam's doubling schedule; with one, an early ``freeze_step`` (3-5% of the run, or
    "auto" with a short ``auto_freeze={"min_steps": ...}``) is the recommended setting).

    A param group may carry ``exp_avg_mask``: a tensor broadcastable to each of its parameters,
    or a list with one tensor (or None) per parameter. In the compression phase the averaged
    momentum is multiplied by it in place, so masked entries (e.g. padding rows) stay zero.

    Returns:
        An optimizer of the wrapped class with Horovod's ``synchronize()`` and
        ``skip_synchronize()``, plus ``phase``, ``steps``, ``freeze_step``, ``freeze_decision``,
        ``flush_error_feedback()``, ``telemetry()`` and the counters
        ``last_step_bytes``, ``total_bytes``, ``last_step_comm_seconds``, ``total_comm_seconds``.
    """
    check_wrapped(optimizer, op in (Average, Sum) and op != Adasum, backward_passes_per_step)
    config = OneBitConfig(freeze_step=freeze_step, compressor=compressor, block_size=block_size,
                          transport=transport, kernel_backend=kernel_backend,
                          bucket_size_mb=bucket_size_mb, check_every=check_every,
                          auto_freeze=auto_freeze, flush_on_commit=flush_on_commit,
                          hierarchical=hierarchical, overlap=overlap, memory=memory,
                          intra_node=intra_node, step_bound=step_bound,
                          zero_variance=zero_variance, precondition=precondition,
                          variance_refresh=variance_refresh)
    validate_masks(optimizer.param_groups)
    config.check_environment([p for g in optimizer.param_groups for p in g["params"]], process_set)

    attrs = dict(_DistributedOptimizer.__dict__)
    attrs.update({k: v for k, v in OneBitFace.__dict__.items()
                  if k not in ("__dict__", "__weakref__")})
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), attrs)
    opt = cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
              op, gradient_predivide_factor, groups, sparse_as_dense, process_set, config)
    elastic.register_state_handler(opt)
    return opt
