"""Allreduce micro-benchmark: fp32 ``hvd.allreduce``, ``Compression.fp16`` and OneBitAllreduce.

Every method reduces the same buffer on every rank; each timed call starts after a barrier, and a
call's time is the slowest rank's (a collective is done when its last rank is). Bytes per rank:

* fp32 / fp16: what a bandwidth-optimal ring allreduce sends, ``2 (n-1)/n * N * 4`` (or ``* 2``);
* onebit: ``wire_bytes``, exactly what this rank hands to the two collectives.

On an emulated cluster every rank also reads its own interface counters around each method, so
``measured_tx_bytes_per_call`` is what really crossed its link (headers and control traffic
included).
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Optional

from hvd_onebit.layout import ring_allreduce_bytes

from ..cluster.network import IFACE

METHODS = ("fp32", "fp16", "onebit", "onebit_mpi")  # onebit_mpi: mpi4py transport (MPI jobs)
DEFAULT_METHODS = ("fp32", "fp16", "onebit")


def _iface_tx_bytes() -> Optional[int]:
    """This rank's own link counter, when it has a link of its own (emulated cluster: the
    interface Horovod's Gloo is kept on, or torchrun's when it is the emulator's; a user's own
    GLOO_SOCKET_IFNAME on this machine counts other traffic than the job's, on loopback)."""
    gloo = os.environ.get("GLOO_SOCKET_IFNAME", "")
    iface = os.environ.get("HOROVOD_GLOO_IFACE") or (gloo if gloo == IFACE else "")
    path = Path(f"/sys/class/net/{iface}/statistics/tx_bytes")
    if not iface or iface == "lo" or not path.exists():
        return None
    return int(path.read_text())


def allreduce_worker(sizes: list[int], methods: tuple[str, ...] = DEFAULT_METHODS,
                     repeats: int = 5) -> list[dict]:
    """Runs inside every rank (after hvd.init()); returns one row per (size, method)."""
    import horovod.torch as hvd
    import torch

    from hvd_onebit.comm.flat import OneBitAllreduce

    n = hvd.size()
    rows = []
    for numel in sizes:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(hvd.rank()))
        for method in methods:
            if method in ("onebit", "onebit_mpi"):
                transport = "mpi" if method == "onebit_mpi" else "horovod"
                comm = OneBitAllreduce(numel, transport=transport, name=f"bench.{numel}.{transport}")
                out = torch.empty_like(x)
                call = lambda: comm.allreduce(x, out=out)  # noqa: E731
            elif method == "fp32":
                call = lambda: hvd.allreduce(x, op=hvd.Average, name=f"bench.fp32.{numel}")  # noqa: E731
            elif method == "fp16":
                call = lambda: hvd.allreduce(x, op=hvd.Average, name=f"bench.fp16.{numel}",  # noqa: E731
                                             compression=hvd.Compression.fp16)
            else:
                raise ValueError(f"method must be one of {METHODS}, got {method!r}")
            call()  # warm-up: buffers, Horovod's response cache, page faults
            times = []
            tx_before = _iface_tx_bytes()
            for _ in range(repeats):
                hvd.allreduce(torch.zeros(1), name="bench.barrier")
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            tx_after = _iface_tx_bytes()
            slowest = hvd.allreduce(torch.tensor(times, dtype=torch.float64), op=hvd.Max,
                                    name=f"bench.times.{numel}.{method}").tolist()
            if method.startswith("onebit"):
                nbytes = comm.wire_bytes
                del comm
            else:
                elem = 4 if method == "fp32" else 2
                nbytes = ring_allreduce_bytes(numel * elem, n)
            rows.append({
                "np": n, "numel": numel, "method": method,
                "median_s": statistics.median(slowest), "min_s": min(slowest),
                "bytes_per_rank": nbytes,
                "measured_tx_bytes_per_call": (None if tx_before is None else
                                               (tx_after - tx_before) / repeats),
            })
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Add fp32-relative figures: speedup (fp32 time / method time) and byte ratio."""
    fp32 = {(r["np"], r["numel"], r.get("bandwidth")): r for r in rows if r["method"] == "fp32"}
    for r in rows:
        base = fp32.get((r["np"], r["numel"], r.get("bandwidth")))
        if base:
            r["speedup_vs_fp32"] = base["median_s"] / r["median_s"]
            r["bytes_ratio_vs_fp32"] = r["bytes_per_rank"] / base["bytes_per_rank"] if base["bytes_per_rank"] else None
    return rows


LINKS = {"local": "loopback, no emulation", "real": "real cluster (--hosts)"}


def plot(rows: list[dict], path: str) -> dict:
    """A PNG of each method's speed-up over fp32: against the emulated link rate when the rows
    sweep two or more emulated rates (and nothing else), otherwise against the buffer size, a
    line per method, world size and link (loopback, a real cluster or one emulated rate), the
    title naming the links measured. Returns what it drew: ``title``, ``x`` and ``series``
    (label -> (x values, speed-ups))."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..cluster.bandwidth import parse_bandwidth

    links = list(dict.fromkeys(r["bandwidth"] for r in rows))
    against_rate = len(links) > 1 and not any(b in LINKS for b in links)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = {}
    if against_rate:
        keys = sorted({(r["np"], r["numel"], r["method"]) for r in rows})
    else:
        keys = sorted({(r["np"], r["bandwidth"], r["method"]) for r in rows})
    for key in keys:
        if key[2] == "fp32":
            continue
        if against_rate:
            n, numel, method = key
            label = f"{method}, np={n}, {numel / 2**20:g}M elements"
            pts = [((parse_bandwidth(r["bandwidth"]) or 1e11) / 1e9, r.get("speedup_vs_fp32"))
                   for r in rows if (r["np"], r["numel"], r["method"]) == key]
        else:
            n, link, method = key
            label = f"{method}, np={n}, {LINKS.get(link, 'emulated ' + str(link))}"
            pts = [(r["numel"], r.get("speedup_vs_fp32"))
                   for r in rows if (r["np"], r["bandwidth"], r["method"]) == key]
        pts = sorted(p for p in pts if p[1])
        if pts:
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            ax.plot(xs, ys, marker="o", label=label)
            series[label] = (xs, ys)
    ax.set_xscale("log")
    if against_rate:
        ax.set_xlabel("link bandwidth (Gbit/s; rightmost = unlimited)")
        title = "Allreduce speed-up over fp32, emulated cluster"
    else:
        ax.set_xlabel("buffer size (fp32 elements)")
        title = ("Allreduce speed-up over fp32, "
                 + "; ".join(LINKS.get(b, f"emulated {b}") for b in links))
    ax.set_ylabel("speed-up over fp32 hvd.allreduce")
    ax.axhline(1, color="grey", lw=0.8)
    if series:
        ax.legend(fontsize=7)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return {"title": title, "x": "link rate" if against_rate else "buffer size",
            "series": series}
