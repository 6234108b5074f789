"""The options of DistributedOptimizer, parsed once into frozen dataclasses.

:class:`OneBitConfig` is what the rest of the library reads: every option resolved to one type,
validated once at construction. Every rank builds the same config from the same arguments, so a
bad option raises the same clear error on every rank before any collective. What can only be
decided against the job (the transport, the kernel backend, the parameters, shared memory) is
decided where the optimizer is built (:mod:`hvd_onebit.job`, :mod:`hvd_onebit.phases.setup`).
This module imports nothing of the library above its base layer.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Iterable, Mapping, Optional, Union

import torch

from .step_bound import ADAM as ADAM_BOUND, StepBound, validate as validate_step_bound
from .param_groups import check_no_amsgrad
from .values import check_positive_int, check_positive_number, is_int, plain_number
from .variance_refresh import DOUBLING, RefreshSchedule


COMPRESSORS = ("onebit", "none")
MEMORY_MODES = ("auto", "lean", "fast")
INTRA_NODE_MODES = ("auto", "shared_memory", "network")
ZERO_VARIANCE_MODES = ("hold", "eps", "floor")
REFRESH_PRESETS = (None, DOUBLING)  # variance_refresh's public values
AUTO = "auto"  # freeze_step="auto": freeze once the variance has settled (hvd_onebit.auto_freeze)
DEFAULT_BUCKET_MB = 64.0
# elements per scale of the 1-bit compression: finer than one per chunk, at 1/16 more bytes
DEFAULT_BLOCK_SIZE = 512
# The recommended freeze_step, as a share of the run: with the default refresh, and with
# variance_refresh=None (the variance frozen for the rest of the run). The docstrings, the CLI's
# defaults and the examples take them from here.
FREEZE_FRACTION = 0.05
FROZEN_FREEZE_FRACTION = 0.2


class _Required:
    """The default of ``freeze_step``, which has none: leaving it out is refused with what to
    pass, rather than with Python's bare missing-argument error."""

    def __repr__(self) -> str:
        return "required"


REQUIRED = _Required()
FREEZE_STEP_REQUIRED = (
    "freeze_step is required: the warmup's steps before the variance freezes; with the default "
    f"variance_refresh {FREEZE_FRACTION:.0%} of the run's steps, "
    f"max(1, total_steps // {round(1 / FREEZE_FRACTION)}); with variance_refresh=None 15-25% of "
    "them; or 'auto' to freeze once the variance has settled. It is a keyword argument: "
    "freeze_step=...")


@dataclass(frozen=True)
class AutoFreeze:
    """How ``freeze_step="auto"`` decides (the rule is in ``hvd_onebit.auto_freeze``).

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
            check_positive_int(f"auto_freeze {name}", getattr(self, name))
        check_positive_number("auto_freeze tolerance", self.tolerance)
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
        if not isinstance(options, Mapping):
            raise TypeError(f"auto_freeze must be a dict of options, got {type(options).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"auto_freeze: unknown option(s) {unknown}; known: {sorted(known)}")
        return cls(**options)


def _refresh_schedule(option) -> RefreshSchedule:
    """Experimental's ``refresh_schedule``: a dict of some of RefreshSchedule's fields (the
    others keep "doubling"'s values) or a RefreshSchedule."""
    if isinstance(option, RefreshSchedule):
        return option
    if not isinstance(option, Mapping):
        raise TypeError(f"Experimental refresh_schedule must be a dict of "
                        f"{[f.name for f in fields(RefreshSchedule)]} or a RefreshSchedule, got "
                        f"{type(option).__name__}")
    return RefreshSchedule.from_option(dict(option))


@dataclass(frozen=True)
class Experimental:
    """Research knobs of :func:`hvd_onebit.DistributedOptimizer`, passed as one argument:
    ``experimental=Experimental(precondition=False)``.

    Each is here for measurement and comparison (the zoo, the benchmarks, the tests); the
    defaults are the measured choices. Leave them alone otherwise.

    Attributes:
        compressor: "onebit" (default) or "none": the momentum averaged in full precision in
            the compression phase (Adam with a frozen variance), to tell what freezing the
            variance costs apart from the 1-bit compression. It averages the momentum itself:
            not preconditioned, so without the 1-bit input's clamp of each rank's ``m / d``
            (the step bound still holds), which can make it end above the 1-bit run.
        precondition: True (default): the 1-bit allreduce carries each element's momentum over
            its frozen denominator, ``m / (sqrt(v / bc2) + eps)``, so one scale per block fits
            elements of any variance alike and the error feedback is in the update's units;
            False: the paper's compression of the momentum itself.
        step_bound: "adam" (default): each compression-phase step clamped at ``lr * B(t)``, the
            longest step Adam itself can take at step t (``hvd_onebit.step_bound``); a
            positive number: a fixed B; None: the paper's unbounded step.
        zero_variance: elements whose variance is exactly 0 at the freeze: "hold" (default)
            keeps them fixed, with a warning; "eps" divides their momentum by Adam's eps;
            "floor" gives them their parameter's smallest non-zero variance.
        intra_node: with ``hierarchical``, how the full-precision stages inside a node travel:
            "auto" (default: shared memory for CPU parameters on the torch transport, else the
            network), "shared_memory" (raises on every rank where it cannot serve) or "network".
        auto_freeze: with ``freeze_step="auto"``, a dict of some of
            :class:`~hvd_onebit.config.AutoFreeze`'s fields (or an AutoFreeze): how the
            warmup's end is decided. None: AutoFreeze's defaults.
        refresh_schedule: with ``variance_refresh="doubling"``, a dict of some of
            :class:`~hvd_onebit.variance_refresh.RefreshSchedule`'s fields (``first_interval``,
            ``growth``, ``updates_per_interval``, ``last_step``, ``variance_update``,
            ``error_feedback``), or a RefreshSchedule: it refines the preset (the
            fields not given keep "doubling"'s values). Refused with ``variance_refresh=None``,
            which keeps the variance frozen.
    """

    compressor: str = "onebit"
    precondition: bool = True
    step_bound: StepBound = ADAM_BOUND
    zero_variance: str = "hold"
    intra_node: str = "auto"
    auto_freeze: Union[AutoFreeze, Mapping[str, Any], None] = None
    refresh_schedule: Union[RefreshSchedule, Mapping[str, Any], None] = None

    def __post_init__(self) -> None:
        if self.compressor not in COMPRESSORS:
            raise ValueError(f"compressor must be one of {COMPRESSORS}, got {self.compressor!r}")
        if not isinstance(self.precondition, bool):
            raise ValueError(f"precondition must be True or False, got {self.precondition!r}")
        validate_step_bound(self.step_bound)
        if self.zero_variance not in ZERO_VARIANCE_MODES:
            raise ValueError(f"zero_variance must be one of {ZERO_VARIANCE_MODES}, got "
                             f"{self.zero_variance!r}")
        if self.intra_node not in INTRA_NODE_MODES:
            raise ValueError(f"intra_node must be one of {INTRA_NODE_MODES}, got "
                             f"{self.intra_node!r}")
        if self.auto_freeze is not None:
            AutoFreeze.from_options(self.auto_freeze)
        if self.refresh_schedule is not None:
            _refresh_schedule(self.refresh_schedule)


# Experimental's knobs, refused as keywords of DistributedOptimizer saying how to pass them
# (most were keywords once).
MOVED = tuple(f.name for f in fields(Experimental))


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def _check_choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


@dataclass(frozen=True)
class OneBitConfig:
    """The options of :func:`hvd_onebit.DistributedOptimizer` (whose docstring says what each
    means), each resolved to one type: built by :meth:`from_options`, read everywhere else.

    Attributes beyond the options' own: ``auto_freeze`` (an :class:`AutoFreeze` with
    ``freeze_step="auto"``, else None), ``refresh`` (the variance refresh's
    :class:`~hvd_onebit.variance_refresh.RefreshSchedule`, or None: the variance stays frozen)
    and Experimental's knobs, flattened.
    """

    freeze_step: Union[int, str]
    compressor: str = "onebit"
    block_size: Optional[int] = DEFAULT_BLOCK_SIZE
    transport: str = "auto"
    kernel_backend: str = "auto"
    bucket_size_mb: float = DEFAULT_BUCKET_MB
    check_every: int = 0
    auto_freeze: Optional[AutoFreeze] = None
    flush_on_commit: bool = False
    hierarchical: Union[bool, str] = False
    overlap: bool = True
    memory: str = "auto"
    intra_node: str = "auto"
    step_bound: StepBound = ADAM_BOUND
    zero_variance: str = "hold"
    precondition: bool = True
    refresh: Optional[RefreshSchedule] = None

    @classmethod
    def from_options(cls, freeze_step: Union[int, str], *,
                     variance_refresh: Optional[str] = DOUBLING,
                     hierarchical: Union[bool, str] = False,
                     bucket_size_mb: float = DEFAULT_BUCKET_MB,
                     transport: str = "auto",
                     overlap: bool = True,
                     memory: str = "auto",
                     flush_on_commit: bool = False,
                     block_size: Optional[int] = DEFAULT_BLOCK_SIZE,
                     check_every: int = 0,
                     kernel_backend: str = "auto",
                     experimental: Optional[Experimental] = None,
                     **moved) -> "OneBitConfig":
        """Parse DistributedOptimizer's options (same names, same defaults). A knob that moved
        into :class:`Experimental`, passed as a keyword, raises a TypeError saying how to pass
        it now."""
        refuse_moved(moved)
        if freeze_step is REQUIRED:
            raise TypeError(FREEZE_STEP_REQUIRED)
        if experimental is None:
            experimental = Experimental()
        elif not isinstance(experimental, Experimental):
            raise TypeError(f"experimental must be an hvd_onebit.Experimental, got "
                            f"{type(experimental).__name__}")
        freeze_step, block_size, check_every, bucket_size_mb = map(
            plain_number, (freeze_step, block_size, check_every, bucket_size_mb))
        auto = isinstance(freeze_step, str) and freeze_step == AUTO
        if not auto and experimental.auto_freeze is not None:
            raise ValueError("Experimental auto_freeze options apply only with "
                             f"freeze_step='auto', got freeze_step={freeze_step!r}")
        return cls(freeze_step=freeze_step, compressor=experimental.compressor,
                   block_size=block_size, transport=transport, kernel_backend=kernel_backend,
                   bucket_size_mb=(float(bucket_size_mb) if _is_size(bucket_size_mb)
                                   else bucket_size_mb),
                   check_every=check_every,
                   auto_freeze=AutoFreeze.from_options(experimental.auto_freeze) if auto else None,
                   flush_on_commit=flush_on_commit, hierarchical=hierarchical, overlap=overlap,
                   memory=memory, intra_node=experimental.intra_node,
                   step_bound=validate_step_bound(experimental.step_bound),
                   zero_variance=experimental.zero_variance,
                   precondition=experimental.precondition,
                   refresh=_resolve_refresh(variance_refresh, experimental.refresh_schedule))

    def __post_init__(self) -> None:
        if self.freeze_step != AUTO and (not is_int(self.freeze_step) or self.freeze_step < 1):
            raise ValueError(f"freeze_step must be a positive int (warmup steps) or 'auto', got "
                             f"{self.freeze_step!r}")
        if (self.freeze_step == AUTO) != isinstance(self.auto_freeze, AutoFreeze):
            raise ValueError("auto_freeze is an AutoFreeze with freeze_step='auto' and None "
                             f"otherwise, got {self.auto_freeze!r} with freeze_step="
                             f"{self.freeze_step!r}")
        if not (self.refresh is None or isinstance(self.refresh, RefreshSchedule)):
            raise TypeError(f"refresh must be a RefreshSchedule or None, got {self.refresh!r}")
        _check_choice("compressor", self.compressor, COMPRESSORS)
        _check_bool("precondition", self.precondition)
        validate_step_bound(self.step_bound)
        _check_choice("zero_variance", self.zero_variance, ZERO_VARIANCE_MODES)
        _check_choice("intra_node", self.intra_node, INTRA_NODE_MODES)
        _check_choice("memory", self.memory, MEMORY_MODES)
        _check_bool("overlap", self.overlap)
        _check_bool("flush_on_commit", self.flush_on_commit)
        if not (isinstance(self.hierarchical, bool) or self.hierarchical == "auto"):
            raise ValueError(f"hierarchical must be True, False or 'auto', got "
                             f"{self.hierarchical!r}")
        if self.block_size is not None and (not is_int(self.block_size) or self.block_size <= 0
                                            or self.block_size % 8):
            raise ValueError(f"block_size must be None or a positive multiple of 8, got "
                             f"{self.block_size!r}")
        if not isinstance(self.transport, str):
            raise ValueError(f"transport must be a transport's name, got {self.transport!r}")
        if not isinstance(self.kernel_backend, str):
            raise ValueError(f"kernel_backend must be a kernel backend's name, got "
                             f"{self.kernel_backend!r}")
        check_positive_number("bucket_size_mb", self.bucket_size_mb, "a positive number of MiB")
        check_positive_int("check_every", self.check_every, minimum=0)

    @property
    def auto(self) -> bool:
        """Whether the warmup ends when the variance has settled (freeze_step="auto")."""
        return self.freeze_step == AUTO

    @property
    def bucket_numel(self) -> int:
        """Elements of float32 momentum per bucket (at least 1)."""
        return max(1, int(self.bucket_size_mb * 2**20 / 4))


def _is_size(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def refuse_moved(moved: Mapping[str, Any]) -> None:
    """Raise a TypeError for keywords that are not options: a knob that moved into
    :class:`Experimental` says how to pass it now."""
    for name, value in moved.items():
        if name in MOVED:
            raise TypeError(f"{name} is an experimental option: pass "
                            f"experimental=Experimental({name}={value!r}) instead of {name}=")
        raise TypeError(f"DistributedOptimizer got an unexpected keyword argument {name!r}")


def _resolve_refresh(preset, schedule) -> Optional[RefreshSchedule]:
    """``variance_refresh`` (None or "doubling") refined by Experimental's ``refresh_schedule``."""
    if isinstance(preset, (Mapping, RefreshSchedule)):
        raise ValueError(f"variance_refresh takes None or {DOUBLING!r}; a schedule's fields go "
                         f"through experimental=Experimental(refresh_schedule={preset!r}) with "
                         f"variance_refresh={DOUBLING!r}")
    if preset not in REFRESH_PRESETS:
        raise ValueError(f"variance_refresh must be None or {DOUBLING!r}, got {preset!r}")
    if preset is None:
        if schedule is not None:
            raise ValueError("Experimental refresh_schedule refines variance_refresh="
                             f"{DOUBLING!r}; with variance_refresh=None the variance stays frozen. "
                             f"Pass variance_refresh={DOUBLING!r} with it")
        return None
    return RefreshSchedule() if schedule is None else _refresh_schedule(schedule)


def check_wrapped(optimizer: torch.optim.Optimizer, op_supported: bool,
                  backward_passes_per_step: Any,
                  face: str = "hvd_onebit.DistributedOptimizer") -> None:
    """Raise if ``face`` cannot wrap ``optimizer`` with these Horovod arguments
    (``op_supported``: the op is hvd.Average or hvd.Sum)."""
    # AdamW named as well: older torch releases do not derive it from Adam
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(f"{face} wraps torch.optim.Adam or torch.optim.AdamW; got "
                        f"{type(optimizer).__module__}.{type(optimizer).__name__}")
    # Horovod's wrappers and both faces' are subclasses of the Adam they wrap, built at run
    # time; what gives them away is a distributed optimizer's own methods (Horovod's
    # skip_synchronize, both faces' flush_error_feedback), not a name an Adam of one's own uses.
    if hasattr(optimizer, "skip_synchronize") or hasattr(optimizer, "flush_error_feedback"):
        raise TypeError(f"{face} wraps a bare torch.optim.Adam or AdamW; this one is already "
                        f"wrapped by a distributed optimizer ({type(optimizer).__module__}."
                        f"{type(optimizer).__name__}, e.g. hvd.DistributedOptimizer): replace "
                        "that wrapper with this one instead of wrapping it")
    check_no_amsgrad(optimizer.param_groups)
    if not op_supported:
        raise ValueError("hvd_onebit.DistributedOptimizer supports op=hvd.Average or hvd.Sum")
    check_positive_int("backward_passes_per_step", backward_passes_per_step)


def check_one_device(params: Iterable[torch.Tensor],
                     face: str = "hvd_onebit.DistributedOptimizer") -> None:
    """Raise ValueError unless every parameter is on one device: the fused buckets, their
    collectives and the kernels each live on one."""
    devices = sorted({str(p.device) for p in params})
    if len(devices) > 1:
        raise ValueError(f"{face} needs all parameters on one device, found {devices}")


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
