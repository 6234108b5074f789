"""hvd_onebit.ddp.DistributedOptimizer: 1-bit Adam for a DDP model under torchrun.

Two phases, decided by the number of optimizer steps taken, as in the Horovod face: the
**warmup**, DDP's own allreduce of the gradients and the wrapped Adam's step (bit-identical to
DDP + that Adam for float32 parameters), then the **compression** phase: DDP's gradient sync is
off for the step (as ``no_sync()`` turns it off), and Adam's momentum is averaged in 1 bit with
error feedback through the engine (:mod:`hvd_onebit.engine`) on torch.distributed, on the DDP
model's own group (or ``process_group``), whatever its backend.
This module is the face: the factory, the class it builds (the wrapped Adam class, then
:class:`DDPFace` beside :class:`~hvd_onebit.face.SharedFace`), and short delegations.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..config import (DEFAULT_BLOCK_SIZE, DEFAULT_BUCKET_MB, DOUBLING, REQUIRED, Experimental,
                      OneBitConfig, check_wrapped)
from ..eager import eager
from ..face import SharedFace, face_attributes, guard_wrapped
from ..stall import building, watch
from ..state.checkpoint import HandedStates
from . import setup
from .view import DDPView


class DDPFace:
    """Methods layered over the wrapped Adam class, beside
    :class:`~hvd_onebit.face.SharedFace`'s."""

    def __init__(self, optimizer: torch.optim.Optimizer, model, config: OneBitConfig, group):
        torch.optim.Optimizer.__init__(self, optimizer.param_groups, optimizer.defaults)
        self.config = config
        self._view = DDPView(self, type(self), setup.model_names(model),
                             setup.module_names(model))
        parts = setup.build(self._view, config, group, model)
        self._schedule, self._telemetry = parts.schedule, parts.telemetry
        self._engine, self._phases, self._hook = parts.engine, parts.phases, parts.hook
        self._handed = HandedStates()
        self.transport = "torch"

    # GradScaler then hands this optimizer the skip decision (hvd_onebit.phases.amp).
    _step_supports_amp_scaling = True

    @eager  # inside a torch.compile'd function: run eagerly (hvd_onebit.eager)
    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's; between backward and step() it skips the batch: the buckets its hooks
        started are started again by the next step."""
        self._phases.gradients_zeroed()
        self._hook.discard_passes()
        self._view.adam.zero_grad(set_to_none)

    def load_state_dict(self, state_dict: dict) -> None:
        """The shared face's, then the hook starts afresh: a state loaded between a backward
        and step() (a rollback) moves the parameters for this optimizer, not another one."""
        SharedFace.load_state_dict(self, state_dict)
        self._hook.discard_passes()

    @eager
    def step(self, closure: Optional[Callable[[], float]] = None, grad_scaler=None):
        """One optimizer step: Adam on DDP's averaged gradients in the warmup, 1-bit momentum
        Adam on the local gradients afterwards (the buckets not started from the gradient
        hooks start here). ``grad_scaler`` is passed by
        ``torch.amp.GradScaler.step()`` itself."""
        try:
            loss = self._phases.step(closure, grad_scaler, lambda: grad_scaler.unscale_(self),
                                     None)
        finally:
            self._hook.end_step()
        self._hook.warn_if_never_run(  # after a step that returned: never over its error
            lambda: any(p.grad is not None for p in self._view.adam.parameters()))
        return loss


def DistributedOptimizer(optimizer: torch.optim.Optimizer, model, *,
                         freeze_step: int | str = REQUIRED,
                         variance_refresh: Optional[str] = DOUBLING,
                         hierarchical: bool | str = False,
                         bucket_size_mb: float = DEFAULT_BUCKET_MB,
                         overlap: bool = True,
                         memory: str = "auto",
                         block_size: Optional[int] = DEFAULT_BLOCK_SIZE,
                         check_every: int = 0,
                         kernel_backend: str = "auto",
                         experimental: Optional[Experimental] = None,
                         process_group=None,
                         **moved):
    """Wrap a ``torch.optim.Adam`` or ``AdamW`` of a DDP model for 1-bit Adam.

    ``optimizer``: a ``torch.optim.Adam`` or ``AdamW`` (amsgrad off) built from the DDP model's
    parameters (float32, float16 or bfloat16, on one device); lr, betas, eps and weight_decay are
    read from the param groups at every step, so LR schedulers and per-group settings work in
    both phases. ``model``: the ``DistributedDataParallel`` module (or ``torch.compile`` of it).
    The optimizer registers its own communication hook on it; DDP allows one, so a model that
    has one already is refused. The options mean what they mean for
    :func:`hvd_onebit.DistributedOptimizer`.

    Args:
        freeze_step (int or "auto"): warmup steps before the variance freezes: 5% of the run
            with the default refresh, 15-25% with ``variance_refresh=None``; "auto": once the
            variance has settled.
        variance_refresh (str, optional): "doubling": full-precision refresh steps of the
            variance on a doubling schedule (as in 0/1 Adam, Lu et al. 2022), thinning out as
            the run goes on; None: the variance stays frozen, the paper's 1-bit Adam (default:
            "doubling")
        hierarchical (bool or "auto", optional): full precision inside each node, 1 bit
            between nodes, the nodes as the launcher numbers them (horovodrun's hosts,
            torchrun's nodes; every node the same number of ranks); "auto": on with several
            nodes of several ranks (default: False)
        bucket_size_mb (float, optional): momentum per 1-bit allreduce, in MiB of fp32
            (default: 64)
        overlap (bool, optional): start buckets from the gradient hooks as backward makes them,
            bit-identical to starting them in step(); off with ``find_unused_parameters``;
            pass False where the script clips or changes the gradients after backward at
            every step (default: True)
        memory (str, optional): "auto", "lean" (one error buffer per collective) or "fast"
            (a spare of each, one pass less per step); "auto": lean on CUDA (default: "auto")
        block_size (int, optional): elements per scale of the 1-bit compression, a multiple
            of 8; None: one scale per chunk (default: 512)
        check_every (int, optional): every K-th ``step()`` raise on every rank if the
            parameters or step counts differ between ranks (default: 0, never)
        kernel_backend (str, optional): "auto", "native", "triton" or "torch" (default: "auto")
        experimental (Experimental, optional): research knobs, for measurement and comparison
            only (:class:`~hvd_onebit.config.Experimental`) (default: None, their defaults)
        process_group (optional): the torch.distributed group the momentum travels on, with
            the ranks DDP averages over (default: None, the DDP model's own group)

    Other keywords (``**moved``) are refused with a TypeError that says what to do instead: the
    Horovod face's own (``transport``, ``flush_on_commit``, ``backward_passes_per_step``, ...)
    and the knobs of :class:`~hvd_onebit.config.Experimental`. Every option is checked here,
    before anything is registered on the model; what one rank refuses, every rank raises.
    ``model.no_sync()``, ``find_unused_parameters``, ``static_graph``,
    ``gradient_as_bucket_view``, several param groups, float16/bfloat16 parameters (float32
    Adam state) and ``torch.amp.GradScaler`` (``scaler.step(opt)``: a non-finite value on one
    rank skips the step on every rank) work as with DDP + Adam.

    Clipping: in the warmup and the variance refresh steps the gradients are DDP's averages, so
    a clip acts as with DDP + Adam. In compressed steps no gradient is averaged: ``p.grad`` is
    this rank's own, and a clip bounds what each rank adds to its momentum before the 1-bit
    average (the update itself is bounded by Adam's own bound,
    ``Experimental(step_bound="adam")``). The recipe is the same line in both phases:
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` before ``opt.step()``
    (after ``scaler.unscale_(opt)`` with a GradScaler).

    Returns:
        An optimizer of the wrapped class, plus ``phase``, ``steps``, ``freeze_step``,
        ``freeze_decision``, ``flush_error_feedback()``, ``error_feedback_state_dict()`` and
        ``load_error_feedback_state_dict()``, ``reset_collectives()``, ``telemetry()`` and the
        counters ``last_step_bytes``, ``total_bytes``, ``last_step_comm_seconds``,
        ``total_comm_seconds``. The optimizer passed in refuses ``step()`` while the one
        returned lives: step that one.
    """
    with watch().watching(lambda: building("hvd_onebit.ddp.DistributedOptimizer",
                                           "the DDP model's process group")):
        with setup.refusals_agreed(model, optimizer):
            check_wrapped(optimizer, True, 1, face=setup.FACE)
            setup.refuse_horovod_only(moved)
            if process_group is dist.GroupMember.NON_GROUP_MEMBER:
                raise ValueError("process_group does not hold this rank (dist.new_group gives "
                                 "the ranks outside a group GroupMember.NON_GROUP_MEMBER): pass "
                                 "each rank the group its DDP model averages over, or None for "
                                 "the model's own")
            if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
                raise TypeError(f"process_group must be a torch.distributed ProcessGroup (e.g. "
                                f"dist.new_group(ranks)) or None, got {process_group!r}")
            config = OneBitConfig.from_options(
                freeze_step, variance_refresh=variance_refresh, hierarchical=hierarchical,
                bucket_size_mb=bucket_size_mb,
                transport="torch", overlap=overlap, memory=memory, block_size=block_size,
                check_every=check_every, kernel_backend=kernel_backend,
                experimental=experimental, **moved)
            model = setup.ddp_model_of(model)
            if setup.finds_unused(model):
                config = dataclasses.replace(config, overlap=False)
            group = setup.check(model, optimizer.param_groups, process_group, config)
        setup.check_job(model, optimizer.param_groups, group, config)
        cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
                   face_attributes(DDPFace))
        opt = cls(optimizer, model, config, group)
    guard_wrapped(optimizer, "hvd_onebit.ddp.DistributedOptimizer", opt,
                  "With Hugging Face Accelerate, wrap it before accelerator.prepare() and pass "
                  "the wrapper to prepare(). ")
    return opt
