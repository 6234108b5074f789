"""A whole calibration (`hvd-onebit bench calibrate`): the compute group, then the
collectives' Horovod jobs on the emulated cluster, into one dict for :func:`.files.save`."""
from __future__ import annotations

import os
import time
from typing import Optional

from .compute import measure_compute
from .files import CALIBRATION_VERSION
from .workloads import BENCH_MODELS, FIGURES


def measure_collectives(nps=(2, 4), link: str = "1gbit", numel: int = 4 << 20, repeats: int = 7,
                        queue_ms: float = 2.0, timeout: float = 900.0,
                        models: Optional[dict] = None) -> dict:
    """``{np: {"unlimited": row, link: row}}`` from jobs on the emulated cluster (root needed);
    with ``models`` the unlimited row also has the bench models' compute timed inside the
    ranks (:func:`.ranks.ranks_compute`)."""
    from ...cluster import EmulatedCluster
    from ...cluster.jobs import run_job
    from ..train import MALLOC_REUSE_ENV

    out: dict = {}
    for n in nps:
        for bw in ("unlimited", link):
            kwargs = {"numel": numel, "repeats": repeats}
            if bw == "unlimited" and models:
                kwargs["models"] = models
            with EmulatedCluster(np=n, bandwidth=bw, queue_ms=queue_ms) as cluster:
                job = run_job("hvd_onebit_tools.bench.calibrate.ranks:collectives_worker", np=n,
                              kwargs=kwargs, timeout=timeout, cluster=cluster,
                              env=MALLOC_REUSE_ENV)
            out.setdefault(str(n), {})[bw] = job.results[0]
    return out


#: How far a bare process's free-running step may be from its lock-step phases' sum before
#: calibration warns: with a core each they time the same work alike.
STEP_AGREEMENT = 1.5


def disagreements(compute: dict, cores: int) -> list[str]:
    """The bench models whose free-running ``step_s`` and lock-step ``fwd_bwd_s + adam_s`` differ
    by more than :data:`STEP_AGREEMENT` times where the processes had a core each: the same
    work, so something else on the machine took the cores while one of them was timed."""
    out = []
    for k, group in sorted(compute.items(), key=lambda kv: int(kv[0])):
        if int(k) > cores:
            continue
        for name, m in group["models"].items():
            phases = m["fwd_bwd_s"] + m["adam_s"]
            if phases > 0 and not 1 / STEP_AGREEMENT <= m["step_s"] / phases <= STEP_AGREEMENT:
                out.append(f"warning: {name} with {k} process(es): whole step "
                           f"{m['step_s'] * 1e3:.1f} ms but forward + backward + Adam "
                           f"{phases * 1e3:.1f} ms; with a core each they should agree, so the "
                           "machine was probably busy: calibrate again when it is idle")
    return out


def calibrate(procs=(1, 2, 4), nps=(2, 4), link: str = "1gbit", numel: int = 4 << 20,
              repeats: int = 7, queue_ms: float = 2.0, progress=None) -> dict:
    """Everything the scale model needs, measured here. ``progress(str)`` reports each stage."""
    from ...cluster.bandwidth import parse_bandwidth
    from ..report import machine_info

    say = progress or (lambda s: None)
    start = time.monotonic()
    say(f"compute and kernels with {', '.join(map(str, procs))} processes at once...")
    compute = measure_compute(procs=procs)
    for line in disagreements(compute, len(os.sched_getaffinity(0))):
        say(line)
    say(f"collectives on the emulated cluster, np={', '.join(map(str, nps))}, "
        f"unlimited and {link} links...")
    coll = measure_collectives(nps=nps, link=link, numel=numel, repeats=repeats,
                               queue_ms=queue_ms, models=BENCH_MODELS)
    return {"version": CALIBRATION_VERSION, "machine": machine_info(),
            "cores": len(os.sched_getaffinity(0)), "link": link,
            "link_bps": parse_bandwidth(link), "queue_ms": queue_ms, "bench_models": BENCH_MODELS,
            "figures": FIGURES, "compute": compute, "collectives": coll,
            "seconds": time.monotonic() - start}
