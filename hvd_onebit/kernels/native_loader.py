"""Where the native kernels come from: the extension ``hvd_onebit._C`` built at install, or a
build against the installed torch at first use, or none (the torch twins run instead).

``pip install --no-build-isolation .`` compiles ``hvd_onebit._C`` against the environment's torch
(``make setup`` does). A plain ``pip install .`` builds no extension (its isolated build
environment holds no torch to compile against); the first job that asks for the native kernels
then compiles ``kernels/csrc/onebit_kernels.cpp`` once with :func:`torch.utils.cpp_extension.load`
(the compiler flags, C++ standard included, are the installed torch's own) into torch's extension
cache, which later runs reuse.

``HVD_ONEBIT_NATIVE=0`` turns both off (the torch twins run, for a test or a broken compiler);
``HVD_ONEBIT_NATIVE=prebuilt`` uses only the installed extension (no compile at first use);
``HVD_ONEBIT_NATIVE=avx2`` loads them as usual but forbids their AVX-512 paths (the same bits
8 lanes at a time, to measure what the 16-lane paths gain).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import sys
import threading
import warnings
from pathlib import Path
from typing import Optional

SOURCE = Path(__file__).resolve().parent / "csrc" / "onebit_kernels.cpp"
ENV = "HVD_ONEBIT_NATIVE"
FIX = ("install a C++ compiler (g++) and reinstall with `pip install --no-build-isolation .` "
       "beside the torch you run, or let the first run compile them (HVD_ONEBIT_NATIVE unset)")


@dataclasses.dataclass(frozen=True)
class NativeKernels:
    """The outcome of loading: the module (None when there is none), where it came from
    ("installed", "compiled at first use" or "none") and, when none, why."""

    module: Optional[object]
    origin: str
    reason: str = ""


def _installed():
    return importlib.import_module("hvd_onebit._C")


NAME = "hvd_onebit_native"


# A load that takes longer than this is most likely a compile (a build in torch's cache loads in
# well under a second on an idle machine), and says what a compile costs without claiming one:
# whether torch will rebuild (another torch, another source) is ninja's to decide, not a file's
# presence.
COMPILE_NOTICE_S = 2.0


def _compile():
    from torch.utils.cpp_extension import load

    if not SOURCE.is_file():
        raise FileNotFoundError(f"the kernel source {SOURCE} is not installed")
    notice = threading.Timer(COMPILE_NOTICE_S, lambda: print(
        f"[hvd_onebit] loading the native kernels ({SOURCE.name}): the first use compiles them "
        f"against this torch, a minute or two once; later runs reuse the build",
        file=sys.stderr, flush=True))
    notice.daemon = True
    notice.start()
    try:
        return load(name=NAME, sources=[str(SOURCE)], extra_cflags=["-O3", "-ffp-contract=off"],
                    verbose=False)
    finally:
        notice.cancel()


@functools.lru_cache(maxsize=None)
def load_native() -> NativeKernels:
    """The native kernels of this process, loaded once (see the module docstring)."""
    mode = os.environ.get(ENV, "1").strip().lower()
    if mode in ("0", "off", "false", "no"):
        return NativeKernels(None, "none", f"{ENV}={os.environ[ENV]} turns them off")
    kernels = _load(mode)
    if mode == "avx2" and kernels.module is not None:
        kernels.module.set_avx512(False)
    return kernels


def _load(mode: str) -> NativeKernels:
    try:
        return NativeKernels(_installed(), "installed")
    except ImportError as exc:
        installed_error = f"hvd_onebit._C does not import ({exc})"
    if mode == "prebuilt":
        return NativeKernels(None, "none", installed_error)
    try:
        return NativeKernels(_compile(), "compiled at first use")
    except Exception as exc:  # noqa: BLE001 - any compiler or loader failure means: no native
        first_line = str(exc).strip().splitlines()[:1] or [type(exc).__name__]
        return NativeKernels(None, "none",
                             f"{installed_error}, and compiling them failed: {first_line[0]}")


_warned = []


def warn_fallback_once() -> None:
    """Warn once per process that CPU kernels run as the torch twins, with the slowdown and fix."""
    if _warned:
        return
    _warned.append(True)
    native = load_native()
    warnings.warn(
        "hvd_onebit: the native CPU kernels are not available, so sign compression runs as the "
        "torch twins, an order of magnitude slower (`hvd-onebit bench dev kernel` measures both), "
        f"which can cost more than 1-bit Adam saves. Why: {native.reason}. Fix: {FIX}. "
        "`hvd-onebit check` reports the kernels this environment uses.",
        RuntimeWarning, stacklevel=3)
