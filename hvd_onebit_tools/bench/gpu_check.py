"""One-go check of hvd_onebit on a CUDA machine; prints one JSON object.

    python benchmarks/gpu_check.py [--numel 16M,64M,256M] [--out result.json]
    python benchmarks/gpu_check.py --dry-run      # no GPU: CPU tensors, Triton's interpreter

Checks (each in its own try/except; a failure is reported in the JSON, the others still run):

* ``bits``: the triton kernels and the torch twins on the device give the bits of the native
  CPU kernels on copies of the same data (worker compress, server step, decode; the momentum
  update inside the compression; the decode with Adam's update, float32/float16/bfloat16
  weights, held elements), n = 1..4, sizes not a multiple of 8, finer blocks.
* ``ratios``: ``hvd-onebit bench dev kernel --device cuda``: each kernel's element rate as a ratio
  to torch.add on the device (the target: >= 0.5 from 16M to 256M elements).
* ``host_cost``: per Triton pass at 16M elements, the host's time to issue one call (no
  synchronization) and the time per call issued back to back (one pair of events around
  them), beside torch.add's; and the host's functions by cumulative time (cProfile) for the
  default step's first pass: whether a pass is bound by its kernels or by its launch.
* ``virtual_ranks``: 2 ranks as threads on one device through the in-process transport,
  ``OneBitAllreduce(..., device=..., backend="triton")``: ranks identical, and the bits of the
  same calls with the native kernels on CPU.
* ``memory``: peak CUDA memory above the baseline during one call (both virtual ranks) against
  the parameters' bytes.
* ``host_syncs``: device-to-host syncs in one call, counted with
  ``torch.cuda.set_sync_debug_mode("warn")``.
* ``compressed_step``: the optimizer's compression engine (``CompressedStep``) on 2 virtual
  ranks with several buckets and step counts on the device (as fused or capturable Adam keeps
  them): the syncs of one steady step (the target: at most 1 outside the in-process
  transport, whose own stream waits are counted apart), what it holds beyond Adam's own and its
  peak (``torch.cuda.max_memory_allocated``) as ratios to the parameters' fp32 bytes. On CPU
  (``--dry-run``) it runs without the sync count.

* ``bits_large``: the default layout (a scale per 512 elements, and one scale per chunk) at 1M
  and 64M elements, every kernel and fused pass, Triton and torch on the device against the CPU.
* ``memory_lean``: ``hvd-onebit bench dev memory --world inprocess --device cuda`` at 2, 8 and
  16 virtual ranks with ``memory="lean"``: held and peak beyond Adam's own over the parameters'
  fp32 bytes (the targets: <= 1.25 from 8 ranks, <= 1 + 1/n + 1/16 at n ranks).
* ``step_time``: one compressed step of a model of 100M parameters on 2 and 8 virtual ranks
  against torch's own ``Adam(fused=True)`` step of the same parameters on the same GPU, with
  a breakdown of the GPU's time per kernel (``torch.profiler``) and, for the first world, the
  host's functions by own time in one more step of rank 0 (cProfile).
* ``engine_paths``, ``gradient_paths``, ``wide``: the engine's steps started early, with tensor
  options and its flush in pieces, against the same run on CPU; the full-precision step's
  non-finite flag and the gradients' storage starts on the device; the kernels past 2**31 elements
  (``hvd_onebit_tools/bench/gpu_paths.py`` says what each runs).
* ``ddp_face``: ``torchrun --nproc_per_node 2`` of ``hvd_onebit_tools/bench/gpu_ddp.py`` with
  NCCL (two ranks on one GPU: NCCL's answer is reported) and with Gloo on CUDA tensors: DDP +
  Adam and DDP + the 1-bit face, ranks identical, host syncs of one compressed step.

``--dry-run`` runs the checks that need no GPU on CPU tensors under Triton's interpreter (small
sizes); the CUDA-only ones are reported as skipped. The script must not import triton before it
has settled ``TRITON_INTERPRET``. With ``--out``, the report is written after every check, so a
run cut short still leaves the checks it finished.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

from hvd_onebit_tools.bench.gpu_paths import (check_engine_paths, check_gradient_paths,
                                              check_wide, layered_engine, tensors_bytes)


BIT_CASES = [(7, 3, None), (33, 4, None), (100, 1, None), (4099, 2, None), (5001, 3, 24),
             (20_001, 4, 4096)]
FUSED_CASES = [([5, 0, 13, 1000, 7], 4), ([3001, 3, 2000, 9000, 11], 2)]


def _bytes(t):
    return None if t is None else tensors_bytes([t])


def _kernel_outputs(backend, device, L, x, y_prev, prev_scales, z_prev, prev_server_scales):
    """worker compress, server step on the rows sent, decode: every output as bytes."""
    import torch
    from hvd_onebit import kernels
    dev = [t.to(device, copy=True) for t in (x, y_prev, prev_scales, z_prev, prev_server_scales)]
    x, y_prev, prev_scales, z_prev, prev_server_scales = dev
    send = torch.full((L.n * L.row_bytes,), 0xAB, dtype=torch.uint8, device=device)
    y_out = torch.full((L.padded,), 123.0, device=device)
    z_out = torch.full((L.chunk,), 5.0, device=device)
    row = torch.full((L.row_bytes,), 0xCD, dtype=torch.uint8, device=device)
    out = torch.full((L.numel,), 7.0, device=device)
    ok = kernels.worker_compress(x, y_prev, prev_scales, y_out, send, L, backend)
    ok_s = kernels.server_compress(send, z_prev, prev_server_scales, z_out, row, L, backend)
    kernels.decode(send, out, L, backend)
    return [bool(ok), bool(ok_s)] + [_bytes(t) for t in (y_out, send, z_out, row, out)]


def _fused_outputs(backend, device, L, sizes, m, grads, rows, weights, variances, steps, decays):
    import torch
    from hvd_onebit.kernels.fused_adam import (AdamUpdate, MomentumInput, decode_update,
                                               worker_compress_momentum)
    to = (lambda t: None if t is None else t.to(device, copy=True))  # updates are in place
    y_prev = torch.zeros(L.padded, device=device)
    prev = torch.zeros(L.n * L.nblocks, device=device)
    y_out = torch.empty(L.padded, device=device)
    send = torch.empty(L.n * L.row_bytes, dtype=torch.uint8, device=device)
    src = MomentumInput(to(m), [to(g) for g in grads], sizes, 0.9)
    worker_compress_momentum(src, y_prev, prev, y_out, send, L, backend)
    w = [to(t) for t in weights]
    out = torch.full((L.numel,), float("nan"), device=device)
    update = AdamUpdate(w, [to(v) for v in variances], sizes, steps, decays,
                        [0.3] * len(sizes), [1e-8] * len(sizes))
    decode_update(to(rows), out, L, update, backend)
    return [_bytes(y_out), _bytes(send), _bytes(out)] + [_bytes(t) for t in w]


def _reference_backend() -> str:
    """The CPU kernels the device's bits are held to: the native ones, or (where they did not
    build) the torch twins, which the suite holds to the native ones bit for bit."""
    from hvd_onebit.kernels.native_loader import load_native
    return "native" if load_native().module is not None else "torch"


def _kernel_args(L, seed: int) -> tuple:
    """The inputs of :func:`_kernel_outputs` for layout ``L``: x, the previous y and its rows'
    scales (random), the previous z and its row's scales, from ``seed``."""
    import torch
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(L.numel, generator=g)
    y_prev = torch.randn(L.padded, generator=g)
    prev_scales = torch.rand(L.n * L.nblocks, generator=g)
    return (L, x, y_prev, prev_scales, torch.randn(L.chunk, generator=g),
            prev_scales[:L.nblocks].clone())


def check_bits(device: str) -> dict:
    """Per case, whether each device implementation gives the native CPU kernels' bits."""
    import torch
    from hvd_onebit import kernels
    from hvd_onebit.dtypes import FLOAT_DTYPES
    from hvd_onebit.layout import Layout
    impls = [("triton", device)] + ([("torch", device)] if device != "cpu" else [])
    cases, ok = [], True
    for numel, n, block in BIT_CASES:
        args = _kernel_args(Layout.build(numel, n, block), numel)
        ref = _kernel_outputs(_reference_backend(), "cpu", *args)
        entry = {"numel": numel, "n": n, "block": block}
        for backend, dev in impls:
            entry[f"{backend}_{dev}"] = _kernel_outputs(backend, dev, *args) == ref
            ok &= entry[f"{backend}_{dev}"]
        cases.append(entry)
    dtypes = list(FLOAT_DTYPES)
    for sizes, n in FUSED_CASES:
        numel = sum(sizes)
        L = Layout.build(numel, n)
        g = torch.Generator().manual_seed(numel)
        m = torch.randn(numel, generator=g)
        grads = [None if i % 3 == 1 else torch.randn(s, generator=g) for i, s in enumerate(sizes)]
        rows = torch.randint(0, 255, (L.n * L.row_bytes,), dtype=torch.uint8, generator=g)
        kernels.row_scales(rows, L, L.n).copy_(torch.rand(L.n, L.nblocks, generator=g))
        weights = [None if i % 3 == 1 else torch.randn(s, generator=g) for i, s in enumerate(sizes)]
        variances = [None if w is None else torch.rand(s, generator=g) + 0.01
                     for w, s in zip(weights, sizes)]
        for v in variances:
            if v is not None:
                v[::7] = 0.0  # held elements
        steps = [-1e-3 * (i + 1) for i in range(len(sizes))]
        decays = [1 - 1e-5 if i % 2 else 1.0 for i in range(len(sizes))]
        fp32 = (L, sizes, m, grads, rows, weights, variances, steps, decays)
        low_w = [None if w is None else w.to(dtypes[i % 3]) for i, w in enumerate(weights)]
        low = (L, sizes, m, grads, rows, low_w, variances, steps, decays)
        ref32 = _fused_outputs(_reference_backend(), "cpu", *fp32)
        ref_low = _fused_outputs("torch", "cpu", *low)  # native takes float32 only
        entry = {"fused_sizes": sizes, "n": n}
        for backend, dev in impls:
            entry[f"{backend}_{dev}"] = _fused_outputs(backend, dev, *fp32) == ref32
            entry[f"{backend}_{dev}_f16_bf16_weights"] = _fused_outputs(backend, dev, *low) == ref_low
            ok &= entry[f"{backend}_{dev}"] and entry[f"{backend}_{dev}_f16_bf16_weights"]
        cases.append(entry)
    return {"ok": bool(ok), "reference": f"{_reference_backend()} kernels on CPU (torch twin "
                                         "for f16/bf16)", "cases": cases}


def check_bits_large(device: str, sizes=(1 << 20, 64 << 20), n: int = 4) -> dict:
    """The kernels and the fused passes at ``sizes`` elements, a scale per 512 elements (the
    default) and one per chunk: the device's bits against the CPU's on the same data."""
    import torch
    from hvd_onebit import kernels
    from hvd_onebit.config import DEFAULT_BLOCK_SIZE
    from hvd_onebit.layout import Layout
    ref_backend = _reference_backend()
    cases, ok = [], True
    for numel in sizes:
        for block in (DEFAULT_BLOCK_SIZE, None):
            args = _kernel_args(Layout.build(numel, n, block), numel + 1)
            ref = _kernel_outputs(ref_backend, "cpu", *args)
            entry = {"numel": numel, "n": n, "block": block}
            for backend in ("triton", "torch"):
                entry[f"{backend}_{device}"] = _kernel_outputs(backend, device, *args) == ref
                ok &= entry[f"{backend}_{device}"]
            del args, ref
            cases.append(entry)
        sizes_p = [numel // 2 - 3, 7, numel - numel // 2 - 4]
        L = Layout.build(numel, n, DEFAULT_BLOCK_SIZE)
        g = torch.Generator().manual_seed(numel + 2)
        rows = torch.randint(0, 255, (L.n * L.row_bytes,), dtype=torch.uint8, generator=g)
        kernels.row_scales(rows, L, L.n).copy_(torch.rand(L.n, L.nblocks, generator=g))
        weights = [torch.randn(k, generator=g) for k in sizes_p]
        variances = [torch.rand(k, generator=g) + 0.01 for k in sizes_p]
        variances[0][::7] = 0.0  # held elements
        fp32 = (L, sizes_p, torch.randn(numel, generator=g),
                [torch.randn(k, generator=g) for k in sizes_p], rows, weights, variances,
                [-1e-3, -2e-3, -3e-3], [1.0, 1 - 1e-5, 1.0])
        ref32 = _fused_outputs(ref_backend, "cpu", *fp32)
        entry = {"fused_numel": numel, "n": n, "block": DEFAULT_BLOCK_SIZE}
        for backend in ("triton", "torch"):
            entry[f"{backend}_{device}"] = _fused_outputs(backend, device, *fp32) == ref32
            ok &= entry[f"{backend}_{device}"]
        cases.append(entry)
        del fp32, ref32
    return {"ok": bool(ok), "reference": f"{ref_backend} kernels on CPU", "cases": cases}


def _virtual_ranks(device: str, backend: str, numel: int, calls: int = 3):
    import torch
    from hvd_onebit import OneBitAllreduce
    from hvd_onebit.transport.inprocess import run_threads

    def rank_fn(t):
        comm = OneBitAllreduce(numel, transport=t, device=device, backend=backend,
                               name=f"gpu_check.{backend}")
        g = torch.Generator().manual_seed(100 + t.rank)
        outs = []
        for _ in range(calls):
            outs.append(_bytes(comm.allreduce(torch.randn(numel, generator=g).to(device))))
        return outs

    return run_threads(2, rank_fn)


def check_virtual_ranks(device: str, numel: int) -> dict:
    per_rank = _virtual_ranks(device, "triton", numel)
    native = _virtual_ranks("cpu", "native", numel)
    return {"ok": per_rank[0] == per_rank[1] and per_rank == native, "numel": numel,
            "ranks_identical": per_rank[0] == per_rank[1], "equal_to_native_cpu": per_rank == native}


def _warm_ranks(numel: int, name: str):
    """2 virtual ranks on the CUDA device, each with a collective that has made one call
    (kernels compiled, first-call buffers allocated), and a function running one more call."""
    import torch
    from hvd_onebit import OneBitAllreduce
    from hvd_onebit.transport.inprocess import run_threads
    comms = {}

    def setup(t):
        comms[t.rank] = (OneBitAllreduce(numel, transport=t, device="cuda", backend="triton",
                                         name=name), torch.randn(numel, device="cuda"))
        comms[t.rank][0].allreduce(comms[t.rank][1])

    run_threads(2, setup)
    torch.cuda.synchronize()
    return lambda: run_threads(2, lambda t: comms[t.rank][0].allreduce(comms[t.rank][1]) is None)


def check_memory(numel: int) -> dict:
    import torch
    call = _warm_ranks(numel, "gpu_check.mem")
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    param_bytes = numel * 4
    return {"ok": True, "numel": numel, "param_bytes": param_bytes, "ranks": 2,
            "peak_above_baseline_bytes": extra,
            "per_rank_over_param_bytes": extra / 2 / param_bytes}


def check_host_syncs(numel: int) -> dict:
    from hvd_onebit_tools.bench.syncs import SyncRecorder
    call = _warm_ranks(numel, "gpu_check.sync")
    with SyncRecorder() as syncs:
        call()
    return {"ok": True, "numel": numel, "ranks": 2, **syncs.summary(2)}


def check_compressed_step(device: str, width: int = 2048, layers: int = 4) -> dict:
    """See the module's docstring: CompressedStep's syncs and memory in one steady step."""
    import threading

    import torch
    from hvd_onebit_tools.bench.memory import held_bytes
    from hvd_onebit_tools.bench.syncs import SyncRecorder
    from hvd_onebit.transport.inprocess import run_threads

    cuda = device == "cuda"
    gate = threading.Barrier(2, timeout=300)
    peak = {}

    def rank_fn(t):
        params, state, engine = layered_engine(t, device, width, layers)
        groups = [{"params": params, "lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8,
                   "weight_decay": 0.0}]
        gen = torch.Generator().manual_seed(1 + t.rank)
        grads = {p: (torch.randn(p.shape, generator=gen) * 1e-3).to(device) for p in params}
        for _ in range(2):  # kernels compiled, first-step reads (step counts) done
            engine.ensure_ready(params)
            engine.step(groups, grads)
        held = held_bytes({"engine": {k: v for k, v in vars(engine).items() if k != "comms"},
                           "collectives": engine.comms}, params, state)
        engine.ensure_ready(params)
        gate.wait()
        if t.rank == 0 and cuda:
            torch.cuda.synchronize()
            peak["base"] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            peak["syncs"] = SyncRecorder().__enter__()
        gate.wait()
        engine.step(groups, grads)
        gate.wait()
        if t.rank == 0 and cuda:
            peak["syncs"].__exit__(None, None, None)
            torch.cuda.synchronize()
            peak["bytes"] = torch.cuda.max_memory_allocated() - peak["base"]
        gate.wait()  # the recorder stopped before either rank reads its parameters back
        return {"buckets": len(engine.buckets), "held": held["total"],
                "param_bytes": 4 * sum(p.numel() for p in params),
                "params": tensors_bytes(params)}

    per_rank = run_threads(2, rank_fn, timeout=600)
    param_bytes = per_rank[0]["param_bytes"]
    out = {"buckets": per_rank[0]["buckets"], "ranks": 2, "param_bytes": param_bytes,
           "ranks_identical": per_rank[0]["params"] == per_rank[1]["params"],
           "held_over_param_bytes": max(r["held"] for r in per_rank) / param_bytes}
    if cuda:
        out.update({**peak["syncs"].summary(2),
                    "peak_over_param_bytes": (max(r["held"] for r in per_rank)
                                              + peak["bytes"] / 2) / param_bytes})
    out["ok"] = bool(out["ranks_identical"] and out["buckets"] > 1
                     and (not cuda or out["host_syncs_per_rank"] <= 1))
    return out


def check_ratios(numels) -> dict:
    """The kernel ratios at the default layout (a scale per 512 elements), and at one scale per
    chunk on the first size."""
    from hvd_onebit.config import DEFAULT_BLOCK_SIZE
    from hvd_onebit_tools.bench.kernel import bench_kernels_cuda
    result = bench_kernels_cuda(numels, block_size=DEFAULT_BLOCK_SIZE)
    per_chunk = bench_kernels_cuda(numels[:1], block_size=None)
    return {"ok": result["meets_target"].get("triton", False), **result,
            "one_scale_per_chunk": per_chunk}


def check_host_cost(device: str, numel: int = 16 << 20, calls: int = 50, ranks: int = 4,
                    profiled: str = "momentum_compress_preconditioned") -> dict:
    """Where a Triton pass's time goes at ``numel`` elements (the default layout): per call,
    the host's time to issue it with nothing synchronized (what a training loop's CPU pays),
    and the time per call when ``calls`` are issued back to back (events around them on CUDA:
    the larger of the host's and the kernels' time; the host's time on CPU), each beside
    torch.add's; then the host's top functions by cumulative time for ``profiled``. A
    measurement, no target (``ok`` is None)."""
    import cProfile

    import torch
    from hvd_onebit.config import DEFAULT_BLOCK_SIZE
    from hvd_onebit_tools.bench.kernel import _buffers, _calls, _fused_calls
    L, b = _buffers(numel, ranks, device, DEFAULT_BLOCK_SIZE)
    passes = {"add": lambda: torch.add(b.x, b.y_prev[:numel], out=b.y)}
    passes.update({k: fn for k, (fn, _) in {**_calls(L, b, "triton"),
                                            **_fused_calls(L, b, "triton")}.items()})
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = {"ok": None, "numel": numel, "calls": calls, "block_size": DEFAULT_BLOCK_SIZE,
           "passes": {}}
    for name, fn in passes.items():
        fn()  # compiles it, on first use
        sync()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else None
        if cuda:
            events[0].record()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        host = (time.perf_counter() - start) / calls
        if cuda:
            events[1].record()
            events[1].synchronize()
        issued = events[0].elapsed_time(events[1]) / 1e3 / calls if cuda else host
        sync()
        out["passes"][name] = {"host_us_per_call": host * 1e6,
                               "back_to_back_us_per_call": issued * 1e6}
    add = out["passes"]["add"]
    for e in out["passes"].values():
        e["back_to_back_ratio_to_add"] = add["back_to_back_us_per_call"] / \
            e["back_to_back_us_per_call"]
        e["host_over_add_host"] = e["host_us_per_call"] / add["host_us_per_call"]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        passes[profiled]()
    prof.disable()
    sync()
    out[f"profile_{profiled}"] = _profile_text(prof, "cumulative", 20)
    return out


def _profile_text(prof, sort: str, limit: int) -> str:
    """A cProfile's top ``limit`` functions by ``sort``, as pstats prints them (the last 6000
    characters, for the JSON)."""
    import io
    import pstats

    text = io.StringIO()
    pstats.Stats(prof, stream=text).strip_dirs().sort_stats(sort).print_stats(limit)
    return text.getvalue()[-6000:]


SWEEP = ((8, 2048, 64), (8, 2048, None), (8, 1024, 64), (8, 1024, None), (8, 512, None),
         (4, 1024, None), (8, 2048, 96), (8, 4096, 64), (16, 2048, 64), (4, 2048, 64))


def check_kernel_sweep(device: str = "cuda", numels=(16 << 20, 128 << 20), variants=SWEEP,
                       bit_sizes=(1 << 20,)) -> dict:
    """The Triton kernels' ratios to torch.add at the default layout under other launch
    settings, (warps per program, elements per program, register cap or None: no cap), the
    first being the shipped one, each with the bits of :func:`check_bits_large` at ``bit_sizes``."""
    import importlib

    from hvd_onebit.config import DEFAULT_BLOCK_SIZE
    from hvd_onebit_tools.bench.kernel import bench_kernels_cuda
    mods = [importlib.import_module(f"hvd_onebit.kernels.triton.{m}")
            for m in ("launch", "compress", "decode")]
    saved = (mods[0].CMAX, mods[1].WARPS, mods[2].WARPS, dict(mods[0].LAUNCH))
    out = {"shipped": {"warps": saved[1], "elements_per_program": saved[0],
                       "launch": saved[3]}, "variants": []}
    try:
        for warps, cmax, maxnreg in variants:
            mods[0].CMAX, mods[1].WARPS, mods[2].WARPS = cmax, warps, warps
            mods[0].LAUNCH.clear()  # the one dict every kernel module launches with
            mods[0].LAUNCH.update({k: v for k, v in saved[3].items() if k != "maxnreg"},
                                  **({} if maxnreg is None else {"maxnreg": maxnreg}))
            entry = {"warps": warps, "elements_per_program": cmax, "maxnreg": maxnreg}
            try:
                r = bench_kernels_cuda(list(numels), repeats=5, backends=("triton",),
                                       block_size=DEFAULT_BLOCK_SIZE)
                entry["ratios"] = [{"numel": e["numel"], **{
                    k[:-len("_ratio_to_add")]: round(v, 3)
                    for k, v in e["backends"]["triton"].items() if k.endswith("_ratio_to_add")}}
                    for e in r["sizes"]]
                entry["bits_ok"] = check_bits_large(device, bit_sizes)["ok"]
            except Exception as exc:  # noqa: BLE001 - a variant that fails is reported
                entry["error"] = f"{type(exc).__name__}: {exc}"[:500]
            out["variants"].append(entry)
    finally:
        mods[0].CMAX, mods[1].WARPS, mods[2].WARPS = saved[:3]
        mods[0].LAUNCH.clear()
        mods[0].LAUNCH.update(saved[3])
    out["ok"] = True
    return out


def check_memory_lean(device: str, ranks=(2, 8, 16), layers: int = 4, width: int = 2048) -> dict:
    """``bench dev memory --world inprocess --memory lean`` on the device at each world size."""
    from hvd_onebit_tools.bench.memory import bench_memory
    out, ok = {"layers": layers, "width": width, "worlds": []}, True
    for n in ranks:
        r = bench_memory(ranks=n, layers=layers, width=width, compressed=3, transport="inprocess",
                         device=device, memory="lean")
        c = r["phases"]["compression"]
        bound = 1 + 1 / n + 1 / 16
        entry = {"ranks": n, "buckets": r["buckets"], "param_bytes": r["param_bytes"],
                 "held_ratio": c["held_ratio"], "peak_ratio": c["peak_ratio"],
                 "bound_1_plus_1_over_n_plus_1_over_16": bound,
                 "held_within_bound": c["held_ratio"] <= bound,
                 "within_bound": c["peak_ratio"] <= bound,
                 "within_1_25": c["peak_ratio"] <= 1.25 if n >= 8 else None}
        if device == "cuda":  # on CPU (--dry-run) the sizes are too small for the bounds
            ok &= entry["within_bound"] and entry["within_1_25"] is not False
        out["worlds"].append(entry)
    out["peak_method"] = r["peak_method"]
    out["ok"] = bool(ok)
    return out


def _kernel_times(prof, ranks: int) -> dict:
    """The profiler's device time per kernel name, per rank, in ms, largest first."""
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if t and e.device_type is not None and "cuda" in str(e.device_type).lower():
            rows.append((e.key, t / 1e3 / ranks, e.count // ranks))
    rows.sort(key=lambda r: -r[1])
    return {"total_ms_per_rank": sum(r[1] for r in rows),
            "kernels": [{"name": k[:80], "ms_per_rank": round(t, 4), "calls_per_rank": c}
                        for k, t, c in rows[:15]]}


def check_step_time(device: str, ranks=(2, 8), width: int = 2048, layers: int = 24,
                    steps: int = 5) -> dict:
    """The compression engine's step (default options) on ``layers`` x (``width``^2 + ``width``)
    parameters per virtual rank, against torch's fused Adam step of the same parameters; one
    profiled step's device time per kernel; the host's functions by own time in one more step
    of the first world's rank 0 (cProfile: where the host's part of a step goes)."""
    import cProfile
    import threading

    import torch
    from hvd_onebit.config import OneBitConfig
    from hvd_onebit.engine import NOT_FROZEN, CompressedStep
    from hvd_onebit.transport.inprocess import run_threads

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    shapes = [s for _ in range(layers) for s in ((width, width), (width,))]

    def make(seed):
        g = torch.Generator().manual_seed(seed)
        params = [torch.randn(s, generator=g).to(device) for s in shapes]
        grads = {p: (torch.randn(p.shape, generator=g) * 1e-3).to(device) for p in params}
        return params, grads

    # torch's Adam, fused where the device has it, on one rank's parameters
    params, grads = make(0)
    for p in params:
        p.grad = grads[p]
    adam = torch.optim.Adam(params, lr=1e-4, fused=cuda)
    for _ in range(3):
        adam.step()
    sync()
    start = time.perf_counter()
    for _ in range(steps * 4):
        adam.step()
    sync()
    adam_ms = 1e3 * (time.perf_counter() - start) / (steps * 4)
    out = {"params": sum(p.numel() for p in params),
           "adam_fused" if cuda else "adam": {"ms_per_step": adam_ms}, "worlds": []}
    if cuda:  # Adam's own device time, for the same breakdown
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            adam.step()
            sync()
        out["adam_fused"]["device_time"] = _kernel_times(prof, 1)
    del params, grads, adam
    if cuda:
        torch.cuda.empty_cache()

    for n in ranks:
        gate = threading.Barrier(n)
        timing = {}

        def rank_fn(t):
            params, grads = make(0)
            state = {p: {"step": torch.tensor(10.0, device=device),
                         "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.full_like(p, 1e-6),
                         "frozen_variance_step": NOT_FROZEN} for p in params}
            gen = torch.Generator().manual_seed(1 + t.rank)
            for p in params:  # each rank its own gradient
                grads[p].mul_((torch.rand(1, generator=gen) + 0.5).item())
            engine = CompressedStep(OneBitConfig.from_options(freeze_step=10), state,
                                    decoupled=lambda group: False, transport=t)
            groups = [{"params": params, "lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8,
                       "weight_decay": 0.0}]

            def one():
                engine.ensure_ready(params)
                engine.begin_step()
                engine.step(groups, grads)

            for _ in range(2):  # kernels compiled, buffers allocated
                one()
            gate.wait()
            if t.rank == 0:
                sync()
                timing["start"] = time.perf_counter()
            gate.wait()
            cpu = time.thread_time()
            for _ in range(steps):
                one()
            cpu = time.thread_time() - cpu
            gate.wait()
            if t.rank == 0:
                sync()
                timing["ms"] = 1e3 * (time.perf_counter() - timing["start"]) / steps
                acts = [torch.profiler.ProfilerActivity.CPU] + (
                    [torch.profiler.ProfilerActivity.CUDA] if cuda else [])
                timing["prof"] = torch.profiler.profile(activities=acts)
                timing["prof"].__enter__()
            gate.wait()
            one()
            gate.wait()
            if t.rank == 0:
                sync()
                timing["prof"].__exit__(None, None, None)
                if n == ranks[0]:  # the host's own functions in one more step, rank 0's thread
                    host = cProfile.Profile()
                    host.enable()
            gate.wait()
            one()
            if t.rank == 0 and n == ranks[0]:
                sync()
                host.disable()
                timing["host_profile"] = _profile_text(host, "tottime", 25)
            gate.wait()
            return {"buckets": len(engine.buckets), "host_cpu_ms": 1e3 * cpu / steps}

        per_rank = run_threads(n, rank_fn, timeout=600)
        host_cpu = [r["host_cpu_ms"] for r in per_rank]
        # the ranks' threads take turns on the interpreter: their CPU time, summed, against the
        # wall time of all of them says how much of the step the host's own work is
        entry = {"ranks": n, "buckets": per_rank[0]["buckets"],
                 "wall_ms_per_step_all_ranks": timing["ms"],
                 "wall_ms_per_step_over_ranks": timing["ms"] / n,
                 "ratio_wall_over_ranks_to_adam": timing["ms"] / n / adam_ms,
                 "host_cpu_ms_per_rank_step": sum(host_cpu) / n,
                 "host_cpu_share_of_wall": sum(host_cpu) / timing["ms"]}
        if "host_profile" in timing:
            entry["host_profile_rank0"] = timing.pop("host_profile")
        if cuda:
            kt = _kernel_times(timing["prof"], n)
            entry.update(device_time=kt,
                         ratio_device_time_per_rank_to_adam_wall=kt["total_ms_per_rank"] / adam_ms)
        out["worlds"].append(entry)
        if cuda:
            torch.cuda.empty_cache()
    out["ok"] = True
    return out


def _repository_env() -> tuple[Path, dict]:
    """The repository's root and an environment whose PYTHONPATH puts it first, for the jobs
    the checks launch from it."""
    root = Path(__file__).resolve().parents[2]
    return root, dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(root)] + [v for v in [os.environ.get("PYTHONPATH")] if v]))


def check_ddp_face(timeouts=(("nccl", 90.0), ("gloo", 240.0))) -> dict:
    """torchrun of ``gpu_ddp`` with 2 ranks on this machine's GPU(s): NCCL, then Gloo."""
    import subprocess
    import torch
    root, env = _repository_env()
    out = {"gpus": torch.cuda.device_count()}
    for backend, timeout in timeouts:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(29700 + len(out)), "-m", "hvd_onebit_tools.bench.gpu_ddp",
               "--backend", backend]
        try:
            proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True,
                                  timeout=timeout)
            lines = [ln[len("GPU_DDP_JSON "):] for ln in proc.stdout.splitlines()
                     if ln.startswith("GPU_DDP_JSON ")]
            entry = {"returncode": proc.returncode,
                     "reports": [json.loads(ln) for ln in lines],
                     "stderr_tail": proc.stderr[-1500:]}
        except subprocess.TimeoutExpired as exc:
            entry = {"returncode": None, "timeout_s": timeout,
                     "stdout_tail": (exc.stdout or b"")[-1500:].decode(errors="replace")
                     if isinstance(exc.stdout, bytes) else str(exc.stdout)[-1500:]}
        out[backend] = entry
    gloo = out["gloo"].get("reports") or [{}]
    out["ok"] = bool(gloo[0].get("ok"))
    return out


def check_probe(timeout: float = 120.0) -> dict:
    """`check --probe --json` under torchrun with 2 ranks: through NCCL on GPU memory where
    this machine has a GPU per rank, else (one GPU, which NCCL takes for one rank only) through
    Gloo on host memory."""
    import subprocess
    import torch
    root, env = _repository_env()
    expected = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "-m", "hvd_onebit_tools.cli", "check", "--probe", "--params", "100M",
           "--compute-ms", "100", "--json"]
    try:
        proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "timeout_s": timeout}
    start = proc.stdout.find("{")
    out = {"returncode": proc.returncode, "expected_device": expected,
           "stderr_tail": proc.stderr[-1500:]}
    if start >= 0:  # printed also where a part of the environment blocks a job (status 1)
        try:
            out["probe"] = json.loads(proc.stdout[start:]).get("probe")
        except json.JSONDecodeError as exc:
            out["stdout_tail"], out["error"] = proc.stdout[-1500:], str(exc)
    probe = out.get("probe") or {}
    out["ok"] = probe.get("device") == expected and probe.get("bus_bps", 0) > 0
    return out


def _guarded(name, fn, *args) -> dict:
    start = time.perf_counter()
    try:
        out = fn(*args)
    except Exception as exc:  # noqa: BLE001 - every check reports, none stops the others
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
               "traceback": traceback.format_exc()[-3000:]}
    out["seconds"] = round(time.perf_counter() - start, 2)
    return out


def run(dry_run: bool, numels, out: Optional[Path] = None, only=None) -> dict:
    device = "cpu" if dry_run else "cuda"
    import torch
    from hvd_onebit import kernels
    report = {"device": device, "dry_run": dry_run, "torch": torch.__version__,
              "cuda_available": torch.cuda.is_available(),
              "triton_installed": kernels.triton_available(), "checks": {}}
    if not dry_run and not torch.cuda.is_available():
        report["error"] = "no CUDA device (torch.cuda.is_available() is False); try --dry-run"
        return report
    from hvd_onebit_tools.bench.report import provenance
    report.update(command="python benchmarks/gpu_check.py " + " ".join(sys.argv[1:]),
                  **provenance())
    if not dry_run:
        import triton
        report["device_name"] = torch.cuda.get_device_name()
        report["versions"].update(cuda=torch.version.cuda, triton=triton.__version__,
                                  nccl=".".join(map(str, torch.cuda.nccl.version())))
    checks = report["checks"]
    if dry_run:
        plan = [("bits", check_bits, (device,)),
                ("virtual_ranks", check_virtual_ranks, (device, 4099)),
                ("compressed_step", check_compressed_step, (device, 64, 3)),
                ("engine_paths", check_engine_paths, (device, 64, 3)),
                ("gradient_paths", check_gradient_paths, (device,)),
                ("memory_lean", check_memory_lean, (device, (2, 8), 3, 64)),
                ("host_cost", check_host_cost, (device, 4096, 2)),
                ("step_time", check_step_time, (device, (2,), 64, 3, 2)),
                ("probe", check_probe, ()),
                ("wide", check_wide, (device, 4099))]  # the code, not yet its int64 positions
        skipped = ("ratios", "memory", "host_syncs", "bits_large", "ddp_face", "kernel_sweep")
    else:
        plan = [("bits", check_bits, (device,)),
                ("virtual_ranks", check_virtual_ranks, (device, 1 << 20)),
                ("compressed_step", check_compressed_step, (device,)),
                ("engine_paths", check_engine_paths, (device,)),
                ("gradient_paths", check_gradient_paths, (device,)),
                ("memory", check_memory, (16 << 20,)),
                ("host_syncs", check_host_syncs, (16 << 20,)),
                ("ratios", check_ratios, (numels,)),
                ("host_cost", check_host_cost, (device,)),
                ("kernel_sweep", check_kernel_sweep, (device,)),
                ("memory_lean", check_memory_lean, (device,)),
                ("step_time", check_step_time, (device,)),
                ("ddp_face", check_ddp_face, ()),
                ("probe", check_probe, ()),
                ("bits_large", check_bits_large, (device,)),
                ("wide", check_wide, (device,))]  # last: it takes most of the GPU's memory
        skipped = ()
    for name in skipped:
        checks[name] = {"ok": None, "skipped": "needs CUDA"}
    for name, fn, args in plan:
        if only and name not in only:
            continue
        checks[name] = _guarded(name, fn, *args)
        report["ok"] = all(c.get("ok") is not False for c in checks.values())
        print(f"[gpu_check] {name}: ok={checks[name].get('ok')} in {checks[name]['seconds']} s",
              file=sys.stderr, flush=True)
        if out is not None:
            out.write_text(json.dumps(report, indent=2) + "\n")
    report["ok"] = all(c.get("ok") is not False for c in checks.values())
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU: CPU tensors under Triton's interpreter, small sizes")
    ap.add_argument("--numel", default="16M,64M,128M,256M",
                    help="sizes for the kernel ratios (CUDA only)")
    ap.add_argument("--out", default=None,
                    help="also write the JSON to this file (after every check)")
    ap.add_argument("--only", default=None, help="comma-separated checks to run (default: all)")
    args = ap.parse_args(argv)
    if args.dry_run:  # before anything imports triton
        os.environ["TRITON_INTERPRET"] = "1"
    from hvd_onebit_tools.bench.cli.options import parse_count
    report = run(args.dry_run, [parse_count(v) for v in args.numel.split(",") if v.strip()],
                 Path(args.out) if args.out else None,
                 set(args.only.split(",")) if args.only else None)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if report.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
