"""Measure the constants of the scale model (:mod:`hvd_onebit.bench.predict`) on this machine.

Three groups, saved together as one JSON file (``hvd-onebit bench calibrate --out FILE``):

* **compute** (no Horovod): for ``k`` processes running at once on this machine's cores
  (``k`` in ``--procs``, default 1, 2, 4), each with one torch thread as a rank has, the
  bench models' whole step (forward, backward, fused Adam) run free, as `bench train`'s
  ``local`` ranks run it, then forward+backward and Adam's step each timed with all k processes
  in the same phase (ranks synchronised by collectives run them so, and contend more for cores
  and memory), and the 1-bit kernels' time per element (momentum + compress, server step,
  decode + update), in lock-step too; and the hierarchical collective's passes (momentum
  written out, the node mean inside the shard's compression, a float32 add, plain compress and
  decode, the copy-out with Adam's update). ``k = 1`` is a rank with a core to itself; larger ``k``
  is what ranks that share cores (the emulator) get.
* **collectives** (Horovod over Gloo on the emulated cluster, every rank its own link): the
  time of a tiny allreduce, alltoall and allgather (the per-op cost: negotiation, size
  exchanges, per-peer messages), and of large fp32 and fp16 allreduces, alltoalls and
  allgathers, at ``--np`` ranks, first on unshaped links (the host's own cost per byte:
  reductions, copies, the TCP stack) then on shaped links of ``--link`` (the link's efficiency:
  payload bytes per second over the nominal rate). The same jobs time the 1-bit stages as
  ``transport="torch"`` runs them (:class:`~hvd_onebit.transport.torch_distributed.TorchTransport`:
  torch.distributed's Gloo alltoall and allgather, no Horovod negotiation), tiny and large,
  under ``torch_*`` keys; and the bench models' compute and the 1-bit kernels as the ranks of
  those jobs run them (next to Horovod's background thread, every rank in the same phase),
  which `bench predict --colocated` prefers to the bare processes' figures.
* **machine**: cores, and the date.

Every timed collective starts after a barrier; a call's time is the slowest rank's (the op ends
when its last rank is done); the median of ``repeats`` calls is kept.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Optional

CALIBRATION_VERSION = 6
# version 2: no torch.distributed collectives, no hierarchical passes; version 3: not the
# hierarchical collective's native passes (read, with what needs them refused); version 4: no
# fp16 allreduce of the bench models' own gradients (fp16 predicted from random normal values);
# version 5: no kernels timed inside the Horovod ranks (the bare processes' figures serve)
READABLE_VERSIONS = (2, 3, 4, 5, 6)
DEFAULT_PATH = Path("~/.cache/hvd_onebit/calibration.json")
# the bench train models at their default sizes (hvd-onebit bench train --model ...)
BENCH_MODELS = {
    "embedding": {"model": "embedding", "vocab": 32768, "embed_dim": 256, "width": 2048,
                  "tokens": 2048, "batch": 4},
    "mlp": {"model": "mlp", "width": 2048, "depth": 3, "batch": 4},
}


def _bench_model(cfg: dict, data_seed: int):
    """One of ``bench train``'s models (``cfg`` as in BENCH_MODELS) with fused Adam and one
    batch of data from ``data_seed``, warmed up by three steps. Returns (net, opt, fwd_bwd,
    step): the forward and backward pass, and the whole step."""
    import torch

    from .train import IN_DIM, OUT_DIM, build_embedding_model, build_mlp

    torch.manual_seed(0)
    net = (build_mlp(cfg["width"], cfg["depth"]) if cfg["model"] == "mlp" else
           build_embedding_model(cfg["vocab"], cfg["embed_dim"], cfg["width"]))
    opt = torch.optim.Adam(net.parameters(), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(data_seed)
    x = (torch.randn(cfg["batch"], IN_DIM, generator=g) if cfg["model"] == "mlp" else
         torch.randint(cfg["vocab"], (cfg["batch"], cfg["tokens"]), generator=g))
    y = torch.randn(cfg["batch"], OUT_DIM, generator=g)
    loss_fn = torch.nn.MSELoss()

    def fwd_bwd():
        opt.zero_grad()
        loss_fn(net(x), y).backward()

    def step():
        fwd_bwd()
        opt.step()

    for _ in range(3):
        step()
    return net, opt, fwd_bwd, step


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


def _kernel_calls(numel: int) -> dict:
    """The 1-bit kernels as the compressed steps run them, each a call on buffers of ``numel``
    float32 elements (4 chunks), by name; the buffers live as long as the calls."""
    import torch

    from .. import kernels
    from ..comm.hierarchical import NodeMean
    from ..kernels import fused_adam
    from ..layout import Layout

    L = Layout.build(numel, 4)
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(numel, generator=g)
    m, y_prev, y_next = (torch.randn(numel, generator=g) * 0.1,
                         torch.randn(L.padded, generator=g) * 0.01, torch.empty(L.padded))
    prev_send = torch.zeros(L.n * L.row_bytes, dtype=torch.uint8)
    send = torch.empty(L.n * L.row_bytes, dtype=torch.uint8)
    server_z, server_z_out = torch.zeros(L.chunk), torch.empty(L.chunk)
    server_sent, row = (torch.zeros(L.row_bytes, dtype=torch.uint8),
                        torch.empty(L.row_bytes, dtype=torch.uint8))
    w, var = torch.randn(numel), torch.rand(numel) + 0.01
    work = torch.empty(numel)
    src = fused_adam.MomentumInput(m, [grad], [numel], 0.9)
    update = fused_adam.AdamUpdate([w], [var], [numel], [-1e-4], [1.0], [0.3], [1e-8])
    x, acc = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
    mean = NodeMean([x, acc], torch.empty(numel))
    return {
        "compress_momentum": lambda: fused_adam.worker_compress_momentum(
            src, y_prev, prev_send, y_next, send, L, "native"),
        # the server reduces one chunk from each of n ranks: L.padded elements read per rank
        "server": lambda: kernels.server_compress(send, server_z, server_sent, server_z_out,
                                                  row, L, "native"),
        "decode_update": lambda: fused_adam.decode_update(send, work, L, update, "native"),
        # the hierarchical collective's passes (hvd_onebit/comm/hierarchical.py): Adam's momentum
        # update written out, the node mean of 2 rows inside the shard's compression (per
        # element of the shard; a float32 add per further row), the plain compress (one node)
        # and decode of a shard, the gathered mean copied out with Adam's update
        "momentum_update": lambda: src.materialize(out=x, backend="native"),
        "compress_mean": lambda: mean.compress(y_prev, prev_send, y_next, send, L, "native"),
        "update": lambda: update.copy_apply(x, work, "native"),
        "add": lambda: acc.add_(x),
        "compress": lambda: kernels.worker_compress(x, y_prev, prev_send, y_next, send, L,
                                                    "native"),
        "decode": lambda: kernels.decode(send, work, L, "native"),
    }


def _compute_proc(k: int, models: dict, kernel_numel: int, repeats: int, seconds: float, barrier,
                  queue) -> None:
    """One of ``k`` processes timing the same work at the same time (so they share the cores)."""
    import torch

    torch.set_num_threads(1)
    shared = k > len(os.sched_getaffinity(0))
    out: dict = {"models": {}}
    for name, cfg in models.items():
        net, opt, fwd_bwd, step = _bench_model(cfg, data_seed=1)
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
    for kname, call in _kernel_calls(kernel_numel).items():
        call()
        barrier.wait()
        out["kernel_s_per_elem"][kname] = _median_time(
            call, repeats, seconds, shared=shared, barrier=barrier) / kernel_numel
    queue.put(out)


#: Elements per buffer of the timed kernels: their buffers (64 MiB each) are well beyond a
#: last-level cache, as a model's are. With buffers that partly fit in the cache, processes
#: timed together ran at one process's per-element speed, where ranks streaming a model's
#: buffers share the memory bandwidth.
KERNEL_NUMEL = 16 << 20


def measure_compute(procs=(1, 2, 4), models: Optional[dict] = None,
                    kernel_numel: int = KERNEL_NUMEL, repeats: int = 3,
                    seconds: float = 1.5) -> dict:
    """Per ``k`` in ``procs``: the medians over the k processes of each timed quantity."""
    import multiprocessing as mp

    from .. import kernels
    from .train import MALLOC_REUSE_ENV

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
            result[str(k)] = {
                "models": {name: {key: (statistics.median(o["models"][name][key] for o in outs))
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


def _rank_timer(seconds: float):
    """In every rank of a Horovod job: ``timed(fn, lockstep)``, the median time of calls of
    ``fn`` made for ``seconds``, the mean over ranks (as `bench train` takes a step's time).
    Free-running: the call alone. Lock-step: every call after a Horovod barrier, as a step's
    collectives line ranks up, until the last rank is done (the next collective waits for
    it), less an empty barrier's own time."""
    import horovod.torch as hvd
    import torch

    def barrier():
        _wait(hvd.allreduce_async(torch.zeros(1), name="cal.compute.barrier"))

    def timed(fn, lockstep: bool, empty: float = 0.0) -> float:
        times: list[float] = []
        end = time.perf_counter() + seconds
        while True:
            if lockstep:
                barrier()
            start = time.perf_counter()
            fn()
            if lockstep:
                barrier()
            times.append(time.perf_counter() - start)
            if len(times) % 5 == 0:  # every rank makes the same number of calls
                more = float(time.perf_counter() < end)
                if float(hvd.allreduce(torch.tensor([more]), op=hvd.Max,
                                       name="cal.compute.more")) == 0:
                    break
        med = statistics.median(times) - (empty if lockstep else 0.0)
        return float(hvd.allreduce(torch.tensor([med], dtype=torch.float64), op=hvd.Average,
                                   name="cal.compute.mean"))

    empty = timed(lambda: None, True)
    return lambda fn, lockstep: timed(fn, lockstep, empty), barrier


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

    timed, barrier = _rank_timer(seconds)
    out = {}
    for name, cfg in models.items():
        net, opt, fwd_bwd, step = _bench_model(cfg, data_seed=hvd.rank())
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


def ranks_kernels(numel: int = KERNEL_NUMEL, seconds: float = 1.0) -> dict:
    """Runs in every rank of a Horovod job: each 1-bit kernel's time per element on buffers of
    ``numel`` floats, in lock-step as a compressed step runs them (:func:`_rank_timer`): every
    rank streams its buffers at once, next to Horovod's background thread. Bare processes
    timed together did not stand for this: two of them often ran at one process's speed,
    which the ranks of a step do not."""
    timed, _ = _rank_timer(seconds)
    out = {}
    for name, call in _kernel_calls(numel).items():
        call()
        out[name] = timed(call, True) / numel
        # the same figure on every rank (the mean over ranks): every rank stops here together
        if out[name] <= 0:
            raise RuntimeError(
                f"calibration: the {name} kernel on {numel} elements took no longer than an "
                "empty Horovod barrier here, so its time is lost in the barrier's noise; time "
                "the kernels on more elements")
    return out


def collectives_worker(numel: int = 4 << 20, repeats: int = 7, tiny_repeats: int = 21,
                       torch_ops: bool = True, models: Optional[dict] = None,
                       kernel_numel: int = KERNEL_NUMEL) -> dict:
    """Runs in every rank: median time (slowest rank) of tiny and large Horovod collectives, and
    with ``torch_ops`` of the 1-bit stages through torch.distributed (``torch_*``: what
    ``transport="torch"``, the default on CPU, runs them with). With ``models``, first the
    models' compute (:func:`ranks_compute`) and the kernels on ``kernel_numel`` elements
    (:func:`ranks_kernels`) as these ranks run them.

    Every wait sleeps (:func:`~hvd_onebit.transport.horovod.sleep_until_done`), as the train benchmark's
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

        from ..transport.torch_distributed import TorchTransport

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
        # tiny ops: the smallest median of three windows (see _median_time)
        out["median_s"][name] = _slowest_median(call, barriers[name],
                                                tiny_repeats if tiny else repeats,
                                                f"cal.times.{name}", windows=3 if tiny else 1)
    return out


def _wait(handle):
    """Sleep until a Horovod handle is done (as `bench train`'s ranks wait), then its result."""
    import horovod.torch as hvd

    from ..transport.horovod import sleep_until_done

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


def measure_collectives(nps=(2, 4), link: str = "1gbit", numel: int = 4 << 20, repeats: int = 7,
                        queue_ms: float = 2.0, timeout: float = 900.0,
                        models: Optional[dict] = None) -> dict:
    """``{np: {"unlimited": row, link: row}}`` from jobs on the emulated cluster (root needed);
    with ``models`` the unlimited row also has the bench models' compute timed inside the
    ranks (:func:`ranks_compute`)."""
    from ..cluster import EmulatedCluster
    from ..testing import run_job
    from .train import MALLOC_REUSE_ENV

    out: dict = {}
    for n in nps:
        for bw in ("unlimited", link):
            kwargs = {"numel": numel, "repeats": repeats}
            if bw == "unlimited" and models:
                kwargs["models"] = models
            with EmulatedCluster(np=n, bandwidth=bw, queue_ms=queue_ms) as cluster:
                job = run_job("hvd_onebit.bench.calibrate:collectives_worker", np=n,
                              kwargs=kwargs, timeout=timeout, cluster=cluster,
                              env=MALLOC_REUSE_ENV)
            out.setdefault(str(n), {})[bw] = job.results[0]
    return out


def calibrate(procs=(1, 2, 4), nps=(2, 4), link: str = "1gbit", numel: int = 4 << 20,
              repeats: int = 7, queue_ms: float = 2.0, progress=None) -> dict:
    """Everything the scale model needs, measured here. ``progress(str)`` reports each stage."""
    from ..cluster.bandwidth import parse_bandwidth
    from .report import machine_info

    say = progress or (lambda s: None)
    start = time.monotonic()
    say(f"compute and kernels with {', '.join(map(str, procs))} processes at once...")
    compute = measure_compute(procs=procs)
    say(f"collectives on the emulated cluster, np={', '.join(map(str, nps))}, "
        f"unlimited and {link} links...")
    coll = measure_collectives(nps=nps, link=link, numel=numel, repeats=repeats,
                               queue_ms=queue_ms, models=BENCH_MODELS)
    return {"version": CALIBRATION_VERSION, "machine": machine_info(),
            "cores": len(os.sched_getaffinity(0)), "link": link,
            "link_bps": parse_bandwidth(link), "queue_ms": queue_ms, "bench_models": BENCH_MODELS,
            "compute": compute, "collectives": coll,
            "seconds": time.monotonic() - start}


def save(cal: dict, path) -> Path:
    p = Path(path).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(cal, indent=2))
    return p


class CalibrationMissing(FileNotFoundError):
    pass


def load(path) -> dict:
    """The saved calibration, or a clear error that says how to make one."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CalibrationMissing(
            f"no calibration file at {p}: run `hvd-onebit bench calibrate --out {p}` on the "
            "machine whose constants you want (it needs root for the emulated cluster, "
            "about 3 minutes), or pass --calibration PATH")
    cal = json.loads(p.read_text())
    if cal.get("version") not in READABLE_VERSIONS:
        raise ValueError(f"{p} is calibration version {cal.get('version')}, this model reads "
                         f"versions {', '.join(map(str, READABLE_VERSIONS))}: run `hvd-onebit bench "
                         "calibrate` again")
    for key in ("compute", "collectives", "cores"):
        if key not in cal:
            raise ValueError(f"{p} has no {key!r}: not a calibration file from "
                             "`hvd-onebit bench calibrate`")
    return cal
