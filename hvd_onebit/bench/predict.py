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
  ``h_op``: the host's cost per byte (reduction, copies, TCP stack), measured on unshaped links
  (for Horovod's fp16 allreduce of a calibrated bench model: on that model's own gradient, as
  float16 subnormals make its cost depend on the values);
  ``kappa``: the share of the shorter of host and wire time that the longer one does not hide
  (the ring pipelines its chunks), from the large fp32 allreduce on a shaped link; Horovod's
  fp16 allreduce has its own, from the fp16 allreduce there (``Compression.fp16`` casts the
  whole buffer before and after the ring, outside its pipeline).
* Ring allreduce: ``2 (n-1)/n B`` per rank, ``2 (n-1)`` latency steps; alltoall and allgather of
  rows of ``r`` bytes: ``(n-1) r`` per rank (alltoall: one latency, its messages go at once;
  ring allgather: ``n-1``). With ``L`` ranks per node the node's link carries ``L (n-L) r`` in the
  alltoall and the ring's ``2 (n-1)/n B`` (one ring crossing per node boundary).
* Flat 1-bit's two stages are costed with the constants of the transport that runs them:
  torch.distributed's Gloo alltoall and allgather (``transport="torch"``, what ``"auto"``
  picks on CPU) or Horovod's.
* Hierarchical 1-bit as ``hvd_onebit/comm/hierarchical.py`` runs it (:meth:`Model._hierarchical`),
  on the same transport as flat 1-bit: with ``"torch"``, the two 1-bit stages of the shard
  ``|m|/L`` as torch.distributed collectives of the ``N`` ranks with the same local rank, and the
  full-precision scatter and gather inside the node through shared memory (``intra_node=
  "shared_memory"``: a barrier each, what CPU ranks do) or the node's links (``"network"``:
  NVLink, PCIe); with ``"horovod"``, four global Horovod alltoalls with splits. Its passes are
  the native kernels it runs (momentum written out, node mean inside the shard's compression,
  decode, copy-out with Adam's update).
* Ranks that share this machine's cores (``colocated``, the emulator) run compute and kernels
  as timed inside the calibration's Horovod ranks (else: bare processes sharing the cores), in
  lock-step: collectives start every rank's phase together (``bench train``'s ``local`` ranks
  run free, so it is predicted with the free-running step); otherwise a rank has a core to
  itself.
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
# hierarchical 1-bit on Horovod's transport with each stage a collective of its own group
# (process sets, which the library does not use there); on torch's transport the stages are
# group collectives already, and this method is onebit_hierarchical
GROUP_METHOD = "onebit_hierarchical_group"
HIERARCHICAL_NOTE = ("onebit_hierarchical models hvd_onebit/comm/hierarchical.py on the flat 1-bit "
                     "transport (torch: group collectives between nodes, intra_node inside them; "
                     "horovod: 4 global alltoalls with splits per bucket); checked on the "
                     "emulator at 2 nodes x 2 ranks only")
INTRA_NODE = ("network", "shared_memory")


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
       "allgather": "allgather", "alltoall_fp32": "alltoall", "torch_alltoall": "torch_alltoall",
       "torch_allgather": "torch_allgather"}
# the op kinds whose per-op cost is calibrated (tiny ops): Horovod's, then torch.distributed's
KINDS = ("allreduce", "alltoall", "allgather", "torch_alltoall", "torch_allgather")
TRANSPORTS = ("torch", "horovod")
# the ops whose overlap of host and wire (kappa) is measured on the shaped link, and the name
# of the constant; every other op takes the fp32 ring's
KAPPA_OPS = {"allreduce_fp32": "kappa", "allreduce_fp16": "kappa_allreduce_fp16"}


def _bytes_per_rank(op: str, n: int, numel: int, row: int) -> int:
    if op == "allreduce_fp32":
        return ring_allreduce_bytes(4 * numel, n)
    if op == "allreduce_fp16":
        return ring_allreduce_bytes(2 * numel, n)
    if op == "alltoall_fp32":  # n rows of numel/n floats, n-1 of them sent
        return (n - 1) * (4 * numel // n)
    return (n - 1) * row


def constants(cal: dict) -> dict:
    """The model's constants from a calibration (see the module docstring), flat, for printing
    and for :func:`predict`. Per world size measured: host cost per byte and overlap per op."""
    coll = cal["collectives"]
    link, link_bps = cal.get("link"), cal.get("link_bps")
    out: dict = {"cores": cal["cores"], "tcp_efficiency": TCP_EFFICIENCY}
    for kind in KINDS:
        points = {int(n): coll[n]["unlimited"]["median_s"].get(f"{kind}_tiny") for n in coll}
        if None in points.values():
            continue  # a version-2 calibration: no torch.distributed ops
        a, b = _line(points)
        out[f"alpha_{kind}_s"] = a
        out[f"alpha_{kind}_per_peer_s"] = b
    for n, runs in coll.items():
        unl = runs["unlimited"]["median_s"]
        shaped = runs[link]["median_s"] if link in runs and link_bps else None
        numel, row = runs["unlimited"]["numel"], runs["unlimited"]["row_bytes"]
        for op, kind in OPS.items():
            if op not in unl:
                continue
            nbytes = _bytes_per_rank(op, int(n), numel, row)
            host = max(0.0, unl[op] - unl[f"{kind}_tiny"])
            out[f"host_{op}_s_per_byte@{n}"] = host / nbytes
        # kappa: the share of the shorter of host and wire time that the longer does not hide,
        # from the large allreduce on the shaped link (1: no overlap; none measured: 1). The
        # fp32 ring pipelines its reduction with the wire; Compression.fp16 casts the whole
        # buffer before and after the allreduce, outside that pipeline: its own figure.
        for op, key in KAPPA_OPS.items():
            measured = shaped is not None and op in shaped
            if not measured and op != "allreduce_fp32":
                continue  # Model._host takes the fp32 ring's
            kappa = 1.0
            if measured:
                alpha = unl["allreduce_tiny"]
                nbytes = _bytes_per_rank(op, int(n), numel, row)
                host = out[f"host_{op}_s_per_byte@{n}"] * nbytes
                wire = nbytes * 8 / (link_bps * TCP_EFFICIENCY)
                if min(host, wire) > 0:
                    kappa = (shaped[op] - alpha - max(host, wire)) / min(host, wire)
            out[f"{key}@{n}"] = min(1.0, max(0.0, kappa))
    for n, runs in coll.items():
        for model, m in runs.get("unlimited", {}).get("models", {}).items():
            out[f"{model}_step_ms@{n}ranks"] = m["step_s"] * 1e3
            out[f"{model}_fwd_bwd_ms@{n}ranks"] = m["fwd_bwd_s"] * 1e3
            out[f"{model}_adam_ms@{n}ranks"] = m["adam_s"] * 1e3
            if "fp16_allreduce_s" in m:
                out[f"{model}_fp16_allreduce_ms@{n}ranks"] = m["fp16_allreduce_s"] * 1e3
        for name, kern in runs.get("unlimited", {}).get("kernel_s_per_elem", {}).items():
            out[f"kernel_{name}_ns_per_elem@{n}ranks"] = kern * 1e9
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
    """Predictions from a calibration.

    ``transport``: what carries 1-bit Adam's stages, flat and hierarchical: ``"torch"``
    (torch.distributed's Gloo collectives, what ``transport="auto"`` picks on CPU; the
    hierarchical stages between nodes as collectives of their groups) or ``"horovod"``
    (Horovod's, with its negotiation per op). ``per_peer_s`` replaces the calibrated per-peer
    cost of every op (``b_op``), e.g. to see what a lower one would change.
    ``hierarchical_global_ops`` (Horovod's transport): every stage of the hierarchical
    collective is one global Horovod alltoall with splits, as ``hvd_onebit/comm/hierarchical.py``
    runs them there (each pays the per-op cost of all n ranks); False: Horovod collectives of
    their own groups (process sets), which the library does not use. ``intra_node``
    (torch's transport): the hierarchical stages inside a node through ``"shared_memory"`` (a
    barrier of the node's ranks each: CPU ranks, the library's default there) or the node's
    links (``"network"``: NCCL over NVLink or PCIe, or emulated links).
    """

    def __init__(self, cal: dict, per_peer_s: Optional[float] = None,
                 hierarchical_global_ops: bool = True, transport: str = "torch",
                 intra_node: str = "network"):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if intra_node not in INTRA_NODE:
            raise ValueError(f"intra_node must be one of {INTRA_NODE}, got {intra_node!r}")
        self.intra_node = intra_node
        self.cal = cal
        self.c = constants(cal)
        self.per_peer_s = per_peer_s
        self.hierarchical_global_ops = hierarchical_global_ops
        self.transport = transport

    # -- per-world-size lookups

    def _procs(self, cl: Cluster) -> str:
        """The calibration's process count for this job's compute: n sharing the cores if
        colocated, else one process with a core to itself."""
        comp = self.cal["compute"]
        if not cl.colocated:
            return min(comp, key=int)
        keys = sorted(int(k) for k in comp)
        return str(min(keys, key=lambda k: (abs(k - cl.n), -k)))

    def _collectives_n(self, n: int, cl: Cluster) -> int:
        """The calibration's collectives job whose figures stand for ``n`` ranks: the nearest
        world size if colocated (ties: the larger), else the smallest (a core per rank)."""
        measured = sorted(int(k) for k in self.cal["collectives"])
        return min(measured, key=lambda k: (abs(k - n), -k)) if cl.colocated else measured[0]

    def _host(self, op: str, n: int, cl: Cluster) -> tuple[float, float]:
        """(seconds per byte, kappa) of the host for ``op`` among ``n`` ranks: kappa of the op
        itself where the calibration measured it on a shaped link, else the fp32 ring's."""
        key = self._collectives_n(n, cl)
        kappa = self.c.get(f"{KAPPA_OPS.get(op, 'kappa')}@{key}", self.c[f"kappa@{key}"])
        return self.c[f"host_{op}_s_per_byte@{key}"], kappa

    def alpha(self, kind: str, n: int) -> float:
        if n <= 1:
            return 0.0
        if f"alpha_{kind}_s" not in self.c:
            raise ValueError(f"the calibration has no {kind} ops (a version-2 file, made before "
                             "transport='torch'): run `hvd-onebit bench calibrate` again, or "
                             "predict with --transport horovod")
        b = self.c[f"alpha_{kind}_per_peer_s"] if self.per_peer_s is None else self.per_peer_s
        return self.c[f"alpha_{kind}_s"] + b * (n - 1)

    # -- compute

    def compute(self, job: Job, cl: Cluster, free_running: bool = False) -> tuple[float, float]:
        """(step compute incl. Adam, Adam's part) in seconds. For a calibrated bench model, the
        phases timed in lock-step (ranks that collectives synchronise), or with
        ``free_running`` the whole step as ranks without communication run it."""
        m = None
        if job.model is not None:
            m = self.model_figures(job.model, cl)
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

    def _compute_figures(self, key: str, cl: Cluster) -> dict:
        """The calibration's ``key`` (``"models"``: the bench models' compute;
        ``"kernel_s_per_elem"``: the 1-bit kernels) for the ranks of ``cl``: colocated, as
        timed inside the ranks of the calibration's Horovod job with the nearest world size
        where it has them (Horovod's background thread and the other ranks share the cores,
        every rank in the same phase, as in `bench train`; kernels from version 6), else as
        bare processes sharing the cores; not colocated, one bare process with a core to
        itself."""
        if cl.colocated:
            k = str(self._collectives_n(cl.n, cl))
            ranks = self.cal["collectives"][k].get("unlimited", {}).get(key)
            if ranks:
                return ranks
        return self.cal["compute"][self._procs(cl)][key]

    def model_figures(self, name: str, cl: Cluster) -> dict:
        """A calibrated bench model's compute (params, step_s, fwd_bwd_s, adam_s)."""
        ranks = self._compute_figures("models", cl)
        return ranks[name] if name in ranks else \
            self.cal["compute"][self._procs(cl)]["models"][name]

    def kernel(self, name: str, elems: float, job: Job, cl: Cluster) -> float:
        rates = self._compute_figures("kernel_s_per_elem", cl)
        if name not in rates:
            raise ValueError(f"the calibration has no {name!r} pass (version "
                             f"{self.cal.get('version')}, made before the hierarchical "
                             "collective's native passes were timed): run `hvd-onebit bench "
                             "calibrate` again")
        return rates[name] * elems / job.kernel_speedup

    # -- collectives

    def _model_host(self, op: str, job: Job, cl: Cluster) -> Optional[float]:
        """Seconds per byte of ``op`` on the job's calibrated bench model's own gradient, where
        the calibration timed it (``allreduce_fp16``, version 5): the float16 cast and sum cost
        depends on the values (subnormals are slow), so random normal values misjudge a real
        gradient. None: use the op's figure from random normal values."""
        if op != "allreduce_fp16" or job.model is None:
            return None
        key = self._collectives_n(cl.n, cl)
        row = self.cal["collectives"][str(key)].get("unlimited", {})
        m = row.get("models", {}).get(job.model, {})
        if "fp16_allreduce_s" not in m:
            return None
        nbytes = ring_allreduce_bytes(2 * m["params"], key)
        return max(0.0, m["fp16_allreduce_s"] - row["median_s"]["allreduce_tiny"]) / nbytes

    def _transfer(self, op: str, n: int, nbytes: float, link_bytes: float, bps, latency_steps: int,
                  latency_s: float, job: Job, cl: Cluster, kind: str) -> float:
        alpha = self.alpha(kind, n)  # first: it says clearly when the calibration lacks op
        h, kappa = self._host(op, n, cl)
        model_h = self._model_host(op, job, cl)
        h = h if model_h is None else model_h
        host = h * nbytes / job.host_speedup
        wire = 0.0 if bps is None else link_bytes * 8 / (bps * TCP_EFFICIENCY)
        data = max(host, wire) + kappa * min(host, wire)
        return alpha + latency_steps * latency_s + data

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

    def _alltoall_stage(self, kind_n: int, per_rank: float, link_bytes: float, bps,
                        latency_s: float, job: Job, cl: Cluster, fp32: bool = False) -> float:
        """One of the hierarchical collective's stages: a Horovod alltoall (with splits) whose
        per-op cost is that of ``kind_n`` ranks (all n when it is a global op), ``per_rank``
        bytes sent by each rank, ``link_bytes`` on the busiest link of rate ``bps``. ``fp32``:
        the full-precision stages, with the host cost of a large float32 alltoall where the
        calibration has one (a version-3 file), else that of the 1-bit rows'."""
        measured = sorted(int(k) for k in self.cal["collectives"])
        op = ("alltoall_fp32" if fp32 and f"host_alltoall_fp32_s_per_byte@{measured[0]}"
              in self.c else "alltoall")
        return self._transfer(op, kind_n, per_rank, link_bytes, bps, 1, latency_s, job, cl,
                              "alltoall")

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
            return self._hierarchical(P, fwd_bwd, job, cl)
        if method == GROUP_METHOD:
            saved, self.hierarchical_global_ops = self.hierarchical_global_ops, False
            try:
                p = self._hierarchical(P, fwd_bwd, job, cl)
            finally:
                self.hierarchical_global_ops = saved
            p.method = method
            return p
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
        pre = "torch_" if self.transport == "torch" else ""
        a2a = self._transfer(pre + "alltoall", n, per_rank, a2a_bytes, a2a_bps, 1, lat, job, cl,
                             pre + "alltoall")
        ag = self._transfer(pre + "allgather", n, per_rank, ag_bytes, ag_bps, n - 1, lat, job,
                            cl, pre + "allgather")
        return a2a, ag, layout.wire_bytes

    def _hierarchical(self, P: int, fwd_bwd: float, job: Job, cl: Cluster) -> Prediction:
        """Hierarchical 1-bit as ``hvd_onebit/comm/hierarchical.py`` runs it, per bucket (``L`` ranks
        per node, ``N`` nodes, shard ``S = P/L``):

        materialize: Adam's momentum update written out (native, one pass of P);
        scatter: the node's full-precision alltoall, ``(L-1) S`` float32 to the node's ranks,
        or with shared memory a barrier of the node's ranks (a tiny torch op among L);
        compress: the node mean computed inside the shard's compression (a pass over the L
        rows of S: calibrated at L = 2, plus a float32 add of S per further row);
        alltoall (1-bit stage 1 among the N ranks of one local rank: ``N-1`` rows of
        ``S/(8N)`` bytes, ``L (N-1)`` rows on a node's link), server (S), allgather (stage 2),
        decode (S);
        gather: the node's allgather, ``(L-1) S`` float32 to the node's ranks (a barrier with
        shared memory; Horovod's alltoall with splits also copies the row L times, P);
        commit: the gathered mean copied out with Adam's update (native, P).

        On Horovod's transport every stage is one global Horovod op
        (``hierarchical_global_ops``, the library's way): each pays Horovod's alltoall per-op
        cost of all n ranks; else that of its group. On torch's, the stages between nodes are
        torch.distributed collectives of the N ranks (its constants).
        """
        n, L, N = cl.n, cl.ranks_per_node, cl.nodes
        S = P / L
        on_torch = self.transport == "torch"
        glob = self.hierarchical_global_ops and not on_torch
        shared = on_torch and self.intra_node == "shared_memory"
        ph = {"compute": fwd_bwd, "materialize": self.kernel("momentum_update", P, job, cl)}
        intra_rank = (L - 1) * S * 4  # each rank's full-precision bytes inside its node
        if shared:
            intra = self.alpha("torch_allgather", L)  # the barrier: one tiny op of the node
        elif on_torch:
            intra = (self._transfer("torch_alltoall", L, intra_rank, intra_rank, cl.intra_bps,
                                    1, cl.intra_latency_s, job, cl, "torch_alltoall")
                     if L > 1 else 0.0)
        else:
            intra = (self._alltoall_stage(n if glob else L, intra_rank, intra_rank, cl.intra_bps,
                                          cl.intra_latency_s, job, cl, fp32=True)
                     if (glob or L > 1) else 0.0)
        ph["scatter"] = intra
        layout = Layout.build(int(math.ceil(S)), N)
        ph["compress"] = (self.kernel("compress_mean", S, job, cl)
                          + self.kernel("add", max(0, L - 2) * S, job, cl) if L > 1
                          else self.kernel("compress", S, job, cl))
        inter_rank = (N - 1) * layout.row_bytes
        for stage in ("alltoall", "allgather"):
            if on_torch:
                op = f"torch_{stage}"
                ph[stage] = (self._transfer(op, N, inter_rank, L * inter_rank, cl.inter_bps,
                                            1 if stage == "alltoall" else N - 1,
                                            cl.inter_latency_s, job, cl, op)
                             if N > 1 else 0.0)
            else:
                ph[stage] = (self._alltoall_stage(n if glob else N, inter_rank, L * inter_rank,
                                                  cl.inter_bps, cl.inter_latency_s, job, cl)
                             if (glob or N > 1) else 0.0)
            if stage == "alltoall":
                ph["server"] = self.kernel("server", S, job, cl)
        ph["decode"] = self.kernel("decode", S, job, cl)
        # Horovod's allgather of the shard is an alltoall of the row copied L times
        ph["gather"] = intra + (0.0 if on_torch else self.kernel("add", P, job, cl))
        ph["commit"] = self.kernel("update", P, job, cl)
        wire = layout.wire_bytes if N > 1 else 0
        return Prediction("onebit_hierarchical", ph,
                          (0 if shared else int(2 * intra_rank)) + wire,
                          L * wire if N > 1 else None, [HIERARCHICAL_NOTE])

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
               ("onebit", "warmup"), ("onebit", "compression"), ("onebit_hier", "warmup"),
               ("onebit_hier", "compression"))
PREDICTED_AS = {"onebit": "onebit", "onebit_hier": "onebit_hierarchical"}


def bound_for(method: str, phase: str, bandwidth: str) -> float:
    """The issue's bounds: 25%, and 15% for the compressed step at 1 Gbit/s."""
    return 0.15 if (method, phase, bandwidth) == ("onebit", "compression", "1gbit") else 0.25


def model_transport(config: dict) -> str:
    """The scale model's transport for flat 1-bit in a `bench train` run: 'auto' and 'torch'
    ran torch.distributed (on CPU 'auto' resolves to it), 'horovod' (and 'mpi', not modelled:
    the nearest) Horovod's."""
    return "torch" if config.get("transport", "auto") in ("auto", "torch") else "horovod"


def model_intra_node(config: dict, transport: str) -> str:
    """How a `bench train` run's hierarchical stages inside a node travelled: its
    ``intra_node`` ('auto' is shared memory on CPU with torch's transport); runs that predate
    the option used the network."""
    mode = config.get("intra_node", "network")
    if mode == "auto":
        mode = "shared_memory" if transport == "torch" else "network"
    return mode


def check_report(reports: list[dict], cal: dict) -> dict:
    """Pairs of predicted and measured step times for ``bench train --json`` reports (several
    runs of one configuration are pooled: median and range). A compressed step's pair also
    carries the predicted phases and the measured breakdown (median per part over the runs)."""
    import statistics

    from ..cluster.bandwidth import parse_bandwidth

    groups: dict = {}
    for rep in reports:
        cfg = rep["config"]
        key = (rep["rows"][0]["np"], rep.get("ranks_per_node", 1) or 1, rep["bandwidth"],
               cfg["model"], model_transport(cfg))
        groups.setdefault(key, []).append(rep)
    pairs = []
    for (n, L, bw, model_name, transport), reps in sorted(groups.items()):
        cfg, row0 = reps[0]["config"], reps[0]["rows"][0]
        model = Model(cal, transport=transport, intra_node=model_intra_node(cfg, transport))
        bps = None if bw in ("local", "real") else parse_bandwidth(bw)  # loopback: unshaped
        cl = Cluster(nodes=n // L, ranks_per_node=L, inter_bps=bps, colocated=True)
        job = Job(params=row0["params"], model=model_name, warmup_frac=cfg["warmup_frac"])
        fp32 = model.predict("horovod_fp32", job, cl)
        preds = {("local", "all"): (model.compute(job, cl, free_running=True)[0], None),
                 ("horovod_fp32", "all"): (fp32.step_s, fp32.phases)}
        for method, predicted in PREDICTED_AS.items():
            preds[(method, "warmup")] = (fp32.step_s, fp32.phases)
            p = model.predict(predicted, job, cl)
            preds[(method, "compression")] = (p.step_s, p.phases)
        fp16 = model.predict("horovod_fp16", job, cl)
        preds[("horovod_fp16", "all")] = (fp16.step_s, fp16.phases)
        for method, phase in CHECK_PAIRS:
            rows = [r for rep in reps for r in rep["rows"]
                    if r["method"] == method and f"{phase}_step_s" in r]
            if not rows:
                continue
            vals = [r[f"{phase}_step_s"] for r in rows]
            pred, pred_phases = preds[(method, phase)]
            med = statistics.median(vals)
            bound = bound_for(method, phase, bw)
            parts = [r.get(f"{phase}_breakdown_s") or {} for r in rows]
            names = sorted({k for b in parts for k in b})
            breakdown = {k: statistics.median(b.get(k, 0.0) for b in parts) for k in names}
            pairs.append({"np": n, "ranks_per_node": L, "bandwidth": bw, "model": model_name,
                          "transport": transport if method.startswith("onebit") else "horovod",
                          "method": method, "phase": phase, "predicted_s": pred,
                          "measured_s": med, "measured_min_s": min(vals),
                          "measured_max_s": max(vals), "measured_runs_s": vals,
                          "runs": len(vals), "ratio": pred / med, "bound": bound,
                          "within": abs(pred / med - 1) <= bound,
                          "predicted_phases_s": pred_phases, "measured_breakdown_s": breakdown})
    # `local` checks the compute input (bench train's step without communication); the methods'
    # predictions are the rest
    methods = [p for p in pairs if p["method"] != "local"]
    compressed = [p for p in pairs if p["phase"] == "compression"]
    return {"pairs": pairs, "met": sum(p["within"] for p in pairs), "total": len(pairs),
            "methods_met": sum(p["within"] for p in methods), "methods_total": len(methods),
            "compressed_met": sum(p["within"] for p in compressed),
            "compressed_total": len(compressed),
            "calibration_date": cal.get("machine", {}).get("date")}


def print_check(result: dict, echo=None) -> None:
    from .report import print_table

    rows = [{**p, "pred_ms": p["predicted_s"] * 1e3, "meas_ms": p["measured_s"] * 1e3,
             "range": f"{p['measured_min_s'] * 1e3:,.1f}-{p['measured_max_s'] * 1e3:,.1f}",
             "ok": ("yes" if p["within"] else "NO") + f" ({p['bound']:.0%})"}
            for p in result["pairs"]]
    print_table(rows, [("np", "np", "d"), ("L", "ranks_per_node", "d"),
                       ("link", "bandwidth", ""), ("model", "model", ""),
                       ("method", "method", ""), ("phase", "phase", ""),
                       ("predicted ms", "pred_ms", ",.1f"), ("measured ms", "meas_ms", ",.1f"),
                       ("measured range", "range", ""), ("runs", "runs", "d"),
                       ("pred/meas", "ratio", ".2f"), ("within", "ok", "")])
    import click

    echo = echo or click.echo
    echo(f"{result['met']} of {result['total']} pairs within their bound; the methods' step times "
         f"(all but local, the compute input): {result['methods_met']} of "
         f"{result['methods_total']}; compressed steps: {result['compressed_met']} of "
         f"{result['compressed_total']}")
    echo("compressed steps, ms: predicted phases | measured breakdown (median over runs; "
         "'wait' is both stages' waits, and for onebit_hier the node mean and compress too)")
    for p in result["pairs"]:
        if p["phase"] != "compression" or not p["predicted_phases_s"]:
            continue
        pred = " ".join(f"{k}={v * 1e3:.1f}" for k, v in p["predicted_phases_s"].items())
        meas = " ".join(f"{k}={v * 1e3:.1f}" for k, v in p["measured_breakdown_s"].items())
        echo(f"np={p['np']} L={p['ranks_per_node']} {p['bandwidth']} {p['model']} {p['method']}"
             f" ({p['transport']}): {pred} | {meas}")


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
        if "onebit" in sel[0]["methods"] and GROUP_METHOD in sel[0]["methods"]:
            d["hierarchical_group_beats_flat_from"] = from_on(
                sel, lambda ms: ms[GROUP_METHOD]["run_step_s"] < ms["onebit"]["run_step_s"])
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
              "onebit_hierarchical": ("tab:green", "hierarchical 1-bit (hierarchical.py)"),
              GROUP_METHOD: ("tab:olive", "hierarchical 1-bit, stages as group collectives")}
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
        for j, (key, color, text) in enumerate((
                ("flat_onebit_stops_paying_at", "tab:blue", "flat 1-bit <= fp32"),
                ("hierarchical_beats_flat_from", "tab:green", "hierarchical > flat"),
                ("hierarchical_group_beats_flat_from", "tab:olive", "group hierarchical > flat"))):
            if c.get(key):
                ax.axvline(c[key], color=color, ls=dashes[i % len(dashes)], lw=0.8, alpha=0.6)
                right = c[key] > max(r["np"] for r in rows) / 4  # keep the label inside
                ax.text(c[key] / 1.03 if right else c[key] * 1.03,
                        0.02 + 0.05 * (3 * i + j),
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
             f", hierarchical beats flat from n={c['hierarchical_beats_flat_from']}"
             + (f", group hierarchical beats flat from n={c['hierarchical_group_beats_flat_from']}"
                if "hierarchical_group_beats_flat_from" in c else ""))
