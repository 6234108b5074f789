"""Triton kernels for CUDA tensors: the sign-compression kernels and Adam's fused passes.

The same arithmetic and the same bits as the native kernels (``csrc/onebit_kernels.cpp``) and
their torch twins (:mod:`hvd_onebit.kernels`, :mod:`hvd_onebit.fused_adam`), one pass over memory
per fused operation. Imported lazily (only once a "triton" backend is resolved), because
``TRITON_INTERPRET=1`` must be set before ``triton.jit`` runs: under Triton's interpreter the same
kernels run on CPU tensors, which is how they are tested on machines without a GPU
(:data:`INTERPRETED` says which mode this import got).

**Block scales without atomics.** A block's scale needs the sum of squares of its whole block
before it is known, but the sign bits do not (bit = ``y >= 0``), nor does ``y`` itself. So the
main kernel of a compression reads its inputs once and writes ``y``, the sign bits and one float64
partial sum of squares per tile; a small kernel then adds each block's partials in a fixed order
(``_finalize_kernel``) and writes the scales; a one-program kernel (``_status_kernel``) turns the
per-block finiteness into the rows' status words. No atomics, a fixed grid and fixed reduction
trees: the same inputs give the same bits run to run and rank to rank (same GPU model and Triton
version). The squares are exact in float64 (a float32 squared has 48 significant bits), so the
summation order only moves the sum within float64 rounding: the float32 scale equals the native
kernel's except when the exact root lies within about 1e-16 relative of a float32 rounding
boundary (never seen in the tests).

**Tiles.** A program covers ``R`` blocks x ``C`` elements (``C`` a power of two >= 8): small blocks
are packed ``R`` to a program, a block larger than ``C`` is split into ``T`` tiles. Chunk, block
and row of every element are per-row scalars, so there is no per-element integer division.

**Segments** (a parameter's gradient, weight and denominator are separate tensors laid end to end
in the flat momentum): passed as a table of addresses, kinds and start offsets, not copied into a
flat buffer first, which would cost a pass of its own. A program finds the segment holding its
first element by binary search on the start offsets and walks forward over the segments its tile
overlaps (almost always one: tiles are 2K elements, parameters are usually larger), loading each
with an address cast from the table. Gradients and weights may be float32, float16 or bfloat16;
low-precision weights are updated in float32 and rounded once, to nearest even (bfloat16 rounded
with integer arithmetic, because the interpreter's float32 -> bfloat16 cast truncates).

**Exact arithmetic**: every launch passes ``enable_fp_fusion=False`` (no FMA contraction, as the
native code's ``-ffp-contract=off``); float32 divisions are ``tl.div_rn`` (Triton's ``/`` is
``div.full.f32`` on NVIDIA, not correctly rounded); float64 ``/`` and ``sqrt`` are IEEE there.
"""
from __future__ import annotations

import math
import os
import threading
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from .layout import Layout

#: Whether these kernels were built for Triton's interpreter (CPU tensors) at import.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

_CMAX = 2048  # elements per program (a power of two)
_FB = 256  # rows (blocks) per finalize program
_TT = 256  # partials per finalize step
_WARPS = 8

_KINDS = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}  # 0: absent (reads as zero)
_LAUNCH = {"enable_fp_fusion": False}


# ---- device helpers -----------------------------------------------------------------------------

@triton.jit
def _load_as_f32(addr, off, mask, kind):
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
def _store_from_f32(addr, off, v, mask, kind):
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
def _frozen_denominator(v, sqrt_bc2, eps):
    """Adam's denominator from the frozen variance ``v`` (float32): ``sqrt(v) / sqrt_bc2 + eps``,
    ``+inf`` where ``v == 0`` (a held element); sqrt and division correctly rounded, as the native
    code's and :func:`hvd_onebit.fused_adam.frozen_denominator`."""
    den = tl.div_rn(tl.sqrt_rn(v), tl.zeros_like(v) + sqrt_bc2) + eps
    return tl.where(v == 0.0, float("inf"), den)


@triton.jit
def _first_segment(starts, nsegs, p_lo):
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
def _tile(pid, G, block, nblocks, T, R: tl.constexpr, C: tl.constexpr):
    """The blocks and positions of program ``pid``: R blocks (gb, [R]) x C elements (o, [C])."""
    t = pid % T
    gb0 = (pid // T) * R
    gb = gb0 + tl.arange(0, R)
    o = t * C + tl.arange(0, C)
    gb_ok = gb < G
    valid = gb_ok[:, None] & (o < block)[None, :]
    p = gb.to(tl.int64)[:, None] * block + o[None, :]
    # the tile's first and one-past-last positions (scalars)
    last = tl.minimum(gb0 + R, G) - 1
    p_lo = gb0.to(tl.int64) * block + t * C
    p_hi = last.to(tl.int64) * block + tl.minimum(t * C + C, block)
    j = gb // nblocks
    b = gb % nblocks
    return t, gb, o, gb_ok, valid, p, p_lo, p_hi, j, b


# ---- compression: y = x + e, sign bits, partial sums of squares -----------------------------------

@triton.jit
def _compress_kernel(src_ptr, src_words_ptr, tab_ptr, ftab_ptr, nsegs, beta1, one_minus_beta1,
                     nrecv, numel, y_prev_ptr, prev_ptr, prev_words_ptr, y_out_ptr, send_ptr,
                     partial_ptr, G, nblocks, block, T, row_bytes, row_words, hb,
                     SRC: tl.constexpr, PRECOND: tl.constexpr, WRITE_Y: tl.constexpr,
                     R: tl.constexpr, C: tl.constexpr):
    """SRC 0: x = src (float32 [numel]); SRC 1: x = beta1 * src + (1 - beta1) * g, g from the
    segment table, and with PRECOND x = clamp(x / denom, -bound, bound), denom = sqrt(v) /
    sqrt_bc2 + eps (+inf where v == 0: held elements give +-0), v, sqrt_bc2, eps and bound per
    segment from the tables;
    SRC 2: x = (rank-ordered fp32 sum of the ``nrecv`` rows at src) / nrecv.
    WRITE_Y: store y (y_out may be y_prev: each element is loaded before it is stored)."""
    pid = tl.program_id(0)
    t, gb, o, gb_ok, valid, p, p_lo, p_hi, j, b = _tile(pid, G, block, nblocks, T, R, C)
    shift = (tl.arange(0, C) % 8).to(tl.uint8)[None, :]  # bit of each element in its byte
    row_off = j.to(tl.int64) * row_bytes
    byte_off = hb + b.to(tl.int64) * (block // 8)  # [R]: the block's first sign byte in its row
    bytes_at = (row_off + byte_off)[:, None] + (o // 8)[None, :]

    if SRC == 0:
        x = tl.load(src_ptr + p, mask=valid & (p < numel), other=0.0)
    elif SRC == 1:
        real = valid & (p < numel)
        m = tl.load(src_ptr + p, mask=real, other=0.0)
        g = tl.zeros([R, C], tl.float32)
        den = tl.full([R, C], 1.0, tl.float32)  # PRECOND: replaced on every real element
        bnd = tl.full([R, C], float("inf"), tl.float32)
        starts = tab_ptr
        s = _first_segment(starts, nsegs, p_lo)
        more = s < nsegs
        while more:
            st = tl.load(starts + s)
            en = tl.load(starts + s + 1)
            here = real & (p >= st) & (p < en)
            gv = _load_as_f32(tl.load(tab_ptr + nsegs + 1 + s), p - st, here,
                              tl.load(tab_ptr + 2 * nsegs + 1 + s))
            g = tl.where(here, gv, g)
            if PRECOND:  # an empty segment's address is 0: its load is masked out entirely
                v = tl.load(tl.load(tab_ptr + 3 * nsegs + 1 + s).to(tl.pointer_type(tl.float32))
                            + (p - st), mask=here, other=1.0)
                den = tl.where(here, _frozen_denominator(v, tl.load(ftab_ptr + 3 * s),
                                                         tl.load(ftab_ptr + 3 * s + 1)), den)
                bnd = tl.where(here, tl.load(ftab_ptr + 3 * s + 2), bnd)
            s += 1
            more = (s < nsegs) & (en < p_hi)
        x = tl.where(real, beta1 * m + one_minus_beta1 * g, 0.0)
        if PRECOND:  # compare and where, so a NaN stays NaN (as the native clamp keeps it)
            x = tl.where(real, tl.div_rn(x, den), 0.0)
            # an infinite u stays infinite: the input is then reported as not finite
            x = tl.where((x < -bnd) & (x != float("-inf")), -bnd,
                         tl.where((x > bnd) & (x != float("inf")), bnd, x))
    else:
        acc = tl.zeros([R, C], tl.float32)
        for i in range(nrecv):  # rank order, fp32: the order of the native kernel
            s_i = tl.load(src_words_ptr + i * row_words + 1 + b, mask=gb_ok, other=0.0)[:, None]
            bits = tl.load(src_ptr + i * row_bytes + bytes_at - row_off[:, None], mask=valid,
                           other=0)
            acc = acc + tl.where(((bits >> shift) & 1) != 0, s_i, -s_i)
        x = tl.div_rn(acc, tl.zeros([R, C], tl.float32) + nrecv * 1.0)

    # the factored error of the previous call: e = y_prev - (+-s_prev)
    prev_s = tl.load(prev_words_ptr + j * row_words + 1 + b, mask=gb_ok, other=0.0)[:, None]
    prev_bits = tl.load(prev_ptr + bytes_at, mask=valid, other=0)
    e = tl.load(y_prev_ptr + p, mask=valid, other=0.0) - tl.where(
        ((prev_bits >> shift) & 1) != 0, prev_s, -prev_s)
    y = x + e
    if WRITE_Y:
        tl.store(y_out_ptr + p, y, mask=valid)

    y64 = tl.where(valid, y, 0.0).to(tl.float64)
    tl.store(partial_ptr + gb.to(tl.int64) * T + t, tl.sum(y64 * y64, axis=1), mask=gb_ok)

    bits = ((y >= 0) & valid).to(tl.uint8) << shift
    packed = tl.sum(tl.reshape(bits, [R, C // 8, 8]), axis=2).to(tl.uint8)
    k = tl.arange(0, C // 8)
    kb = t * (C // 8) + k
    tl.store(send_ptr + (row_off + byte_off)[:, None] + kb[None, :], packed,
             mask=gb_ok[:, None] & (kb < block // 8)[None, :])


@triton.jit
def _finalize_kernel(partial_ptr, words_ptr, flags_ptr, G, T, nblocks, block, row_words,
                     FB: tl.constexpr, TT: tl.constexpr):
    """Each block's partials added in a fixed order -> scale = float(sqrt(sumsq / block));
    flags[pid] = 1 if any of this program's blocks had a non-finite sum."""
    pid = tl.program_id(0)
    gb = pid * FB + tl.arange(0, FB)
    ok = gb < G
    acc = tl.zeros([FB, TT], tl.float64)
    for t0 in range(0, T, TT):
        tt = t0 + tl.arange(0, TT)
        acc += tl.load(partial_ptr + gb.to(tl.int64)[:, None] * T + tt[None, :],
                       mask=ok[:, None] & (tt < T)[None, :], other=0.0)
    ss = tl.sum(acc, axis=1)
    scale = tl.sqrt(ss / block).to(tl.float32)
    tl.store(words_ptr + (gb // nblocks).to(tl.int64) * row_words + 1 + gb % nblocks, scale,
             mask=ok)
    bad = ok & ~(ss < float("inf"))  # NaN compares false
    tl.store(flags_ptr + pid, tl.max(bad.to(tl.int32), axis=0))


@triton.jit
def _status_kernel(flags_ptr, nflags, ok_ptr, words_ptr, bytes_ptr, nrows, row_words, row_bytes,
                   used, pad, FB: tl.constexpr):
    """One program: the rows' status words (1.0 if any block was not finite) and zeroed pad
    bytes; ok[0] = 1 when every block was finite."""
    acc = tl.zeros([FB], tl.int32)
    for f0 in range(0, nflags, FB):
        f = f0 + tl.arange(0, FB)
        acc = tl.maximum(acc, tl.load(flags_ptr + f, mask=f < nflags, other=0))
    bad = tl.max(acc, axis=0)
    status = tl.zeros([FB], tl.float32) + bad.to(tl.float32)
    tl.store(ok_ptr, 1 - bad)
    for r0 in range(0, nrows, FB):
        r = r0 + tl.arange(0, FB)
        rm = r < nrows
        tl.store(words_ptr + r.to(tl.int64) * row_words, status, mask=rm)
        for k in range(pad):
            tl.store(bytes_ptr + r.to(tl.int64) * row_bytes + used + k,
                     tl.zeros([FB], tl.uint8), mask=rm)


# ---- decode, optionally with Adam's update ------------------------------------------------------

@triton.jit
def _decode_kernel(rows_ptr, words_ptr, m_ptr, numel, G, nblocks, block, T, row_bytes,
                   row_words, hb, tab_ptr, ftab_ptr, nsegs,
                   UPDATE: tl.constexpr, PRECOND: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """m[p] = d = +-s for p < numel; with UPDATE, for segments with a variance v:
    denom = sqrt(v) / sqrt_bc2 + eps (+inf where v == 0: held), and
    - not PRECOND (every such segment has a weight): w = w * decay (if flagged),
      w = w + clamp((step * d) / denom, -bound, bound), m = held ? +0 : d;
    - PRECOND (d is u = m / denom): m = held ? +0 : d * denom and, if the segment has a weight,
      w = w * decay (if flagged), w = w + (held ? +0 : clamp(step * d, -bound, bound))."""
    pid = tl.program_id(0)
    t, gb, o, gb_ok, valid, p, p_lo, p_hi, j, b = _tile(pid, G, block, nblocks, T, R, C)
    valid = valid & (p < numel)
    shift = (tl.arange(0, C) % 8).to(tl.uint8)[None, :]
    s = tl.load(words_ptr + j.to(tl.int64) * row_words + 1 + b, mask=gb_ok, other=0.0)[:, None]
    bytes_at = (j.to(tl.int64) * row_bytes + hb + b.to(tl.int64) * (block // 8))[:, None] + \
        (o // 8)[None, :]
    bits = tl.load(rows_ptr + bytes_at, mask=valid, other=0)
    d = tl.where(((bits >> shift) & 1) != 0, s, -s)
    if UPDATE:
        starts = tab_ptr
        p_hi = tl.minimum(p_hi, numel)
        seg = _first_segment(starts, nsegs, p_lo)
        more = (seg < nsegs) & (p_lo < p_hi)
        while more:
            st = tl.load(starts + seg)
            en = tl.load(starts + seg + 1)
            v_addr = tl.load(tab_ptr + 2 * nsegs + 1 + seg)
            if v_addr != 0:
                here = valid & (p >= st) & (p < en)
                off = p - st
                kind = tl.load(tab_ptr + 3 * nsegs + 1 + seg)  # the weight's; 0: none
                w_addr = tl.load(tab_ptr + nsegs + 1 + seg)
                v = tl.load(v_addr.to(tl.pointer_type(tl.float32)) + off, mask=here, other=1.0)
                den = _frozen_denominator(v, tl.load(ftab_ptr + 5 * seg + 2),
                                          tl.load(ftab_ptr + 5 * seg + 3))
                held = den == float("inf")
                # the step bound: where/compare rather than min/max, so a NaN step stays NaN
                bound = tl.load(ftab_ptr + 5 * seg + 4)
                if PRECOND:
                    if kind != 0:
                        w = _load_as_f32(w_addr, off, here, kind)
                        if tl.load(tab_ptr + 4 * nsegs + 1 + seg) != 0:
                            w = w * tl.load(ftab_ptr + 5 * seg + 1)
                        q = tl.load(ftab_ptr + 5 * seg) * d
                        q = tl.where(q < -bound, -bound, tl.where(q > bound, bound, q))
                        w = w + tl.where(held, 0.0, q)  # +0: a held weight only decays
                        _store_from_f32(w_addr, off, w, here, kind)
                    # m = u * denom, once the step has read u; +0 where held (d * inf is
                    # +-inf or NaN there)
                    d = tl.where(here, tl.where(held, 0.0, d * den), d)
                else:
                    w = _load_as_f32(w_addr, off, here, kind)
                    if tl.load(tab_ptr + 4 * nsegs + 1 + seg) != 0:
                        w = w * tl.load(ftab_ptr + 5 * seg + 1)
                    q = tl.div_rn(tl.load(ftab_ptr + 5 * seg) * d, den)
                    q = tl.where(q < -bound, -bound, tl.where(q > bound, bound, q))
                    w = w + q
                    _store_from_f32(w_addr, off, w, here, kind)
                    d = tl.where(here & held, 0.0, d)
            seg += 1
            more = (seg < nsegs) & (en < p_hi)
    tl.store(m_ptr + p, d, mask=valid)


# ---- Python side --------------------------------------------------------------------------------

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


def _geometry(block: int) -> tuple[int, int, int]:
    """(R, C, T): blocks per program, elements per row of a tile, tiles per block."""
    if block <= _CMAX:
        c = max(8, triton.next_power_of_2(block))
        return _CMAX // c, c, 1
    return 1, _CMAX, triton.cdiv(block, _CMAX)


_INTERPRETER_LOCK = threading.Lock()


class _on_device:
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


def _words(buf: torch.Tensor) -> torch.Tensor:
    """A row buffer (uint8, length a multiple of 4) as float32 words: status and scales."""
    return buf.view(torch.float32)


def _kind(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None or t.numel() == 0 else _KINDS[t.dtype]


def _addr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


def _table(columns: Sequence[Sequence[int]], sizes: Sequence[int], device) -> torch.Tensor:
    """int64 [starts (nsegs+1), then each column (nsegs)], on ``device``."""
    starts = [0]
    for s in sizes:
        starts.append(starts[-1] + int(s))
    flat = starts + [v for col in columns for v in col]
    return torch.tensor(flat, dtype=torch.int64).to(device, non_blocking=True)


def _compress(src_mode: int, src, src_words, tab, nsegs: int, beta1: float, nrecv: int,
              numel: int, y_prev, prev, y_out, send, nrows: int, chunk: int, layout: Layout,
              ftab=None) -> DeviceFlag:
    """One compression (SRC = ``src_mode``); ``ftab``: SRC 1's float table (sqrt_bc2, eps per
    segment), None when not preconditioned."""
    block, nblocks = layout.block, layout.nblocks
    G = nrows * nblocks
    R, C, T = _geometry(block)
    dev = send.device
    write_y = y_out is not None
    if not write_y:
        y_out = y_prev  # not written (WRITE_Y=False): any float32 pointer will do
    partial = torch.empty(G * T, dtype=torch.float64, device=dev)
    nfin = triton.cdiv(G, _FB)
    flags = torch.empty(nfin, dtype=torch.int32, device=dev)
    ok = torch.empty(1, dtype=torch.int32, device=dev)
    words = _words(send)
    rw = layout.row_bytes // 4
    precond = ftab is not None
    if not precond:
        ftab = y_prev  # not read (PRECOND=False): any float32 pointer will do
    with _on_device(y_out):
        _compress_kernel[(triton.cdiv(G, R) * T,)](
            src, src_words, tab, ftab, nsegs, float(beta1), float(1.0 - beta1), nrecv, numel,
            y_prev, prev, _words(prev), y_out, send, partial, G, nblocks, block, T,
            layout.row_bytes, rw, layout.header_bytes, SRC=src_mode, PRECOND=precond,
            WRITE_Y=write_y, R=R, C=C, num_warps=_WARPS, **_LAUNCH)
        _finalize_kernel[(nfin,)](partial, words, flags, G, T, nblocks, block, rw, FB=_FB,
                                  TT=min(_TT, triton.next_power_of_2(T)), **_LAUNCH)
        used = layout.header_bytes + chunk // 8
        _status_kernel[(1,)](flags, nfin, ok, words, send, nrows, rw, layout.row_bytes, used,
                             layout.row_bytes - used, FB=_FB, **_LAUNCH)
    return DeviceFlag(ok)


def worker_compress(x: torch.Tensor, y_prev: torch.Tensor, prev_send: torch.Tensor,
                    y_out: Optional[torch.Tensor], send: torch.Tensor, layout: Layout
                    ) -> DeviceFlag:
    """:func:`hvd_onebit.kernels.worker_compress` (float32 contiguous tensors, one device)."""
    return _compress(0, x, x, x, 1, 0.0, 1, x.numel(), y_prev, prev_send, y_out, send,
                     layout.n, layout.chunk, layout)


def worker_compress_momentum(momentum: torch.Tensor, grads: Sequence[Optional[torch.Tensor]],
                             sizes: Sequence[int], beta1: float, y_prev: torch.Tensor,
                             prev_send: torch.Tensor, y_out: Optional[torch.Tensor],
                             send: torch.Tensor, layout: Layout,
                             variances: Optional[Sequence[torch.Tensor]] = None,
                             sqrt_bc2s: Optional[Sequence[float]] = None,
                             epss: Optional[Sequence[float]] = None,
                             bounds: Optional[Sequence[float]] = None) -> DeviceFlag:
    """Worker compression of ``x = beta1 * momentum + (1 - beta1) * g`` computed in the same
    pass, ``g`` the gradients laid end to end (None reads as zeros); with ``variances`` (one
    float32 per segment, with its ``sqrt_bc2s``, ``epss`` and ``bounds``: a preconditioned
    :class:`~hvd_onebit.fused_adam.MomentumInput`), of ``u = clamp(x / denom, -bound, bound)``,
    ``denom = sqrt(v) / sqrt_bc2 + eps`` (+inf where ``v == 0``); see :func:`ready`."""
    columns = [[_addr(g) for g in grads], [_kind(g) for g in grads]]
    ftab = None
    if variances is not None:
        if len(variances) != len(sizes) or any(
                v is None or v.numel() != s for v, s in zip(variances, sizes)):
            raise ValueError("preconditioning needs one variance of its segment's size per "
                             "gradient")
        columns.append([_addr(v) for v in variances])
        bounds = [math.inf] * len(sizes) if bounds is None else bounds
        ftab = torch.tensor([float(v) for row in zip(sqrt_bc2s, epss, bounds) for v in row],
                            dtype=torch.float32).to(momentum.device, non_blocking=True)
    tab = _table(columns, sizes, momentum.device)
    return _compress(1, momentum, momentum, tab, len(sizes), beta1, 1, momentum.numel(), y_prev,
                     prev_send, y_out, send, layout.n, layout.chunk, layout, ftab)


def server_compress(recv: torch.Tensor, z_prev: torch.Tensor, prev_row: torch.Tensor,
                    z_out: Optional[torch.Tensor], out_row: torch.Tensor, layout: Layout
                    ) -> DeviceFlag:
    """:func:`hvd_onebit.kernels.server_compress`: the n rows averaged, compressed, one pass."""
    return _compress(2, recv, _words(recv), z_prev, 1, 0.0, layout.n, layout.chunk, z_prev,
                     prev_row, z_out, out_row, 1, layout.chunk, layout)


def decode(rows: torch.Tensor, out: torch.Tensor, layout: Layout,
           weights: Optional[Sequence[Optional[torch.Tensor]]] = None,
           variances: Optional[Sequence[Optional[torch.Tensor]]] = None,
           sizes: Optional[Sequence[int]] = None, steps: Optional[Sequence[float]] = None,
           decays: Optional[Sequence[float]] = None, sqrt_bc2s: Optional[Sequence[float]] = None,
           epss: Optional[Sequence[float]] = None,
           bounds: Optional[Sequence[float]] = None, preconditioned: bool = False) -> None:
    """out[:numel] = s * sign from the n rows; with ``weights`` (AdamUpdate's lists), Adam's
    update in the same pass (see :class:`hvd_onebit.fused_adam.AdamUpdate`). ``preconditioned``:
    the rows carry ``u = m / denom``; ``m = u * denom`` is stored (+0 where held), the step is
    ``clamp(step * u, -bound, bound)`` (+0 where held), and a variance without its weight
    converts its momentum only."""
    numel = out.numel()
    if numel == 0:
        return
    block, nblocks = layout.block, layout.nblocks
    G = layout.n * nblocks
    R, C, T = _geometry(block)
    update = weights is not None
    if update:
        live = [w is not None and w.numel() > 0 for w in weights]
        if any(k and v is None for v, k in zip(variances, live)):
            raise ValueError("every weight given needs its variance")
        # the segments the kernel visits are those with a variance address: with a weight, or
        # preconditioned also without one (its momentum converted); unread variances are left out
        read_v = [(k or preconditioned) and v is not None for v, k in zip(variances, live)]
        tab = _table([[_addr(w) if k else 0 for w, k in zip(weights, live)],
                      [_addr(v) if r else 0 for v, r in zip(variances, read_v)],
                      [_kind(w) if k else 0 for w, k in zip(weights, live)],
                      [int(float(dc) != 1.0) for dc in decays]], sizes, out.device)
        bounds = [math.inf] * len(sizes) if bounds is None else bounds
        ftab = torch.tensor([float(v) for row in zip(steps, decays, sqrt_bc2s, epss, bounds)
                             for v in row], dtype=torch.float32).to(out.device, non_blocking=True)
        nsegs = len(sizes)
    else:
        tab, ftab, nsegs = out, out, 1
    with _on_device(out):
        _decode_kernel[(triton.cdiv(G, R) * T,)](
            rows, _words(rows), out, numel, G, nblocks, block, T, layout.row_bytes,
            layout.row_bytes // 4, layout.header_bytes, tab, ftab, nsegs, UPDATE=update,
            PRECOND=update and bool(preconditioned), R=R, C=C, num_warps=_WARPS, **_LAUNCH)


def ready(tensors: Sequence[Optional[torch.Tensor]], device: torch.device,
          dtypes=(torch.float32,)) -> bool:
    """Whether the kernels can read (and write) every given tensor in place: on ``device``,
    contiguous, of one of ``dtypes`` (None entries are fine)."""
    return all(t is None or (t.device == device and t.is_contiguous() and t.dtype in dtypes)
               for t in tensors)


LOW_PRECISION = tuple(_KINDS)  # the dtypes gradients and weights may have
