"""Triton kernels for CUDA tensors: the sign-compression kernels and Adam's fused passes.

The same arithmetic and the same bits as the native kernels (``kernels/csrc/onebit_kernels.cpp``)
and their torch twins (:mod:`hvd_onebit.kernels.reference`,
:mod:`hvd_onebit.kernels.fused_reference`), one pass over memory per fused operation. Imported
lazily (only once a "triton" backend is resolved), because
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

The modules: :mod:`.device` (the device helpers the kernels share), :mod:`.launch` (the host side
they share), :mod:`.compress` (worker and server compressions), :mod:`.decode` (decode, with
Adam's update). Callers use the names below, looked up here at each call (tests count them).
"""
from .compress import server_compress, worker_compress, worker_compress_momentum
from .decode import decode
from .launch import INTERPRETED, DeviceFlag

__all__ = ["INTERPRETED", "DeviceFlag", "decode", "server_compress", "worker_compress",
           "worker_compress_momentum"]
