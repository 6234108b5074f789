"""The compute group of a calibration, without Horovod: the bench models' step and phases
and the 1-bit kernels' time per element, timed by ``k`` bare processes at once (ranks sharing
this machine's cores; ``k = 1``: a rank with a core to itself)."""
from __future__ import annotations

import os
import statistics
import time
from typing import Optional

from .workloads import BENCH_MODELS, KERNEL_NUMEL, bench_model, kernel_calls


def _median_time(fn, repeats: int, min_seconds: float = 0.0, windows: int = 5,
                 shared: bool = False, barrier=None) -> float:
    """Time of ``fn`` on this machine, not its neighbours': the medians of ``windows`` windows
    (each at least ``repeats`` calls and ``min_seconds / windows`` seconds, so that processes
    timing at once overlap throughout), and the smallest of them. Other jobs on a shared
    machine come and go; a window they hit is slower, and is not kept.

    ``shared``: processes share the cores (more of them than cores). The scheduler then runs
    some calls whole within a time slice and stretches others over several, so the median
    call is the unshared time; a window's mean (its time over its calls) is the share of the
    cores a call really gets. ``barrier``: every process timing at once starts each window
    together, so that the smallest window is not one the others did not overlap."""
    best = float("inf")
    for _ in range(windows):
        if barrier is not None:
            barrier.wait()
        times = []
        end = time.perf_counter() + min_seconds / windows
        while len(times) < repeats or time.perf_counter() < end:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        best = min(best, statistics.fmean(times) if shared else statistics.median(times))
    return best


def _compute_proc(k: int, models: dict, kernel_numel: int, repeats: int, seconds: float, barrier,
                  queue) -> None:
    """One of ``k`` processes timing the same work at the same time (so they share the cores)."""
    import torch

    torch.set_num_threads(1)
    shared = k > len(os.sched_getaffinity(0))
    out: dict = {"models": {}}
    for name, cfg in models.items():
        net, opt, fwd_bwd, step = bench_model(cfg, data_seed=1)
        # the whole step free-running (as `bench train`'s local method runs), then each phase
        # in lock-step (as ranks that collectives synchronise run them)
        barrier.wait()
        step_s = _median_time(step, repeats, seconds, shared=shared, barrier=barrier)
        barrier.wait()
        fwd_bwd_s = _median_time(fwd_bwd, repeats, seconds, shared=shared, barrier=barrier)
        barrier.wait()
        out["models"][name] = {"params": sum(p.numel() for p in net.parameters()),
                               "step_s": step_s, "fwd_bwd_s": fwd_bwd_s,
                               "adam_s": _median_time(opt.step, repeats, seconds,
                                                      shared=shared, barrier=barrier)}
    out["kernel_s_per_elem"] = {}
    for kname, call in kernel_calls(kernel_numel).items():
        call()
        barrier.wait()
        out["kernel_s_per_elem"][kname] = _median_time(
            call, repeats, seconds, shared=shared, barrier=barrier) / kernel_numel
    queue.put(out)


def measure_compute(procs=(1, 2, 4), models: Optional[dict] = None,
                    kernel_numel: int = KERNEL_NUMEL, repeats: int = 3,
                    seconds: float = 1.5) -> dict:
    """Per ``k`` in ``procs``: the medians over the k processes of each timed quantity
    (:data:`~.workloads.FIGURES` says what each is)."""
    import multiprocessing as mp

    from hvd_onebit import kernels
    from ..train import MALLOC_REUSE_ENV

    if not kernels.native_available():
        raise RuntimeError("calibration times the native kernels, which are not built here")
    models = models or BENCH_MODELS
    # the ranks of `bench train` run with these (glibc reads them at start-up)
    saved = {k: os.environ.get(k) for k in (*MALLOC_REUSE_ENV, "OMP_NUM_THREADS")}
    os.environ.update({**MALLOC_REUSE_ENV, "OMP_NUM_THREADS": "1"})
    ctx = mp.get_context("spawn")
    result = {}
    try:
        for k in procs:
            barrier, queue = ctx.Barrier(k), ctx.Queue()
            ps = [ctx.Process(target=_compute_proc,
                              args=(k, models, kernel_numel, repeats, seconds, barrier, queue))
                  for _ in range(k)]
            for p in ps:
                p.start()
            outs = [queue.get(timeout=600) for _ in ps]
            for p in ps:
                p.join()
            # the parameter count is the model's, the same in every process; the times are
            # the median over the processes
            result[str(k)] = {
                "models": {name: {key: (outs[0]["models"][name][key] if key == "params" else
                                        statistics.median(o["models"][name][key] for o in outs))
                                  for key in outs[0]["models"][name]}
                           for name in models},
                "kernel_s_per_elem": {kn: statistics.median(o["kernel_s_per_elem"][kn] for o in outs)
                                      for kn in outs[0]["kernel_s_per_elem"]},
            }
    finally:
        for key, v in saved.items():
            if v is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = v
    return result
