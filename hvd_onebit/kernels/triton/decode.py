"""The decode in Triton: ``s * sign`` from the n rows, optionally with Adam's update applied
in the same pass (see :class:`hvd_onebit.kernels.fused_adam.AdamUpdate`)."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from ...layout import Layout
from ..fused_reference import inverse_root_bc2
from .device import (NOT_ALIGNED, first_segment, frozen_denominator, load_aligned_as_f32,
                     load_as_f32, store_aligned_from_f32, store_from_f32, tile)
from .launch import (LAUNCH, WARPS, address, aligned_offsets, as_words, device_table, geometry,
                     kind_code, on_device, segment_table, wide)


@triton.jit
def _update(d, w, v, here, kind, seg, tab_ptr, ftab_ptr, nsegs, PRECOND: tl.constexpr):
    """One segment's Adam update on its elements ``here``: ``(d, w)`` after it (see
    :func:`_decode_kernel`); ``w`` reads as zeros, and is not to be stored, where kind is 0."""
    den = frozen_denominator(v, tl.load(ftab_ptr + 5 * seg + 2), tl.load(ftab_ptr + 5 * seg + 3))
    held = den == float("inf")
    # the step bound: where/compare rather than min/max, so a NaN step stays NaN
    bound = tl.load(ftab_ptr + 5 * seg + 4)
    if PRECOND:
        if kind != 0:
            if tl.load(tab_ptr + 4 * nsegs + 1 + seg) != 0:
                w = w * tl.load(ftab_ptr + 5 * seg + 1)
            q = tl.load(ftab_ptr + 5 * seg) * d
            q = tl.where(q < -bound, -bound, tl.where(q > bound, bound, q))
            w = w + tl.where(held, 0.0, q)  # +0: a held weight only decays
        # m = u * denom, once the step has read u; +0 where held (d * inf is +-inf or NaN there)
        d = tl.where(here, tl.where(held, 0.0, d * den), d)
    else:
        if tl.load(tab_ptr + 4 * nsegs + 1 + seg) != 0:
            w = w * tl.load(ftab_ptr + 5 * seg + 1)
        q = tl.div_rn(tl.load(ftab_ptr + 5 * seg) * d, den)
        q = tl.where(q < -bound, -bound, tl.where(q > bound, bound, q))
        w = w + q
        d = tl.where(here & held, 0.0, d)
    return d, w


@triton.jit
def _decode_kernel(rows_ptr, words_ptr, m_ptr, m_h_ptr, numel, G, nblocks, block, T, row_bytes,
                   row_words, hb, tab_ptr, ftab_ptr, nsegs,
                   UPDATE: tl.constexpr, PRECOND: tl.constexpr, R: tl.constexpr, C: tl.constexpr,
                   WIDE: tl.constexpr):
    """m[p] = d = +-s for p < numel; with UPDATE, for segments with a variance v:
    denom = sqrt(v) * (1 / sqrt_bc2) + eps (+inf where v == 0: held), and
    - not PRECOND (every such segment has a weight): w = w * decay (if flagged),
      w = w + clamp((step * d) / denom, -bound, bound), m = held ? +0 : d;
    - PRECOND (d is u = m / denom): m = held ? +0 : d * denom and, if the segment has a weight,
      w = w * decay (if flagged), w = w + (held ? +0 : clamp(step * d, -bound, bound)).
    Table columns: weight address, variance address, weight kind, decay flag, then the
    variance's and the weight's aligned offsets from m (``m_h``: m as int16)."""
    pid = tl.program_id(0)
    t, gb, o, gb_ok, tile_valid, p, p_lo, p_hi, j, b = tile(pid, G, block, nblocks, T, R, C, WIDE)
    valid = tile_valid & (p < numel)
    whole = p_hi <= numel  # every element of the tile is real: unmasked by numel, vector stores
    shift = (tl.arange(0, C) % 8).to(tl.uint8)[None, :]
    s = tl.load(words_ptr + j.to(tl.int64) * row_words + 1 + b, mask=gb_ok, other=0.0)[:, None]
    bytes_at = (j.to(tl.int64) * row_bytes + hb + b.to(tl.int64) * (block // 8))[:, None] + \
        (o // 8)[None, :]
    bits = tl.load(rows_ptr + bytes_at, mask=valid, other=0)
    d = tl.where(((bits >> shift) & 1) != 0, s, -s)
    if UPDATE:
        starts = tab_ptr
        p_hi = tl.minimum(p_hi, numel)
        seg = first_segment(starts, nsegs, p_lo)
        # the usual tile: inside one segment with a variance, its tensors at aligned offsets
        qv = tl.load(tab_ptr + 5 * nsegs + 1 + seg)
        qw = tl.load(tab_ptr + 6 * nsegs + 1 + seg)
        one = (whole & (tl.load(starts + seg) <= p_lo) & (p_hi <= tl.load(starts + seg + 1))
               & (tl.load(tab_ptr + 2 * nsegs + 1 + seg) != 0) & (qv != NOT_ALIGNED)
               & (qw != NOT_ALIGNED))
        if one:
            kind = tl.load(tab_ptr + 3 * nsegs + 1 + seg)  # the weight's; 0: none
            v = tl.load((m_ptr + qv * 4) + p, mask=tile_valid, other=1.0)
            w = load_aligned_as_f32(m_ptr, m_h_ptr, qw, p, tile_valid, kind)
            d, w = _update(d, w, v, tile_valid, kind, seg, tab_ptr, ftab_ptr, nsegs, PRECOND)
            store_aligned_from_f32(m_ptr, m_h_ptr, qw, p, w, tile_valid, kind)
            more = False
        else:
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
                w = load_as_f32(w_addr, off, here, kind)
                d, w = _update(d, w, v, here, kind, seg, tab_ptr, ftab_ptr, nsegs, PRECOND)
                store_from_f32(w_addr, off, w, here, kind)
            seg += 1
            more = (seg < nsegs) & (en < p_hi)
    if whole:
        tl.store(m_ptr + p, d, mask=tile_valid)
    else:
        tl.store(m_ptr + p, d, mask=valid)


def decode(rows: torch.Tensor, out: torch.Tensor, layout: Layout,
           weights: Optional[Sequence[Optional[torch.Tensor]]] = None,
           variances: Optional[Sequence[Optional[torch.Tensor]]] = None,
           sizes: Optional[Sequence[int]] = None, steps: Optional[Sequence[float]] = None,
           decays: Optional[Sequence[float]] = None, sqrt_bc2s: Optional[Sequence[float]] = None,
           epss: Optional[Sequence[float]] = None,
           bounds: Optional[Sequence[float]] = None, preconditioned: bool = False) -> None:
    """out[:numel] = s * sign from the n rows; with ``weights`` (AdamUpdate's lists), Adam's
    update in the same pass (see :class:`hvd_onebit.kernels.fused_adam.AdamUpdate`).
    ``preconditioned``:
    the rows carry ``u = m / denom``; ``m = u * denom`` is stored (+0 where held), the step is
    ``clamp(step * u, -bound, bound)`` (+0 where held), and a variance without its weight
    converts its momentum only."""
    numel = out.numel()
    if numel == 0:
        return
    block, nblocks = layout.block, layout.nblocks
    G = layout.n * nblocks
    R, C, T = geometry(block)
    update = weights is not None
    if update:
        live = [w is not None and w.numel() > 0 for w in weights]
        if any(k and v is None for v, k in zip(variances, live)):
            raise ValueError("every weight given needs its variance")
        # the segments the kernel visits are those with a variance address: with a weight, or
        # preconditioned also without one (its momentum converted); unread variances are left out
        read_v = [(k or preconditioned) and v is not None for v, k in zip(variances, live)]
        read_w = [w if k else None for w, k in zip(weights, live)]
        read_vs = [v if r else None for v, r in zip(variances, read_v)]
        tab = segment_table([[address(w) for w in read_w], [address(v) for v in read_vs],
                             [kind_code(w) for w in read_w],
                             [int(float(dc) != 1.0) for dc in decays],
                             aligned_offsets(out, read_vs, sizes),
                             aligned_offsets(out, read_w, sizes)], sizes, out.device)
        bounds = [math.inf] * len(sizes) if bounds is None else bounds
        inverses = [inverse_root_bc2(s) for s in sqrt_bc2s]
        ftab = device_table(tuple(float(v) for row in zip(steps, decays, inverses, epss, bounds)
                                  for v in row), torch.float32, out.device)
        nsegs = len(sizes)
    else:
        tab, ftab, nsegs = out, out, 1
    with on_device(out):
        _decode_kernel[(triton.cdiv(G, R) * T,)](
            rows, as_words(rows), out, out.view(torch.int16), numel, G, nblocks, block, T, layout.row_bytes,
            layout.row_bytes // 4, layout.header_bytes, tab, ftab, nsegs, UPDATE=update,
            PRECOND=update and bool(preconditioned), R=R, C=C, WIDE=wide(G, block),
            num_warps=WARPS, **LAUNCH)
