"""The device helpers the Triton kernels share: loads and stores of any float dtype, Adam's
denominator, the segment search and a program's tile (see :mod:`hvd_onebit.kernels.triton`)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Each float dtype's code in the segment tables, as :func:`load_as_f32` and
#: :func:`store_from_f32` read it; 0: absent (reads as zero).
KINDS = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}

#: An aligned-offset column's entry for a segment that cannot take the vector path
#: (``launch.aligned_offsets``).
NOT_ALIGNED = tl.constexpr(-(1 << 62))


@triton.jit
def load_as_f32(addr, off, mask, kind):
    """Elements ``off`` of the tensor at address ``addr`` of dtype ``kind`` (1 f32, 2 f16,
    3 bf16, 0 absent: zeros), as float32."""
    v = tl.zeros(off.shape, tl.float32)
    if kind == 1:
        v = tl.load(addr.to(tl.pointer_type(tl.float32)) + off, mask=mask, other=0.0)
    elif kind == 2:
        v = tl.load(addr.to(tl.pointer_type(tl.float16)) + off, mask=mask, other=0.0).to(tl.float32)
    elif kind == 3:
        u = tl.load(addr.to(tl.pointer_type(tl.uint16)) + off, mask=mask, other=0)
        v = (u.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return v


@triton.jit
def load_aligned_as_f32(base32, base16, q, p, mask, kind):
    """:func:`load_as_f32` of a segment that lies at ``q`` from ``base32``/``base16`` (the
    same address as float32 and as int16; see ``launch.aligned_offsets``): element ``p`` at
    ``q * 4 + p`` (float32) or ``q * 8 + p`` (16-bit), 16-byte aligned, so vectorised loads
    (the scalar part added first: the positions stay as narrow as ``p``)."""
    v = tl.zeros(p.shape, tl.float32)
    if kind == 1:
        v = tl.load((base32 + q * 4) + p, mask=mask, other=0.0)
    elif kind == 2:
        h = tl.load((base16 + q * 8) + p, mask=mask, other=0)
        v = h.to(tl.float16, bitcast=True).to(tl.float32)
    elif kind == 3:
        u = tl.load((base16 + q * 8) + p, mask=mask, other=0).to(tl.uint16, bitcast=True)
        v = (u.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return v


@triton.jit
def store_aligned_from_f32(base32, base16, q, p, v, mask, kind):
    """:func:`store_from_f32` at ``q`` from the bases (see :func:`load_aligned_as_f32`)."""
    if kind == 1:
        tl.store((base32 + q * 4) + p, v, mask=mask)
    elif kind == 2:
        tl.store((base16 + q * 8) + p, v.to(tl.float16).to(tl.int16, bitcast=True), mask=mask)
    elif kind == 3:  # as store_from_f32
        u = v.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(v != v, 0x7FC0, r)
        tl.store((base16 + q * 8) + p, r.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)


@triton.jit
def store_from_f32(addr, off, v, mask, kind):
    """Store float32 ``v`` into a tensor of dtype ``kind``, rounded once to nearest even."""
    if kind == 1:
        tl.store(addr.to(tl.pointer_type(tl.float32)) + off, v, mask=mask)
    elif kind == 2:
        tl.store(addr.to(tl.pointer_type(tl.float16)) + off, v.to(tl.float16), mask=mask)
    elif kind == 3:  # torch's float -> bfloat16: round to nearest even, NaN -> 0x7FC0
        u = v.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(v != v, 0x7FC0, r)
        tl.store(addr.to(tl.pointer_type(tl.uint16)) + off, r.to(tl.uint16), mask=mask)


@triton.jit
def frozen_denominator(v, inv_root_bc2, eps):
    """Adam's denominator from the frozen variance ``v`` (float32):
    ``sqrt(v) * inv_root_bc2 + eps`` (``inv_root_bc2``: the host's
    :func:`hvd_onebit.kernels.fused_reference.inverse_root_bc2`), ``+inf`` where ``v == 0`` (a
    held element); the root correctly rounded, no FMA, as the native code's and
    :func:`hvd_onebit.kernels.fused_reference.frozen_denominator`."""
    den = tl.sqrt_rn(v) * inv_root_bc2 + eps
    return tl.where(v == 0.0, float("inf"), den)


@triton.jit
def first_segment(starts, nsegs, p_lo):
    """The last segment whose start is <= p_lo (starts: int64, non-decreasing)."""
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + nsegs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = tl.load(starts + mid) <= p_lo
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def tile(pid, G, block, nblocks, T, R: tl.constexpr, C: tl.constexpr, WIDE: tl.constexpr):
    """The blocks and positions of program ``pid``: R blocks (gb, [R]) x C elements (o, [C]).
    Positions are int64 only when the buffer has 2**31 elements or more (``WIDE``): int32
    positions keep half the registers, and the registers bound these kernels' occupancy."""
    t = pid % T
    gb0 = (pid // T) * R
    gb = gb0 + tl.arange(0, R)
    o = t * C + tl.arange(0, C)
    gb_ok = gb < G
    valid = gb_ok[:, None] & (o < block)[None, :]
    if WIDE:
        p = gb.to(tl.int64)[:, None] * block + o[None, :]
    else:
        p = gb[:, None] * block + o[None, :]
    # the tile's first and one-past-last positions (scalars)
    last = tl.minimum(gb0 + R, G) - 1
    p_lo = gb0.to(tl.int64) * block + t * C
    p_hi = last.to(tl.int64) * block + tl.minimum(t * C + C, block)
    j = gb // nblocks
    b = gb % nblocks
    return t, gb, o, gb_ok, valid, p, p_lo, p_hi, j, b
