"""`hvd-onebit bench dev tensors`: what a compressed step costs per parameter tensor on the host.

A model of a fixed number of parameters is cut into more and more tensors; for each count, DDP
with torch's fused Adam (``ddp_adam``) and the DDP face of 1-bit Adam (``ddp_onebit``,
compressed steps only, ``variance_refresh=None``) run the same training steps in one torchrun
job. Each step's whole time (zero_grad, forward, backward, step) and the step's own are the
means over the steps measured (a mean, not a median: the garbage collector's full collections
land on a few steps, and their cost is part of the step's). The summary fits each method's
whole step time to the tensor count, per repetition: the slope is the cost of one tensor more
(the parameters' work stays the same), and 1-bit's slope less Adam's is what the compressed
step adds per tensor on the host (its hooks, bookkeeping and per-tensor kernel arguments).

Run as a job: ``python -m torch.distributed.run --nproc_per_node 2 -m
hvd_onebit_tools.bench.tensors --counts 10,100 --json-out FILE``; :func:`bench_tensors` does it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

METHODS = ("ddp_adam", "ddp_onebit")
FREEZE = 5  # Adam steps before the freeze
SETTLE = 3  # compressed steps run before the ones measured


def _model(count: int, total: int):
    """``count`` flat parameters of about ``total`` elements in all, and a loss touching every
    element (a forward of a few ops whatever the count)."""
    import torch

    class Many(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            size = max(1, total // count)
            self.ps = torch.nn.ParameterList(
                torch.nn.Parameter(torch.randn(size, generator=g) * 0.1) for _ in range(count))

        def forward(self, x):
            flat = torch.cat([p.view(-1) for p in self.ps])
            return (flat * x).sum() + 1e-3 * (flat * flat).sum()

    return Many()


def _run(method: str, count: int, total: int, steps: int, rank: int) -> dict:
    """One method at one tensor count: the means of the measured steps, in ms."""
    import gc

    import torch
    from torch.nn.parallel import DistributedDataParallel

    import hvd_onebit.ddp

    gc.collect()  # the models before leave no garbage for this one's steps to collect
    model = DistributedDataParallel(_model(count, total))
    adam = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    opt = adam if method == "ddp_adam" else hvd_onebit.ddp.DistributedOptimizer(
        adam, model, freeze_step=FREEZE, variance_refresh=None)
    x = torch.randn(sum(p.numel() for p in model.parameters()),
                    generator=torch.Generator().manual_seed(100 + rank))
    whole, step, backward = [], [], []
    for i in range(FREEZE + SETTLE + steps):
        start = time.perf_counter()
        opt.zero_grad()
        loss = model(x)
        before_backward = time.perf_counter()
        loss.backward()
        before_step = time.perf_counter()
        opt.step()
        end = time.perf_counter()
        if i >= FREEZE + SETTLE:
            whole.append(end - start)
            step.append(end - before_step)
            backward.append(before_step - before_backward)
    if method != "ddp_adam" and opt.phase != "compression":
        raise RuntimeError(f"the 1-bit steps measured were not compressed (phase {opt.phase})")
    return {"whole_ms": 1e3 * statistics.fmean(whole), "step_ms": 1e3 * statistics.fmean(step),
            "backward_ms": 1e3 * statistics.fmean(backward)}


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The least-squares slope of ``ys`` over ``xs``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mx) ** 2 for x in xs)
    if spread == 0:
        raise ValueError("a slope needs two or more distinct tensor counts")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / spread


def summarize(rows: list[dict]) -> dict:
    """Per count and method, the whole step's median over repetitions with its range, and the
    ratio of 1-bit's to Adam's; per repetition, each method's slope (us per tensor) and 1-bit's
    less Adam's, with their ranges."""
    counts = sorted({r["tensors"] for r in rows})
    reps = sorted({r["rep"] for r in rows})
    at = {(r["rep"], r["tensors"], r["method"]): r for r in rows}
    table = []
    for n in counts:
        entry = {"tensors": n}
        for m in METHODS:
            values = [at[(k, n, m)]["whole_ms"] for k in reps]
            entry[m] = {"whole_ms": statistics.median(values),
                        "whole_ms_range": [min(values), max(values)],
                        "step_ms": statistics.median(at[(k, n, m)]["step_ms"] for k in reps)}
        ratios = [at[(k, n, "ddp_onebit")]["whole_ms"] / at[(k, n, "ddp_adam")]["whole_ms"]
                  for k in reps]
        entry["ratio"] = statistics.median(ratios)
        entry["ratio_range"] = [min(ratios), max(ratios)]
        table.append(entry)
    slopes = {m: [1e3 * slope(counts, [at[(k, n, m)]["whole_ms"] for n in counts])
                  for k in reps] for m in METHODS}
    extra = [a - b for a, b in zip(slopes["ddp_onebit"], slopes["ddp_adam"])]
    return {"counts": table,
            "us_per_tensor": {m: {"median": statistics.median(v), "range": [min(v), max(v)]}
                              for m, v in slopes.items()},
            "extra_us_per_tensor": {"median": statistics.median(extra),
                                    "range": [min(extra), max(extra)]}}


def bench_tensors(np: int, counts: Sequence[int], params: int, steps: int, reps: int,
                  timeout: float = 1800.0, log=None) -> dict:
    """Run the job on ``np`` local ranks (torchrun, Gloo, CPU); its rows and their summary."""
    from .lm import run_local_torchrun

    if len(set(counts)) < 2:
        raise ValueError("give two or more distinct tensor counts: the slope needs them")
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rows.json"
        argv = ["-m", "hvd_onebit_tools.bench.tensors", "--counts",
                ",".join(map(str, counts)), "--params", str(params), "--steps", str(steps),
                "--reps", str(reps), "--json-out", str(out)]
        status = run_local_torchrun(argv, np, timeout, log)
        if status != 0 or not out.is_file():
            raise RuntimeError(f"the tensors job ended with status {status} (None: it ran past "
                               f"{timeout:.0f} s) and wrote no rows")
        rows = json.loads(out.read_text())
    return {"ranks": np, "params": params, "steps": steps, "reps": reps, "rows": rows,
            **summarize(rows)}


def sweep(counts: Sequence[int], params: int, steps: int, reps: int) -> list[dict]:
    """Every repetition, count and method, on every rank of torch.distributed's default group
    (set up); the rows, the same on every rank (rank 0's figures)."""
    import torch.distributed as dist

    rows = []
    for rep in range(reps):
        for count in counts:
            for method in METHODS:
                dist.barrier()
                rows.append({"rep": rep, "tensors": count, "method": method,
                             **_run(method, count, params, steps, dist.get_rank())})
    shared = [rows]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def main(argv: Optional[Sequence[str]] = None) -> None:
    """A rank of the job: :func:`sweep`, whose rows rank 0 writes to ``--json-out``."""
    import torch
    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--counts", required=True)
    parser.add_argument("--params", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--reps", type=int, required=True)
    parser.add_argument("--json-out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rows = sweep([int(c) for c in args.counts.split(",")], args.params, args.steps, args.reps)
    if dist.get_rank() == 0:
        Path(args.json_out).write_text(json.dumps(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
