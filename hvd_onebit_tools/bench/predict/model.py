"""The scale model itself: :class:`Model`, each method's step time per phase and bytes per rank
for a job on a cluster, from a calibration's constants (:mod:`.constants`). The terms and their
assumptions are in :mod:`hvd_onebit_tools.bench.predict`'s docstring."""
from __future__ import annotations

import math
from typing import Optional

from hvd_onebit.config import DEFAULT_BLOCK_SIZE
from hvd_onebit.layout import Layout, ring_allreduce_bytes
from .constants import KAPPA_OPS, TCP_EFFICIENCY, TRANSPORTS, constants
from .job import Cluster, Job, Prediction

METHODS = ("horovod_fp32", "horovod_fp16", "onebit", "onebit_hierarchical")
# the DDP face's methods, named as `bench train` names its runs, and the Horovod face's method
# each is priced as: DDP + Adam's allreduce is the same ring and bytes as Horovod's fp32 one
# (Gloo's and NCCL's are not calibrated apart), and the DDP face's compressed step is flat
# 1-bit's stages on torch.distributed
DDP_METHODS = {"ddp_adam": "horovod_fp32", "ddp_onebit": "onebit"}


def priced_as(method: str) -> str:
    """The method whose prices ``method`` takes (itself, but for :data:`DDP_METHODS`)."""
    return DDP_METHODS.get(method, method)


def is_onebit(method: str) -> bool:
    """Whether ``method`` runs 1-bit Adam (a warmup, then compressed steps), on either face."""
    return priced_as(method).startswith("onebit")


# hierarchical 1-bit on Horovod's transport with each stage a collective of its own group
# (process sets, which the library does not use there); on torch's transport the stages are
# group collectives already, and this method is onebit_hierarchical
GROUP_METHOD = "onebit_hierarchical_group"
HIERARCHICAL_NOTE = ("onebit_hierarchical models hvd_onebit/comm/hierarchical.py on the flat 1-bit "
                     "transport (torch: group collectives between nodes, intra_node inside them; "
                     "horovod: 4 global alltoalls with splits per bucket); checked on the "
                     "emulator at 2 nodes x 2 ranks only")
INTRA_NODE = ("network", "shared_memory")


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
    links (``"network"``: NCCL over NVLink or PCIe, or emulated links). ``block_size``: the
    1-bit rows' elements per scale, as the optimizer's option (None: one scale per chunk).
    """

    def __init__(self, cal: dict, per_peer_s: Optional[float] = None,
                 hierarchical_global_ops: bool = True, transport: str = "torch",
                 intra_node: str = "network", block_size: Optional[int] = DEFAULT_BLOCK_SIZE):
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
        self.block_size = block_size

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
        """(step compute incl. Adam, Adam's part) in seconds. For a calibrated bench model:
        ``fwd_bwd_s + adam_s``, its phases timed in lock-step (ranks that collectives
        synchronise), the compute of every method's step here and in `bench predict --check`;
        with ``free_running``, ``step_s``, the whole step as ranks without communication run it
        (`bench train`'s ``local`` method, and nothing else).
        :data:`~hvd_onebit_tools.bench.calibrate.workloads.FIGURES` says what each figure is."""
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

    def add_elems_per_s(self) -> float:
        """torch.add's element rate in one bare process of the calibration machine: the rate
        the 1-bit kernels' costs are relative to (they run at a share of memory speed), so a
        device's own torch.add rate over this one is its ``kernel_speedup``."""
        return 1.0 / self.cal["compute"][min(self.cal["compute"], key=int)][
            "kernel_s_per_elem"]["add"]

    def pricing_note(self, job: Job) -> Optional[str]:
        """What a prediction at the calibration's own speeds (no ``--kernel-speedup`` or
        ``--host-speedup``) assumes, and how to price faster devices; None when either is set."""
        if job.kernel_speedup != 1.0 or job.host_speedup != 1.0:
            return None
        cores = self.cal.get("cores") or (self.cal.get("machine") or {}).get("cpu_count")
        k = min(self.cal["compute"], key=int)  # add_elems_per_s's process count
        return (f"priced at the calibration's CPU speeds ({cores}-core machine; torch.add "
                f"{self.add_elems_per_s() / 1e9:.2f} G elements/s "
                f"{'in one process' if k == '1' else f'with {k} processes at once'}): on GPU "
                "nodes the kernels and the hosts cost less, and the hierarchical verdict "
                "most of all; pass --kernel-speedup (your device's torch.add rate over that "
                "one, from `hvd-onebit bench dev kernel --device cuda`) and --host-speedup "
                "('inf' for the link alone): docs/predicting.md, GPU nodes")

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
                row = Layout.build(P, n, self.block_size).row_bytes
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
        layout = Layout.build(P, n, self.block_size)
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
        layout = Layout.build(int(math.ceil(S)), N, self.block_size)
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
                          L * wire if N > 1 else None, [self.hierarchical_note(cl.intra_bps)])

    def hierarchical_note(self, intra_bps=None) -> str:
        """:data:`HIERARCHICAL_NOTE` and what carries the hierarchical stages inside a node
        (``intra_bps``: the node links' rate, None: unlimited)."""
        from .tables import link_text

        shared = self.transport == "torch" and self.intra_node == "shared_memory"
        inside = "shared memory" if shared else f"the node links, {link_text(intra_bps)}"
        return f"{HIERARCHICAL_NOTE}; inside a node: {inside}"

    def predict_all(self, job: Job, cl: Cluster, methods=METHODS) -> dict:
        """Per method: phases, step time, bytes; 1-bit rows also their warmup step and the
        whole run's speed-up over Horovod fp32 (``warmup_frac`` of the steps in warmup)."""
        fp32 = self.predict("horovod_fp32", job, cl)
        out = {}
        for m in methods:
            p = fp32 if priced_as(m) == "horovod_fp32" else self.predict(priced_as(m), job, cl)
            row = {"method": m, "phases_s": p.phases, "step_s": p.step_s,
                   "bytes_per_rank": p.bytes_per_rank, "step_speedup_vs_fp32": fp32.step_s / p.step_s}
            if p.inter_node_bytes_per_node is not None:
                row["inter_node_bytes_per_node"] = p.inter_node_bytes_per_node
            if is_onebit(m):
                run = job.warmup_frac * fp32.step_s + (1 - job.warmup_frac) * p.step_s
                row.update({"warmup_step_s": fp32.step_s, "compression_step_s": p.step_s,
                            "run_step_s": run, "run_speedup_vs_fp32": fp32.step_s / run})
            else:
                row["run_speedup_vs_fp32"] = fp32.step_s / p.step_s
            if p.notes:
                row["notes"] = p.notes
            out[m] = row
        return out
