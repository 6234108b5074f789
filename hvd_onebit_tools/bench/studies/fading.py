"""A task whose gradients grow and then fade as it fits: each ``variance_refresh`` against Adam.

An MLP memorises random labels (``--samples`` points, ``--classes`` labels drawn uniformly), on
``--np`` Horovod ranks, ``--batch`` points per rank per step, the variance frozen at
``--freeze`` of the run. Early on the model predicts the uniform distribution and the gradients
are small; they grow while it starts to separate the points and fade once it has memorised
them. A variance frozen in the first phase is then smaller than Adam's for most of the run.

Every setting of :data:`SETTINGS` trains from the same initial weights and the same batches (one
Horovod job runs them one after another). For each, the final loss over the whole training set
and its ratio to Adam's. The committed results (``docs/step/fading*.json``) also hold rows of
the two refresh gates measured there and since retired (``accept="lowering"`` and
``"hypergradient"``), with what each gate saw at its refreshes.

Usage:
    python benchmarks/fading.py --out docs/step/fading.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

WORKER = "hvd_onebit_tools.bench.studies.fading:fading_worker"
INPUTS = 32  # input features

#: name -> the optimizer's variance_refresh (None: 1-bit Adam without refresh); "adam":
#: Horovod's own DistributedOptimizer over torch Adam
SETTINGS = {
    "adam": "adam",
    "none": None,
    "doubling": "doubling",
}


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


def full_loss(model, x, y) -> float:
    with torch.no_grad():
        return float(F.cross_entropy(model(x), y))


def run_setting(name: str, steps: int, batch: int, freeze: int, seed: int, lr: float,
                samples: int, classes: int, width: int) -> dict:
    """Train one setting on this rank of the job; the record (rank 0's is kept)."""
    import horovod.torch as hvd

    import hvd_onebit

    x, y, model = build(seed, samples, classes, width)
    adam = torch.optim.Adam(model.parameters(), lr=lr)
    named = list(model.named_parameters())
    if SETTINGS[name] == "adam":
        opt = hvd.DistributedOptimizer(adam, named_parameters=named, groups=1)
    else:
        opt = hvd_onebit.DistributedOptimizer(adam, named_parameters=named, groups=1,
                                              freeze_step=freeze,
                                              variance_refresh=SETTINGS[name])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    draw = torch.Generator().manual_seed(seed * 1000 + hvd.rank())
    curve, grad_sq = [(0, full_loss(model, x, y))], []
    start = time.perf_counter()
    for step in range(steps):
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
        record.update({"refreshes": t["refreshes"], "freeze_step": opt.freeze_step})
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
    """Final loss and its ratio to Adam's, per setting."""
    adam = next(r["final_loss"] for r in records if r["setting"] == "adam")
    return {r["setting"]: {"final_loss": r["final_loss"], "over_adam": r["final_loss"] / adam}
            for r in records}


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
    """The benchmarks' shared provenance (report.provenance), with this run's command, the CPU
    and the load it started under."""
    from ..report import provenance as shared

    out = shared()
    out["machine"]["cpu"] = platform.processor()
    return {"command": " ".join(["python benchmarks/fading.py", *argv]), **out,
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
