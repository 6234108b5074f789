"""The one backend dispatch of every kernel: which implementation runs a call.

Three implementations give the same bits: ``native`` (the fused C++ extension ``hvd_onebit._C``,
CPU tensors), ``triton`` (:mod:`hvd_onebit.kernels.triton`, CUDA tensors, or CPU tensors under
``TRITON_INTERPRET=1``; imported only once picked) and ``torch`` (the reference twins,
:mod:`~hvd_onebit.kernels.reference` and :mod:`~hvd_onebit.kernels.fused_reference`, any device).

A caller names a backend ("auto", "native", "torch" or "triton"); :func:`resolve_backend` turns it
into the implementation for a device (raising on an impossible request), and :func:`pick`, which
every kernel entry point calls, runs that implementation where it can read the call's tensors in
place and the torch twin otherwise.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import Callable, Optional, Sequence, Union

import torch

from .native_loader import load_native, warn_fallback_once

BACKENDS = ("auto", "native", "torch", "triton")

_TRITON = f"{__package__}.triton"  # the Triton kernels' package, imported on first use

Ready = Union[bool, Callable[[], bool]]
_CPU = torch.device("cpu")


def native_available() -> bool:
    """Whether the fused C++ kernels are there (built at install, or compiled at first use: see
    :mod:`.native_loader`)."""
    return load_native().module is not None


def native_module():
    """The compiled native kernels (None when there are none), for the kernels that call them
    once :func:`pick` chose "native"."""
    return load_native().module


def triton_available() -> bool:
    """Whether the ``triton`` package is installed (not imported here: importing it is slow, and
    :mod:`hvd_onebit.kernels.triton` must be imported after ``TRITON_INTERPRET`` is settled)."""
    return importlib.util.find_spec("triton") is not None


def triton_module():
    """:mod:`hvd_onebit.kernels.triton`, imported on first use."""
    return importlib.import_module(_TRITON)


def _triton_interpreted() -> bool:
    mod = sys.modules.get(_TRITON)
    if mod is not None:
        return mod.INTERPRETED
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def in_place(tensors: Sequence[Optional[torch.Tensor]], device: torch.device,
             dtypes: Optional[Sequence[torch.dtype]] = (torch.float32,)) -> bool:
    """Whether a kernel can read (and write) every given tensor in place: on ``device``,
    contiguous, of one of ``dtypes`` (None: any dtype; None entries are fine)."""
    if device.type == "cpu":  # is_cpu is cheaper than building each tensor's device
        return all(t is None or (t.is_cpu and t.is_contiguous()
                                 and (dtypes is None or t.dtype in dtypes)) for t in tensors)
    return all(t is None or (t.device == device and t.is_contiguous()
                             and (dtypes is None or t.dtype in dtypes)) for t in tensors)


def native_ready(tensors) -> bool:
    """Whether the native kernels can read every given tensor in place (fp32, contiguous, CPU;
    None entries are skipped)."""
    return in_place(tensors, _CPU)


def resolve_backend(backend: str, device: torch.device) -> str:
    """Pick "native", "triton" or "torch" for tensors on ``device``; raise on an impossible
    request. "auto": native on CPU (when built; else torch, with a warning once per process),
    triton on CUDA (when installed), else torch."""
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type == "cpu":
            if native_available():
                return "native"
            warn_fallback_once()
            return "torch"
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "native":
        if not native_available():
            raise RuntimeError(f"the native kernels are not available: {load_native().reason}")
        if device.type != "cpu":
            raise ValueError(f"the native kernels run on CPU tensors only, got device {device}")
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("the triton kernels need the triton package (pip install triton)")
        if device.type != "cuda" and not (device.type == "cpu" and _triton_interpreted()):
            raise ValueError(f"the triton kernels run on CUDA tensors (CPU tensors only under "
                             f"TRITON_INTERPRET=1), got device {device}")
    return backend


def pick(backend: str, device: torch.device, *, native: Ready = False,
         triton: Ready = False) -> str:
    """The implementation that runs one kernel call: the backend :func:`resolve_backend` gives
    for ``device`` where the call can run on it (``native`` / ``triton``: whether it can, a bool
    or a function asked only when that backend is the one resolved), else "torch".

    Raises as :func:`resolve_backend` does, whatever the readiness."""
    resolved = resolve_backend(backend, device)
    ready = {"native": native, "triton": triton}.get(resolved, True)
    if resolved != "torch" and (ready() if callable(ready) else ready):
        return resolved
    return "torch"
