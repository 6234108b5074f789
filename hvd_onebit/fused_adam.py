"""Adam's work fused into the 1-bit allreduce's own passes over memory: a prologue and an epilogue.

In the compression phase a step reads the momentum twice and the weights once. Done as separate
passes, Adam's arithmetic would cost as much memory traffic as the compression itself, so it rides
along in the collective's passes:

* **prologue** (:class:`MomentumInput`): the allreduce's input ``x = beta1 * m + (1 - beta1) * g``
  is computed inside the worker compression (:func:`worker_compress_momentum`), never stored.
* **epilogue** (:class:`AdamUpdate`): the decode pass that writes the averaged momentum also
  applies Adam's update, its denominators computed from the frozen variance in the same pass
  (:func:`decode_update`): no parameter-sized copy of them is kept.

:class:`~hvd_onebit.comm.flat.OneBitAllreduce` knows neither: it takes them through its generic
hooks (``InputProducer`` and ``Epilogue`` in :mod:`hvd_onebit.comm.protocol`). Each fused kernel
(native C++ on CPU, Triton on CUDA) has a torch reference beside it
(:meth:`MomentumInput.materialize`, :meth:`AdamUpdate.apply`) giving the same bits on every
device: separate fp32 ``mul``, ``div`` and ``add``, no FMA, as the native code is built with
``-ffp-contract=off`` and the Triton kernels are launched with ``enable_fp_fusion=False``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import kernels
from .layout import Layout
from .step_bound import as_float32


#: Elements per slice of :meth:`AdamUpdate.apply` (the torch reference): bounds its temporaries.
APPLY_SLICE = 1 << 20


def frozen_denominator(v: torch.Tensor, sqrt_bc2: float, eps: float) -> torch.Tensor:
    """Adam's denominator from a frozen variance ``v`` (float32, any shape): a fresh float32
    tensor ``sqrt(v) / sqrt_bc2 + eps``, ``+inf`` where ``v == 0`` (an element held fixed). The
    torch reference of what the fused kernels compute in their passes, correctly rounded on
    every device: torch's float32 sqrt on CPU is MKL's (not always correctly rounded, unlike
    the kernels'), a float64 root rounded to float32 is; the division is by a float32 tensor
    (:func:`~hvd_onebit.kernels.exact_div`)."""
    root = torch.sqrt(v.double()).float()
    d = kernels.exact_div(root, float(sqrt_bc2)).add_(float(eps))
    return d.masked_fill_(v == 0, math.inf)


# ---- prologue: the momentum update, computed inside the worker compression ----------------------------

@dataclass
class MomentumInput:
    """An allreduce input given as Adam's momentum update, ``x = beta1 * m + (1 - beta1) * g``.

    The native worker compression computes x inside its own pass (the momentum update costs no
    pass over memory of its own); elsewhere :meth:`materialize` computes it with torch ops that
    give the same bits (two fp32 products and a sum, no FMA). An ``InputProducer`` of
    :mod:`hvd_onebit.comm.protocol`.

    With ``variances`` the input is **preconditioned**: ``u = clamp(x / denom, -bound, bound)``,
    ``denom`` the frozen variance's Adam denominator (:func:`frozen_denominator`; ``+inf`` where
    ``v == 0``, so held elements give +-0; an infinite ``u`` is left infinite, so a non-finite
    input is still reported and the step skipped). The clamp (``bound = B(t) * bc1``, Adam's own bound
    on ``|m| / sqrt(v)`` at step t, :mod:`hvd_onebit.step_bound`) keeps each rank's momentum
    where Adam's could be given the frozen variance: without it, the few elements whose
    gradient outgrew their frozen variance set the chunk's scale (a root mean square), and every
    element of the chunk would receive it. Every rank divides by the same bits, so averaging u is averaging x; one
    scale per chunk then serves elements of any variance alike (in x, a small-variance
    element would receive the chunk's large magnitude and step far), and the error feedback
    works in the units the update uses. :class:`AdamUpdate` with ``preconditioned=True``
    takes the average back (``m = u * denom``).

    Attributes:
        momentum: float32 [numel], contiguous: the fused exp_avg (read only).
        grads: one gradient per segment, float32, laid end to end in ``momentum``'s order;
            None reads as zeros (a parameter without a gradient on this rank).
        sizes: elements of each segment; they sum to numel.
        beta1: Adam's first-moment decay.
        variances: None (x itself), or each segment's frozen ``exp_avg_sq`` (float32, its size).
        sqrt_bc2s, eps: with ``variances``, per segment (as :class:`AdamUpdate`'s).
        bounds: with ``variances``, per segment, the largest ``|u|`` sent (default ``inf``);
            rounded to float32 here, so every kernel clamps at one number.
    """

    momentum: torch.Tensor
    grads: list[Optional[torch.Tensor]]
    sizes: list[int]
    beta1: float
    variances: Optional[list[torch.Tensor]] = None
    sqrt_bc2s: Optional[Sequence[float]] = None
    eps: Optional[Sequence[float]] = None
    bounds: Optional[Sequence[float]] = None

    def __post_init__(self):
        if self.variances is not None:
            self.bounds = ([math.inf] * len(self.sizes) if self.bounds is None
                           else [as_float32(float(b)) for b in self.bounds])
            if any(not b >= 0 for b in self.bounds):
                raise ValueError(f"input bounds must be >= 0, got {self.bounds}")

    def native_precondition_args(self) -> tuple:
        """(variances, sqrt_bc2s, eps, bounds) as the native kernels take them: empty lists when
        the input is not preconditioned."""
        if self.variances is None:
            return [], [], [], []
        return (list(self.variances), [float(b) for b in self.sqrt_bc2s],
                [float(e) for e in self.eps], [float(b) for b in self.bounds])

    @property
    def like(self) -> torch.Tensor:
        """A tensor of x's size, dtype and device (the momentum): the output is shaped like it."""
        return self.momentum

    def native_ready(self) -> bool:
        """Whether the native kernel can read every tensor in place (fp32, contiguous, CPU)."""
        return kernels.native_ready([self.momentum, *self.grads, *(self.variances or [])])

    def materialize(self, out: Optional[torch.Tensor] = None,
                    backend: str = "torch") -> torch.Tensor:
        """x as float32 [numel], or written into ``out`` (any float dtype, must not alias the
        momentum) and returned as ``out``. With ``backend="torch"`` (default) the torch
        reference of the fused prologue; "native" or "auto" computes it in one native pass where
        every tensor can be read in place (the same bits)."""
        if out is not None and out.dtype != torch.float32:
            return out.copy_(self.materialize())
        if (kernels.resolve_backend(backend, self.momentum.device) == "native"
                and self.native_ready() and (out is None or kernels.native_ready([out]))):
            if out is None:
                out = torch.empty_like(self.momentum)
            kernels.native_module().momentum_update(self.momentum, self.grads, self.sizes,
                                                    float(self.beta1),
                                                    *self.native_precondition_args(),
                                                    out.view(-1), True)
            return out
        out = torch.mul(self.momentum.reshape(-1).float(), self.beta1, out=out)
        start = 0
        for i, (g, size) in enumerate(zip(self.grads, self.sizes)):
            seg = out[start:start + size]
            if g is None:
                seg.add_(0.0)  # the kernel adds (1 - beta1) * 0; -0.0 becomes +0.0 as it does there
            else:
                seg.add_(torch.mul(g.reshape(-1).float(), 1 - self.beta1))
            if self.variances is not None:  # x / denom, in slices that bound the temporaries
                v = self.variances[i].reshape(-1)
                for lo in range(0, size, APPLY_SLICE):
                    hi = min(size, lo + APPLY_SLICE)
                    piece = seg[lo:hi].div_(frozen_denominator(v[lo:hi], float(self.sqrt_bc2s[i]),
                                                               float(self.eps[i])))
                    if self.bounds[i] != math.inf:  # clamp_ keeps a NaN, as the kernels do;
                        # an infinite u stays infinite, so the input is reported not finite
                        up, down = piece == math.inf, piece == -math.inf
                        piece.clamp_(-self.bounds[i], self.bounds[i])
                        piece.masked_fill_(up, math.inf).masked_fill_(down, -math.inf)
            start += size
        return out

    def compress(self, y_prev: torch.Tensor, prev_send: torch.Tensor, y_out: torch.Tensor,
                 send: torch.Tensor, layout: Layout, backend: str = "auto") -> bool:
        """The collective's hook: :func:`worker_compress_momentum` of this input."""
        return worker_compress_momentum(self, y_prev, prev_send, y_out, send, layout, backend)


def worker_compress_momentum(src: MomentumInput, y_prev: torch.Tensor, prev_send: torch.Tensor,
                             y_out: torch.Tensor, send: torch.Tensor, layout: Layout,
                             backend: str = "auto") -> bool:
    """:func:`~hvd_onebit.kernels.worker_compress` of ``x = src.materialize()``, with x computed
    in the same pass where the native kernel can read every tensor in place."""
    resolved = kernels.resolve_backend(backend, src.momentum.device)
    if resolved == "native" and src.native_ready():
        return kernels.native_module().worker_compress_momentum(
            src.momentum, src.grads, src.sizes, float(src.beta1), *src.native_precondition_args(),
            y_prev, prev_send, y_out, send, *layout.as_args(), True)
    if resolved == "triton" and layout.padded > 0:
        tk = kernels.triton_module()
        if (tk.ready([src.momentum, *(src.variances or [])], src.momentum.device)
                and tk.ready(src.grads, src.momentum.device, tk.LOW_PRECISION)):
            return tk.worker_compress_momentum(src.momentum, src.grads, src.sizes,
                                               float(src.beta1), y_prev, prev_send, y_out, send,
                                               layout, src.variances, src.sqrt_bc2s, src.eps,
                                               src.bounds)
    return kernels.worker_compress(src.materialize(), y_prev, prev_send, y_out, send, layout,
                                   backend)


# ---- epilogue: Adam's update, applied in the decode pass ----------------------------------------------

@dataclass
class AdamUpdate:
    """Adam's use of the averaged momentum ``m``, to fuse into the decode pass that writes it.

    For every parameter given (None entries are left to the caller), with ``v`` its frozen
    variance: ``denom = sqrt(v) / sqrt_bc2 + eps`` (``+inf`` where ``v == 0``), computed in the
    pass itself (fp32, in this order, sqrt and division correctly rounded); ``w = w * decay``
    when ``decay != 1`` (AdamW's decoupled decay), then
    ``w = w + clamp((step * m) / denom, -bound, bound)`` (``step = -lr / bias_correction1``;
    ``bound``: the step bound of :mod:`hvd_onebit.step_bound`, ``inf`` for none), in the operation
    order of torch's ``w.mul_(decay)`` and ``w.addcdiv_(m, denom, value=step)`` on CPU. An element whose denominator is ``+inf`` is held
    fixed: the update adds +-0 and its momentum is set to +0 afterwards (how the optimizer keeps
    elements whose frozen variance is 0 out of training). An ``Epilogue`` of
    :mod:`hvd_onebit.comm.protocol`.

    Attributes:
        weights: each parameter's data, laid end to end in ``m``'s order (None = not here);
            float16/bfloat16 weights are updated in float32 and rounded once.
        variances: the frozen ``exp_avg_sq`` of each weight, float32, same shape (None with its
            weight); read only.
        sizes: elements of each parameter; they sum to m's numel.
        steps, decays: per parameter.
        sqrt_bc2s: per parameter, ``sqrt(1 - beta2 ** frozen_step)`` (default 1.0).
        eps: per parameter, Adam's eps (default 0.0).
        bounds: per parameter, the largest ``|(step * m) / denom|`` applied, >= 0 (default
            ``inf``: unbounded); rounded to float32 here, so every kernel clamps at one number.
        preconditioned: the momentum given is ``u = m / denom`` (a preconditioned
            :class:`MomentumInput`'s average): ``m = u * denom`` is stored (+0 where held) and
            the step is ``clamp(step * u, -bound, bound)`` (+0 where held). A parameter may
            then have a variance and no weight: its momentum is converted, nothing updated.
    """

    weights: list[Optional[torch.Tensor]]
    variances: list[Optional[torch.Tensor]]
    sizes: list[int]
    steps: list[float]
    decays: list[float]
    sqrt_bc2s: Optional[Sequence[float]] = None
    eps: Optional[Sequence[float]] = None
    bounds: Optional[Sequence[float]] = None
    preconditioned: bool = False

    def __post_init__(self):
        if self.sqrt_bc2s is None:
            self.sqrt_bc2s = [1.0] * len(self.sizes)
        if self.eps is None:
            self.eps = [0.0] * len(self.sizes)
        if self.bounds is None:
            self.bounds = [math.inf] * len(self.sizes)
        else:
            self.bounds = [as_float32(float(b)) for b in self.bounds]
            if any(not b >= 0 for b in self.bounds):
                raise ValueError(f"step bounds must be >= 0, got {self.bounds}")

    def native_ready(self) -> bool:
        """Whether the native kernel can update every tensor in place (fp32, contiguous, CPU)."""
        return kernels.native_ready([*self.weights, *self.variances])

    def native_args(self) -> tuple:
        """(weights, variances, sizes, steps, decays, sqrt_bc2s, eps, bounds, preconditioned)
        as the native kernels take them: the scalars as Python floats, one per parameter."""
        return (self.weights, self.variances, self.sizes, [float(s) for s in self.steps],
                [float(d) for d in self.decays], [float(b) for b in self.sqrt_bc2s],
                [float(e) for e in self.eps], [float(b) for b in self.bounds],
                bool(self.preconditioned))

    def denominator(self, i: int, lo: int = 0, hi: Optional[int] = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` of parameter ``i``'s denominator, float32 (a fresh tensor,
        :func:`frozen_denominator`)."""
        return frozen_denominator(self.variances[i].reshape(-1)[lo:hi], self.sqrt_bc2s[i],
                                  self.eps[i])

    def apply(self, m: torch.Tensor) -> None:
        """The update with torch ops, ``m``: the decoded momentum [numel]. The torch reference
        of the fused epilogue. Works through each parameter in slices of ``APPLY_SLICE``
        elements, so its temporaries (the denominator, the update, a float32 copy of a
        low-precision weight) stay small whatever the parameter's size."""
        flat = m.reshape(-1)
        start = 0
        for i, (w, size, step, decay, bound) in enumerate(zip(self.weights, self.sizes, self.steps,
                                                              self.decays, self.bounds)):
            if w is not None or (self.preconditioned and self.variances[i] is not None):
                # in m's (row-major) order; a copy only for a non-contiguous (channels-last) weight
                w_flat = w.reshape(-1) if w is not None else None
                for lo in range(0, size, APPLY_SLICE):
                    hi = min(size, lo + APPLY_SLICE)
                    self._apply_slice(flat[start + lo:start + hi], w, w_flat, i, lo, hi, step,
                                      decay, bound)
                if w is not None and not w.is_contiguous():
                    w.copy_(w_flat.view(w.shape))
            start += size

    def _apply_slice(self, m_here: torch.Tensor, w: Optional[torch.Tensor],
                     w_flat: Optional[torch.Tensor], i: int, lo: int, hi: int, step: float,
                     decay: float, bound: float) -> None:
        """:meth:`apply` on elements ``[lo, hi)`` of parameter ``i`` (``m_here``: theirs)."""
        d = self.denominator(i, lo, hi)
        held = d == math.inf
        if self.preconditioned:  # m_here holds u: the step from u, then m = u * denom
            q = torch.mul(m_here, step) if w is not None else None
        else:  # (step * m) / d: the CPU's addcdiv_ order. CUDA's addcdiv_ computes
            # w + step * (m / d) and contracts it into an FMA: other bits.
            q = torch.mul(m_here, step).div_(d)
        if q is not None:
            if bound != math.inf:  # clamp_ keeps a NaN step NaN, as the kernels do
                q.clamp_(-bound, bound)
            if self.preconditioned:
                q.masked_fill_(held, 0.0)
            # float16/bfloat16 weights: the update in float32, rounded once
            w_here = w_flat[lo:hi]
            target = w_here if w.dtype == m_here.dtype else w_here.float()
            if decay != 1.0:
                target.mul_(decay)
            target.add_(q)
            if target is not w_here:
                w_here.copy_(target)
        if self.preconditioned:
            m_here.mul_(d)
        m_here.masked_fill_(held, 0.0)

    def copy_apply(self, src: torch.Tensor, out: torch.Tensor, backend: str = "auto") -> None:
        """``out.copy_(src)`` then :meth:`apply` to ``out``, in one pass where the native kernel
        can (``src``, ``out``: float32 [numel]; ``src`` may be ``out``). The collective's hook for
        an output that arrives decoded (the hierarchical collective's gathered shards)."""
        src = src.reshape(-1)
        if (kernels.resolve_backend(backend, out.device) == "native" and self.native_ready()
                and kernels.native_ready([src, out]) and out.is_contiguous()):
            kernels.native_module().update(src, out.view(-1), *self.native_args(), True)
            return
        if src.data_ptr() != out.data_ptr():
            out.view(-1).copy_(src)
        self.apply(out)

    def decode_into(self, rows: torch.Tensor, out: torch.Tensor, layout: Layout,
                    backend: str = "auto") -> None:
        """The collective's hook: :func:`decode_update` with this update."""
        decode_update(rows, out, layout, self, backend)


def decode_update(rows: torch.Tensor, out: torch.Tensor, layout: Layout, update: AdamUpdate,
                  backend: str = "auto") -> None:
    """:func:`~hvd_onebit.kernels.decode` into ``out`` (the momentum, float32 [numel]), then
    ``update`` in the same pass where the native kernel can."""
    resolved = kernels.resolve_backend(backend, rows.device)
    if resolved == "native" and update.native_ready() and out.dtype == torch.float32:
        kernels.native_module().decode_update(rows, out, *update.native_args(),
                                              *layout.as_args(), True)
        return
    if resolved == "triton" and layout.padded > 0 and out.dtype == torch.float32:
        tk = kernels.triton_module()
        # the rows are uint8: checked apart, or the float32 check would refuse every call
        if (tk.ready([rows], rows.device, (torch.uint8,))
                and tk.ready([out, *update.variances], rows.device)
                and tk.ready(update.weights, rows.device, tk.LOW_PRECISION)):
            tk.decode(rows, out, layout, update.weights, update.variances, update.sizes,
                      update.steps, update.decays, update.sqrt_bc2s, update.eps, update.bounds,
                      update.preconditioned)
            return
    kernels.decode(rows, out, layout, backend)
    update.apply(out)
