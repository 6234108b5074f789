"""The host side the Triton kernels share: launch settings, tile geometry, the device made
current (one launch sequence at a time under the interpreter), segment tables, and
:class:`DeviceFlag` (a kernel's "all finite" left on the device)."""
from __future__ import annotations

import functools
import math
import os
import threading
from typing import Optional, Sequence

import torch
import triton

from .device import KINDS, NOT_ALIGNED

#: Whether these kernels were built for Triton's interpreter (CPU tensors) at import.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

CMAX = 2048  # elements per program (a power of two)
FB = 256  # rows (blocks) per finalize program
TT = 256  # partials per finalize step
WARPS = 8
#: No FMA contraction (the native code's bits); at most 64 registers per thread: the fused
#: passes otherwise take up to 128, which leaves a quarter of the threads a multiprocessor
#: holds, too few to keep its memory busy (``benchmarks/gpu_check.py``'s sweep measures it).
LAUNCH = {"enable_fp_fusion": False, "maxnreg": 64}


class DeviceFlag:
    """A kernel's "all finite" result, left on the device: truth-testing it reads it (a host
    sync); code that learns the outcome from the rows' status words never pays for that."""

    __slots__ = ("_t",)

    def __init__(self, t: torch.Tensor):
        self._t = t

    def __bool__(self) -> bool:
        return bool(self._t.item())

    def __eq__(self, other) -> bool:
        return bool(self) == other

    __hash__ = None

    def __repr__(self) -> str:
        return f"DeviceFlag({bool(self)})"


def geometry(block: int) -> tuple[int, int, int]:
    """(R, C, T): blocks per program, elements per row of a tile, tiles per block."""
    if block <= CMAX:
        c = max(8, triton.next_power_of_2(block))
        return CMAX // c, c, 1
    return 1, CMAX, triton.cdiv(block, CMAX)


def wide(G: int, block: int) -> bool:
    """Whether a buffer of ``G`` blocks of ``block`` elements needs int64 positions."""
    return G * block >= 2**31


_INTERPRETER_LOCK = threading.Lock()


class on_device:
    """The tensor's CUDA device made current for the launches (Triton launches on the current
    device). Under the interpreter, one launch sequence at a time: it keeps global state (the
    grid index, patched ``tl`` functions), and virtual ranks are threads."""

    def __init__(self, t: torch.Tensor):
        if t.device.type == "cuda":
            self._ctx = torch.cuda.device(t.device)
        else:
            self._ctx = _INTERPRETER_LOCK if INTERPRETED else None

    def __enter__(self):
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc):
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


def as_words(buf: torch.Tensor) -> torch.Tensor:
    """A row buffer (uint8, length a multiple of 4) as float32 words: status and scales."""
    return buf.view(torch.float32)


def kind_code(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None or t.numel() == 0 else KINDS[t.dtype]


def address(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


def aligned_offsets(base: torch.Tensor, tensors: Sequence[Optional[torch.Tensor]],
                    sizes: Sequence[int]) -> list[int]:
    """Per segment, ``q`` such that its element at flat position ``p`` (a position in the
    segment table's numbering) lies at element ``q * (16 // size) + p`` of ``base`` seen with
    the segment's element size, or ``device.NOT_ALIGNED`` where no such ``q`` exists. Loads
    written ``base_ptr + (q * k + p)`` then carry the 16-byte alignment the compiler needs to
    vectorise them (an address read from a table carries none); 0 for an absent tensor."""
    out, start = [], 0
    b = base.data_ptr()
    for t, size in zip(tensors, sizes):
        if kind_code(t) == 0:
            out.append(0)
        else:
            es = t.element_size()
            delta = t.data_ptr() - b
            off = delta // es - start
            per = 16 // es
            out.append(off // per if delta % es == 0 and off % per == 0
                       else NOT_ALIGNED.value)
        start += int(size)
    return out


def segment_table(columns: Sequence[Sequence[int]], sizes: Sequence[int], device) -> torch.Tensor:
    """int64 [starts (nsegs+1), then each column (nsegs)], on ``device`` (see
    :func:`device_table`)."""
    starts = [0]
    for s in sizes:
        starts.append(starts[-1] + int(s))
    return device_table(tuple(starts + [int(v) for col in columns for v in col]), torch.int64,
                        torch.device(device))


def device_table(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor of ``dtype`` on ``device``, made once per distinct table: a step
    passes the same tensors (addresses) as the last one, so its launches reuse the segment
    tables already on the device instead of building and copying them again; the
    coefficients' tables change with the step count (Adam's bias corrections), so those are
    copied anew (a few floats per segment, no sync). The kernels only read them. Tables are
    told apart by their values' signs too: -0.0 equals 0.0 (an lr of 0 gives a step of -0.0),
    and the kernels would take the other one's sign."""
    signs = tuple(math.copysign(1.0, v) for v in values) if dtype.is_floating_point else None
    return _device_table(values, signs, dtype, device)


@functools.lru_cache(maxsize=256)
def _device_table(values: tuple, signs: Optional[tuple], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


device_table.cache_info = _device_table.cache_info  # what the tables' reuse came to
