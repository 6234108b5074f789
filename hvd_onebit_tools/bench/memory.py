"""`hvd-onebit bench dev memory`: what 1-bit Adam holds beyond Adam's own memory, per phase.

Adam's own: the parameters, their gradients, ``exp_avg``, ``exp_avg_sq`` and ``step``. Everything
else the optimizer, its compression engine and its collectives hold is *extra*, reported in bytes
and as a ratio to the parameters' float32 bytes (the target in the compression phase: at most
1.25, peak included).

Two numbers per phase:

* **held**: the bytes of every tensor reachable from the optimizer's state, the engine and the
  collectives (walked through their attributes, transports left out), deduplicated by storage,
  Adam's own storages excluded, after the phase's first and last step (the last warmup step
  already allocates the compression phase's buffers, while its allreduce is on the wire). Exact.
* **peak**: the most, over the phase's steps, of what was held before a step plus the transient
  growth of its backward pass and ``optimizer.step()`` (both: the optimizer starts its
  collectives from the gradient hooks, in the warmup and, with ``overlap``, in the compression
  phase) less that of the backward pass alone on a copy of the model without an optimizer
  (``backward_transient_bytes``: autograd's temporaries are not the optimizer's). torch's own
  Adam step has temporaries too, measured on that copy as ``adam_step_transient_bytes`` and
  not subtracted. Measured
  on CPU as the rise of the resident set's high-water mark (``VmHWM`` in ``/proc/self/status``,
  reset through ``/proc/self/clear_refs`` before the step) over the resident set before it, with
  glibc told to serve every allocation above 128 KiB by its own ``mmap`` (so a freed temporary
  leaves the resident set and the next one is counted again); on CUDA,
  ``torch.cuda.max_memory_allocated`` over ``memory_allocated`` before the step. The CPU figure
  counts every page the process touched (Python, Horovod's own buffers, the transport's
  copies), so it is an upper bound of the optimizer's transients; small models give noisy
  ratios.

Two ways to run: a Horovod job (``transport="horovod"``: ``DistributedOptimizer`` over ``Adam``
on a stack of linear layers, warmup and compression phases, one process per rank), or the
compression engine alone on n virtual ranks of the in-process transport (``"inprocess"``:
threads of one process, so the transient is the process's rise over one step of all ranks
together divided by n; the ranks run in lockstep, so their transients overlap).
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from .refresh import optimizer_options

ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")

#: glibc: every allocation above 128 KiB is its own mmap, given back when freed (see the module).
MALLOC_MEASURE_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10),
                      "MALLOC_TRIM_THRESHOLD_": str(128 << 10)}


# ---- held bytes ---------------------------------------------------------------------------------

def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def reachable_storages(root: Any, skip_types: tuple = ()) -> dict[int, int]:
    """{storage address: bytes} of every tensor reachable from ``root`` through containers and
    the attributes of hvd_onebit's own objects (not through ``skip_types`` instances, modules,
    functions, or other libraries' objects)."""
    from hvd_onebit.transport.base import Transport

    found: dict[int, int] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta" and not obj.is_sparse:
                ptr, nbytes = _storage(obj)
                found[ptr] = max(found.get(ptr, 0), nbytes)
            continue
        if isinstance(obj, (Transport, *skip_types)):
            continue
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif type(obj).__module__.startswith("hvd_onebit"):
            stack.extend(getattr(obj, "__dict__", {}).values())
            for name in getattr(type(obj), "__slots__", ()):
                stack.append(getattr(obj, name, None))
    return found


def adam_storages(params, state) -> set[int]:
    """Storage addresses of Adam's own memory: parameters, gradients, exp_avg, exp_avg_sq, step
    (exp_avg may be views into the engine's fused buckets: those buckets are Adam's)."""
    own = set()
    for p in params:
        for t in (p, p.grad, *(state.get(p, {}).get(k) for k in ADAM_KEYS)):
            if isinstance(t, torch.Tensor):
                own.add(_storage(t)[0])
    return own


def held_bytes(roots: dict[str, Any], params, state) -> dict[str, int]:
    """Extra bytes per root (a storage is counted once, under the first root that reaches it),
    Adam's own excluded; "total" sums them."""
    own = adam_storages(params, state)
    counted = set(own)
    out = {}
    for name, root in roots.items():
        mine = {ptr: n for ptr, n in reachable_storages(root).items() if ptr not in counted}
        counted.update(mine)
        out[name] = sum(mine.values())
    out["total"] = sum(out.values())
    return out


# ---- transient peak of one step ------------------------------------------------------------------

def use_measuring_malloc() -> None:
    """:data:`MALLOC_MEASURE_ENV` for a process already running (glibc reads the environment at
    start): ``mallopt`` through ctypes. A no-op where glibc is not the allocator."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 128 << 10)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


class StepPeak:
    """Around one step: how far memory rose above where it was (bytes). CPU: the resident
    set's high-water mark (reset first) over the resident set; CUDA: the allocator's peak."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.bytes = 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident set
            self._base = _status_kb("VmRSS") * 1024
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            self.bytes = max(0, _status_kb("VmHWM") * 1024 - self._base)


def peak_method(device: str) -> str:
    return ("torch.cuda.max_memory_allocated - memory_allocated before the step"
            if torch.device(device).type == "cuda" else
            "VmHWM (reset via /proc/self/clear_refs) - VmRSS before the step, glibc mmap "
            "threshold 128 KiB")


def _phase_entry(held: list[dict], before: list[int], transients: list[int],
                 param_bytes: int) -> dict:
    """held: after each step of the phase; before: the total held before each step;
    transients: each step's."""
    peaks = [b + t for b, t in zip(before, transients)]
    return {"held_bytes": held[0], "held_bytes_end": held[-1],
            "held_ratio": held[0]["total"] / param_bytes,
            "held_ratio_end": held[-1]["total"] / param_bytes,
            "step_transient_bytes": transients[-1], "max_step_transient_bytes": max(transients),
            "peak_bytes": max(peaks), "peak_ratio": max(peaks) / param_bytes,
            "steps_measured": len(transients)}


# ---- a Horovod job: DistributedOptimizer through both phases -------------------------------------

PHASES = ("warmup", "compression", "refresh")  # "refresh": variance refresh steps (measured apart)

def rank_run(layers: int, width: int, warmup: int, compressed: int, batch: int = 8,
             device: str = "cpu", bucket_size_mb: Optional[float] = None,
             memory: str = "lean", variance_refresh=None) -> dict:
    """Inside each rank of a Horovod job: ``warmup`` Adam steps, then ``compressed`` 1-bit
    steps of ``DistributedOptimizer(Adam)`` on ``layers`` linear layers of ``width``^2 weights;
    the memory of each phase (see the module). With ``variance_refresh``, the compression
    phase's refresh steps are measured apart, as phase "refresh"."""
    import horovod.torch as hvd

    import hvd_onebit

    torch.manual_seed(0)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(dev)
    params = list(model.parameters())
    extra = optimizer_options(variance_refresh, **({} if bucket_size_mb is None
                                                   else {"bucket_size_mb": bucket_size_mb}))
    opt = hvd_onebit.DistributedOptimizer(torch.optim.Adam(params, lr=1e-4),
                                          named_parameters=model.named_parameters(),
                                          freeze_step=warmup, memory=memory, **extra)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(hvd.rank())).to(dev)
    transients: dict[str, list[int]] = {ph: [] for ph in PHASES}
    held: dict[str, list[dict]] = {ph: [] for ph in PHASES}
    before: dict[str, list[int]] = {ph: [] for ph in PHASES}
    backward_transient, adam_transient = _baseline_transients(model, x, dev)
    last, refreshes = 0, 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(warmup + compressed):
            phase = opt.phase
            loss = model(x).square().mean()
            opt.zero_grad(set_to_none=False)
            with StepPeak(dev) as peak:
                loss.backward()
                opt.step()
            now = opt.telemetry().get("refreshes", 0)  # one read a step, after it
            if now > refreshes:
                phase = "refresh"
            refreshes = now
            transients[phase].append(max(0, peak.bytes - backward_transient))
            before[phase].append(last)
            engine = opt.compressed_step
            # the collectives first: the engine's parts reach them too
            held[phase].append(held_bytes({"optimizer_state": opt.state,
                                           "collectives": engine.comms, "engine": vars(engine),
                                           "auto_freeze": getattr(opt, "_monitor", None)},
                                          params, opt.state))
            last = held[phase][-1]["total"]
    param_bytes = 4 * sum(p.numel() for p in params)
    return {"rank": hvd.rank(), "param_bytes": param_bytes,
            "buckets": len(engine.buckets or []), "adam_step_transient_bytes": adam_transient,
            "backward_transient_bytes": backward_transient,
            "phases": {ph: _phase_entry(held[ph], before[ph], transients[ph], param_bytes)
                       for ph in PHASES if held[ph]}}


def _baseline_transients(model: torch.nn.Module, x: torch.Tensor, dev: torch.device
                         ) -> tuple[int, int]:
    """On a copy of ``model`` with torch's own Adam: the transient growth of a backward pass
    (gradients already allocated) and of one Adam step (its state already allocated)."""
    import copy

    twin = copy.deepcopy(model)
    adam = torch.optim.Adam(twin.parameters(), lr=1e-4)
    for _ in range(2):
        adam.zero_grad(set_to_none=False)
        loss = twin(x).square().mean()
        with StepPeak(dev) as backward:
            loss.backward()
        with StepPeak(dev) as step:
            adam.step()
    del twin, adam
    return backward.bytes, step.bytes


# ---- the engine alone on n virtual ranks ---------------------------------------------------------

def inprocess_run(n: int, layers: int, width: int, steps: int,
                  bucket_size_mb: Optional[float] = None, memory: str = "lean",
                  device: str = "cpu") -> dict:
    """The compression engine (:class:`~hvd_onebit.engine.CompressedStep`) on n virtual
    ranks (threads, in-process transport), from a warmed-up Adam state: the compression phase's
    memory per rank over ``steps`` steps after a first one. On CUDA every virtual rank holds
    its tensors on the one device, and the peak is the allocator's over all ranks' step,
    divided by n, as on CPU."""
    import threading

    from hvd_onebit.engine import NOT_FROZEN, CompressedStep
    from hvd_onebit.config import OneBitConfig
    from hvd_onebit.transport.inprocess import run_threads

    dev = torch.device(device)
    if dev.type == "cpu":
        use_measuring_malloc()
    gate = threading.Barrier(n)
    peaks: list[int] = []

    def rank_fn(t):
        g = torch.Generator().manual_seed(0)
        params = [torch.randn(width, width, generator=g).to(dev) for _ in range(layers)]
        state = {p: {"step": torch.tensor(10.0),
                     "exp_avg": (torch.randn(p.shape, generator=g) * 1e-3).to(dev),
                     "exp_avg_sq": (torch.rand(p.shape, generator=g) * 1e-6 + 1e-9).to(dev),
                     "frozen_variance_step": NOT_FROZEN} for p in params}
        extra = {} if bucket_size_mb is None else {"bucket_size_mb": bucket_size_mb}
        engine = CompressedStep(OneBitConfig.from_options(freeze_step=10, memory=memory, **extra), state,
                                decoupled=lambda group: False, transport=t)
        groups = [{"params": params, "lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8,
                   "weight_decay": 0.0}]
        gen = torch.Generator().manual_seed(1 + t.rank)
        grads = {p: (torch.randn(p.shape, generator=gen) * 1e-3).to(dev) for p in params}
        for p in params:
            p.grad = grads[p]
        engine.ensure_ready(params)
        engine.step(groups, grads)  # not measured: one-time allocations of the first step
        before = held_bytes({"collectives": engine.comms, "engine": vars(engine)}, params,
                            state)["total"]
        for step in range(steps):
            gate.wait()
            peak = StepPeak(dev)
            if t.rank == 0:
                peak.__enter__()
            gate.wait()
            engine.step(groups, grads)
            gate.wait()
            if t.rank == 0:
                peak.__exit__(None, None, None)
                peaks.append(peak.bytes // n)
        held = [held_bytes({"collectives": engine.comms, "engine": vars(engine)}, params,
                           state)]
        return {"rank": t.rank, "held": held, "before": before,
                "param_bytes": 4 * sum(p.numel() for p in params), "buckets": len(engine.buckets)}

    results = run_threads(n, rank_fn, timeout=600)
    param_bytes = results[0]["param_bytes"]
    worst = max(results, key=lambda r: r["held"][0]["total"])
    return {"rank": worst["rank"], "param_bytes": param_bytes, "buckets": worst["buckets"],
            "phases": {"compression": _phase_entry(worst["held"], [worst["before"]] * len(peaks),
                                                   peaks, param_bytes)}}


def bench_memory(ranks: int = 2, layers: int = 4, width: int = 1024, warmup: int = 3,
                 compressed: int = 3, transport: str = "horovod", device: str = "cpu",
                 bucket_size_mb: Optional[float] = None, timeout: float = 600.0,
                 memory: str = "lean", variance_refresh=None, cluster=None) -> dict:
    """Run the measurement; return the JSON report (every rank's phases, and the worst).
    ``cluster``: a started emulated cluster the Horovod job runs on (None: loopback).
    ``memory``: the optimizer's option ("lean", the CUDA default, is what the target is about;
    "fast", the CPU default, keeps 1x the parameters more)."""
    if transport == "inprocess":
        if variance_refresh is not None:
            raise ValueError("variance refresh steps run through Horovod: use transport='horovod'")
        per_rank = [inprocess_run(ranks, layers, width, compressed, bucket_size_mb, memory,
                                  device)]
    else:
        from ..cluster.jobs import run_job

        env = dict(MALLOC_MEASURE_ENV) if device == "cpu" else {}
        per_rank = run_job("hvd_onebit_tools.bench.memory:rank_run", np=ranks, timeout=timeout,
                           env=env, cluster=cluster,
                           kwargs=dict(layers=layers, width=width, warmup=warmup,
                                       compressed=compressed, device=device,
                                       bucket_size_mb=bucket_size_mb, memory=memory,
                                       variance_refresh=variance_refresh)).results
    phases = {}
    for ph in PHASES:
        entries = [r["phases"][ph] for r in per_rank if ph in r["phases"]]
        if entries:
            phases[ph] = max(entries, key=lambda e: e["peak_ratio"])
    return {"transport": transport, "device": device, "memory": memory, "ranks": ranks,
            "layers": layers,
            "width": width, "param_bytes": per_rank[0]["param_bytes"],
            "buckets": per_rank[0]["buckets"], "target_ratio": 1.25,
            "floor_ratio_note": "worker error 1 + server error 1/n + scales, for any world n",
            "peak_method": peak_method(device), "phases": phases, "per_rank": per_rank}
