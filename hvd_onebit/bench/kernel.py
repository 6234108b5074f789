"""Compression-kernel throughput, as a ratio to ``torch.add(x, e, out=y)`` in the same process.

``torch.add`` reads two fp32 arrays and writes one: the memory-speed yardstick. A kernel whose
ratio is near 1 costs about as much as one extra pass over the momentum; the sign compression in
plain torch ops runs an order of magnitude slower, which is what the native kernels fix.
"""
from __future__ import annotations

import statistics
import time

import torch

from .. import fused_adam, kernels
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
    server_z, server_z_out = torch.zeros(L.chunk), torch.empty(L.chunk)
    server_sent, row = (torch.zeros(L.row_bytes, dtype=torch.uint8),
                        torch.empty(L.row_bytes, dtype=torch.uint8))
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
            "server": _rate(lambda: kernels.server_compress(send, server_z, server_sent,
                                                            server_z_out, row, L, backend),
                            L.padded, reps),
            "decode": _rate(lambda: kernels.decode(send, out, L, backend), numel, reps),
        }
        result["backends"][backend] = {
            **{f"{k}_elems_per_s": v for k, v in rates.items()},
            **{f"{k}_ratio_to_add": v / add for k, v in rates.items()},
        }
    if kernels.native_available():
        result["fused_optimizer_passes"] = _bench_fused(L, x, y_prev, prev_send, y_next, send,
                                                        repeats)
    return result


def _bench_fused(L: Layout, g: torch.Tensor, y_prev, prev_send, y_next, send, repeats) -> dict:
    """The optimizer's two fused passes against the separate passes they replace (native).

    * momentum + compress: ``worker_compress_momentum`` (beta1*m + (1-beta1)*g computed inside
      the compression) vs ``torch.lerp`` into a buffer, then ``worker_compress``.
    * decode + update: ``decode_update`` vs ``decode`` into m, then ``w.addcdiv_(m, denom)``.
    """
    numel = g.numel()
    m, work = torch.randn(numel) * 0.1, torch.empty(numel)
    w, denom = torch.randn(numel), torch.rand(numel) + 0.01
    src = fused_adam.MomentumInput(m, [g], [numel], 0.9)
    update = fused_adam.AdamUpdate([w], [denom], [numel], [-1e-4], [1.0])

    def separate_compress():
        torch.lerp(m, g, 0.1, out=work)
        kernels.worker_compress(work, y_prev, prev_send, y_next, send, L, "native")

    def separate_update():
        kernels.decode(send, work, L, "native")
        w.addcdiv_(work, denom, value=-1e-4)

    ms = {
        "momentum_compress_ms": numel / _rate(lambda: fused_adam.worker_compress_momentum(
            src, y_prev, prev_send, y_next, send, L, "native"), numel, repeats) * 1e3,
        "lerp_then_compress_ms": numel / _rate(separate_compress, numel, repeats) * 1e3,
        "decode_update_ms": numel / _rate(lambda: fused_adam.decode_update(
            send, work, L, update, "native"), numel, repeats) * 1e3,
        "decode_then_addcdiv_ms": numel / _rate(separate_update, numel, repeats) * 1e3,
    }
    ms["momentum_compress_speedup"] = ms["lerp_then_compress_ms"] / ms["momentum_compress_ms"]
    ms["decode_update_speedup"] = ms["decode_then_addcdiv_ms"] / ms["decode_update_ms"]
    return ms
