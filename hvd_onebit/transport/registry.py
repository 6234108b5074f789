"""The transports by name: the one list of names, what each can carry, "auto", and building one.

Every place that takes a transport's name (:class:`~hvd_onebit.config.OneBitConfig`, the
optimizer, :class:`~hvd_onebit.OneBitAllreduce`, the hierarchical collective, the bench CLI) asks
here: :data:`TRANSPORTS` and :func:`check_name` for the name, :func:`supports` for what a
transport can carry, :func:`check_transport` for whether it can run in this job,
:func:`make_transport` to build it, :func:`job_transport` for the compression phase's.
Importing this module imports no Horovod: each transport's module is imported when that
transport is checked or built.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

AUTO = "auto"


def _build_horovod(process_set, device):
    from .horovod import HorovodTransport
    return HorovodTransport(process_set)


def _build_mpi(process_set, device):
    from .mpi import MPITransport
    return MPITransport(process_set)


def _build_torch(process_set, device):
    from .torch_distributed import TorchTransport
    return TorchTransport(process_set, device)


def _check_mpi(process_set, device) -> None:
    from .mpi import check_mpi_transport
    check_mpi_transport(process_set, device)


def _check_torch(process_set, device) -> None:
    import torch

    from .torch_distributed import check_torch_transport
    check_torch_transport(process_set, torch.device(device))


@dataclass(frozen=True)
class TransportKind:
    """A transport a name stands for.

    Attributes:
        name: what users pass as ``transport=``.
        build: ``(process_set, device) -> Transport``.
        check: ``(process_set, device) -> None``, raising (alike on every rank, without a
            collective) where this transport cannot serve the job; None: it always can.
        hierarchical: the hierarchical collective runs its stages on it.
        shared_memory: the hierarchical stages inside a node may go through shared memory
            beside it (``intra_node="shared_memory"``).
    """

    name: str
    build: Callable[[Any, Any], Any]
    check: Optional[Callable[[Any, Any], None]] = None
    hierarchical: bool = False
    shared_memory: bool = False


KINDS: dict[str, TransportKind] = {k.name: k for k in (
    TransportKind("horovod", _build_horovod, hierarchical=True),
    TransportKind("mpi", _build_mpi, _check_mpi),
    TransportKind("torch", _build_torch, _check_torch, hierarchical=True, shared_memory=True),
)}
#: What "auto" may stand for, in order of preference (see :func:`resolve_transport`).
AUTO_PICKS = ("torch", "horovod")
#: Every name a user may pass.
TRANSPORTS = (AUTO, *KINDS)


def check_name(kind: Any) -> None:
    """Raise ValueError unless ``kind`` is one of :data:`TRANSPORTS`."""
    if kind not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {kind!r}")


def supports(kind: Any, feature: str) -> bool:
    """Whether transport ``kind`` can carry ``feature`` (a :class:`TransportKind` flag:
    "hierarchical", "shared_memory"); "auto" can where a transport it may pick can."""
    if kind == AUTO:
        return any(getattr(KINDS[k], feature) for k in AUTO_PICKS)
    return kind in TRANSPORTS and getattr(KINDS[kind], feature)


def supporting(feature: str) -> tuple[str, ...]:
    """The transports (not "auto") that can carry ``feature``, in :data:`TRANSPORTS` order."""
    return tuple(k for k in TRANSPORTS if k in KINDS and getattr(KINDS[k], feature))


def either(names: tuple[str, ...], quote: str = "'") -> str:
    """``'horovod' or 'torch'``: ``names`` for an error message."""
    return " or ".join(f"{quote}{n}{quote}" for n in names)


def resolve_transport(kind: str, process_set, device, hierarchical: bool | str = False) -> str:
    """The transport "auto" stands for in this job: "torch" where torch.distributed can serve
    (all of Horovod's ranks, not elastic, CPU or CUDA tensors, and, if the script initialised
    torch.distributed itself, a group that fits), else "horovod". Other kinds are returned as
    they are. Decided from what every rank sees alike, without a collective. (``hierarchical``
    is accepted for the callers' symmetry; the hierarchical collective runs on either.)"""
    if kind != AUTO:
        return kind
    for pick in AUTO_PICKS[:-1]:
        try:
            KINDS[pick].check(process_set, device)
        except (RuntimeError, ValueError):
            continue
        return pick
    return AUTO_PICKS[-1]  # horovod: serves every job


def check_transport(kind: str, process_set, device) -> None:
    """Raise (the same error on every rank) if transport ``kind`` cannot run in this job on
    ``device``; collective-free, so it can run at construction."""
    check_name(kind)
    if kind != AUTO and KINDS[kind].check is not None:
        KINDS[kind].check(process_set, device)


def make_transport(kind: str, process_set, device="cpu"):
    """Build the transport named ``kind`` (one of :data:`TRANSPORTS`; "auto": see
    :func:`resolve_transport`) for ``process_set``."""
    kind = resolve_transport(kind, process_set, device)
    check_name(kind)
    return KINDS[kind].build(process_set, device)


def job_transport(transport, process_set=None):
    """The compression phase's transport, resolved once: a
    :class:`~hvd_onebit.transport.base.JobTransport` as it is; a name (or None, "auto") as
    :class:`~hvd_onebit.transport.horovod.HorovodJob` over ``process_set`` (None: Horovod's
    global process set); any other :class:`~hvd_onebit.transport.base.Transport` object by
    itself (e.g. the in-process one)."""
    from .base import JobTransport

    if isinstance(transport, JobTransport):
        return transport
    if transport is None or isinstance(transport, str):
        from .horovod import HorovodJob

        if process_set is None:
            import horovod.torch as hvd
            process_set = hvd.global_process_set
        return HorovodJob(AUTO if transport is None else transport, process_set)
    return JobTransport(transport)

