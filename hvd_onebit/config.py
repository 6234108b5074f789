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
from .variance_refresh import RefreshSchedule


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
    """The 1-bit options of :func:`hvd_onebit.DistributedOptimizer`: their meanings and
    trade-offs. Validated here, once, at construction.

    Attributes:
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
        variance_refresh: None (default: the variance stays frozen, 1-bit Adam as the paper
            has it), "doubling" (0/1 Adam's schedule: the variance updated at steps 0, 1, ...,
            15, then every 2 steps for 16 updates, every 4, ...; 96 of the first 1,000 steps)
            or a dict of some of ``first_interval`` (1), ``growth`` (2),
            ``updates_per_interval`` (16), ``last_step`` (None: refresh forever),
            ``variance_update`` ("gap"), ``error_feedback`` ("rescale") and ``accept``
            ("always"; "lowering": a parameter takes a refresh only where it lowers its mean
            denominator; "hypergradient": the same, reversed where its last step overshot),
            explained in :class:`~hvd_onebit.variance_refresh.RefreshSchedule`.
            A step of the compression phase on the schedule is a full-precision **refresh
            step**: the gradients are allreduced by Horovod as in the warmup (from its hooks),
            a non-finite average is
            skipped on every rank, and Adam's step updates ``m`` and ``v`` from the exact
            average, with Adam's bias corrections and the step bound; the steps between stay
            1-bit and use the refreshed variance. Elements held for a zero variance train from
            the first refresh that sees their gradient. Every rank decides from the step count
            alone (no collective); checkpoints carry it. No persistent
            buffer is added (a refresh uses temporaries of one bucket). Each refresh sends what
            a warmup step sends (about 32x a compressed step's bytes). With a refresh
            schedule an early ``freeze_step`` (3-5% of the run, measured with "doubling"; or
            "auto" with a short ``auto_freeze={"min_steps": ...}``) is the recommended setting.
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
    variance_refresh: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "step_bound", validate_step_bound(self.step_bound))
        self._parse_variance_refresh()
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

    def _parse_variance_refresh(self) -> None:
        object.__setattr__(self, "variance_refresh",
                           RefreshSchedule.from_option(self.variance_refresh))

    @property
    def refresh(self) -> Optional[RefreshSchedule]:
        """The variance refresh schedule, or None (the variance stays frozen)."""
        return self.variance_refresh

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


def check_wrapped(optimizer: torch.optim.Optimizer, op_supported: bool,
                  backward_passes_per_step: Any) -> None:
    """Raise if DistributedOptimizer cannot wrap ``optimizer`` with these Horovod arguments
    (``op_supported``: the op is hvd.Average or hvd.Sum)."""
    if not isinstance(optimizer, torch.optim.Adam):
        raise TypeError("hvd_onebit.DistributedOptimizer wraps torch.optim.Adam or "
                        f"torch.optim.AdamW; got {type(optimizer).__module__}."
                        f"{type(optimizer).__name__}")
    if any(g.get("amsgrad") for g in optimizer.param_groups):
        raise ValueError("amsgrad=True is not supported: 1-bit Adam freezes the variance, "
                         "which amsgrad's running maximum would contradict")
    if not op_supported:
        raise ValueError("hvd_onebit.DistributedOptimizer supports op=hvd.Average or hvd.Sum")
    if not _is_int(backward_passes_per_step) or backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be a positive int, got "
                         f"{backward_passes_per_step!r}")


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
