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

import warnings
from typing import Callable, Iterable, Optional

import horovod.torch as hvd
import torch
from horovod.torch.compression import Compression
from horovod.torch.mpi_ops import Adasum, Average, Sum
from horovod.torch.optimizer import _DistributedOptimizer

from . import elastic
from .config import (DEFAULT_BLOCK_SIZE, DEFAULT_BUCKET_MB, DOUBLING, REQUIRED, Experimental,
                     OneBitConfig, check_wrapped)
from .eager import eager
from .face import face_attributes, guard_wrapped
from .horovod_view import HorovodView
from .low_precision import WidenBfloat16
from .stall import building, watch
from .state.checkpoint import HandedStates
from .phases import setup
from .values import check_positive_number


class OneBitFace:
    """Methods layered over Horovod's ``_DistributedOptimizer`` and the wrapped Adam class,
    beside :class:`~hvd_onebit.face.SharedFace`'s."""

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
        self._warmup = parts.warmup
        self._handed = HandedStates()

    # ---- Horovod's hooks, synchronize and zero_grad -------------------------------------------------

    def _make_hook(self, p):
        horovod_hook = _DistributedOptimizer._make_hook(self, p)
        return eager(lambda *args: self._phases.gradient_hook(
            p, lambda *a: self._warmup.hook(p, horovod_hook, *a), *args))

    def synchronize(self) -> None:
        """Warmup: wait for the gradient allreduces (as Horovod). Compression: nothing to wait for."""
        self._phases.synchronize(self._make_hook)

    @eager  # inside a torch.compile'd function: run eagerly (hvd_onebit.eager)
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Horovod's rule: refused between backward and step() unless synchronize() was called
        (the compression phase's buckets started during backward count as in flight). After
        it, the batch is skipped: the step that follows starts those buckets again."""
        if self._handles or (self._engine.started and not self._view.synchronized):
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(). This is "
                                 "prohibited as it can cause a race condition.")
        self._phases.gradients_zeroed()
        self._view.adam.zero_grad(set_to_none)

    # ---- step ----------------------------------------------------------------------------------

    # GradScaler then hands this optimizer the skip decision (hvd_onebit.phases.amp).
    _step_supports_amp_scaling = True

    @eager
    def step(self, closure: Optional[Callable[[], float]] = None, grad_scaler=None):
        """One optimizer step: Horovod + Adam in warmup, 1-bit momentum Adam afterwards.
        ``grad_scaler`` is passed by ``torch.amp.GradScaler.step()`` itself."""
        elastic.raise_if_reset_due(self)
        return self._phases.step(closure, grad_scaler,
                                 lambda: grad_scaler.unscale_(self), self._make_hook)


def check_horovod_arguments(op, gradient_predivide_factor, compression) -> None:
    """Horovod's own arguments, refused here as ``hvd.DistributedOptimizer`` refuses them, or
    where it would fail only at the first step (a zero factor, a compression that is not a
    compressor)."""
    factor = gradient_predivide_factor
    check_positive_number("gradient_predivide_factor", factor, "a positive finite number")
    if factor != 1.0 and op != Average:
        raise ValueError(f"gradient_predivide_factor={factor!r} needs op=hvd.Average (as "
                         f"hvd.DistributedOptimizer refuses it with op != Average)")
    if not all(callable(getattr(compression, name, None)) for name in ("compress", "decompress")):
        raise TypeError(f"compression must be a Horovod compressor (hvd.Compression.none or "
                        f"hvd.Compression.fp16), got {compression!r}")


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[Iterable[tuple[str, torch.Tensor]]] = None,
                         compression=Compression.none,
                         backward_passes_per_step: int = 1,
                         op=Average,
                         gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0,
                         groups=None,
                         sparse_as_dense: bool = False,
                         process_set: hvd.ProcessSet = hvd.global_process_set,
                         *,
                         freeze_step: int | str = REQUIRED,
                         variance_refresh: Optional[str] = DOUBLING,
                         hierarchical: bool | str = False,
                         bucket_size_mb: float = DEFAULT_BUCKET_MB,
                         transport: str = "auto",
                         overlap: bool = True,
                         memory: str = "auto",
                         flush_on_commit: bool = False,
                         block_size: Optional[int] = DEFAULT_BLOCK_SIZE,
                         check_every: int = 0,
                         kernel_backend: str = "auto",
                         experimental: Optional[Experimental] = None,
                         **moved):
    """Wrap a ``torch.optim.Adam`` or ``AdamW`` for 1-bit Adam over Horovod.

    ``optimizer``: a ``torch.optim.Adam`` or ``AdamW`` (amsgrad off) over float32, float16 or
    bfloat16 parameters on one device; its lr, betas, eps and weight_decay are read from the
    param groups at every step, so LR schedulers and per-group settings work in both phases.
    The arguments up to ``process_set`` mean what they mean for ``hvd.DistributedOptimizer``
    and govern the warmup (``op``: ``hvd.Average`` or ``hvd.Sum``); both phases average over
    ``process_set`` alone, and a rank outside it steps alone, as Horovod's does. A param group
    may carry ``exp_avg_mask``: a tensor broadcastable to each of its parameters, or a list
    with one tensor (or None) per parameter; the averaged momentum is multiplied by it in the
    compression phase, so masked entries (e.g. padding rows) stay zero.

    Three options matter: ``freeze_step``, ``variance_refresh``, and ``hierarchical`` on
    multi-node jobs. Leave the others at their defaults unless a measurement says otherwise.

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
        transport (str, optional): how the 1-bit stages travel: "auto", "torch", "horovod",
            "mpi"; ``opt.transport`` says which "auto" chose (default: "auto")
        overlap (bool, optional): start buckets from the gradient hooks, bit-identical to
            starting them in step(); pass False where the script clips or changes the
            gradients after backward at every step (default: True)
        memory (str, optional): "auto", "lean" (one error buffer per collective) or "fast"
            (a spare of each, one pass less per step); "auto": lean on CUDA (default: "auto")
        flush_on_commit (bool, optional): fold the error feedback into the momentum at every
            Horovod elastic ``state.commit()`` (default: False)
        block_size (int, optional): elements per scale of the 1-bit compression, a multiple
            of 8; None: one scale per chunk (default: 512)
        check_every (int, optional): every K-th ``step()`` raise on every rank if the
            parameters or step counts differ between ranks (default: 0, never)
        kernel_backend (str, optional): "auto", "native", "triton" or "torch" (default: "auto")
        experimental (Experimental, optional): research knobs, for measurement and comparison
            only (:class:`~hvd_onebit.config.Experimental`) (default: None, their defaults)

    ``compressor``, ``precondition``, ``step_bound``, ``zero_variance``, ``intra_node`` and
    ``auto_freeze`` belong to :class:`~hvd_onebit.config.Experimental`: passed here as
    keywords they raise a TypeError that says so. Every option is checked here, before any
    other collective; what one rank refuses, every rank raises.

    Returns:
        An optimizer of the wrapped class with Horovod's ``synchronize()`` and
        ``skip_synchronize()``, plus ``phase``, ``steps``, ``freeze_step``, ``freeze_decision``,
        ``flush_error_feedback()``, ``error_feedback_state_dict()`` and
        ``load_error_feedback_state_dict()``, ``telemetry()`` and the counters
        ``last_step_bytes``, ``total_bytes``, ``last_step_comm_seconds``, ``total_comm_seconds``.
        The optimizer passed in refuses ``step()`` while the one returned lives: step that one.
    """
    if num_groups != 0:  # as Horovod treats it: the old name of an integer ``groups``
        warnings.warn("Parameter `num_groups` has been replaced by `groups`", DeprecationWarning,
                      stacklevel=2)
        groups = num_groups if groups is None else groups
    if named_parameters is not None:  # read twice: by the checks and by Horovod's constructor
        named_parameters = list(named_parameters)
    with setup.refusals_agreed(process_set):
        check_wrapped(optimizer, op in (Average, Sum) and op != Adasum, backward_passes_per_step)
        check_horovod_arguments(op, gradient_predivide_factor, compression)
        config = OneBitConfig.from_options(
            freeze_step, variance_refresh=variance_refresh, hierarchical=hierarchical,
            bucket_size_mb=bucket_size_mb, transport=transport, overlap=overlap, memory=memory,
            flush_on_commit=flush_on_commit, block_size=block_size, check_every=check_every,
            kernel_backend=kernel_backend, experimental=experimental, **moved)
        # (name, tensor) pairs only: Horovod's constructor refuses anything else, in its words
        pairs = named_parameters is not None and all(
            isinstance(item, tuple) and len(item) == 2 for item in named_parameters)
        setup.check(config, optimizer.param_groups, process_set,
                    {p: name for name, p in named_parameters} if pairs else None)

    attrs = dict(_DistributedOptimizer.__dict__)
    attrs.update(face_attributes(OneBitFace))
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), attrs)
    with watch().watching(lambda: building("hvd_onebit.DistributedOptimizer", "process_set")):
        opt = cls(optimizer.param_groups, named_parameters, compression,
                  backward_passes_per_step, op, gradient_predivide_factor, groups,
                  sparse_as_dense, process_set, config)
    # Horovod's constructor builds the class again from the param groups alone, which leaves
    # the class's own defaults (Adam's signature's lr) where add_param_group fills in a new
    # group's options: the optimizer's, as the DDP face and the wrapped Adam have them
    opt.defaults = dict(optimizer.defaults)
    guard_wrapped(optimizer, "hvd_onebit.DistributedOptimizer", opt,
                  "hvd.broadcast_optimizer_state() takes the wrapper too (it steps the "
                  "optimizer it is given once). ")
    elastic.register_state_handler(opt)
    return opt
