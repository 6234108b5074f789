"""The wire rows seen as tensors (the torch side of :mod:`hvd_onebit.layout`'s row format).

A row is a status word, one float32 scale per block, then the sign bits (bit j of byte b is
element 8b + j; set: ``y >= 0``), then zero padding. Views of a buffer's rows and sign packing.
"""
from __future__ import annotations

import torch

from ..layout import STATUS_BYTES, Layout


def rows_of(buf: torch.Tensor, layout: Layout, count: int) -> torch.Tensor:
    """The first ``count`` rows of ``buf``: uint8 [count, row_bytes]."""
    return buf[: count * layout.row_bytes].view(count, layout.row_bytes)


def row_status(buf: torch.Tensor, layout: Layout, count: int) -> torch.Tensor:
    """The status word of each of ``count`` rows in ``buf``: float32 [count]; non-zero = bad input."""
    return rows_of(buf, layout, count)[:, :STATUS_BYTES].view(torch.float32)[:, 0]


def row_scales(buf: torch.Tensor, layout: Layout, count: int) -> torch.Tensor:
    """Scales of each row: float32 [count, nblocks]."""
    return rows_of(buf, layout, count)[:, STATUS_BYTES : layout.header_bytes].view(torch.float32)


def row_bits(buf: torch.Tensor, layout: Layout, count: int) -> torch.Tensor:
    """The sign bytes of each row: uint8 [count, bits_bytes]."""
    bits = slice(layout.header_bytes, layout.header_bytes + layout.bits_bytes)
    return rows_of(buf, layout, count)[:, bits]


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


def write_rows(buf, layout, count, status: float, scales, bits) -> None:
    """Write ``count`` whole rows: the status word, the scales, the sign bytes, zero padding."""
    rows = rows_of(buf, layout, count)
    rows[:, layout.header_bytes + layout.bits_bytes :] = 0
    row_status(buf, layout, count).fill_(status)
    row_scales(buf, layout, count).copy_(scales)
    row_bits(buf, layout, count).copy_(bits)


def decoded(rows: torch.Tensor, layout: Layout, count: int) -> torch.Tensor:
    """s * sign for ``count`` rows: float32 [count, nblocks, block]."""
    scales = row_scales(rows, layout, count).unsqueeze(-1)
    positive = unpack_signs(row_bits(rows, layout, count)).view(count, layout.nblocks, layout.block)
    return torch.where(positive, scales, -scales)

