"""The compressions in Triton: worker (of x, or of Adam's momentum update computed in the same
pass, optionally preconditioned) and server (the n rows averaged). One main kernel writes ``y``,
the sign bits and float64 partial sums of squares per tile; ``_finalize_kernel`` adds each
block's partials in a fixed order into its scale; ``_status_kernel`` writes the rows' status
words (see :mod:`hvd_onebit.kernels.triton`)."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from ...layout import Layout
from ..fused_reference import inverse_root_bc2
from .device import (NOT_ALIGNED, first_segment, frozen_denominator, load_aligned_as_f32,
                     load_as_f32, tile)
from .launch import (FB, LAUNCH, TT, WARPS, DeviceFlag, address, aligned_offsets, as_words,
                     device_table, geometry, kind_code, on_device, segment_table, wide)


@triton.jit
def _compress_kernel(src_ptr, src_h_ptr, src_words_ptr, tab_ptr, ftab_ptr, nsegs, beta1,
                     one_minus_beta1,
                     nrecv, numel, y_prev_ptr, prev_scales_ptr, y_out_ptr, send_ptr,
                     partial_ptr, G, nblocks, block, T, row_bytes, row_words, hb,
                     SRC: tl.constexpr, PRECOND: tl.constexpr, WRITE_Y: tl.constexpr,
                     R: tl.constexpr, C: tl.constexpr, WIDE: tl.constexpr):
    """SRC 0: x = src (float32 [numel]); SRC 1: x = beta1 * src + (1 - beta1) * g, g from the
    segment table (columns: gradient address, kind, aligned offset from src (``src_h``: src
    as int16), variance's aligned offset, variance address), and with PRECOND
    x = clamp(x / denom, -bound, bound), denom = sqrt(v) * (1 / sqrt_bc2) + eps (+inf where
    v == 0: held elements give +-0), v, 1 / sqrt_bc2, eps and bound per segment from the tables;
    SRC 2: x = (rank-ordered fp32 sum of the ``nrecv`` rows at src) / nrecv.
    WRITE_Y: store y (y_out may be y_prev: each element is loaded before it is stored)."""
    pid = tl.program_id(0)
    t, gb, o, gb_ok, valid, p, p_lo, p_hi, j, b = tile(pid, G, block, nblocks, T, R, C, WIDE)
    shift = (tl.arange(0, C) % 8).to(tl.uint8)[None, :]  # bit of each element in its byte
    row_off = j.to(tl.int64) * row_bytes
    byte_off = hb + b.to(tl.int64) * (block // 8)  # [R]: the block's first sign byte in its row
    bytes_at = (row_off + byte_off)[:, None] + (o // 8)[None, :]

    if SRC == 0:
        if p_hi <= numel:  # masks of whole vectors: vector loads
            x = tl.load(src_ptr + p, mask=valid, other=0.0)
        else:
            x = tl.load(src_ptr + p, mask=valid & (p < numel), other=0.0)
    elif SRC == 1:
        real = valid & (p < numel)
        g = tl.zeros([R, C], tl.float32)
        den = tl.full([R, C], 1.0, tl.float32)  # PRECOND: replaced on every real element
        bnd = tl.full([R, C], float("inf"), tl.float32)
        starts = tab_ptr
        s = first_segment(starts, nsegs, p_lo)
        # the usual tile: inside one segment whose tensors sit at aligned offsets from src
        qg = tl.load(tab_ptr + 3 * nsegs + 1 + s)
        one = ((tl.load(starts + s) <= p_lo) & (p_hi <= tl.load(starts + s + 1))
               & (qg != NOT_ALIGNED))
        if PRECOND:
            qv = tl.load(tab_ptr + 4 * nsegs + 1 + s)
            one = one & (qv != NOT_ALIGNED)
        if one:  # vector loads (every valid element is real: p < p_hi <= the segment's end)
            m = tl.load(src_ptr + p, mask=valid, other=0.0)
            g = load_aligned_as_f32(src_ptr, src_h_ptr, qg, p, valid,
                                    tl.load(tab_ptr + 2 * nsegs + 1 + s))
            if PRECOND:
                v = tl.load((src_ptr + qv * 4) + p, mask=valid, other=1.0)
                den = frozen_denominator(v, tl.load(ftab_ptr + 3 * s),
                                         tl.load(ftab_ptr + 3 * s + 1))
                bnd = tl.zeros([R, C], tl.float32) + tl.load(ftab_ptr + 3 * s + 2)
            more = False
        else:
            m = tl.load(src_ptr + p, mask=real, other=0.0)
            more = s < nsegs
        while more:
            st = tl.load(starts + s)
            en = tl.load(starts + s + 1)
            here = real & (p >= st) & (p < en)
            gv = load_as_f32(tl.load(tab_ptr + nsegs + 1 + s), p - st, here,
                              tl.load(tab_ptr + 2 * nsegs + 1 + s))
            g = tl.where(here, gv, g)
            if PRECOND:  # an empty segment's address is 0: its load is masked out entirely
                v = tl.load(tl.load(tab_ptr + 5 * nsegs + 1 + s).to(tl.pointer_type(tl.float32))
                            + (p - st), mask=here, other=1.0)
                den = tl.where(here, frozen_denominator(v, tl.load(ftab_ptr + 3 * s),
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

    # the factored error of the previous call: e = y_prev - (+-s_prev), the sign y_prev's own
    prev_s = tl.load(prev_scales_ptr + gb, mask=gb_ok, other=0.0)[:, None]
    y_prev = tl.load(y_prev_ptr + p, mask=valid, other=0.0)
    e = y_prev - tl.where(y_prev >= 0, prev_s, -prev_s)
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


def _compress(src_mode: int, src, src_words, tab, nsegs: int, beta1: float, nrecv: int,
              numel: int, y_prev, prev_scales, y_out, send, nrows: int, chunk: int,
              layout: Layout, ftab=None) -> DeviceFlag:
    """One compression (SRC = ``src_mode``); ``ftab``: SRC 1's float table (sqrt_bc2, eps per
    segment), None when not preconditioned."""
    block, nblocks = layout.block, layout.nblocks
    G = nrows * nblocks
    R, C, T = geometry(block)
    dev = send.device
    write_y = y_out is not None
    if not write_y:
        y_out = y_prev  # not written (WRITE_Y=False): any float32 pointer will do
    partial = torch.empty(G * T, dtype=torch.float64, device=dev)
    nfin = triton.cdiv(G, FB)
    flags = torch.empty(nfin, dtype=torch.int32, device=dev)
    ok = torch.empty(1, dtype=torch.int32, device=dev)
    words = as_words(send)
    rw = layout.row_bytes // 4
    precond = ftab is not None
    if not precond:
        ftab = y_prev  # not read (PRECOND=False): any float32 pointer will do
    with on_device(y_out):
        _compress_kernel[(triton.cdiv(G, R) * T,)](
            src, src_words.view(torch.int16), src_words, tab, ftab, nsegs, float(beta1),
            float(1.0 - beta1), nrecv, numel,
            y_prev, prev_scales, y_out, send, partial, G, nblocks, block, T,
            layout.row_bytes, rw, layout.header_bytes, SRC=src_mode, PRECOND=precond,
            WRITE_Y=write_y, R=R, C=C, WIDE=wide(G, block), num_warps=WARPS, **LAUNCH)
        _finalize_kernel[(nfin,)](partial, words, flags, G, T, nblocks, block, rw, FB=FB,
                                  TT=min(TT, triton.next_power_of_2(T)), **LAUNCH)
        used = layout.header_bytes + chunk // 8
        _status_kernel[(1,)](flags, nfin, ok, words, send, nrows, rw, layout.row_bytes, used,
                             layout.row_bytes - used, FB=FB, **LAUNCH)
    return DeviceFlag(ok)


def worker_compress(x: torch.Tensor, y_prev: torch.Tensor, prev_scales: torch.Tensor,
                    y_out: Optional[torch.Tensor], send: torch.Tensor, layout: Layout
                    ) -> DeviceFlag:
    """:func:`hvd_onebit.kernels.ops.worker_compress` (float32 contiguous tensors, one device)."""
    return _compress(0, x, x, x, 1, 0.0, 1, x.numel(), y_prev, prev_scales, y_out, send,
                     layout.n, layout.chunk, layout)


def worker_compress_momentum(momentum: torch.Tensor, grads: Sequence[Optional[torch.Tensor]],
                             sizes: Sequence[int], beta1: float, y_prev: torch.Tensor,
                             prev_scales: torch.Tensor, y_out: Optional[torch.Tensor],
                             send: torch.Tensor, layout: Layout,
                             variances: Optional[Sequence[torch.Tensor]] = None,
                             sqrt_bc2s: Optional[Sequence[float]] = None,
                             epss: Optional[Sequence[float]] = None,
                             bounds: Optional[Sequence[float]] = None) -> DeviceFlag:
    """Worker compression of ``x = beta1 * momentum + (1 - beta1) * g`` computed in the same
    pass, ``g`` the gradients laid end to end (None reads as zeros); with ``variances`` (one
    float32 per segment, with its ``sqrt_bc2s``, ``epss`` and ``bounds``: a preconditioned
    :class:`~hvd_onebit.kernels.fused_adam.MomentumInput`), of
    ``u = clamp(x / denom, -bound, bound)``,
    ``denom = sqrt(v) * (1 / sqrt_bc2) + eps`` (+inf where ``v == 0``); see
    :func:`hvd_onebit.kernels.backend.in_place`."""
    columns = [[address(g) for g in grads], [kind_code(g) for g in grads],
               aligned_offsets(momentum, grads, sizes)]
    ftab = None
    if variances is not None:
        if len(variances) != len(sizes) or any(
                v is None or v.numel() != s for v, s in zip(variances, sizes)):
            raise ValueError("preconditioning needs one variance of its segment's size per "
                             "gradient")
        columns += [aligned_offsets(momentum, variances, sizes), [address(v) for v in variances]]
        bounds = [math.inf] * len(sizes) if bounds is None else bounds
        inverses = [inverse_root_bc2(s) for s in sqrt_bc2s]
        ftab = device_table(tuple(float(v) for row in zip(inverses, epss, bounds) for v in row),
                            torch.float32, momentum.device)
    tab = segment_table(columns, sizes, momentum.device)
    return _compress(1, momentum, momentum, tab, len(sizes), beta1, 1, momentum.numel(), y_prev,
                     prev_scales, y_out, send, layout.n, layout.chunk, layout, ftab)


def server_compress(recv: torch.Tensor, z_prev: torch.Tensor, prev_scales: torch.Tensor,
                    z_out: Optional[torch.Tensor], out_row: torch.Tensor, layout: Layout
                    ) -> DeviceFlag:
    """:func:`hvd_onebit.kernels.ops.server_compress`: the n rows averaged, compressed, one pass."""
    return _compress(2, recv, as_words(recv), z_prev, 1, 0.0, layout.n, layout.chunk, z_prev,
                     prev_scales, z_out, out_row, 1, layout.chunk, layout)
