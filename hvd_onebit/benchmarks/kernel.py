"""Compression-kernel throughput, as a ratio to ``torch.add(x, e, out=y)`` in the same process.

``torch.add`` reads two fp32 arrays and writes one: the memory-speed yardstick. A kernel whose
ratio is near 1 costs about as much as one extra pass over the momentum; the sign compression in
plain torch ops runs an order of magnitude slower, which is what the native kernels fix.
"""
from __future__ import annotations

import statistics
import time

import torch

from .. import kernels
from ..layout import Layout


def _rate(fn, numel: int, repeats: int) -> float:
    """Median elements per second of ``fn`` over ``repeats`` runs (after one warm-up run)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return numel / statistics.median(times)


def bench_kernels(numel: int = 16 << 20, ranks: int = 4, threads: int = 1, repeats: int = 7,
                  backends: tuple[str, ...] = ("native", "torch")) -> dict:
    """Throughput of worker compress, server step and decode for one buffer of ``numel`` floats.

    Returns a dict with ``add_elems_per_s`` and, per backend, ``<kernel>_elems_per_s`` and
    ``<kernel>_ratio_to_add`` (kernel throughput / add throughput; target >= 0.5 for native).
    The server step is counted per element of the chunk it reduces times n (the data it reads).
    """
    torch.set_num_threads(threads)
    L = Layout.build(numel, ranks)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=g)
    y_prev, y_next, y = torch.randn(L.padded, generator=g) * 0.01, torch.empty(L.padded), torch.empty(numel)
    prev_send = torch.zeros(L.n * L.row_bytes, dtype=torch.uint8)
    send = torch.empty(L.n * L.row_bytes, dtype=torch.uint8)
    server_err, server_err_out = torch.zeros(L.chunk), torch.empty(L.chunk)
    row = torch.empty(L.row_bytes, dtype=torch.uint8)
    out = torch.empty(numel)
    add = _rate(lambda: torch.add(x, y_prev[:numel], out=y), numel, repeats)
    result = {"numel": numel, "ranks": ranks, "threads": threads, "add_elems_per_s": add,
              "native_available": kernels.native_available(), "backends": {}}
    for backend in backends:
        if backend == "native" and not kernels.native_available():
            continue
        reps = repeats if backend == "native" else max(1, repeats // 3)
        def compress():
            kernels.worker_compress(x, y_prev, prev_send, y_next, send, L, backend)

        compress()
        rates = {
            "compress": _rate(compress, numel, reps),
            "server": _rate(lambda: kernels.server_compress(send, server_err, server_err_out, row,
                                                            L, backend), L.padded, reps),
            "decode": _rate(lambda: kernels.decode(send, out, L, backend), numel, reps),
        }
        result["backends"][backend] = {
            **{f"{k}_elems_per_s": v for k, v in rates.items()},
            **{f"{k}_ratio_to_add": v / add for k, v in rates.items()},
        }
    return result
