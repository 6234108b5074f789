"""A task whose gradients grow and then fade as it fits, and what the refresh gates see on it.

An MLP memorises random labels (``--samples`` points, ``--classes`` labels drawn uniformly), on
``--np`` Horovod ranks, ``--batch`` points per rank per step, the variance frozen at
``--freeze`` of the run. Early on the model predicts the uniform distribution and the gradients
are small; they grow while it starts to separate the points and fade once it has memorised
them. A variance frozen in the first phase is then smaller than Adam's for most of the run.

Every setting of :data:`SETTINGS` trains from the same initial weights and the same batches (one
Horovod job runs them one after another). For each, the final loss over the whole training set
and its ratio to Adam's; with a refresh gate, what the gate saw at every refresh, per parameter:
the sums of the old and new roots (``sum(sqrt(v))`` before and after the refresh's variance
update, over ``v > 0``), the bias corrections' roots before and after, the ratio of the mean
denominators new / old that the "lowering" rule compares with 1, the hypergradient
``sum(g * u)`` against its threshold, and whether the parameter declined the update.
``"doubling, gate observed"`` runs the "lowering" gate's sums on the doubling schedule but
accepts every update: the same steps as ``"doubling"`` (its final loss is checked to be
identical), with what the gate would have decided on them.

Usage:
    python benchmarks/fading.py --out docs/step/fading.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

WORKER = "hvd_onebit_tools.bench.studies.fading:fading_worker"
INPUTS = 32  # input features

#: name -> the optimizer's variance_refresh (None: 1-bit Adam without refresh; a dict: "doubling"
#: with that refresh schedule, ``Experimental(refresh_schedule=...)``); "adam": Horovod's own
#: DistributedOptimizer over torch Adam
SETTINGS = {
    "adam": "adam",
    "none": None,
    "doubling": "doubling",
    "lowering": {"accept": "lowering"},
    "hypergradient": {"accept": "hypergradient"},
    "doubling, gate observed": {"accept": "lowering"},
}
OBSERVE_ONLY = "doubling, gate observed"


def build(seed: int, samples: int, classes: int, width: int):
    """(inputs, labels, model): the same on every rank, the model initialised from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, INPUTS, generator=gen)
    y = torch.randint(classes, (samples,), generator=gen)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(INPUTS, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, classes))
    return x, y, model


class GateProbe:
    """Records what :func:`hvd_onebit.engine.refresh_gate.declined` is given and decides, while
    installed (``with``); with ``accept_all`` it then accepts every update (the sums are still
    taken: the run is the doubling schedule's)."""

    def __init__(self, names: dict, accept_all: bool = False):
        self.names, self.accept_all = names, accept_all
        self.step: Optional[int] = None
        self.refreshes: list[dict] = []

    def __enter__(self):
        from hvd_onebit.engine import refresh_gate

        self.module, self.original = refresh_gate, refresh_gate.declined

        def declined(sums, old, new):
            out = self.original(sums, old, new)
            self.refreshes.append(self.record(sums, old, new, out))
            return [] if self.accept_all else out

        refresh_gate.declined = declined
        return self

    def __exit__(self, *exc):
        self.module.declined = self.original

    def record(self, sums, old, new, out) -> dict:
        params, rises, overshoots = [], 0, 0
        gone = {id(p) for p in out}
        for p, s in sums.items():
            values = [float(v) for v in s.tolist()]
            mean_ratio = ((values[1] / new[p]) / (values[0] / old[p])
                          if values[0] > 0 else math.nan)
            entry = {"name": self.names.get(id(p), "?"), "old_roots": values[0],
                     "new_roots": values[1], "sqrt_bc2_old": old[p], "sqrt_bc2_new": new[p],
                     "roots_ratio": values[1] / values[0] if values[0] > 0 else math.nan,
                     "mean_denominator_ratio": mean_ratio, "declined": id(p) in gone}
            rises += mean_ratio > 1
            if len(values) == 4:
                from hvd_onebit.engine.refresh_gate import OVERSHOOT_Z
                entry.update({"g_dot_u": values[2], "threshold":
                              -OVERSHOOT_Z * math.sqrt(values[3]),
                              "overshot": values[2] < -OVERSHOOT_Z * math.sqrt(values[3])})
                overshoots += entry["overshot"]
            params.append(entry)
        return {"step": self.step, "parameters": params, "declined": len(out),
                "rising": rises, "overshot": overshoots}


def full_loss(model, x, y) -> float:
    with torch.no_grad():
        return float(F.cross_entropy(model(x), y))


def run_setting(name: str, steps: int, batch: int, freeze: int, seed: int, lr: float,
                samples: int, classes: int, width: int) -> dict:
    """Train one setting on this rank of the job; the record (rank 0's is kept)."""
    import horovod.torch as hvd

    import hvd_onebit
    from hvd_onebit.config import Experimental

    x, y, model = build(seed, samples, classes, width)
    adam = torch.optim.Adam(model.parameters(), lr=lr)
    named = list(model.named_parameters())
    if SETTINGS[name] == "adam":
        opt = hvd.DistributedOptimizer(adam, named_parameters=named, groups=1)
    else:
        setting = SETTINGS[name]
        schedule = setting if isinstance(setting, dict) else None  # a gate: doubling's steps
        opt = hvd_onebit.DistributedOptimizer(
            adam, named_parameters=named, groups=1, freeze_step=freeze,
            variance_refresh="doubling" if schedule else setting,
            experimental=Experimental(refresh_schedule=schedule) if schedule else None)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    draw = torch.Generator().manual_seed(seed * 1000 + hvd.rank())
    probe = GateProbe({id(p): n for n, p in named}, accept_all=name == OBSERVE_ONLY)
    curve, grad_sq = [(0, full_loss(model, x, y))], []
    start = time.perf_counter()
    with probe:
        for step in range(steps):
            probe.step = step
            ix = torch.randint(samples, (batch,), generator=draw)
            loss = F.cross_entropy(model(x[ix]), y[ix])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if SETTINGS[name] == "adam":  # Horovod's step leaves the averaged gradient in .grad
                grad_sq.append(sum(float(p.grad.double().square().sum())
                                   for p in model.parameters()))
            if (step + 1) % max(1, steps // 10) == 0 or step + 1 == steps:
                curve.append((step + 1, full_loss(model, x, y)))
    record = {"setting": name, "variance_refresh": SETTINGS[name], "final_loss": curve[-1][1],
              "curve": curve, "seconds": time.perf_counter() - start}
    if grad_sq:  # the averaged gradient's squared norm, per tenth of the run
        tenth = max(1, steps // 10)
        record["grad_sq_by_tenth"] = [sum(grad_sq[i:i + tenth]) / len(grad_sq[i:i + tenth])
                                      for i in range(0, steps, tenth)]
    if SETTINGS[name] != "adam":
        t = opt.telemetry()
        record.update({"refreshes": t["refreshes"], "refresh_declined": t["refresh_declined"],
                       "freeze_step": opt.freeze_step, "gate": probe.refreshes})
    return record


def fading_worker(settings: list[str], **task) -> list[dict]:
    """Every setting in order on this rank (a Horovod job's rank); rank 0 returns the records."""
    import horovod.torch as hvd

    from ..waits import sleeping_horovod_waits

    torch.set_num_threads(1)
    sleeping_horovod_waits(True)
    records = [run_setting(name, **task) for name in settings]
    return records if hvd.rank() == 0 else []


def summarise(records: list[dict]) -> dict:
    """Final loss over Adam's per setting, and per gated setting how its refreshes went."""
    adam = next(r["final_loss"] for r in records if r["setting"] == "adam")
    out = {}
    for r in records:
        entry = {"final_loss": r["final_loss"], "over_adam": r["final_loss"] / adam}
        gate = r.get("gate") or []
        if gate:
            decisions = [p for g in gate for p in g["parameters"]]
            ratios = sorted(p["mean_denominator_ratio"] for p in decisions)
            entry.update({
                "refreshes_seen": len(gate),
                "parameter_updates": len(decisions),
                "declined": sum(p["declined"] for p in decisions),
                "rising": sum(p["mean_denominator_ratio"] > 1 for p in decisions),
                "roots_grew": sum(p["roots_ratio"] > 1 for p in decisions),
                "median_mean_denominator_ratio": ratios[len(ratios) // 2],
                "overshot": sum(bool(p.get("overshot")) for p in decisions),
                "by_third": by_third(gate, r["curve"][-1][0])})
        out[r["setting"]] = entry
    return out


def by_third(gate: list[dict], steps: int) -> list[dict]:
    """The gate's refreshes in each third of the run: how many parameter updates, how many
    declined, the median ratio of mean denominators new / old and of the roots' sums."""
    out = []
    for k in range(3):
        lo, hi = k * steps // 3, (k + 1) * steps // 3
        ps = [p for g in gate if lo <= g["step"] < hi for p in g["parameters"]]
        if not ps:
            continue
        ratios = sorted(p["mean_denominator_ratio"] for p in ps)
        roots = sorted(p["roots_ratio"] for p in ps)
        out.append({"steps": [lo, hi], "parameter_updates": len(ps),
                    "declined": sum(p["declined"] for p in ps),
                    "median_mean_denominator_ratio": ratios[len(ratios) // 2],
                    "median_roots_ratio": roots[len(roots) // 2]})
    return out


def rounded(x, digits: int = 6):
    """``x`` with every float to ``digits`` significant digits (a smaller file, same story)."""
    if isinstance(x, float):
        return float(f"{x:.{digits}g}")
    if isinstance(x, dict):
        return {k: rounded(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [rounded(v, digits) for v in x]
    return x


def provenance(argv: list[str]) -> dict:
    from ..report import machine_info

    root = Path(__file__).resolve().parents[3]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=root, capture_output=True, text=True).stdout.strip())
    return {"command": " ".join(["python benchmarks/fading.py", *argv]), "commit": commit,
            "uncommitted_changes": dirty, "machine": {**machine_info(),
                                                      "cpu": platform.processor()},
            "load_before": os.getloadavg()}


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32, help="points per rank per step")
    ap.add_argument("--freeze", type=float, default=0.1, help="freeze step, a share of --steps")
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    args = ap.parse_args(argv)
    from ...cluster.jobs import run_job

    settings = ["adam", *[s for s in args.settings if s != "adam"]]
    result = {"provenance": provenance(argv), "task": {
        k: getattr(args, k) for k in ("np", "steps", "batch", "freeze", "samples", "classes",
                                      "width", "lr")}, "seeds": {}}
    for seed in args.seeds:
        task = dict(steps=args.steps, batch=args.batch, freeze=round(args.freeze * args.steps),
                    seed=seed, lr=args.lr, samples=args.samples, classes=args.classes,
                    width=args.width)
        job = run_job(WORKER, np=args.np, kwargs={"settings": settings, **task},
                      timeout=args.timeout)
        records = next(r for r in job.results if r)
        result["seeds"][str(seed)] = {"summary": summarise(records), "runs": records}
        print(json.dumps({"seed": seed, "summary": result["seeds"][str(seed)]["summary"]}),
              file=sys.stderr, flush=True)
    per_seed = [v["summary"] for v in result["seeds"].values()]
    result["over_adam"] = {name: {"per_seed": [x[name]["over_adam"] for x in per_seed],
                                  "worst": max(x[name]["over_adam"] for x in per_seed),
                                  "median": statistics.median(x[name]["over_adam"]
                                                              for x in per_seed)}
                           for name in settings}
    result["provenance"]["load_after"] = os.getloadavg()
    text = json.dumps(rounded(result), separators=(",", ":"))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
