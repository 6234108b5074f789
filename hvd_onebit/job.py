"""What the options mean in this job: the checks that need the parameters, the transports and
the kernels, and the decisions that follow from the device and the transport.

:class:`~hvd_onebit.config.OneBitConfig` holds the options alone; this module reads them
against the job, once, where the optimizer is built (:mod:`hvd_onebit.phases.setup`), and the
engine asks it what its collectives keep (:func:`spare_errors`,
:func:`shared_memory_inside_nodes`). Every rank decides alike, from what every rank sees alike.
"""
from __future__ import annotations

import warnings
from typing import Iterable, Mapping, Optional

import torch

from . import kernels
from .config import DEFAULT_BUCKET_MB, OneBitConfig, check_one_device
from .dtypes import FLOAT_DTYPES, other_dtypes
from .transport.registry import check_name as check_transport_name
from .transport.registry import check_transport, either, supporting, supports


# Buckets below this many elements are a collective per handful of elements: a bucket size
# given in another unit than MiB, most likely.
TINY_BUCKET = 64


def check_options(config: OneBitConfig) -> None:
    """The options that name a transport or a kernel backend, and their combinations: raises a
    ValueError naming the option and the value, on every rank, before any collective. A bucket
    size that cuts the parameters into a few elements per collective warns."""
    if config.bucket_numel < TINY_BUCKET:
        warnings.warn(f"hvd_onebit: bucket_size_mb={config.bucket_size_mb:g} makes buckets of "
                      f"{config.bucket_numel} float32 element(s), each a collective of its own "
                      f"in every compressed step: the steps will be slow (bucket_size_mb is in "
                      f"MiB; the default, {DEFAULT_BUCKET_MB:g}, suits most models)")
    check_transport_name(config.transport)
    if config.kernel_backend not in kernels.BACKENDS:
        raise ValueError(f"kernel_backend must be one of {kernels.BACKENDS}, got "
                         f"{config.kernel_backend!r}")
    if config.hierarchical is True and not supports(config.transport, "hierarchical"):
        raise ValueError(f"hierarchical 1-bit runs on transport="
                         f"{either(supporting('hierarchical'))}, got "
                         f"transport={config.transport!r}")
    if config.intra_node == "shared_memory" and not supports(config.transport, "shared_memory"):
        raise ValueError(f"intra_node='shared_memory' runs beside transport="
                         f"{either(supporting('shared_memory'))} (or 'auto'), got "
                         f"transport={config.transport!r}")


def check_environment(config: OneBitConfig, params: Iterable[torch.Tensor],
                      process_set, names: Optional[Mapping] = None) -> None:
    """What can only be checked against the parameters and the job: dtypes, one device, a
    kernel backend that runs there, a transport this job can use. Raises on every rank."""
    check_options(config)
    params = list(params)
    check_parameters(config, params, names=names)
    if params and config.compressor == "onebit":
        check_transport(config.transport, process_set, params[0].device)


def check_parameters(config: OneBitConfig, params: list[torch.Tensor],
                     face: str = "hvd_onebit.DistributedOptimizer",
                     names: Optional[Mapping] = None) -> None:
    """The parameters against the options, whatever the job: float dtypes, one device, a
    kernel backend that runs there. Raises on every rank, naming ``face`` and the parameters
    (by ``names``, else by their place in the optimizer)."""
    bad = other_dtypes(params)
    if bad:
        which = [f"{(names or {}).get(p) or f'parameter {i}'} "
                 f"({str(p.dtype).removeprefix('torch.')})"
                 for i, p in enumerate(params) if p.dtype not in FLOAT_DTYPES]
        raise TypeError(f"{face} trains float32, float16 and bfloat16 parameters; got "
                        f"{', '.join(bad)}: {len(which)} parameter(s), "
                        f"{', '.join(which[:4])}{' ...' if len(which) > 4 else ''}")
    check_one_device(params, face)
    if params:
        kernels.resolve_backend(config.kernel_backend, params[0].device)


def spare_errors(memory: str, device: torch.device) -> bool:
    """Whether the collectives keep spare error buffers on ``device`` (``memory="fast"``):
    "auto" keeps them off CUDA, where memory is plentiful and the repeated passes would cost
    compute time the CPU is short of; on a GPU the passes run at memory speed and the memory
    is what is short."""
    if memory == "auto":
        return torch.device(device).type != "cuda"
    return memory == "fast"


def shared_memory_inside_nodes(intra_node: str, transport: str, device: torch.device) -> bool:
    """Whether the hierarchical stages inside a node go through shared memory: CPU buffers on
    the torch transport ("auto" and "shared_memory"); "network" never. Raises if
    "shared_memory" was asked for where it cannot serve (the transport resolved to another
    one, or the parameters are not on the CPU)."""
    possible = transport in supporting("shared_memory") and torch.device(device).type == "cpu"
    if intra_node == "shared_memory" and not possible:
        raise ValueError("intra_node='shared_memory' needs CPU parameters on transport "
                         f"'torch', this job has {torch.device(device)} on {transport!r}")
    return possible and intra_node != "network"
