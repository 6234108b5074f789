"""OneBitConfig: the 1-bit options of DistributedOptimizer, validated once, at construction.

Every rank builds the same config from the same arguments, so a bad option raises the same clear
error on every rank before any collective, not hours later at the freeze.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Iterable, Optional, Union

import torch

from . import kernels
from .dtypes import FLOAT_DTYPES
from .step_bound import ADAM as ADAM_BOUND, validate as validate_step_bound
from .transport.registry import check_name as check_transport_name
from .transport.registry import check_transport, either, supporting, supports

COMPRESSORS = ("onebit", "none")
MEMORY_MODES = ("auto", "lean", "fast")
INTRA_NODE_MODES = ("auto", "shared_memory", "network")
ZERO_VARIANCE_MODES = ("hold", "eps", "floor")
AUTO = "auto"  # freeze_step="auto": freeze once the variance has settled (hvd_onebit.auto_freeze)
DEFAULT_BUCKET_MB = 64.0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class AutoFreeze:
    """Options of ``freeze_step="auto"`` (``auto_freeze=dict(...)``; the rule is in
    :mod:`hvd_onebit.auto_freeze`), validated at construction.

    Attributes:
        window: steps between checks; the change is measured over this many steps.
        tolerance: freeze when the relative L1 change of the bias-corrected variance over a
            window is below this...
        patience: ...at this many consecutive checks.
        min_steps: never freeze before this many steps.
        max_steps: freeze after this many steps at the latest.
    """

    window: int = 10
    tolerance: float = 0.1
    patience: int = 2
    min_steps: int = 50
    max_steps: int = 10000

    def __post_init__(self) -> None:
        for name in ("window", "patience", "min_steps", "max_steps"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"auto_freeze {name} must be a positive int, got {value!r}")
        tol = self.tolerance
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not math.isfinite(tol) \
                or tol <= 0:
            raise ValueError(f"auto_freeze tolerance must be a positive number, got {tol!r}")
        if self.max_steps < self.min_steps:
            raise ValueError(f"auto_freeze max_steps ({self.max_steps}) must be >= min_steps "
                             f"({self.min_steps})")

    @classmethod
    def from_options(cls, options) -> "AutoFreeze":
        """From None (the defaults), a dict of some of the fields, or an AutoFreeze."""
        if options is None:
            return cls()
        if isinstance(options, cls):
            return options
        if not isinstance(options, dict):
            raise TypeError(f"auto_freeze must be a dict of options, got {type(options).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"auto_freeze: unknown option(s) {unknown}; known: {sorted(known)}")
        return cls(**options)


@dataclass(frozen=True)
class OneBitConfig:
    """The compression-phase options (see :func:`hvd_onebit.DistributedOptimizer` for meanings).

    Attributes:
        freeze_step: warmup length in optimizer steps, >= 1, or "auto".
        auto_freeze: with freeze_step="auto", its options: None (the defaults), a dict of some
            of :class:`AutoFreeze`'s fields, or an AutoFreeze; stored as
            an AutoFreeze (None with an int freeze_step).
        compressor: "onebit" or "none".
        block_size: elements per scale (a positive multiple of 8), or None for one per chunk.
        transport: "auto", "horovod", "mpi" or "torch".
        kernel_backend: "auto", "native" or "torch".
        bucket_size_mb: MiB of float32 momentum per fused bucket, > 0.
        check_every: steps between cross-rank parameter checks, 0 for never.
        flush_on_commit: elastic jobs: fold the error feedback into the momentum at every
            commit (:meth:`flush_error_feedback`), so a committed state loses none.
        hierarchical: True, False or "auto": the 1-bit stage among nodes, full precision inside
            them (:mod:`hvd_onebit.hierarchical`); "auto" when there are several nodes of several
            ranks each.
        overlap: start each bucket's exchange from the gradient hooks, during backward.
        memory: "lean", "fast" or "auto": one error buffer per collective and its passes
            repeated at the commit, or a spare one of each and no pass repeated; "auto" is lean
            on CUDA and fast elsewhere (see :meth:`spare_errors`).
        intra_node: "auto", "shared_memory" or "network": how the hierarchical stages inside a
            node travel (see :meth:`shared_memory_inside_nodes`).
        step_bound: "adam", a positive number or None: the bound on each compression-phase
            step (:mod:`hvd_onebit.step_bound`).
        zero_variance: "hold", "eps" or "floor": what elements whose variance is 0 at the
            freeze do in the compression phase (see ``CompressedStep._freeze_variances``).
        precondition: the 1-bit collectives carry the momentum over its frozen denominator
            (:class:`~hvd_onebit.kernels.fused_adam.MomentumInput`), or the momentum itself.
    """

    freeze_step: Union[int, str]
    compressor: str = "onebit"
    block_size: Optional[int] = None
    transport: str = "auto"
    kernel_backend: str = "auto"
    bucket_size_mb: float = DEFAULT_BUCKET_MB
    check_every: int = 0
    auto_freeze: Any = None
    flush_on_commit: bool = False
    hierarchical: Union[bool, str] = False
    overlap: bool = True
    memory: str = "auto"
    intra_node: str = "auto"
    step_bound: Any = ADAM_BOUND
    zero_variance: str = "hold"
    precondition: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "step_bound", validate_step_bound(self.step_bound))
        if self.freeze_step == AUTO:
            object.__setattr__(self, "auto_freeze", AutoFreeze.from_options(self.auto_freeze))
        elif not _is_int(self.freeze_step) or self.freeze_step < 1:
            raise ValueError(f"freeze_step must be a positive int (warmup steps) or 'auto', got "
                             f"{self.freeze_step!r}")
        elif self.auto_freeze is not None:
            raise ValueError("auto_freeze options apply only with freeze_step='auto', got "
                             f"freeze_step={self.freeze_step!r}")
        if self.zero_variance not in ZERO_VARIANCE_MODES:
            raise ValueError(f"zero_variance must be one of {ZERO_VARIANCE_MODES}, got "
                             f"{self.zero_variance!r}")
        if not isinstance(self.precondition, bool):
            raise ValueError(f"precondition must be True or False, got {self.precondition!r}")
        if self.memory not in MEMORY_MODES:
            raise ValueError(f"memory must be one of {MEMORY_MODES}, got {self.memory!r}")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"overlap must be True or False, got {self.overlap!r}")
        if not isinstance(self.flush_on_commit, bool):
            raise ValueError(f"flush_on_commit must be True or False, got {self.flush_on_commit!r}")
        if not (isinstance(self.hierarchical, bool) or self.hierarchical == "auto"):
            raise ValueError(f"hierarchical must be True, False or 'auto', got "
                             f"{self.hierarchical!r}")
        if self.hierarchical is not False and not supports(self.transport, "hierarchical"):
            raise ValueError(f"hierarchical 1-bit runs on transport="
                             f"{either(supporting('hierarchical'))}, got "
                             f"transport={self.transport!r}")
        if self.intra_node not in INTRA_NODE_MODES:
            raise ValueError(f"intra_node must be one of {INTRA_NODE_MODES}, got "
                             f"{self.intra_node!r}")
        if self.intra_node == "shared_memory" and not supports(self.transport, "shared_memory"):
            raise ValueError(f"intra_node='shared_memory' runs beside transport="
                             f"{either(supporting('shared_memory'))} (or 'auto'), got "
                             f"transport={self.transport!r}")
        if self.compressor not in COMPRESSORS:
            raise ValueError(f"compressor must be one of {COMPRESSORS}, got {self.compressor!r}")
        if self.block_size is not None and (not _is_int(self.block_size) or self.block_size <= 0
                                            or self.block_size % 8):
            raise ValueError(f"block_size must be None or a positive multiple of 8, got "
                             f"{self.block_size!r}")
        check_transport_name(self.transport)
        if self.kernel_backend not in kernels.BACKENDS:
            raise ValueError(f"kernel_backend must be one of {kernels.BACKENDS}, got "
                             f"{self.kernel_backend!r}")
        size = self.bucket_size_mb
        if (isinstance(size, bool) or not isinstance(size, (int, float)) or not math.isfinite(size)
                or size <= 0):
            raise ValueError(f"bucket_size_mb must be a positive number of MiB, got {size!r}")
        if not _is_int(self.check_every) or self.check_every < 0:
            raise ValueError(f"check_every must be a non-negative int, got {self.check_every!r}")

    @property
    def auto(self) -> bool:
        """Whether the warmup ends when the variance has settled (freeze_step="auto")."""
        return self.freeze_step == AUTO

    def spare_errors(self, device: torch.device) -> bool:
        """Whether the collectives keep spare error buffers on ``device`` (memory="fast"):
        "auto" keeps them off CUDA, where memory is plentiful and the repeated passes would cost
        compute time the CPU is short of; on a GPU the passes run at memory speed and the
        memory is what is short."""
        if self.memory == "auto":
            return torch.device(device).type != "cuda"
        return self.memory == "fast"

    def shared_memory_inside_nodes(self, transport: str, device: torch.device) -> bool:
        """Whether the hierarchical stages inside a node go through shared memory: CPU buffers
        on the torch transport ("auto" and "shared_memory"); "network" never. Raises if
        "shared_memory" was asked for where it cannot serve (the transport resolved to another
        one, or the parameters are not on the CPU)."""
        possible = transport in supporting("shared_memory") and torch.device(device).type == "cpu"
        if self.intra_node == "shared_memory" and not possible:
            raise ValueError("intra_node='shared_memory' needs CPU parameters on transport "
                             f"'torch', this job has {torch.device(device)} on {transport!r}")
        return possible and self.intra_node != "network"

    @property
    def bucket_numel(self) -> int:
        """Elements of float32 momentum per bucket (at least 1)."""
        return max(1, int(self.bucket_size_mb * 2**20 / 4))

    def check_environment(self, params: Iterable[torch.Tensor], process_set) -> None:
        """What can only be checked against the parameters and the job: dtypes, one device, a
        kernel backend that runs there, a transport this job can use. Raises on every rank."""
        params = list(params)
        bad = sorted({str(p.dtype) for p in params if p.dtype not in FLOAT_DTYPES})
        if bad:
            raise TypeError(f"hvd_onebit.DistributedOptimizer trains float32, float16 and bfloat16 "
                            f"parameters; got {', '.join(bad)}")
        check_one_device(params)
        if params:
            kernels.resolve_backend(self.kernel_backend, params[0].device)
            if self.compressor == "onebit":
                check_transport(self.transport, process_set, params[0].device)


def check_one_device(params: Iterable[torch.Tensor]) -> None:
    """Raise ValueError unless every parameter is on one device: the fused buckets, their
    collectives and the kernels each live on one."""
    devices = sorted({str(p.device) for p in params})
    if len(devices) > 1:
        raise ValueError("hvd_onebit.DistributedOptimizer needs all parameters on one device, "
                         f"found {devices}")


def group_masks(group: dict) -> list[Optional[torch.Tensor]]:
    """The group's ``exp_avg_mask`` as one entry per parameter (None = no mask)."""
    mask = group.get("exp_avg_mask")
    params = group["params"]
    if mask is None:
        return [None] * len(params)
    if isinstance(mask, torch.Tensor):
        return [mask] * len(params)
    return list(mask)


def validate_masks(param_groups: list[dict]) -> None:
    """Each group's ``exp_avg_mask``: one tensor, or one tensor (or None) per parameter, each
    broadcastable to its parameter."""
    for gi, group in enumerate(param_groups):
        masks = group_masks(group)
        if len(masks) != len(group["params"]):
            raise ValueError(f"param group {gi}: exp_avg_mask has {len(masks)} entries for "
                             f"{len(group['params'])} parameters")
        for p, mask in zip(group["params"], masks):
            if mask is None:
                continue
            if not isinstance(mask, torch.Tensor):
                raise TypeError(f"param group {gi}: exp_avg_mask entries must be tensors or None")
            try:
                ok = torch.broadcast_shapes(mask.shape, p.shape) == p.shape
            except RuntimeError:
                ok = False
            if not ok:
                raise ValueError(f"param group {gi}: exp_avg_mask of shape {tuple(mask.shape)} "
                                 f"does not broadcast to parameter shape {tuple(p.shape)}")
