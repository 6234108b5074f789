"""Compression-kernel throughput, as a ratio to ``torch.add(x, e, out=y)`` in the same process.

``torch.add`` reads two fp32 arrays and writes one: the memory-speed yardstick. A kernel whose
ratio is near 1 costs about as much as one extra pass over the momentum; the sign compression in
plain torch ops runs an order of magnitude slower, which is what the native kernels (CPU) and the
Triton kernels (CUDA, :func:`bench_kernels_cuda`) fix.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Optional

import torch

from hvd_onebit import kernels
from hvd_onebit.kernels import fused_adam
from hvd_onebit.layout import Layout

TARGET_RATIO = 0.5  # every kernel at >= half of torch.add's element rate


@dataclass(frozen=True)
class Streams:
    """What a pass moves per element it counts: fp32 streams read and written, and streams of
    packed sign bits (1/8 byte per element, read or written)."""

    reads: float
    writes: float
    bits: float = 0.0

    @property
    def bytes_per_element(self) -> float:
        return 4.0 * (self.reads + self.writes) + self.bits / 8.0


def pass_streams(ranks: int) -> dict[str, Streams]:
    """Every timed pass's streams as the benchmark calls it (write-allocate reads not counted).

    The server step counts n elements per element of its chunk (one per received row), so its
    chunk-sized streams (z read and written, its new signs) count 1/n each. The previous
    call's signs are y_prev's (z_prev's) own: no stream of their own.
    """
    n = float(ranks)
    return {
        "add": Streams(2, 1),                      # x, e -> y
        "compress": Streams(2, 1, 1),              # x, y_prev -> y, signs
        "server": Streams(1 / n, 1 / n, 1 + 1 / n),  # n rows' signs, z_prev -> z, signs
        "decode": Streams(0, 1, 1),                # signs -> out
        "momentum_compress": Streams(3, 1, 1),     # m, g, y_prev -> y, signs
        "momentum_compress_preconditioned": Streams(4, 1, 1),  # m, g, v, y_prev -> y, signs
        "decode_update": Streams(2, 2, 1),         # signs, v, w -> m, w
        "decode_update_preconditioned": Streams(2, 2, 1),
        "moments": Streams(3, 3),                  # m, v, g -> m, v, ratio
        "errors": Streams(2, 1),                   # y, ratio -> y
    }


def _rate(fn, numel: int, repeats: int) -> float:
    """Median elements per second of ``fn`` over ``repeats`` runs (after one warm-up run)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return numel / statistics.median(times)


def native_vector_path() -> Optional[str]:
    """The native kernels' widest vector path in this process: "avx512" where the CPU has it
    and it is allowed (``HVD_ONEBIT_NATIVE=avx2`` forbids it), else "avx2"; None: no native
    kernels."""
    from hvd_onebit.kernels.native_loader import load_native

    module = load_native().module
    if module is None:
        return None
    allowed = module.set_avx512(True)  # returns what was allowed; put it back at once
    module.set_avx512(allowed)
    return "avx512" if allowed and module.has_avx512() else "avx2"


def _buffers(numel: int, ranks: int, device: str = "cpu", block_size=None):
    """The layout (``block_size``: None, one scale per chunk) and the buffers every kernel
    reads and writes, made on ``device``."""
    L = Layout.build(numel, ranks, block_size)
    g = torch.Generator(device=device).manual_seed(0)
    b = SimpleNamespace(device=device)
    b.x = torch.randn(numel, generator=g, device=device)
    b.y_prev = torch.randn(L.padded, generator=g, device=device) * 0.01
    b.y_next, b.y = torch.empty(L.padded, device=device), torch.empty(numel, device=device)
    b.prev_scales = torch.zeros(L.n * L.nblocks, device=device)
    b.send = torch.empty(L.n * L.row_bytes, dtype=torch.uint8, device=device)
    b.server_z, b.server_z_out = torch.zeros(L.chunk, device=device), torch.empty(L.chunk, device=device)
    b.server_scales = torch.zeros(L.nblocks, device=device)
    b.row = torch.empty(L.row_bytes, dtype=torch.uint8, device=device)
    b.out = torch.empty(numel, device=device)
    return L, b


def _calls(L: Layout, b, backend: str) -> dict:
    """name -> (kernel call, elements it counts): worker compress and decode per element of the
    buffer, the server step per element of the chunk it reduces times n (the data it reads)."""
    return {
        "compress": (lambda: kernels.worker_compress(b.x, b.y_prev, b.prev_scales, b.y_next,
                                                     b.send, L, backend), L.numel),
        "server": (lambda: kernels.server_compress(b.send, b.server_z, b.server_scales,
                                                   b.server_z_out, b.row, L, backend), L.padded),
        "decode": (lambda: kernels.decode(b.send, b.out, L, backend), L.numel),
    }


def _fused_calls(L: Layout, b, backend: str) -> dict:
    """Adam's fused passes on ``b``: the momentum update inside the compression (gradients in
    two segments) and the decode with the update (one weight, a tenth of it held, a step bound),
    each as the paper has it and preconditioned (the optimizer's default: the compression
    divides by the denominators it computes from the variance, the decode multiplies back)."""
    numel, dev = L.numel, b.device
    m = torch.randn(numel, device=dev) * 0.1
    half = numel // 2
    w, var = torch.randn(numel, device=dev), torch.rand(numel, device=dev) + 0.01
    var[::10] = 0.0  # held elements
    grads, sizes = [b.x[:half], b.x[half:]], [half, numel - half]
    src = fused_adam.MomentumInput(m, grads, sizes, 0.9)
    pre = fused_adam.MomentumInput(m, grads, sizes, 0.9, variances=[var[:half], var[half:]],
                                   sqrt_bc2s=[0.3, 0.3], eps=[1e-8, 1e-8])
    terms = ([w], [var], [numel], [-1e-4], [1 - 1e-5], [0.3], [1e-8], [7e-4])
    update = fused_adam.AdamUpdate(*terms)
    update_pre = fused_adam.AdamUpdate(*terms, preconditioned=True)
    return {
        "momentum_compress": (lambda: fused_adam.worker_compress_momentum(
            src, b.y_prev, b.prev_scales, b.y_next, b.send, L, backend), numel),
        "momentum_compress_preconditioned": (lambda: fused_adam.worker_compress_momentum(
            pre, b.y_prev, b.prev_scales, b.y_next, b.send, L, backend), numel),
        "decode_update": (lambda: fused_adam.decode_update(b.send, b.out, L, update, backend),
                          numel),
        "decode_update_preconditioned": (lambda: fused_adam.decode_update(
            b.send, b.out, L, update_pre, backend), numel),
    }


def bench_kernels(numel: int = 16 << 20, ranks: int = 4, threads: int = 1, repeats: int = 7,
                  backends: tuple[str, ...] = ("native", "torch")) -> dict:
    """Throughput of worker compress, server step and decode for one buffer of ``numel`` floats.

    Returns a dict with ``add_elems_per_s`` and, per backend, ``<kernel>_elems_per_s`` and
    ``<kernel>_ratio_to_add`` (kernel throughput / add throughput; target >= 0.5 for native),
    Adam's fused passes included as the optimizer runs them (``momentum_compress`` and
    ``decode_update``, each also ``_preconditioned``, the default). The server step is counted
    per element of the chunk it reduces times n (the data it reads). ``meets_target`` says, per
    backend, whether every ratio reaches :data:`TARGET_RATIO`.
    """
    torch.set_num_threads(threads)
    L, b = _buffers(numel, ranks)
    streams = pass_streams(ranks)
    add = _rate(lambda: torch.add(b.x, b.y_prev[:numel], out=b.y), numel, repeats)
    result = {"numel": numel, "ranks": ranks, "threads": threads, "add_elems_per_s": add,
              "add_bytes_per_s": add * streams["add"].bytes_per_element,
              "streams": {k: asdict(v) for k, v in streams.items()},
              "native_available": kernels.native_available(),
              "native_vector_path": native_vector_path(), "backends": {}}
    for backend in backends:
        if backend == "native" and not kernels.native_available():
            continue
        reps = repeats if backend == "native" else max(1, repeats // 3)
        calls = {**_calls(L, b, backend), **_fused_calls(L, b, backend)}
        calls["compress"][0]()
        rates = {k: _rate(fn, count, reps) for k, (fn, count) in calls.items()}
        result["backends"][backend] = {
            **{f"{k}_elems_per_s": v for k, v in rates.items()},
            **{f"{k}_ratio_to_add": v / add for k, v in rates.items()},
            **{f"{k}_bytes_per_s": v * streams[k].bytes_per_element for k, v in rates.items()},
        }
    result["target_ratio"] = TARGET_RATIO
    result["meets_target"] = {
        backend: all(v >= TARGET_RATIO for k, v in rates.items() if k.endswith("_ratio_to_add"))
        for backend, rates in result["backends"].items()}
    if kernels.native_available():
        result["fused_optimizer_passes"] = _bench_fused(L, b.x, b.y_prev, b.prev_scales, b.y_next,
                                                        b.send, repeats)
        result["refresh_passes"] = _bench_refresh(L, b.x, b.y_prev, b.prev_scales, repeats, add,
                                                  streams)
    return result



def _rate_cuda(fn, numel: int, repeats: int) -> float:
    """Median elements per second of ``fn`` on the current CUDA stream, timed with CUDA events
    (one warm-up call first: it compiles the Triton kernels)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return numel / statistics.median(times)


def bench_kernels_cuda(numels=(16 << 20, 64 << 20, 256 << 20), ranks: int = 4, repeats: int = 9,
                       backends: tuple[str, ...] = ("triton", "torch"), block_size=None) -> dict:
    """The kernels on the CUDA device, per buffer size: element rates and ratios to torch.add
    on the same device, Adam's fused passes included (``momentum_compress``, ``decode_update``).
    ``block_size``: the layout's scale granularity (None: one scale per chunk).

    Raises RuntimeError without a CUDA device, or without triton when "triton" is asked for.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("bench dev kernel --device cuda needs a CUDA device; "
                           "torch.cuda.is_available() is False here")
    if "triton" in backends and not kernels.triton_available():
        raise RuntimeError("the triton backend needs the triton package (pip install triton)")
    streams = pass_streams(ranks)
    result = {"device": "cuda", "device_name": torch.cuda.get_device_name(), "ranks": ranks,
              "block_size": block_size, "target_ratio": TARGET_RATIO,
              "streams": {k: asdict(v) for k, v in streams.items()}, "sizes": []}
    for numel in numels:
        L, b = _buffers(numel, ranks, "cuda", block_size)
        add = _rate_cuda(lambda: torch.add(b.x, b.y_prev[:numel], out=b.y), numel, repeats)
        entry = {"numel": numel, "add_elems_per_s": add,
                 "add_bytes_per_s": add * streams["add"].bytes_per_element, "backends": {}}
        for backend in backends:
            calls = {**_calls(L, b, backend), **_fused_calls(L, b, backend)}
            reps = repeats if backend == "triton" else max(2, repeats // 3)
            rates = {k: _rate_cuda(fn, count, reps) for k, (fn, count) in calls.items()}
            entry["backends"][backend] = {
                **{f"{k}_elems_per_s": v for k, v in rates.items()},
                **{f"{k}_ratio_to_add": v / add for k, v in rates.items()},
                **{f"{k}_bytes_per_s": v * streams[k].bytes_per_element
                   for k, v in rates.items()},
            }
        result["sizes"].append(entry)
        del b
        torch.cuda.empty_cache()
    result["meets_target"] = {
        backend: all(v >= TARGET_RATIO for e in result["sizes"]
                     for k, v in e["backends"][backend].items() if k.endswith("_ratio_to_add"))
        for backend in backends}
    return result


def _bench_fused(L: Layout, g: torch.Tensor, y_prev, prev_scales, y_next, send, repeats) -> dict:
    """The optimizer's two fused passes against the separate passes they replace (native).

    * momentum + compress: ``worker_compress_momentum`` (beta1*m + (1-beta1)*g computed inside
      the compression) vs ``torch.lerp`` into a buffer, then ``worker_compress``.
    * decode + update: ``decode_update`` (denominators computed from the variance in the pass)
      vs ``decode`` into m, then ``w.addcdiv_(m, denom)`` with stored denominators.
    """
    numel = g.numel()
    m, work = torch.randn(numel) * 0.1, torch.empty(numel)
    w, var = torch.randn(numel), torch.rand(numel) + 0.01
    denom = var.sqrt() / 0.3 + 1e-8
    src = fused_adam.MomentumInput(m, [g], [numel], 0.9)
    update = fused_adam.AdamUpdate([w], [var], [numel], [-1e-4], [1.0], [0.3], [1e-8])

    def separate_compress():
        torch.lerp(m, g, 0.1, out=work)
        kernels.worker_compress(work, y_prev, prev_scales, y_next, send, L, "native")

    def separate_update():
        kernels.decode(send, work, L, "native")
        w.addcdiv_(work, denom, value=-1e-4)

    ms = {
        "momentum_compress_ms": numel / _rate(lambda: fused_adam.worker_compress_momentum(
            src, y_prev, prev_scales, y_next, send, L, "native"), numel, repeats) * 1e3,
        "lerp_then_compress_ms": numel / _rate(separate_compress, numel, repeats) * 1e3,
        "decode_update_ms": numel / _rate(lambda: fused_adam.decode_update(
            send, work, L, update, "native"), numel, repeats) * 1e3,
        "decode_then_addcdiv_ms": numel / _rate(separate_update, numel, repeats) * 1e3,
    }
    ms["momentum_compress_speedup"] = ms["lerp_then_compress_ms"] / ms["momentum_compress_ms"]
    ms["decode_update_speedup"] = ms["decode_then_addcdiv_ms"] / ms["decode_update_ms"]
    return ms


def _bench_refresh(L: Layout, g: torch.Tensor, y_prev, scales, repeats: int, add: float,
                   streams: dict) -> dict:
    """A variance refresh's passes (native) against the separate passes they replace, each as a
    ratio to torch.add's element rate ``add`` and in bytes per second (``streams``):

    * moments: ``refresh_moments`` (old denominators, ``m`` and ``v`` updated, old / new, one
      pass) vs the native denominators, torch's ``lerp_``, ``mul_`` and ``addcmul_``, then the
      native division.
    * errors: ``rescale_error`` (``y = (y - s * sign(y)) * ratio`` in place) vs the worker
      error materialised (torch ops), multiplied and copied back.
    """
    numel, eps = g.numel(), 1e-8
    m, v, ratio = torch.randn(numel) * 0.1, torch.rand(numel) + 0.01, torch.empty(numel)
    v[::10] = 0.0  # held elements
    y = y_prev.clone()
    scale = torch.full((numel,), 0.999)  # near 1: repeated calls keep y's magnitude

    def separate_moments():
        kernels.denominators(v, ratio, 0.3, eps, "native")
        m.lerp_(g, 0.1)
        v.mul_(1 - 1e-3).addcmul_(g, g, value=1e-3)
        kernels.divide_by_denominators(ratio, v, 0.31, eps, "native")

    def separate_errors():
        e = kernels.worker_error(y, scales, L)
        e[:numel].mul_(scale)
        y.copy_(e)

    calls = {
        "moments": (lambda: kernels.refresh_moments(m, v, g, ratio, 0.9, 1e-3, 0.3, 0.31, eps,
                                                    "native"), separate_moments),
        "errors": (lambda: kernels.rescale_error(y, scales, scale, L, L.n, "native"),
                   separate_errors),
    }
    out = {}
    for name, (fused, separate) in calls.items():
        fast, slow = _rate(fused, numel, repeats), _rate(separate, numel, max(1, repeats // 3))
        out[f"{name}_ms"] = numel / fast * 1e3
        out[f"{name}_separate_ms"] = numel / slow * 1e3
        out[f"{name}_speedup"] = fast / slow
        out[f"{name}_ratio_to_add"] = fast / add
        out[f"{name}_bytes_per_s"] = fast * streams[name].bytes_per_element
    return out
