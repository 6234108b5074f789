"""A calibrated scale model of a training step: Horovod fp32 / fp16 Adam, flat 1-bit Adam and
hierarchical 1-bit Adam at any number of ranks, from constants measured on one machine
(:mod:`hvd_onebit.bench.calibrate`).

The model (README.md, "Predicting the speed-up at scale", says the same in prose):

* A step is its phases, one after another (no overlap of compute and communication):
  ``compute`` (forward + backward + the optimizer's own pass), then the method's collectives and
  kernels. 1-bit Adam's compressed step replaces Adam's pass by its two fused kernels (momentum +
  compress, decode + update) and the server step.
* A collective of ``b`` bytes per rank on a link of rate ``R``::

      t = alpha_op(n) + steps * latency + max(host, wire) + kappa * min(host, wire)
      wire = bytes on the busiest link * 8 / (R * TCP_EFFICIENCY)      host = h_op(n) * b

  ``alpha_op(n) = a_op + b_op * (n - 1)``: Horovod's cost per op (negotiation, size exchanges,
  one message per peer), a line through the tiny-op times measured at two world sizes.
  ``h_op``: the host's cost per byte (reduction, copies, TCP stack), measured on unshaped links;
  ``kappa``: the share of the shorter of host and wire time that the longer one does not hide
  (the ring pipelines its chunks), from the large fp32 allreduce on a shaped link.
* Ring allreduce: ``2 (n-1)/n B`` per rank, ``2 (n-1)`` latency steps; alltoall and allgather of
  rows of ``r`` bytes: ``(n-1) r`` per rank (alltoall: one latency, its messages go at once;
  ring allgather: ``n-1``). With ``L`` ranks per node the node's link carries ``L (n-L) r`` in the
  alltoall and the ring's ``2 (n-1)/n B`` (one ring crossing per node boundary).
* Hierarchical 1-bit (ALGORITHM.md; predicted only: modelled before the library had it, and
  not checked against a measurement):
  full-precision reduce-scatter inside the node, the two-stage 1-bit allreduce of the shard
  ``|m|/L`` among the ``N`` ranks with the same local rank (the node's link carries
  ``2 (N-1)/N |m|/8`` bytes), full-precision allgather inside the node.
* Ranks that share this machine's cores (``colocated``, the emulator) run compute and kernels at
  the speeds measured with that many processes at once (in lock-step: collectives start every
  rank's phase together; ``bench train``'s ``local`` ranks run free, so it is predicted with the
  free-running step); otherwise a rank has a core to itself.
* Whole run: ``warmup_frac`` of the steps at the warmup step time (Horovod's fp32 allreduce),
  the rest at the compressed step time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from ..layout import Layout, ring_allreduce_bytes

TCP_EFFICIENCY = 1448 / 1514  # TCP payload per Ethernet frame at a 1500-byte MTU
METHODS = ("horovod_fp32", "horovod_fp16", "onebit", "onebit_hierarchical")
HIERARCHICAL_NOTE = ("onebit_hierarchical is a prediction of ALGORITHM.md's hierarchical scheme, "
                     "not checked against a measurement with several ranks per node")


# --------------------------------------------------------------------------------------------
# constants from a calibration file


def _nearest(table: dict, n: int):
    """The entry of ``table`` (keys: str(int)) for the key nearest ``n`` (ties: the larger)."""
    keys = sorted(int(k) for k in table)
    return table[str(min(keys, key=lambda k: (abs(k - n), -k)))]


def _line(points: dict[int, float]):
    """a + b (n-1) through the points (least squares; b >= 0); one point gives b = 0."""
    ns = sorted(points)
    if len(ns) == 1:
        return points[ns[0]], 0.0
    xs = [n - 1 for n in ns]
    ys = [points[n] for n in ns]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys))
            / sum((x - mx) ** 2 for x in xs))
    return max(0.0, my - b * mx), b


OPS = {"allreduce_fp32": "allreduce", "allreduce_fp16": "allreduce", "alltoall": "alltoall",
       "allgather": "allgather"}


def _bytes_per_rank(op: str, n: int, numel: int, row: int) -> int:
    if op == "allreduce_fp32":
        return ring_allreduce_bytes(4 * numel, n)
    if op == "allreduce_fp16":
        return ring_allreduce_bytes(2 * numel, n)
    return (n - 1) * row


def constants(cal: dict) -> dict:
    """The model's constants from a calibration (see the module docstring), flat, for printing
    and for :func:`predict`. Per world size measured: host cost per byte and overlap per op."""
    coll = cal["collectives"]
    link, link_bps = cal.get("link"), cal.get("link_bps")
    out: dict = {"cores": cal["cores"], "tcp_efficiency": TCP_EFFICIENCY}
    for kind in ("allreduce", "alltoall", "allgather"):
        a, b = _line({int(n): coll[n]["unlimited"]["median_s"][f"{kind}_tiny"] for n in coll})
        out[f"alpha_{kind}_s"] = a
        out[f"alpha_{kind}_per_peer_s"] = b
    for n, runs in coll.items():
        unl = runs["unlimited"]["median_s"]
        shaped = runs[link]["median_s"] if link in runs and link_bps else None
        numel, row = runs["unlimited"]["numel"], runs["unlimited"]["row_bytes"]
        for op, kind in OPS.items():
            nbytes = _bytes_per_rank(op, int(n), numel, row)
            host = max(0.0, unl[op] - unl[f"{kind}_tiny"])
            out[f"host_{op}_s_per_byte@{n}"] = host / nbytes
        # kappa: the share of the shorter of host and wire time that the longer does not hide,
        # from the large fp32 allreduce on the shaped link (1: no overlap; none measured: 1)
        kappa = 1.0
        if shaped is not None:
            alpha = unl["allreduce_tiny"]
            nbytes = _bytes_per_rank("allreduce_fp32", int(n), numel, row)
            host = out[f"host_allreduce_fp32_s_per_byte@{n}"] * nbytes
            wire = nbytes * 8 / (link_bps * TCP_EFFICIENCY)
            if min(host, wire) > 0:
                kappa = (shaped["allreduce_fp32"] - alpha - max(host, wire)) / min(host, wire)
        out[f"kappa@{n}"] = min(1.0, max(0.0, kappa))
    for k, c in cal["compute"].items():
        for name, kern in c["kernel_s_per_elem"].items():
            out[f"kernel_{name}_ns_per_elem@{k}procs"] = kern * 1e9
        for model, m in c["models"].items():
            out[f"{model}_fwd_bwd_ms@{k}procs"] = m["fwd_bwd_s"] * 1e3
            out[f"{model}_adam_ms@{k}procs"] = m["adam_s"] * 1e3
    return out


# --------------------------------------------------------------------------------------------
# the cluster and the job


@dataclass
class Cluster:
    """``nodes`` x ``ranks_per_node`` ranks. Rates in bits/s (None: unlimited), latency in s.

    ``inter_bps`` is each node's link to the network, shared by its ranks; ``intra_bps`` each
    rank's link inside its node. ``ranks_per_node=1`` is the emulator: a link per rank.
    """

    nodes: int
    ranks_per_node: int = 1
    inter_bps: Optional[float] = 1e9
    intra_bps: Optional[float] = None
    inter_latency_s: float = 0.0
    intra_latency_s: float = 0.0
    colocated: bool = False  # every rank on this machine's cores (the emulator)

    @property
    def n(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass
class Job:
    """What the model needs of a training job.

    ``compute_s``: forward + backward + Adam's step; ``adam_s``: the Adam part of it (the
    compressed step replaces it; 0 if ``compute_s`` is given without it); ``None`` for both:
    from the calibration's bench model ``model`` (embedding or mlp). ``kernel_speedup`` / ``host_speedup`` divide the calibrated
    per-element kernel and per-byte host costs (a faster device or NIC than this machine's core).
    """

    params: int
    compute_s: Optional[float] = None
    adam_s: Optional[float] = None
    model: Optional[str] = None
    warmup_frac: float = 0.15
    kernel_speedup: float = 1.0
    host_speedup: float = 1.0


@dataclass
class Prediction:
    method: str
    phases: dict  # phase name -> seconds, in order (compute first)
    bytes_per_rank: int  # sent per step by each rank
    inter_node_bytes_per_node: Optional[int] = None
    notes: list = field(default_factory=list)

    @property
    def step_s(self) -> float:
        return sum(self.phases.values())


class Model:
    """Predictions from a calibration. ``per_peer_s`` replaces the calibrated per-peer cost of
    every Horovod op (``b_op``), e.g. to see what a lower one would change."""

    def __init__(self, cal: dict, per_peer_s: Optional[float] = None,
                 hierarchical_global_ops: bool = False):
        self.cal = cal
        self.c = constants(cal)
        self.per_peer_s = per_peer_s
        self.hierarchical_global_ops = hierarchical_global_ops

    # -- per-world-size lookups

    def _procs(self, cl: Cluster) -> str:
        """The calibration's process count for this job's compute: n sharing the cores if
        colocated, else one process with a core to itself."""
        comp = self.cal["compute"]
        if not cl.colocated:
            return min(comp, key=int)
        keys = sorted(int(k) for k in comp)
        return str(min(keys, key=lambda k: (abs(k - cl.n), -k)))

    def _host(self, op: str, n: int, cl: Cluster) -> tuple[float, float]:
        """(seconds per byte, kappa) of the host for ``op`` among ``n`` ranks: as measured with
        the nearest world size if colocated, else with the smallest (a core per rank)."""
        measured = sorted(int(k) for k in self.cal["collectives"])
        key = (min(measured, key=lambda k: (abs(k - n), -k)) if cl.colocated else measured[0])
        return self.c[f"host_{op}_s_per_byte@{key}"], self.c[f"kappa@{key}"]

    def alpha(self, kind: str, n: int) -> float:
        if n <= 1:
            return 0.0
        b = self.c[f"alpha_{kind}_per_peer_s"] if self.per_peer_s is None else self.per_peer_s
        return self.c[f"alpha_{kind}_s"] + b * (n - 1)

    # -- compute

    def compute(self, job: Job, cl: Cluster, free_running: bool = False) -> tuple[float, float]:
        """(step compute incl. Adam, Adam's part) in seconds. For a calibrated bench model, the
        phases timed in lock-step (ranks that collectives synchronise), or with
        ``free_running`` the whole step as ranks without communication run it."""
        m = None
        if job.model is not None:
            m = self.cal["compute"][self._procs(cl)]["models"][job.model]
        compute = job.compute_s if job.compute_s is not None else (
            (m["step_s"] if free_running else m["fwd_bwd_s"] + m["adam_s"]) if m else None)
        if compute is None:
            raise ValueError("give the compute time per step (compute_s) or a calibrated model")
        if job.adam_s is not None:
            adam = job.adam_s
        elif m is not None and job.compute_s is None:
            adam = m["adam_s"] * job.params / m["params"]
        else:  # a compute time given without its Adam share: the compressed step gets no credit
            adam = 0.0
        return compute, min(adam, compute)

    def kernel(self, name: str, elems: float, job: Job, cl: Cluster) -> float:
        per = self.cal["compute"][self._procs(cl)]["kernel_s_per_elem"][name]
        return per * elems / job.kernel_speedup

    # -- collectives

    def _transfer(self, op: str, n: int, nbytes: float, link_bytes: float, bps, latency_steps: int,
                  latency_s: float, job: Job, cl: Cluster, kind: str) -> float:
        h, kappa = self._host(op, n, cl)
        host = h * nbytes / job.host_speedup
        wire = 0.0 if bps is None else link_bytes * 8 / (bps * TCP_EFFICIENCY)
        data = max(host, wire) + kappa * min(host, wire)
        return self.alpha(kind, n) + latency_steps * latency_s + data

    def _bottleneck(self, cl: Cluster, inter_bytes: float, intra_bytes: float) -> tuple[float, float]:
        """(link bytes on the slower path scaled to the inter-node rate, rate)."""
        if cl.nodes == 1:
            return intra_bytes, cl.intra_bps
        if cl.ranks_per_node == 1 or cl.intra_bps is None or cl.inter_bps is None:
            return inter_bytes, cl.inter_bps
        t_inter, t_intra = inter_bytes / cl.inter_bps, intra_bytes / cl.intra_bps
        return (inter_bytes, cl.inter_bps) if t_inter >= t_intra else (intra_bytes, cl.intra_bps)

    def ring_allreduce(self, op: str, nbytes_total: int, cl: Cluster, job: Job) -> float:
        """Ring allreduce over all ranks, node-major: each link and each node boundary carries
        2 (n-1)/n of the buffer."""
        n = cl.n
        if n == 1:
            return 0.0
        per_rank = ring_allreduce_bytes(nbytes_total, n)
        link_bytes, bps = self._bottleneck(cl, per_rank, per_rank)
        lat = cl.inter_latency_s if cl.nodes > 1 else cl.intra_latency_s
        return self._transfer(op, n, per_rank, link_bytes, bps, 2 * (n - 1), lat, job, cl,
                              "allreduce")

    def hierarchical_stages(self, shard: float, cl: Cluster, job: Job) -> tuple[float, float, int]:
        """(alltoall s, allgather s, bytes per rank) of the two-stage 1-bit allreduce of a shard
        among the ``nodes`` ranks with the same local rank; the node's ``L`` ranks do theirs at
        once, so its link carries ``L (N-1)`` rows per stage."""
        N, L = cl.nodes, cl.ranks_per_node
        layout = Layout.build(int(math.ceil(shard)), N)
        per_rank = (N - 1) * layout.row_bytes
        args = (N, per_rank, L * per_rank, cl.inter_bps)
        a2a = self._transfer("alltoall", *args, 1, cl.inter_latency_s, job, cl, "alltoall")
        ag = self._transfer("allgather", *args, N - 1, cl.inter_latency_s, job, cl, "allgather")
        return a2a, ag, layout.wire_bytes

    # -- the methods

    def predict(self, method: str, job: Job, cl: Cluster) -> Prediction:
        compute, adam = self.compute(job, cl)
        P, n, L, N = job.params, cl.n, cl.ranks_per_node, cl.nodes
        if method in ("horovod_fp32", "horovod_fp16", "onebit_warmup"):
            op, elem = (("allreduce_fp16", 2) if method == "horovod_fp16" else ("allreduce_fp32", 4))
            t = self.ring_allreduce(op, elem * P, cl, job)
            nbytes = ring_allreduce_bytes(elem * P, n)
            return Prediction(method, {"compute": compute, f"allreduce_{op[-4:]}": t}, nbytes,
                              nbytes if N > 1 else None)
        fwd_bwd = compute - adam
        if method == "onebit":
            if n == 1:
                return Prediction(method, {"compute": compute}, 0)
            a2a, ag, nbytes = self._flat_onebit(P, cl, job)
            phases = {"compute": fwd_bwd,
                      "compress": self.kernel("compress_momentum", P, job, cl),
                      "alltoall": a2a, "server": self.kernel("server", P, job, cl),
                      "allgather": ag, "decode_update": self.kernel("decode_update", P, job, cl)}
            inter = None
            if N > 1:  # rows to other nodes, both stages, per node
                row = Layout.build(P, n).row_bytes
                inter = L * (n - L) * row + (n - 1) * row
            return Prediction(method, phases, nbytes, inter)
        if method == "onebit_hierarchical":
            shard = P / L
            phases = {"compute": fwd_bwd}
            intra = Cluster(nodes=1, ranks_per_node=L, intra_bps=cl.intra_bps,
                            intra_latency_s=cl.intra_latency_s, colocated=cl.colocated)
            rs_bytes = ring_allreduce_bytes(4 * P, L) // 2  # reduce-scatter: half a ring allreduce
            phases["reduce_scatter"] = (self.ring_allreduce("allreduce_fp32", 4 * P, intra, job) / 2
                                        if L > 1 else 0.0)
            phases["compress"] = self.kernel("compress_momentum", shard, job, cl)
            a2a = ag = 0.0
            inter_bytes = 0
            if N > 1:
                a2a, ag, inter_bytes = self.hierarchical_stages(shard, cl, job)
            phases["alltoall"] = a2a
            phases["server"] = self.kernel("server", shard, job, cl)
            phases["allgather"] = ag
            phases["decode_update"] = self.kernel("decode_update", P, job, cl)
            phases["allgather_intra"] = phases["reduce_scatter"]
            if self.hierarchical_global_ops and N > 1:
                # every stage one global Horovod op (as hvd_onebit/hierarchical.py runs them):
                # each pays the per-op cost of all n ranks instead of its group's
                used = {"reduce_scatter": self.alpha("allreduce", L) / 2 if L > 1 else 0.0,
                        "alltoall": self.alpha("alltoall", N),
                        "allgather": self.alpha("allgather", N)}
                used["allgather_intra"] = used["reduce_scatter"]
                for ph, a in used.items():
                    phases[ph] += self.alpha("alltoall", n) - a
            return Prediction(method, phases, 2 * rs_bytes + inter_bytes,
                              L * inter_bytes if N > 1 else None, [HIERARCHICAL_NOTE])
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")

    def _flat_onebit(self, P: int, cl: Cluster, job: Job) -> tuple[float, float, int]:
        """The flat two-stage 1-bit allreduce among all n ranks. Alltoall: a node's L ranks each
        send a row to the n-L ranks elsewhere (L (n-L) rows on the node's link, L-1 rows on each
        rank's link inside it); ring allgather: n-1 rows cross every link and node boundary."""
        n, L = cl.n, cl.ranks_per_node
        layout = Layout.build(P, n)
        row = layout.row_bytes
        per_rank = (n - 1) * row
        lat = cl.inter_latency_s if cl.nodes > 1 else cl.intra_latency_s
        a2a_bytes, a2a_bps = self._bottleneck(cl, L * (n - L) * row, per_rank if cl.nodes == 1
                                              else (L - 1) * row)
        ag_bytes, ag_bps = self._bottleneck(cl, per_rank, per_rank)
        a2a = self._transfer("alltoall", n, per_rank, a2a_bytes, a2a_bps, 1, lat, job, cl,
                             "alltoall")
        ag = self._transfer("allgather", n, per_rank, ag_bytes, ag_bps, n - 1, lat, job, cl,
                            "allgather")
        return a2a, ag, layout.wire_bytes

    def predict_all(self, job: Job, cl: Cluster, methods=METHODS) -> dict:
        """Per method: phases, step time, bytes; 1-bit rows also their warmup step and the
        whole run's speed-up over Horovod fp32 (``warmup_frac`` of the steps in warmup)."""
        fp32 = self.predict("horovod_fp32", job, cl)
        out = {}
        for m in methods:
            p = fp32 if m == "horovod_fp32" else self.predict(m, job, cl)
            row = {"method": m, "phases_s": p.phases, "step_s": p.step_s,
                   "bytes_per_rank": p.bytes_per_rank, "step_speedup_vs_fp32": fp32.step_s / p.step_s}
            if p.inter_node_bytes_per_node is not None:
                row["inter_node_bytes_per_node"] = p.inter_node_bytes_per_node
            if m.startswith("onebit"):
                run = job.warmup_frac * fp32.step_s + (1 - job.warmup_frac) * p.step_s
                row.update({"warmup_step_s": fp32.step_s, "compression_step_s": p.step_s,
                            "run_step_s": run, "run_speedup_vs_fp32": fp32.step_s / run})
            else:
                row["run_speedup_vs_fp32"] = fp32.step_s / p.step_s
            if p.notes:
                row["notes"] = p.notes
            out[m] = row
        return out


# --------------------------------------------------------------------------------------------
# predicted vs measured (bench train on the emulated cluster)

# (method, phase of bench train's row) -> the predicted quantity
CHECK_PAIRS = (("local", "all"), ("horovod_fp32", "all"), ("horovod_fp16", "all"),
               ("onebit", "warmup"), ("onebit", "compression"))


def bound_for(method: str, phase: str, bandwidth: str) -> float:
    """The issue's bounds: 25%, and 15% for the compressed step at 1 Gbit/s."""
    return 0.15 if (method, phase, bandwidth) == ("onebit", "compression", "1gbit") else 0.25


def check_report(reports: list[dict], cal: dict) -> dict:
    """Pairs of predicted and measured step times for ``bench train --json`` reports (several
    runs of one configuration are pooled: median and range)."""
    import statistics

    from ..cluster.bandwidth import parse_bandwidth

    model = Model(cal)
    groups: dict = {}
    for rep in reports:
        cfg = rep["config"]
        key = (rep["rows"][0]["np"], rep["bandwidth"], cfg["model"])
        groups.setdefault(key, []).append(rep)
    pairs = []
    for (n, bw, model_name), reps in sorted(groups.items()):
        cfg, row0 = reps[0]["config"], reps[0]["rows"][0]
        bps = None if bw in ("local", "real") else parse_bandwidth(bw)  # loopback: unshaped
        cl = Cluster(nodes=n, inter_bps=bps, colocated=True)
        job = Job(params=row0["params"], model=model_name, warmup_frac=cfg["warmup_frac"])
        preds = {"local": model.compute(job, cl, free_running=True)[0],
                 "horovod_fp32": model.predict("horovod_fp32", job, cl).step_s,
                 "horovod_fp16": model.predict("horovod_fp16", job, cl).step_s,
                 "onebit/warmup": model.predict("horovod_fp32", job, cl).step_s,
                 "onebit/compression": model.predict("onebit", job, cl).step_s}
        for method, phase in CHECK_PAIRS:
            vals = [r[f"{phase}_step_s"] for rep in reps for r in rep["rows"]
                    if r["method"] == method and f"{phase}_step_s" in r]
            if not vals:
                continue
            pred = preds[method if phase == "all" else f"{method}/{phase}"]
            med = statistics.median(vals)
            bound = bound_for(method, phase, bw)
            pairs.append({"np": n, "bandwidth": bw, "model": model_name, "method": method,
                          "phase": phase, "predicted_s": pred, "measured_s": med,
                          "measured_min_s": min(vals), "measured_max_s": max(vals),
                          "runs": len(vals), "ratio": pred / med, "bound": bound,
                          "within": abs(pred / med - 1) <= bound})
    met = sum(p["within"] for p in pairs)
    return {"pairs": pairs, "met": met, "total": len(pairs),
            "calibration_date": cal.get("machine", {}).get("date")}


def print_check(result: dict, echo=None) -> None:
    from .report import print_table

    rows = [{**p, "pred_ms": p["predicted_s"] * 1e3, "meas_ms": p["measured_s"] * 1e3,
             "range": f"{p['measured_min_s'] * 1e3:,.1f}-{p['measured_max_s'] * 1e3:,.1f}",
             "ok": ("yes" if p["within"] else "NO") + f" ({p['bound']:.0%})"}
            for p in result["pairs"]]
    print_table(rows, [("np", "np", "d"), ("link", "bandwidth", ""), ("model", "model", ""),
                       ("method", "method", ""), ("phase", "phase", ""),
                       ("predicted ms", "pred_ms", ",.1f"), ("measured ms", "meas_ms", ",.1f"),
                       ("measured range", "range", ""), ("runs", "runs", "d"),
                       ("pred/meas", "ratio", ".2f"), ("within", "ok", "")])
    import click

    (echo or click.echo)(f"{result['met']} of {result['total']} pairs within their bound")


# --------------------------------------------------------------------------------------------
# sweeps, crossovers and the figure


def parse_params(text: str) -> int:
    """'350M' -> 350,000,000 (decimal, as parameter counts are quoted); '9.4e6' and plain
    integers too."""
    t = str(text).strip().lower()
    mult = {"k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9}.get(t[-1:] if t else "", None)
    return int(round(float(t[:-1]) * mult)) if mult else int(float(t))


def sweep(model: Model, job: Job, nps, bandwidths_bps, ranks_per_node: int = 1,
          intra_bps=None, inter_latency_s: float = 0.0, intra_latency_s: float = 0.0,
          colocated: bool = False, methods=METHODS) -> list[dict]:
    """One row per (ranks, bandwidth): ``predict_all``'s dict under ``methods``."""
    rows = []
    for bps in bandwidths_bps:
        for n in nps:
            L = ranks_per_node if n % ranks_per_node == 0 and n >= ranks_per_node else 1
            cl = Cluster(nodes=n // L, ranks_per_node=L, inter_bps=bps, intra_bps=intra_bps,
                         inter_latency_s=inter_latency_s, intra_latency_s=intra_latency_s,
                         colocated=colocated)
            rows.append({"np": n, "nodes": cl.nodes, "ranks_per_node": L, "inter_bps": bps,
                         "methods": model.predict_all(job, cl, methods)})
    return rows


def crossovers(rows: list[dict]) -> dict:
    """Per bandwidth: the world size from which on flat 1-bit's whole run is no faster than fp32
    (it stops paying), and from which on hierarchical 1-bit beats flat (it takes over); None
    if that never holds up to the largest world size of the sweep."""
    def from_on(sel, holds):
        first = None
        for r in sel:
            first = (first or r["np"]) if holds(r["methods"]) else None
        return first

    out: dict = {}
    for bps in dict.fromkeys(r["inter_bps"] for r in rows):
        sel = sorted((r for r in rows if r["inter_bps"] == bps), key=lambda r: r["np"])
        d = {"flat_onebit_stops_paying_at": None, "hierarchical_beats_flat_from": None}
        if "onebit" in sel[0]["methods"]:
            d["flat_onebit_stops_paying_at"] = from_on(
                sel, lambda ms: ms["onebit"]["run_speedup_vs_fp32"] <= 1.0)
            if "onebit_hierarchical" in sel[0]["methods"]:
                d["hierarchical_beats_flat_from"] = from_on(
                    sel, lambda ms: ms["onebit_hierarchical"]["run_step_s"]
                    < ms["onebit"]["run_step_s"])
        out[str(bps)] = d
    return out


def plot_sweep(rows: list[dict], path: str, title: str) -> None:
    """Whole-run speed-up over Horovod fp32 against ranks, one line per method and bandwidth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..cluster.bandwidth import format_bandwidth

    fig, ax = plt.subplots(figsize=(10.5, 5))
    styles = {"horovod_fp16": ("tab:gray", "fp16"), "onebit": ("tab:blue", "flat 1-bit"),
              "onebit_hierarchical": ("tab:green", "hierarchical 1-bit (ALGORITHM.md)")}
    dashes = ["-", "--", ":", "-."]
    bws = sorted({r["inter_bps"] or 0 for r in rows})
    cross = crossovers(rows)
    for i, bps in enumerate(bws):
        sel = sorted((r for r in rows if (r["inter_bps"] or 0) == bps), key=lambda r: r["np"])
        label_bw = format_bandwidth(int(bps)) if bps else "unlimited"
        for m, (color, name) in styles.items():
            if m not in sel[0]["methods"]:
                continue
            xs = [r["np"] for r in sel]
            ys = [r["methods"][m]["run_speedup_vs_fp32"] for r in sel]
            ax.plot(xs, ys, dashes[i % len(dashes)], color=color, marker="o", ms=3,
                    label=f"{name}, {label_bw}")
        c = cross.get(str(sel[0]["inter_bps"]), {})
        for key, color, text in (("flat_onebit_stops_paying_at", "tab:blue", "flat 1-bit <= fp32"),
                                 ("hierarchical_beats_flat_from", "tab:green",
                                  "hierarchical > flat")):
            if c.get(key):
                ax.axvline(c[key], color=color, ls=dashes[i % len(dashes)], lw=0.8, alpha=0.6)
                right = c[key] > max(r["np"] for r in rows) / 4  # keep the label inside
                ax.text(c[key] / 1.03 if right else c[key] * 1.03,
                        0.02 + 0.06 * (2 * i + (color == "tab:green")),
                        f"{text} from n={c[key]} ({label_bw})", fontsize=7, color=color,
                        ha="right" if right else "left", transform=ax.get_xaxis_transform())
    ax.axhline(1, color="black", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks")
    ax.set_ylabel("whole-run speed-up over Horovod fp32 Adam")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_phases(pred: dict, path: str, title: str) -> None:
    """Stacked bars of each method's step time by phase (one world size and bandwidth)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = list(pred)
    phases = list(dict.fromkeys(p for m in names for p in pred[m]["phases_s"]))
    bottom = [0.0] * len(names)
    for ph in phases:
        vals = [pred[m]["phases_s"].get(ph, 0.0) * 1e3 for m in names]
        ax.bar(names, vals, bottom=bottom, label=ph)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("ms per step")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_prediction(report: dict, echo=None) -> None:
    """`bench predict`'s table: per world size, bandwidth and method."""
    import click

    from .report import print_table

    echo = echo or click.echo
    table = []
    for r in report["rows"]:
        for m, p in r["methods"].items():
            table.append({"np": r["np"], "bw": "unlimited" if not r["inter_bps"] else
                          f"{r['inter_bps'] / 1e9:g} Gbit/s", "method": m,
                          "ms": p["step_s"] * 1e3,
                          "phases": " ".join(f"{k}={v * 1e3:,.1f}" for k, v in p["phases_s"].items()),
                          "mb": p["bytes_per_rank"] / 1e6, "step_x": p["step_speedup_vs_fp32"],
                          "run_x": p["run_speedup_vs_fp32"]})
    inputs = report["inputs"]
    echo(f"{inputs['params']:,} parameters, compute {inputs['compute_s'] * 1e3:,.1f} ms/step, "
         f"warmup {inputs['warmup_frac']:.0%}; {report['note']}")
    print_table(table, [("np", "np", "d"), ("link", "bw", ""), ("method", "method", ""),
                        ("step ms", "ms", ",.1f"), ("MB/rank/step", "mb", ",.2f"),
                        ("step x fp32", "step_x", ".2f"), ("run x fp32", "run_x", ".2f"),
                        ("phases (ms)", "phases", "")])
    for bw, c in report["crossovers"].items():
        echo(f"link {bw} bit/s: flat 1-bit stops paying from n={c['flat_onebit_stops_paying_at']}"
             f", hierarchical beats flat from n={c['hierarchical_beats_flat_from']}")
