"""Launching the zoo: one job per family, results appended to one JSON-lines file.

:func:`run_zoo` plans every family's cells (``grid.py``), skips those already in the results
file when resuming, and runs each family as one ``np``-rank job (with its timeout: a hung job is
killed whole): through :func:`hvd_onebit_tools.cluster.jobs.run_job` for the Horovod face, under
torchrun (``python -m hvd_onebit_tools.bench.zoo.worker``) for the DDP face. A family whose
job fails is reported and the others still run; the cells it finished before failing are kept.
While a job runs, a thread prints each new cell to ``progress`` as rank 0 writes it.
"""
from __future__ import annotations

import json
import pickle
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

from ...cluster.jobs import RankFailure, run_job
from ..lm import run_local_torchrun
from .faces import option_names
from .grid import ADAM, cell_key, plan_family

WORKER = "hvd_onebit_tools.bench.zoo.worker:zoo_worker"
RESULTS = "cells.jsonl"


def read_cells(path: Path) -> list[dict]:
    """The records in a results file (a torn last line, from a killed job, is skipped)."""
    if not path.exists():
        return []
    cells = []
    for line in path.read_text().splitlines():
        try:
            cells.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return cells


def check_options(cells: Iterable[dict], face: str = "horovod") -> None:
    """Raise a ValueError here, before any job starts, if a scheme passes an option the
    installed face's DistributedOptimizer does not take (every rank would raise it)."""
    params = option_names(face)
    factory = "hvd_onebit.ddp" if face == "ddp" else "hvd_onebit"
    for cell in cells:
        missing = [k for k in cell.get("options", {}) if k not in params]
        if missing:
            raise ValueError(f"scheme {cell['scheme']!r} passes {', '.join(missing)}, which this "
                             f"{factory}.DistributedOptimizer does not take")


def run_ddp_job(kwargs: dict, np: int, timeout: float) -> None:
    """The zoo worker's keyword arguments run as one DDP job of ``np`` ranks under torchrun;
    RankFailure, with the end of the job's output, when it fails or runs past ``timeout``."""
    with tempfile.TemporaryDirectory(prefix="hvd_onebit_zoo_") as folder:
        path = Path(folder) / "kwargs.pkl"
        path.write_bytes(pickle.dumps(kwargs))
        log_path = Path(folder) / "output.log"
        with open(log_path, "wb") as log:
            rc = run_local_torchrun(["-m", "hvd_onebit_tools.bench.zoo.worker", str(path)], np,
                              timeout, log)
        if rc != 0:
            why = f"job timed out after {timeout:.0f}s" if rc is None else f"exited with {rc}"
            raise RankFailure(f"zoo worker under torchrun on {np} ranks: {why}\n"
                              + log_path.read_text(errors="replace")[-6000:])


def describe(record: dict, adam: Optional[dict] = None) -> str:
    """One progress line for a finished cell."""
    what = "adam" if record["method"] == ADAM else f"{record['scheme']} {record['freeze']}"
    loss = record["final_loss"]
    text = (f"{record['family']} {record['lr_rule']} seed {record['seed']} {what}: "
            f"{'diverged' if record['diverged'] else 'loss'} "
            f"{'nan' if loss is None else f'{loss:.4f}'}")
    if adam and adam.get("final_loss") and loss is not None:
        text += f" (x{loss / adam['final_loss']:.3f} Adam)"
    if record.get("freeze_step") is not None:
        text += f", freeze {record['freeze_step']}"
    if record.get("clamped_fraction") is not None:
        text += f", clamped {record['clamped_fraction']:.2%}"
    return text + f", {record['seconds']:.1f}s"


def _reason(message: str) -> str:
    """The line of a RankFailure that says what went wrong (a traceback's last line, or a
    time-out), for the progress output; the whole message goes into the result."""
    lines = [x.strip() for x in message.splitlines() if x.strip()]
    for x in lines:
        if x.startswith("job timed out") or "Error:" in x or "Exception:" in x:
            return x[:300]
    return (lines[1] if len(lines) > 1 else message)[:300]


class _Follower(threading.Thread):
    """Prints each line rank 0 appends to the results file while a job runs."""

    def __init__(self, path: Path, progress: Callable[[str], None]):
        super().__init__(daemon=True)
        self.path, self.progress = path, progress
        self.offset = path.stat().st_size if path.exists() else 0
        self.stopped = threading.Event()
        self.adam: dict[tuple, dict] = {}

    def poll(self) -> None:
        if not self.path.exists():
            return
        with open(self.path) as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[:chunk.rfind("\n") + 1]
        self.offset += len(complete.encode())
        for line in complete.splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            key = (record["family"], record["lr_rule"], record["seed"])
            if record["method"] == ADAM:
                self.adam[key] = record
            self.progress("[zoo] " + describe(record, self.adam.get(key)))

    def run(self) -> None:
        while not self.stopped.wait(1.0):
            self.poll()

    def stop(self) -> None:
        self.stopped.set()
        self.join()
        self.poll()


def run_zoo(families: Iterable[str], out_dir: Path, seeds: Iterable[int], schemes: Iterable[str],
            freezes: Optional[Iterable[str]] = None, lr_rules: Optional[Iterable[str]] = None,
            steps: Optional[int] = None, batch: Optional[int] = None, np: int = 4,
            timeout: float = 1200.0, resume: bool = False,
            progress: Callable[[str], None] = print, cluster=None,
            face: str = "horovod") -> dict:
    """Run the zoo; return ``{"results": path, "failures": {family: message}, "seconds": s}``.

    Without ``resume`` the results file is started afresh; with it, cells already in it are
    not run again (an interrupted zoo goes on where it stopped). ``cluster``: a started
    :class:`hvd_onebit_tools.cluster.EmulatedCluster` the jobs run on (None: loopback).
    ``face``: "horovod" or "ddp" (torchrun on loopback; no cluster)."""
    if face == "ddp" and cluster is not None:
        raise ValueError("the DDP face's zoo runs on loopback: no emulated cluster")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = (out_dir / RESULTS).resolve()
    if not resume:
        path.unlink(missing_ok=True)
    kept = read_cells(path)
    done = {cell_key(c) for c in kept}
    kwargs = {k: v for k, v in [("freezes", freezes), ("lr_rules", lr_rules)] if v is not None}
    planned = {name: plan_family(name, list(seeds), list(schemes), steps=steps, batch=batch,
                                 **kwargs) for name in families}
    for name, cells in planned.items():
        runs = {(c["steps"], c["batch"]) for c in cells}
        other = sorted({(c.get("steps"), c.get("batch")) for c in kept
                        if c.get("family") == name} - runs)
        if other:  # the report would put both in one cell's seeds
            raise ValueError(f"{path} holds {name} runs of (steps, batch) {other}, this zoo "
                             f"runs {sorted(runs)}: --resume goes on with the same --steps and "
                             "--batch-size; give another --out-dir for other ones")
    plans = {name: [c for c in cells if cell_key(c) not in done]
             for name, cells in planned.items()}
    check_options((c for cells in plans.values() for c in cells), face)
    failures: dict[str, str] = {}
    start = time.monotonic()
    for name, cells in plans.items():
        if not cells:
            progress(f"[zoo] {name}: every cell already in {path}")
            continue
        progress(f"[zoo] {name}: {len(cells)} runs on {np} ranks ({face} face)")
        follower = _Follower(path, progress)
        follower.start()
        t0 = time.monotonic()
        job = {"cells": cells, "results": str(path)}
        try:
            if face == "ddp":
                run_ddp_job(job, np, timeout)
            else:
                run_job(WORKER, np=np, kwargs=job, timeout=timeout, cluster=cluster)
        except RankFailure as exc:
            failures[name] = str(exc)
            progress(f"[zoo] {name}: job failed after {time.monotonic() - t0:.0f}s: "
                     f"{_reason(str(exc))}")
        finally:
            follower.stop()
        progress(f"[zoo] {name}: {time.monotonic() - t0:.0f}s")
    return {"results": str(path), "failures": failures, "seconds": time.monotonic() - start}
