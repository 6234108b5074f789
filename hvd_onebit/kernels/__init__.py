"""Sign-compression kernels: worker compress, server average-and-recompress, decode; and Adam's
passes fused into them (:mod:`.fused_adam`).

Three implementations with the same arguments and the same bits:

* ``native``: fused C++ (``hvd_onebit._C``, built from ``kernels/csrc/onebit_kernels.cpp``; AVX2
  where the CPU has it), CPU tensors only. This is what makes 1-bit Adam pay off on CPU:
  torch-eager sign compression takes several passes over memory per element where the fused
  kernel takes one, so it runs far below memory speed and would eat the bandwidth it saves
  (``hvd-onebit bench dev kernel`` compares the two).
* ``triton``: the same fused passes for CUDA tensors (:mod:`.triton`, imported only when picked);
  CPU tensors too under Triton's interpreter (``TRITON_INTERPRET=1``), for tests.
* ``torch``: plain tensor ops (:mod:`.reference`, :mod:`.fused_reference`), for any device and as
  the reference the others are tested against.

Which one runs a call is decided in one place, :mod:`.backend` (``resolve_backend``, ``pick``);
:mod:`.ops` holds the three kernels as callers see them, :mod:`.rows` the wire rows as tensors.

New rows go to a separate buffer; y (z) is updated in place or not stored (``y_out=None``), so a
caller can send the rows first and store y only once the call has succeeded on every rank (see
:class:`hvd_onebit.OneBitAllreduce`): a failed call changes nothing. Both error-feedback buffers
are stored factored: the last call's ``y`` (or server ``z``) and the scales of the rows it sent
(the signs sent were y's own, so they are read back from y), from which ``e = y - s * sign(y)``
is rebuilt inside the next compression (:func:`worker_error` and :func:`server_error` materialise
it). Each compression is then one pass over the data instead of two, and the error costs one
scale per block beyond y.
"""
from .backend import (BACKENDS, _triton_interpreted, in_place, native_available, native_module,
                      native_ready, pick, resolve_backend, triton_available, triton_module)
from .denominators import denominators, divide_by_denominators, refresh_moments
from .ops import decode, rescale_error, server_compress, worker_compress
from .reference import exact_div, server_error, worker_error
from .rows import pack_signs, row_scales, row_status, unpack_signs

__all__ = ["BACKENDS", "decode", "denominators", "divide_by_denominators", "exact_div", "in_place", "native_available", "native_module", "native_ready", "pack_signs", "pick",
           "refresh_moments", "rescale_error", "resolve_backend", "row_scales", "row_status",
           "server_compress", "server_error", "triton_available",
           "triton_module", "unpack_signs", "worker_compress", "worker_error"]
