"""What runs inside every rank of a calibration's Horovod jobs: tiny and large Horovod (and
torch.distributed) collectives, and the bench models' compute and the 1-bit kernels as the
ranks of a job run them, next to Horovod's background thread, in lock-step."""
from __future__ import annotations

import math
import statistics
import time
from typing import Optional

from .workloads import KERNEL_NUMEL, bench_model, kernel_calls


def _rank_timer(seconds: float):
    """In every rank of a Horovod job: ``timed(fn, lockstep, calls=1)``, the median time of one
    call of ``fn`` over calls made for ``seconds``, the mean over ranks (as `bench train` takes
    a step's time). Free-running: the call alone. Lock-step: ``calls`` calls after a Horovod
    barrier, as a step's collectives line ranks up, until the last rank is done (the next
    collective waits for it), less an empty barrier's own time, divided by ``calls``. Also
    returns ``barrier`` and ``empty``, the empty barrier's own time."""
    import horovod.torch as hvd
    import torch

    def barrier():
        _wait(hvd.allreduce_async(torch.zeros(1), name="cal.compute.barrier"))

    def timed(fn, lockstep: bool, empty: float = 0.0, calls: int = 1) -> float:
        times: list[float] = []
        end = time.perf_counter() + seconds
        while True:
            if lockstep:
                barrier()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            if lockstep:
                barrier()
            times.append(time.perf_counter() - start)
            if len(times) % 5 == 0:  # every rank makes the same number of calls
                more = float(time.perf_counter() < end)
                if float(hvd.allreduce(torch.tensor([more]), op=hvd.Max,
                                       name="cal.compute.more")) == 0:
                    break
        med = (statistics.median(times) - (empty if lockstep else 0.0)) / calls
        return float(hvd.allreduce(torch.tensor([med], dtype=torch.float64), op=hvd.Average,
                                   name="cal.compute.mean"))

    empty = timed(lambda: None, True)
    return lambda fn, lockstep, calls=1: timed(fn, lockstep, empty, calls), barrier, empty


def ranks_compute(models: dict, seconds: float = 1.0) -> dict:
    """Runs in every rank of a Horovod job: the bench models' compute as `bench train`'s ranks
    run it, next to Horovod's background thread (it wakes every cycle) and every other rank
    of this machine (see :func:`_rank_timer`). ``step_s``: the whole step free-running (the
    ``local`` method); in lock-step ``fwd_bwd_s`` (forward + backward) and ``adam_s`` (fused
    Adam). ``fp16_allreduce_s``: ``Compression.fp16``'s cast, allreduce and cast back of the
    model's own gradient, all of it in one buffer (the slowest rank's median): its cost depends
    on the values, not only on their number, because gradients under 2**-14 in magnitude become
    float16 subnormals, which the host converts and sums several times slower than normal
    values or zeros."""
    import horovod.torch as hvd
    import torch

    timed, barrier, _ = _rank_timer(seconds)
    out = {}
    for name, cfg in models.items():
        net, opt, fwd_bwd, step = bench_model(cfg, data_seed=hvd.rank())
        out[name] = {"params": sum(p.numel() for p in net.parameters()),
                     "step_s": timed(step, False), "fwd_bwd_s": timed(fwd_bwd, True),
                     "adam_s": timed(opt.step, True)}
        fwd_bwd()
        grad = torch.cat([p.grad.flatten() for p in net.parameters() if p.grad is not None])
        del net, opt
        out[name]["fp16_allreduce_s"] = _slowest_median(
            lambda g=grad: _fp16_allreduce(hvd, g), barrier, repeats=5,
            name=f"cal.fp16.{name}.times")
        del grad
    return out


def ranks_kernels(numel: int = KERNEL_NUMEL, seconds: float = 1.0,
                  clear_of_barrier: float = 8.0, max_calls: int = 64) -> dict:
    """Runs in every rank of a Horovod job: each 1-bit kernel's time per element on buffers of
    ``numel`` floats, in lock-step as a compressed step runs them (:func:`_rank_timer`): every
    rank streams its buffers at once, next to Horovod's background thread. Bare processes
    timed together did not stand for this: two of them often ran at one process's speed,
    which the ranks of a step do not.

    A fast kernel on a fast machine can take less than the empty barrier's jitter, so each
    kernel runs as many times between two barriers as it takes for the calls to last
    ``clear_of_barrier`` times an empty barrier (the fastest rank's free-running call sets the
    count, the same on every rank), at most ``max_calls``."""
    import horovod.torch as hvd
    import torch

    timed, _, empty = _rank_timer(seconds)
    out = {}
    for name, call in kernel_calls(numel).items():
        call()
        start = time.perf_counter()
        call()
        one = float(hvd.allreduce(torch.tensor([time.perf_counter() - start],
                                               dtype=torch.float64),
                                  op=hvd.Min, name=f"cal.kernel.{name}.one"))
        calls = int(min(max_calls, max(1, math.ceil(clear_of_barrier * empty / max(one, 1e-9)))))
        out[name] = timed(call, True, calls) / numel
        # the same figure on every rank (the mean over ranks): every rank stops here together
        if out[name] <= 0:
            raise RuntimeError(
                f"calibration: the {name} kernel on {numel} elements, {calls} calls between "
                f"two barriers, took no longer than an empty Horovod barrier ({empty * 1e3:.3f} "
                "ms) here, so its time is lost in the barrier's noise; time the kernels on more "
                "elements")
    return out


def collectives_worker(numel: int = 4 << 20, repeats: int = 7, tiny_repeats: int = 21,
                       torch_ops: bool = True, models: Optional[dict] = None,
                       kernel_numel: int = KERNEL_NUMEL) -> dict:
    """Runs in every rank: median time (slowest rank) of tiny and large Horovod collectives, and
    with ``torch_ops`` of the 1-bit stages through torch.distributed (``torch_*``: what
    ``transport="torch"``, the default on CPU, runs them with). With ``models``, first the
    models' compute (:func:`ranks_compute`) and the kernels on ``kernel_numel`` elements
    (:func:`ranks_kernels`) as these ranks run them.

    Every wait sleeps (:func:`~hvd_onebit.transports.sleep_until_done`), as the train benchmark's
    do: ranks spinning in ``hvd.synchronize`` would take the cores of ranks sharing them. Gloo's
    own waits already block on a condition variable.
    """
    import horovod.torch as hvd
    import torch

    n = hvd.size()
    row = max(8, numel // 8 // n)  # one 1-bit row of a numel-element buffer
    x = torch.randn(numel)
    calls = {
        "allreduce_tiny": lambda: _wait(hvd.allreduce_async(torch.zeros(1), name="cal.ar.tiny")),
        "alltoall_tiny": lambda: _wait(hvd.alltoall_async(torch.zeros(n, 8, dtype=torch.uint8),
                                                         name="cal.a2a.tiny")),
        "allgather_tiny": lambda: _wait(hvd.allgather_async(torch.zeros(1, 8, dtype=torch.uint8),
                                                           name="cal.ag.tiny")),
        "allreduce_fp32": lambda: _wait(hvd.allreduce_async(x, op=hvd.Average, name="cal.ar.fp32")),
        "allreduce_fp16": lambda: _fp16_allreduce(hvd, x),
        # full precision: the hierarchical collective's scatter and gather inside a node
        "alltoall_fp32": lambda: _wait(hvd.alltoall_async(x.view(n, -1), name="cal.a2a.fp32")),
        "alltoall": lambda: _wait(hvd.alltoall_async(torch.zeros(n, row, dtype=torch.uint8),
                                                    name="cal.a2a")),
        "allgather": lambda: _wait(hvd.allgather_async(torch.zeros(1, row, dtype=torch.uint8),
                                                      name="cal.ag")),
    }
    barriers = dict.fromkeys(calls, lambda: _wait(hvd.allreduce_async(torch.zeros(1),
                                                                      name="cal.barrier")))
    if torch_ops:
        import torch.distributed as dist

        from hvd_onebit.transport.torch_distributed import TorchTransport

        tt = TorchTransport()  # torch.distributed's default group over Horovod's ranks (Gloo)
        torch_calls = {
            "torch_alltoall_tiny": lambda: tt.wait(tt.alltoall_async(
                torch.zeros(n, 8, dtype=torch.uint8), "cal.t.a2a.tiny")),
            "torch_allgather_tiny": lambda: tt.wait(tt.allgather_async(
                torch.zeros(1, 8, dtype=torch.uint8), "cal.t.ag.tiny")),
            "torch_alltoall": lambda: tt.wait(tt.alltoall_async(
                torch.zeros(n, row, dtype=torch.uint8), "cal.t.a2a")),
            "torch_allgather": lambda: tt.wait(tt.allgather_async(
                torch.zeros(1, row, dtype=torch.uint8), "cal.t.ag")),
        }
        calls.update(torch_calls)
        # the preceding op in a compressed step is a Gloo op too: a Gloo barrier
        barriers.update(dict.fromkeys(torch_calls, dist.barrier))
    out = {"np": n, "numel": numel, "row_bytes": row, "median_s": {}}
    if models:  # compute and kernels as the ranks of a Horovod job run them (before any
        # large buffer of the collectives)
        out["models"] = ranks_compute(models)
        out["kernel_s_per_elem"] = ranks_kernels(kernel_numel)
    for name, call in calls.items():
        tiny = name.endswith("_tiny")
        # tiny ops: the smallest median of three windows (see .compute._median_time)
        out["median_s"][name] = _slowest_median(call, barriers[name],
                                                tiny_repeats if tiny else repeats,
                                                f"cal.times.{name}", windows=3 if tiny else 1)
    return out


def _wait(handle):
    """Sleep until a Horovod handle is done (as `bench train`'s ranks wait), then its result."""
    import horovod.torch as hvd

    from hvd_onebit.transport.horovod import sleep_until_done

    sleep_until_done(handle)
    return hvd.synchronize(handle)


def _slowest_median(call, barrier, repeats: int, name: str, windows: int = 1) -> float:
    """Every rank calls ``call`` ``repeats`` times, each after ``barrier``; per call the slowest
    rank's time (one Horovod allreduce named ``name``), and of ``windows`` consecutive windows
    of them the smallest median (the first untimed call negotiates and allocates)."""
    import horovod.torch as hvd
    import torch

    call()
    times = []
    for _ in range(repeats):
        barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    slowest = hvd.allreduce(torch.tensor(times, dtype=torch.float64), op=hvd.Max,
                            name=name).tolist()
    size = -(-len(slowest) // windows)
    return min(statistics.median(slowest[i:i + size]) for i in range(0, len(slowest), size))


def _fp16_allreduce(hvd, x):
    """``Compression.fp16`` as Horovod's optimizer applies it: cast, allreduce, cast back."""
    comp = hvd.Compression.fp16
    half, ctx = comp.compress(x)
    return comp.decompress(_wait(hvd.allreduce_async(half, op=hvd.Average, name="cal.ar.fp16")),
                           ctx)
