"""Predictions over a grid of world sizes and bandwidths (`bench predict --np 8,...,1024
--bandwidth ...`), and the world sizes where flat 1-bit stops paying and hierarchical 1-bit
takes over."""
from __future__ import annotations

from .job import Cluster, Job
from .model import GROUP_METHOD, METHODS, Model, priced_as


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


def flat_method(methods) -> str:
    """The flat 1-bit row among ``methods`` (``onebit``, else the DDP face's ``ddp_onebit``), or
    ``onebit`` where there is none."""
    return next((m for m in methods if priced_as(m) == "onebit"), "onebit")


def crossovers(rows: list[dict]) -> dict:
    """Per bandwidth: the world size from which on flat 1-bit's whole run is no faster than fp32
    (it stops paying), and from which on hierarchical 1-bit beats flat (it takes over); None
    if that never holds up to the largest world size of the sweep. Only the verdicts whose
    methods were priced."""
    def from_on(sel, holds):
        first = None
        for r in sel:
            first = (first or r["np"]) if holds(r["methods"]) else None
        return first

    out: dict = {}
    for bps in dict.fromkeys(r["inter_bps"] for r in rows):
        sel = sorted((r for r in rows if r["inter_bps"] == bps), key=lambda r: r["np"])
        d: dict = {}
        flat = flat_method(sel[0]["methods"])
        if flat in sel[0]["methods"] and GROUP_METHOD in sel[0]["methods"]:
            d["hierarchical_group_beats_flat_from"] = from_on(
                sel, lambda ms: ms[GROUP_METHOD]["run_step_s"] < ms[flat]["run_step_s"])
        if flat in sel[0]["methods"]:
            d["flat_onebit_stops_paying_at"] = from_on(
                sel, lambda ms: ms[flat]["run_speedup_vs_fp32"] <= 1.0)
            if "onebit_hierarchical" in sel[0]["methods"]:
                d["hierarchical_beats_flat_from"] = from_on(
                    sel, lambda ms: ms["onebit_hierarchical"]["run_step_s"]
                    < ms[flat]["run_step_s"])
        out[str(bps)] = d
    return out
