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
(native C++ on CPU, Triton on CUDA) has a torch reference in
:mod:`~hvd_onebit.kernels.fused_reference` (:meth:`MomentumInput.materialize`,
:meth:`AdamUpdate.apply`) giving the same bits on every device; which one runs is
:func:`~hvd_onebit.kernels.backend.pick`'s choice.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..dtypes import FLOAT_DTYPES
from ..layout import Layout
from . import ops
from .backend import in_place, native_module, native_ready, pick, triton_module
from .fused_reference import apply_update, frozen_denominator, materialize_momentum
from .fused_terms import MomentumTerms, UpdateTerms


# ---- prologue: the momentum update, computed inside the worker compression ----------------------------

class MomentumInput(MomentumTerms):
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

    def native_ready(self) -> bool:
        """Whether the native kernel can read every tensor in place (fp32, contiguous, CPU)."""
        return native_ready([self.momentum, *self.grads, *(self.variances or [])])

    def materialize(self, out: Optional[torch.Tensor] = None,
                    backend: str = "torch") -> torch.Tensor:
        """x as float32 [numel], or written into ``out`` (any float dtype, must not alias the
        momentum) and returned as ``out``. With ``backend="torch"`` (default) the torch
        reference of the fused prologue; "native" or "auto" computes it in one native pass where
        every tensor can be read in place (the same bits)."""
        if out is not None and out.dtype != torch.float32:
            return out.copy_(self.materialize())
        if pick(backend, self.momentum.device, native=lambda: self.native_ready() and (
                out is None or native_ready([out]))) == "native":
            if out is None:
                out = torch.empty_like(self.momentum)
            native_module().momentum_update(self.momentum, self.grads, self.sizes,
                                            float(self.beta1), *self.native_precondition_args(),
                                            out.view(-1), True)
            return out
        return materialize_momentum(self, out)

    def compress(self, y_prev: torch.Tensor, prev_scales: torch.Tensor, y_out: torch.Tensor,
                 send: torch.Tensor, layout: Layout, backend: str = "auto") -> bool:
        """The collective's hook: :func:`worker_compress_momentum` of this input."""
        return worker_compress_momentum(self, y_prev, prev_scales, y_out, send, layout, backend)


def worker_compress_momentum(src: MomentumInput, y_prev: torch.Tensor, prev_scales: torch.Tensor,
                             y_out: torch.Tensor, send: torch.Tensor, layout: Layout,
                             backend: str = "auto") -> bool:
    """:func:`~hvd_onebit.kernels.ops.worker_compress` of ``x = src.materialize()``, with x
    computed in the same pass where the native or Triton kernel can read every tensor in
    place."""
    device = src.momentum.device
    impl = pick(backend, device, native=src.native_ready, triton=lambda: (
        layout.padded > 0 and in_place([src.momentum, *(src.variances or [])], device)
        and in_place(src.grads, device, FLOAT_DTYPES)))
    if impl == "native":
        return native_module().worker_compress_momentum(
            src.momentum, src.grads, src.sizes, float(src.beta1), *src.native_precondition_args(),
            y_prev, prev_scales, y_out, send, *layout.as_args(), True)
    if impl == "triton":
        return triton_module().worker_compress_momentum(
            src.momentum, src.grads, src.sizes, float(src.beta1), y_prev, prev_scales, y_out, send,
            layout, src.variances, src.sqrt_bc2s, src.eps, src.bounds)
    # the torch twin of the prologue, then whichever compression runs on x
    return ops.worker_compress(src.materialize(), y_prev, prev_scales, y_out, send, layout,
                               backend)


# ---- epilogue: Adam's update, applied in the decode pass ----------------------------------------------

class AdamUpdate(UpdateTerms):
    """Adam's use of the averaged momentum ``m``, to fuse into the decode pass that writes it.

    For every parameter given (None entries are left to the caller), with ``v`` its frozen
    variance: ``denom = sqrt(v) * (1 / sqrt_bc2) + eps`` (``+inf`` where ``v == 0``), computed in
    the pass itself (fp32, in this order, the root correctly rounded, ``1 / sqrt_bc2`` once per
    parameter: :func:`~hvd_onebit.kernels.fused_reference.inverse_root_bc2`); ``w = w * decay``
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

    def native_ready(self) -> bool:
        """Whether the native kernel can update every tensor in place (fp32, contiguous, CPU)."""
        return native_ready([*self.weights, *self.variances])

    def denominator(self, i: int, lo: int = 0, hi: Optional[int] = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` of parameter ``i``'s denominator, float32 (a fresh tensor,
        :func:`frozen_denominator`)."""
        return frozen_denominator(self.variances[i].reshape(-1)[lo:hi], self.sqrt_bc2s[i],
                                  self.eps[i])

    def apply(self, m: torch.Tensor) -> None:
        """The update with torch ops, ``m``: the decoded momentum [numel]. The torch reference
        of the fused epilogue (:func:`~hvd_onebit.kernels.fused_reference.apply_update`), in
        slices of ``APPLY_SLICE`` elements whatever the parameter's size."""
        apply_update(self, m)

    def copy_apply(self, src: torch.Tensor, out: torch.Tensor, backend: str = "auto") -> None:
        """``out.copy_(src)`` then :meth:`apply` to ``out``, in one pass where the native kernel
        can (``src``, ``out``: float32 [numel]; ``src`` may be ``out``). The collective's hook for
        an output that arrives decoded (the hierarchical collective's gathered shards)."""
        src = src.reshape(-1)
        if pick(backend, out.device, native=lambda: self.native_ready() and native_ready(
                [src, out]) and out.is_contiguous()) == "native":
            native_module().update(src, out.view(-1), *self.native_args(), True)
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
    """:func:`~hvd_onebit.kernels.ops.decode` into ``out`` (the momentum, float32 [numel]), then
    ``update`` in the same pass where the native kernel can."""
    device = rows.device
    impl = pick(backend, device, native=lambda: (
        update.native_ready() and out.dtype == torch.float32), triton=lambda: (
        layout.padded > 0 and out.dtype == torch.float32
        # the rows are uint8: checked apart, or the float32 check would refuse every call
        and in_place([rows], device, (torch.uint8,))
        and in_place([out, *update.variances], device)
        and in_place(update.weights, device, FLOAT_DTYPES)))
    if impl == "native":
        native_module().decode_update(rows, out, *update.native_args(), *layout.as_args(), True)
    elif impl == "triton":
        triton_module().decode(rows, out, layout, update.weights, update.variances, update.sizes,
                               update.steps, update.decays, update.sqrt_bc2s, update.eps,
                               update.bounds, update.preconditioned)
    else:  # the decode that runs here, then the torch twin of the update
        ops.decode(rows, out, layout, backend)
        update.apply(out)
