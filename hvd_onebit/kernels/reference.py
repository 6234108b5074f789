"""The torch twins of the three sign-compression kernels: the reference the others are tested
against, and what runs where neither native nor Triton can (any device).

Written so that CUDA gives the CPU's bits: no op that multiplies by a reciprocal or contracts
into an FMA on CUDA (see :func:`exact_div`). The arithmetic, per block of ``layout.block``
elements: ``y = x + e`` in fp32; ``s = float(sqrt(sum(double(y)^2) / block))``; sign bit
``y >= 0``; ``e_new = y - (+s or -s)``, kept as y and s (the sign is y's). The server sums
the decoded rows in rank order in fp32, divides by n and adds its error. Arguments as
:mod:`hvd_onebit.kernels.ops`' functions of the same names, less ``backend``.
"""
from __future__ import annotations

import torch

from ..layout import Layout
from .rows import decoded, pack_signs, write_rows


def exact_div(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """``t / divisor`` correctly rounded on every device. CUDA divides by a Python (CPU) scalar
    as a multiplication by its reciprocal, which is not the CPU's bits when 1/divisor is not
    exact (n = 3); a divisor tensor on t's device is a true division everywhere."""
    return t / torch.full((), divisor, dtype=t.dtype, device=t.device)


def rms_scales(y: torch.Tensor, block: int) -> tuple[bool, torch.Tensor]:
    """y: fp32 [rows, nblocks, block] -> (all finite, scales fp32 [rows, nblocks]): the block
    rms, with the sum of squares in double as the native kernels accumulate it."""
    sumsq = y.double().square().sum(-1)
    return bool(torch.isfinite(sumsq).all()), torch.sqrt(exact_div(sumsq, block)).float()


def worker_compress(x: torch.Tensor, y_prev: torch.Tensor, prev_scales: torch.Tensor,
                    y_out, send: torch.Tensor, layout: Layout) -> bool:
    """:func:`hvd_onebit.kernels.worker_compress` with torch ops."""
    n, nb, block = layout.n, layout.nblocks, layout.block
    e = worker_error(y_prev, prev_scales, layout)  # before y_out is written: it may be y_prev
    if y_out is None:
        y_out = torch.empty_like(y_prev)
    y_out.zero_()
    y_out[: layout.numel].copy_(x)
    y_out.add_(e)  # x + e on real elements, 0 + e on the padding: the native kernel's order
    y = y_out.view(n, nb, block)
    finite, scales = rms_scales(y, block)
    write_rows(send, layout, n, 0.0 if finite else 1.0, scales, pack_signs((y >= 0).view(n, -1)))
    return finite


def factored_error(y: torch.Tensor, scales: torch.Tensor, layout: Layout,
                   count: int) -> torch.Tensor:
    """``y - s * sign(y)`` over ``count`` chunks (sign(0) = +1), ``s`` each block's scale in
    ``scales`` float32 [count * nblocks]: a factored error materialised, a fresh tensor."""
    yb = y.view(count, layout.nblocks, layout.block)
    s = scales.view(count, layout.nblocks, 1)
    e = torch.where(yb >= 0, s, -s)
    return torch.sub(yb, e, out=e).view(-1)


def worker_error(y: torch.Tensor, scales: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The worker error ``e = y - s * sign(y)`` as float32 [padded], a fresh tensor, from its
    factored form: ``y`` float32 [padded], the ``scales`` float32 [n * nblocks] of the rows
    sent (their signs were y's own). The one implementation, on any device (it serves
    checkpoints and flushes; the compressions rebuild the error inside their own pass)."""
    return factored_error(y, scales, layout, layout.n)


def server_compress(recv: torch.Tensor, z_prev: torch.Tensor, prev_scales: torch.Tensor,
                    z_out, out_row: torch.Tensor, layout: Layout) -> bool:
    """:func:`hvd_onebit.kernels.server_compress` with torch ops."""
    n, nb, block = layout.n, layout.nblocks, layout.block
    rows = decoded(recv, layout, n)
    acc = torch.zeros(nb, block, dtype=torch.float32, device=recv.device)
    for i in range(n):  # rank order, fp32: the order the native kernel uses
        acc = acc + rows[i]
    e = server_error(z_prev, prev_scales, layout).view(nb, block)  # z_out may be z_prev
    if z_out is None:
        z_out = torch.empty_like(z_prev)
    z = z_out.view(1, nb, block)
    torch.add(exact_div(acc, n), e, out=z[0])
    finite, scales = rms_scales(z, block)
    write_rows(out_row, layout, 1, 0.0 if finite else 1.0, scales,
               pack_signs((z >= 0).view(1, -1)))
    return finite


def server_error(z: torch.Tensor, scales: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The server error ``e_s = z - s * sign(z)`` as float32 [chunk], a fresh tensor, from its
    factored form: ``z`` float32 [chunk], the ``scales`` float32 [nblocks] of the row sent."""
    return factored_error(z, scales, layout, 1)


def decode(rows: torch.Tensor, out: torch.Tensor, layout: Layout) -> None:
    """:func:`hvd_onebit.kernels.decode` with torch ops."""
    out.copy_(decoded(rows, layout, layout.n).view(-1)[: layout.numel])
