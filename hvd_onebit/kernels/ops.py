"""The three sign-compression kernels as callers see them: worker compress, server average and
recompress, decode; and a factored error scaled in place. Each asks
:func:`~hvd_onebit.kernels.backend.pick` which implementation runs it (native C++, Triton or the
torch twin of :mod:`~hvd_onebit.kernels.reference`) and calls it; every implementation gives the
same bits.
"""
from __future__ import annotations

import torch

from ..layout import Layout
from . import reference
from .backend import in_place, native_module, native_ready, pick, triton_module


def _triton_fits(layout: Layout, device: torch.device, tensors) -> bool:
    """Whether the Triton kernels take this call: something to do, and every tensor (float32 or
    uint8) contiguous on ``device``."""
    return layout.padded > 0 and in_place(tensors, device, dtypes=None)


def worker_compress(x: torch.Tensor, y_prev: torch.Tensor, prev_scales: torch.Tensor,
                    y_out: torch.Tensor, send: torch.Tensor, layout: Layout,
                    backend: str = "auto") -> bool:
    """Compress ``x + e`` into the n send rows, with ``e = y_prev - s_prev * sign(y_prev)``.

    Args:
        x: float32 [numel], contiguous. Elements past numel are padding (zeros).
        y_prev: float32 [padded], the previous call's y (read only).
        prev_scales: float32 [n * nblocks], the scales of the previous call's rows (read only);
            with ``y_prev``, whose signs those rows carried, it is the worker error feedback.
        y_out: float32 [padded], receives this call's y = x + e; may be ``y_prev`` itself
            (updated in place), or None (y is not stored: the rows alone).
        send: uint8 [n * row_bytes], receives one row per destination rank.
    Returns:
        False if any block held a non-finite value (the rows then carry status 1.0). The triton
        backend returns a :class:`~hvd_onebit.kernels.triton.DeviceFlag` instead: it tests
        the same, and only a test of it waits for the GPU.
    """
    outputs = (send,) if y_out is None else (y_out, send)
    impl = pick(backend, x.device, native=True, triton=lambda: _triton_fits(
        layout, x.device, (x, y_prev, prev_scales, *outputs)))
    if impl == "triton":
        return triton_module().worker_compress(x, y_prev, prev_scales, y_out, send, layout)
    if impl == "native":
        return native_module().worker_compress(x, y_prev, prev_scales, y_out, send,
                                               *layout.as_args(), True)
    return reference.worker_compress(x, y_prev, prev_scales, y_out, send, layout)


def server_compress(recv: torch.Tensor, z_prev: torch.Tensor, prev_scales: torch.Tensor,
                    z_out: torch.Tensor, out_row: torch.Tensor, layout: Layout,
                    backend: str = "auto") -> bool:
    """Average the n received rows of this rank's chunk, add the server error, compress.

    The server error is factored like the worker's: ``e_s = z_prev - s_prev * sign(z_prev)``,
    from the previous call's z and the scales of the row it sent, so the step is a single pass.

    Args:
        recv: uint8 [n * row_bytes], row i from rank i.
        z_prev: float32 [chunk], the previous call's z (read only).
        prev_scales: float32 [nblocks], the scales of the previous call's sent row (read only).
        z_out: float32 [chunk], receives this call's z = mean + e_s; may be ``z_prev`` itself,
            or None (not stored).
        out_row: uint8 [row_bytes], receives z compressed.
    Returns:
        False if z was not finite.
    """
    outputs = (out_row,) if z_out is None else (z_out, out_row)
    impl = pick(backend, recv.device, native=True, triton=lambda: _triton_fits(
        layout, recv.device, (recv, z_prev, prev_scales, *outputs)))
    if impl == "triton":
        return triton_module().server_compress(recv, z_prev, prev_scales, z_out, out_row, layout)
    if impl == "native":
        return native_module().server_compress(recv, z_prev, prev_scales, z_out, out_row,
                                               *layout.as_args(), True)
    return reference.server_compress(recv, z_prev, prev_scales, z_out, out_row, layout)


def decode(rows: torch.Tensor, out: torch.Tensor, layout: Layout, backend: str = "auto") -> None:
    """out[:numel] = s * sign from the n rows (row j holds chunk j).

    Args:
        rows: uint8 [n * row_bytes].
        out: float32 [numel], contiguous.
    """
    impl = pick(backend, rows.device, native=True,
                triton=lambda: _triton_fits(layout, rows.device, (rows, out)))
    if impl == "triton":
        triton_module().decode(rows, out, layout)
    elif impl == "native":
        native_module().decode(rows, out, *layout.as_args(), True)
    else:
        reference.decode(rows, out, layout)


def rescale_error(y: torch.Tensor, scales: torch.Tensor, ratio: torch.Tensor, layout: Layout,
                  count: int, backend: str = "auto") -> None:
    """A factored error scaled into new units, in place of ``y``: ``y = e * ratio`` over
    ``ratio``'s elements and ``y = e`` past them, ``e = y - s * sign(y)`` over ``count`` rows'
    scales (``layout.n`` for the worker error, 1 for the server's), in one pass without
    materialising ``e``. The caller then zeroes the scales, so y is the scaled error itself.

    Args:
        y: float32 [count * chunk], the factored error's y (or z).
        scales: float32 [count * nblocks], the scales of the rows it sent.
        ratio: float32 [k], k <= y.numel(): the factors of y's first k elements.
    """
    if ratio.numel() > y.numel():
        raise ValueError(f"ratio has {ratio.numel()} elements, y {y.numel()}")
    if pick(backend, y.device, native=lambda: native_ready((y, ratio, scales))) == "native":
        if y.numel():
            native_module().rescale_error(y, scales, ratio, count, layout.chunk, layout.block,
                                          layout.row_bytes, True)
        return
    e = reference.factored_error(y, scales, layout, count)
    e[:ratio.numel()].mul_(ratio)
    y.copy_(e)
