"""The zoo's rank worker: runs a list of cells inside one job, one after another.

Started on every rank by :func:`hvd_onebit_tools.cluster.jobs.run_job` (``zoo_worker``, the
Horovod face), or by torchrun as ``python -m hvd_onebit_tools.bench.zoo.worker KWARGS`` (the DDP
face; :mod:`.faces` says what each face wraps). Each cell gets a fresh model and optimizer;
rank 0 appends one JSON line per finished cell to the results file, so the cells done before a
crash or a timeout survive it.

What makes Adam and 1-bit Adam comparable cell by cell, so that they differ in the compression
phase only (a 1-bit run's warmup is bit-identical to the Adam run's first steps; the test checks
it):

* the model is initialised from the seed and broadcast from rank 0 (Horovod's recipe; DDP's
  constructor does the same);
* the optimizer state is not broadcast: a fresh optimizer's state is zeros on every rank, and
  ``hvd.broadcast_optimizer_state`` on a fresh torch Adam creates it by taking a step with zero
  gradients, which starts plain Adam one bias-correction step ahead of hvd_onebit's (whose
  state exists from construction); examples/train_lm.py does the same for the same reason;
* the batches come from a generator seeded from (seed, rank), and the global generator, which
  draws dropout masks, is reseeded from (seed, rank) just before training; nothing the
  optimizers do draws random numbers;
* the gradients travel as one grouped allreduce per step (``groups=1``, for Adam and for
  hvd_onebit's warmup alike): Horovod's default fusion packs whichever gradients are ready in a
  cycle, so the reduction order, hence the last bits, would change from run to run, and chaos
  would turn them into ~1% of final loss; grouped, a rerun gives the same bits. It is also
  2-3x cheaper per step here than one allreduce per tensor. DDP's buckets are fixed from the
  model, so its reduction order is the same in every run anyway.
"""
from __future__ import annotations

import json
import math
import os
import pickle
import sys
import time
import warnings
from pathlib import Path
from typing import Optional

import torch

from hvd_onebit.step_bound import clamped_fraction, input_clamped_fraction

from .faces import make_face
from .grid import ADAM, experimental, learning_rate, options_record
from .models import Task, family, parameter_count

EVALS_PER_RUN = 10  # held-out evaluations per run (every steps // 10 steps, and the last step)
TAIL_EVALS = 3      # the "tail" loss: mean of the last few evaluations (less noisy than the last)


def _finite(x: Optional[float]) -> bool:
    return x is not None and math.isfinite(x)


def _json_number(x: Optional[float]) -> Optional[float]:
    # JSON has no NaN or infinity: a non-finite figure is written as null (and flagged).
    return float(x) if _finite(x) else None


@torch.no_grad()
def held_out_loss(task: Task, saw_nonfinite: bool, face) -> tuple[float, bool]:
    """The mean held-out loss over every rank's share, and whether any rank saw a non-finite
    training loss since the last call (one allreduce carries both, so every rank decides alike
    whether the run has diverged).

    BatchNorm's running statistics are the one state each rank keeps for itself (the optimizer
    averages gradients, not buffers): they are averaged over the ranks for the evaluation and
    restored afterwards, so training is exactly what a Horovod user's is."""
    model = task.model
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    saved = [b.clone() for b in buffers]
    if buffers:  # one grouped allreduce, not one negotiation per buffer
        face.average_(buffers, "zoo.buffers")
    model.eval()
    total, count = 0.0, 0
    for batch in task.held_out(face.rank, face.size):
        s, n = task.sums(model, batch)
        total, count = total + s, count + n
    model.train()
    for b, s in zip(buffers, saved):
        b.copy_(s)
    # A non-finite local sum must not poison the count: carry it as a flag.
    bad = float(saw_nonfinite or not math.isfinite(total))
    sums = face.sum(torch.tensor([total if math.isfinite(total) else 0.0, count, bad],
                                 dtype=torch.float64), "zoo.held_out")
    nonfinite = bool(sums[2] > 0)
    return (math.nan if nonfinite else float(sums[0] / sums[1])), nonfinite


def zero_variance_fraction(optimizer) -> float:
    """The share of all parameter elements whose variance is exactly 0 (read at the freeze:
    the elements that got no gradient in the whole warmup, which ``zero_variance="hold"``
    keeps fixed for the rest of the run)."""
    zero = total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            v = optimizer.state[p]["exp_avg_sq"]
            zero += int((v == 0).sum())
            total += v.numel()
    return zero / total if total else 0.0


def _held(zero_fraction: Optional[float], cell: dict) -> Optional[float]:
    # zero_variance="hold" (the default) keeps the zero-variance elements fixed; "eps" and
    # "floor" train them.
    if zero_fraction is None:
        return None
    return zero_fraction if experimental(cell).zero_variance == "hold" else 0.0


def run_cell(cell: dict, face) -> dict:
    """Train one cell under ``face`` (:mod:`.faces`); the record of what happened (every rank
    returns the same figures)."""
    fam = family(cell["family"])
    rank, world = face.rank, face.size
    steps, seed = cell["steps"], cell["seed"]
    lr = learning_rate(fam.base_lr, cell["lr_rule"], world)
    onebit = cell["method"] != ADAM
    # The bound clamped_fraction measures against: the scheme's, or the library's default
    # ("adam") when the scheme leaves it out. An unbounded scheme has none to measure.
    bound = experimental(cell).step_bound if onebit else None
    start, cpu_start = time.perf_counter(), time.process_time()

    task = fam.build(seed, lr, cell["batch"])
    wrapped = face.wrap(task, cell)
    optimizer = wrapped.optimizer
    torch.manual_seed(seed * 1000 + rank)  # dropout masks: the same for Adam and 1-bit
    draw = task.sampler(seed, rank, world)

    initial, _ = held_out_loss(task, False, face)
    curve = [(0, initial)]
    eval_every = max(1, steps // EVALS_PER_RUN)
    nonfinite_local: Optional[int] = None  # first step with a non-finite loss on this rank
    diverged_at: Optional[int] = None
    clamped: list[float] = []
    input_clamped: list[float] = []
    zero_fraction: Optional[float] = None
    compressed_steps = 0
    taken = 0
    for step in range(steps):
        compressing = onebit and optimizer.phase == "compression"
        if compressing and zero_fraction is None:
            # The variance is final here, and not yet rewritten: zero_variance="eps" or
            # "floor" fill its zeros during this step's first compressed pass.
            zero_fraction = zero_variance_fraction(optimizer)
            if "compression_lr_factor" in cell:  # a null change (grid.COMPRESSION_LR_FACTORS)
                for group in optimizer.param_groups:
                    group["lr"] *= cell["compression_lr_factor"]
        batch = draw()
        loss = task.loss(wrapped.model, batch)
        optimizer.zero_grad()
        loss.backward()
        if compressing and bound is not None and experimental(cell).precondition:
            # the input bound (preconditioned only), from this rank's momentum and gradient
            c = input_clamped_fraction(optimizer.param_groups, optimizer.state, bound)
            if c is not None:
                input_clamped.append(c)
        optimizer.step()
        taken = step + 1
        if nonfinite_local is None and not math.isfinite(loss.item()):
            nonfinite_local = step
        if compressing:
            compressed_steps += 1
            if bound is not None:
                c = clamped_fraction(optimizer.param_groups, optimizer.state, bound)
                if c is not None:
                    clamped.append(c)
        if taken % eval_every == 0 or taken == steps:
            value, nonfinite = held_out_loss(task, nonfinite_local is not None, face)
            curve.append((taken, value))
            if nonfinite or not math.isfinite(value):
                diverged_at = taken  # every rank stops here: the flag came through an allreduce
                break

    final = curve[-1][1]
    tail = [v for _, v in curve[-TAIL_EVALS:]]
    tail_loss = sum(tail) / len(tail) if all(_finite(v) for v in tail) else math.nan
    diverged = diverged_at is not None or not _finite(final) or final > initial
    record = {**cell, "face": face.name, "lr": lr, "world": world,
              "params": parameter_count(task.model),
              "initial_loss": _json_number(initial), "final_loss": _json_number(final),
              "tail_loss": _json_number(tail_loss), "diverged": diverged,
              "nonfinite_at": diverged_at, "steps_taken": taken,
              "curve": [(s, _json_number(v)) for s, v in curve],
              "seconds": time.perf_counter() - start,
              # every rank's CPU time: what the run would take on idle cores, whatever else the
              # machine runs (the ranks' wall time is about this over the number of cores)
              "cpu_seconds": float(face.sum(torch.tensor(time.process_time() - cpu_start,
                                                         dtype=torch.float64),
                                            "zoo.cpu_seconds"))}
    if "options" in cell:  # JSON: the Experimental knobs flat
        record["options"] = options_record(cell["options"])
    if onebit:
        telemetry = optimizer.telemetry()
        record.update({
            "freeze_step": optimizer.freeze_step, "compressed_steps": compressed_steps,
            "skipped_steps": telemetry["skipped_steps"],
            "clamped_fraction": sum(clamped) / len(clamped) if clamped else None,
            "clamped_max": max(clamped) if clamped else None,
            "input_clamped_fraction": (sum(input_clamped) / len(input_clamped)
                                       if input_clamped else None),
            "zero_variance_fraction": zero_fraction,
            "held_fraction": _held(zero_fraction, cell), "bound": bound})
        if optimizer.freeze_decision is not None:
            record["freeze_reason"] = optimizer.freeze_decision.get("reason")
    return record


def zoo_worker(cells: list[dict], results: str, threads: int = 1,
               face: str = "horovod") -> list[dict]:
    """Run ``cells`` in order on this rank under ``face`` ("horovod" or "ddp"); rank 0 appends
    each record to ``results`` (JSON lines) as soon as it is done. Returns the records (rank 0;
    the other ranks return [])."""
    ranks = make_face(face)
    torch.set_num_threads(threads)
    ranks.prepare()
    # A held element warns once per run; 54 runs x 4 ranks of the same warning say nothing the
    # record's held_fraction does not.
    warnings.filterwarnings("ignore", message=".*held fixed.*")
    records = []
    path = Path(results)
    for cell in cells:
        record = run_cell(cell, ranks)
        if ranks.rank == 0:
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
            records.append(record)
    return records


def torchrun_main(kwargs_path: str) -> None:
    """A DDP-face rank as torchrun starts it: Gloo set up from torchrun's environment, then
    :func:`zoo_worker` on the pickled keyword arguments at ``kwargs_path``."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    zoo_worker(**pickle.loads(Path(kwargs_path).read_bytes()), face="ddp")
    dist.destroy_process_group()


if __name__ == "__main__":
    torchrun_main(sys.argv[1])
