"""Sign-compression kernels: worker compress, server average-and-recompress, decode.

Three implementations with the same arguments and the same bits:

* ``native``: fused C++ (``hvd_onebit._C``, AVX2 where the CPU has it), CPU tensors only. This is
  what makes 1-bit Adam pay off on CPU: torch-eager sign compression takes several passes over
  memory per element where the fused kernel takes one, so it runs far below memory speed and
  would eat the bandwidth it saves (``hvd-onebit bench kernel`` compares the two).
* ``triton``: the same fused passes for CUDA tensors (:mod:`hvd_onebit.triton_kernels`, imported
  only when picked); CPU tensors too under Triton's interpreter (``TRITON_INTERPRET=1``), for tests.
* ``torch``: plain tensor ops, for any device and as the reference the others are tested
  against. Written so that CUDA gives the CPU's bits: no op that multiplies by a reciprocal or
  contracts into an FMA on CUDA (see :func:`exact_div`).

The arithmetic both follow, per block of ``layout.block`` elements (see :mod:`hvd_onebit.layout`):
``y = x + e`` in fp32; ``s = float(sqrt(sum(double(y)^2) / block))``; sign bit ``y >= 0``;
``e_new = y - (+s or -s)``. The server sums the decoded rows in rank order in fp32, divides by n
and adds its error. New rows go to a separate buffer; y (z) is updated in place or not stored
(``y_out=None``), so a caller can send the rows first and store y only once the call has
succeeded on every rank (see :class:`hvd_onebit.OneBitAllreduce`): a failed call changes nothing.

Both error-feedback buffers are stored factored: the last call's ``y`` (or server ``z``) and the
rows it sent (scales and signs), from which ``e = y - s * sign(y)`` is rebuilt inside the next
compression (:func:`worker_error` and :func:`server_error` materialise it). Each compression is
then one pass over the data instead of two.
"""
from __future__ import annotations

import importlib.util
import os

import torch

from .layout import STATUS_BYTES, Layout

try:  # The extension is built by `make setup` (pip install -e .); torch fallback without it.
    from . import _C as _native
except ImportError:  # pragma: no cover - exercised only on machines without a compiler
    _native = None

BACKENDS = ("auto", "native", "torch", "triton")


def native_available() -> bool:
    """Whether the fused C++ kernels were built."""
    return _native is not None


def native_ready(tensors) -> bool:
    """Whether the native kernels can read every given tensor in place (fp32, contiguous, CPU;
    None entries are skipped)."""
    return all(t is None or (t.dtype == torch.float32 and t.is_contiguous()
                             and t.device.type == "cpu") for t in tensors)


def native_module():
    """The compiled extension ``hvd_onebit._C`` (None when not built), for modules that call
    fused kernels of their own (:mod:`hvd_onebit.fused_adam`) after :func:`resolve_backend`."""
    return _native


def triton_available() -> bool:
    """Whether the ``triton`` package is installed (not imported here: importing it is slow, and
    :mod:`hvd_onebit.triton_kernels` must be imported after ``TRITON_INTERPRET`` is settled)."""
    return importlib.util.find_spec("triton") is not None


def triton_module():
    """:mod:`hvd_onebit.triton_kernels`, imported on first use."""
    from . import triton_kernels
    return triton_kernels


def _triton_interpreted() -> bool:
    import sys
    mod = sys.modules.get(f"{__package__}.triton_kernels")
    if mod is not None:
        return mod.INTERPRETED
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, device: torch.device) -> str:
    """Pick "native", "triton" or "torch" for tensors on ``device``; raise on an impossible
    request. "auto": native on CPU (when built), triton on CUDA (when installed), else torch."""
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type == "cpu":
            return "native" if _native is not None else "torch"
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "native":
        if _native is None:
            raise RuntimeError("the native kernels (hvd_onebit._C) are not built; run `make setup`")
        if device.type != "cpu":
            raise ValueError(f"the native kernels run on CPU tensors only, got device {device}")
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("the triton kernels need the triton package (pip install triton)")
        if device.type != "cuda" and not (device.type == "cpu" and _triton_interpreted()):
            raise ValueError(f"the triton kernels run on CUDA tensors (CPU tensors only under "
                             f"TRITON_INTERPRET=1), got device {device}")
    return backend


def _use_triton(backend: str, device: torch.device, layout: Layout, tensors) -> bool:
    """Whether this call runs the triton kernels: resolved to triton, something to do, and every
    tensor float32/uint8, contiguous, on ``device``."""
    return (resolve_backend(backend, device) == "triton" and layout.padded > 0
            and all(t.device == device and t.is_contiguous() for t in tensors))


def exact_div(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """``t / divisor`` correctly rounded on every device. CUDA divides by a Python (CPU) scalar
    as a multiplication by its reciprocal, which is not the CPU's bits when 1/divisor is not
    exact (n = 3); a divisor tensor on t's device is a true division everywhere."""
    return t / torch.full((), divisor, dtype=t.dtype, device=t.device)


# ---- row views (torch path) ------------------------------------------------------------------------

def _rows(buf: torch.Tensor, layout: Layout, count: int) -> torch.Tensor:
    return buf[: count * layout.row_bytes].view(count, layout.row_bytes)


def row_status(buf: torch.Tensor, layout: Layout, count: int) -> torch.Tensor:
    """The status word of each of ``count`` rows in ``buf``: float32 [count]; non-zero = bad input."""
    return _rows(buf, layout, count)[:, :STATUS_BYTES].view(torch.float32)[:, 0]


def row_scales(buf: torch.Tensor, layout: Layout, count: int) -> torch.Tensor:
    """Scales of each row: float32 [count, nblocks]."""
    return _rows(buf, layout, count)[:, STATUS_BYTES : layout.header_bytes].view(torch.float32)


def _row_bits(buf: torch.Tensor, layout: Layout, count: int) -> torch.Tensor:
    return _rows(buf, layout, count)[:, layout.header_bytes : layout.header_bytes + layout.bits_bytes]


_SHIFTS_CACHE: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    if device not in _SHIFTS_CACHE:
        _SHIFTS_CACHE[device] = torch.arange(8, dtype=torch.uint8, device=device)
    return _SHIFTS_CACHE[device]


def pack_signs(positive: torch.Tensor) -> torch.Tensor:
    """bool [..., 8k] -> uint8 [..., k]; bit j of byte b is element 8b+j."""
    groups = positive.reshape(*positive.shape[:-1], -1, 8).to(torch.uint8)
    return (groups << _shifts(positive.device)).sum(-1, dtype=torch.uint8)


def unpack_signs(bits: torch.Tensor) -> torch.Tensor:
    """uint8 [..., k] -> bool [..., 8k], the inverse of :func:`pack_signs`."""
    expanded = (bits.unsqueeze(-1) >> _shifts(bits.device)) & 1
    return expanded.reshape(*bits.shape[:-1], -1).bool()


def _write_rows(buf, layout, count, status: float, scales, bits) -> None:
    rows = _rows(buf, layout, count)
    rows[:, layout.header_bytes + layout.bits_bytes :] = 0
    row_status(buf, layout, count).fill_(status)
    row_scales(buf, layout, count).copy_(scales)
    _row_bits(buf, layout, count).copy_(bits)


def _decoded(rows: torch.Tensor, layout: Layout, count: int) -> torch.Tensor:
    """s * sign for ``count`` rows: float32 [count, nblocks, block]."""
    scales = row_scales(rows, layout, count).unsqueeze(-1)
    positive = unpack_signs(_row_bits(rows, layout, count)).view(count, layout.nblocks, layout.block)
    return torch.where(positive, scales, -scales)


def _rms_scales(y: torch.Tensor, block: int) -> tuple[bool, torch.Tensor]:
    """y: fp32 [rows, nblocks, block] -> (all finite, scales fp32 [rows, nblocks]): the block
    rms, with the sum of squares in double as the native kernels accumulate it."""
    sumsq = y.double().square().sum(-1)
    return bool(torch.isfinite(sumsq).all()), torch.sqrt(exact_div(sumsq, block)).float()


def set_identity_rows(buf: torch.Tensor, layout: Layout, count: int) -> None:
    """Make ``count`` rows of ``buf`` decode to +0 everywhere (zero scales, every sign bit set).

    A factored error (y, rows) with such rows is e = y - (+0) = y exactly, signed zeros
    included: how a given error is loaded into the factored form.
    """
    rows = _rows(buf, layout, count)
    rows.zero_()
    rows[:, layout.header_bytes:layout.header_bytes + layout.bits_bytes] = 0xFF


# ---- the three kernels -------------------------------------------------------------------------------

def worker_compress(x: torch.Tensor, y_prev: torch.Tensor, prev_send: torch.Tensor,
                    y_out: torch.Tensor, send: torch.Tensor, layout: Layout,
                    backend: str = "auto") -> bool:
    """Compress ``x + e`` into the n send rows, with ``e = y_prev - s_prev * sign_prev``.

    Args:
        x: float32 [numel], contiguous. Elements past numel are padding (zeros).
        y_prev: float32 [padded], the previous call's y (read only).
        prev_send: uint8 [n * row_bytes], the previous call's rows (read only); with ``y_prev``
            it is the worker error feedback.
        y_out: float32 [padded], receives this call's y = x + e; may be ``y_prev`` itself
            (updated in place), or None (y is not stored: the rows alone).
        send: uint8 [n * row_bytes], receives one row per destination rank (not ``prev_send``).
    Returns:
        False if any block held a non-finite value (the rows then carry status 1.0). The triton
        backend returns a :class:`~hvd_onebit.triton_kernels.DeviceFlag` instead: it tests
        the same, and only a test of it waits for the GPU.
    """
    outputs = (send,) if y_out is None else (y_out, send)
    if _use_triton(backend, x.device, layout, (x, y_prev, prev_send, *outputs)):
        return triton_module().worker_compress(x, y_prev, prev_send, y_out, send, layout)
    if resolve_backend(backend, x.device) == "native":
        return _native.worker_compress(x, y_prev, prev_send, y_out, send, *layout.as_args(), True)
    n, nb, block = layout.n, layout.nblocks, layout.block
    e = worker_error(y_prev, prev_send, layout)  # before y_out is written: it may be y_prev
    if y_out is None:
        y_out = torch.empty_like(y_prev)
    y_out.zero_()
    y_out[: layout.numel].copy_(x)
    y_out.add_(e)  # x + e on real elements, 0 + e on the padding: the native kernel's order
    y = y_out.view(n, nb, block)
    finite, scales = _rms_scales(y, block)
    _write_rows(send, layout, n, 0.0 if finite else 1.0, scales, pack_signs((y >= 0).view(n, -1)))
    return finite


def worker_error(y: torch.Tensor, rows: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The worker error ``e = y - s * sign(y)`` as float32 [padded], from its factored form."""
    return y - _decoded(rows, layout, layout.n).view(-1)


def server_compress(recv: torch.Tensor, z_prev: torch.Tensor, prev_row: torch.Tensor,
                    z_out: torch.Tensor, out_row: torch.Tensor, layout: Layout,
                    backend: str = "auto") -> bool:
    """Average the n received rows of this rank's chunk, add the server error, compress.

    The server error is factored like the worker's: ``e_s = z_prev - s_prev * sign_prev``, from
    the previous call's z and the row it sent, so the step is a single pass.

    Args:
        recv: uint8 [n * row_bytes], row i from rank i.
        z_prev: float32 [chunk], the previous call's z (read only).
        prev_row: uint8 [row_bytes], the previous call's sent row (read only).
        z_out: float32 [chunk], receives this call's z = mean + e_s; may be ``z_prev`` itself,
            or None (not stored).
        out_row: uint8 [row_bytes], receives z compressed (not ``prev_row``).
    Returns:
        False if z was not finite.
    """
    outputs = (out_row,) if z_out is None else (z_out, out_row)
    if _use_triton(backend, recv.device, layout, (recv, z_prev, prev_row, *outputs)):
        return triton_module().server_compress(recv, z_prev, prev_row, z_out, out_row, layout)
    if resolve_backend(backend, recv.device) == "native":
        return _native.server_compress(recv, z_prev, prev_row, z_out, out_row, *layout.as_args(),
                                       True)
    n, nb, block = layout.n, layout.nblocks, layout.block
    decoded = _decoded(recv, layout, n)
    acc = torch.zeros(nb, block, dtype=torch.float32, device=recv.device)
    for i in range(n):  # rank order, fp32: the order the native kernel uses
        acc = acc + decoded[i]
    e = server_error(z_prev, prev_row, layout).view(nb, block)  # z_out may be z_prev
    if z_out is None:
        z_out = torch.empty_like(z_prev)
    z = z_out.view(1, nb, block)
    torch.add(exact_div(acc, n), e, out=z[0])
    finite, scales = _rms_scales(z, block)
    _write_rows(out_row, layout, 1, 0.0 if finite else 1.0, scales,
                pack_signs((z >= 0).view(1, -1)))
    return finite


def server_error(z: torch.Tensor, row: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The server error ``e_s = z - s * sign(z)`` as float32 [chunk], from its factored form."""
    return z - _decoded(row, layout, 1).view(-1)


def decode(rows: torch.Tensor, out: torch.Tensor, layout: Layout, backend: str = "auto") -> None:
    """out[:numel] = s * sign from the n rows (row j holds chunk j).

    Args:
        rows: uint8 [n * row_bytes].
        out: float32 [numel], contiguous.
    """
    if _use_triton(backend, rows.device, layout, (rows, out)):
        triton_module().decode(rows, out, layout)
        return
    if resolve_backend(backend, rows.device) == "native":
        _native.decode(rows, out, *layout.as_args(), True)
        return
    out.copy_(_decoded(rows, layout, layout.n).view(-1)[: layout.numel])
