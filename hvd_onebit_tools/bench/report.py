"""How the benchmarks report: the machine a run was measured on, and plain-text tables."""
from __future__ import annotations

import json
import math
import os
import platform
import sys
import time

import click


def strict_json(value, **kwargs) -> str:
    """``json.dumps`` whose output every JSON parser reads: an infinite or NaN number (e.g.
    ``--host-speedup inf``) is written as the string "inf", "-inf" or "nan"."""
    def finite(v):
        if isinstance(v, float) and not math.isfinite(v):
            return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [finite(x) for x in v]
        return v
    return json.dumps(finite(value), allow_nan=False, **kwargs)


def machine_info() -> dict:
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(),
            "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}


# Variables that change what a benchmark measures (HVD_ONEBIT_NATIVE=avx2: the 8-lane paths),
# recorded with its provenance when set.
MEASURED_ENVIRONMENT = ("HVD_ONEBIT_NATIVE",)


def provenance() -> dict:
    """Where a result was measured, for its JSON: the machine and date, this checkout's commit
    (and whether it had uncommitted changes), and the versions of torch and Horovod."""
    import importlib.metadata
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True,
                              text=True).stdout.strip()

    versions = {}
    for name in ("torch", "horovod"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    machine = machine_info()
    out = {"machine": machine, "date": machine["date"], "commit": git("rev-parse", "HEAD"),
           "uncommitted_changes": bool(git("status", "--porcelain", "--untracked-files=no")),
           "versions": versions}
    environment = {k: os.environ[k] for k in MEASURED_ENVIRONMENT if k in os.environ}
    if environment:  # what changed the kernels the run measured
        out["environment"] = environment
    return out


def command_line() -> str:
    """The command as typed, for a report's provenance."""
    return " ".join(["hvd-onebit", *sys.argv[1:]])


def report_head(benchmark: str) -> dict:
    """The head of a report: which benchmark, the command, and :func:`provenance`."""
    return {"benchmark": benchmark, "command": command_line(), **provenance()}


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (header, key, format spec)."""
    cells = [[h for h, _, _ in columns]]
    for r in rows:
        line = []
        for _, key, fmt in columns:
            v = r.get(key)
            line.append("-" if v is None else format(v, fmt))
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    for k, line in enumerate(cells):
        click.echo("  ".join(c.rjust(w) for c, w in zip(line, widths)))
        if k == 0:
            click.echo("  ".join("-" * w for w in widths))


def repeated_runs(run, repeats: int, label: str) -> dict:
    """``run()`` (one benchmark run, a dict of figures) ``repeats`` times, each reported on
    stderr as it lands; returns every run and, per float figure, the median and the range."""
    import json
    import statistics
    import sys

    runs = []
    for i in range(repeats):
        runs.append(run())
        print(f"[{label}] run {i + 1}: {json.dumps(runs[-1])}", file=sys.stderr, flush=True)
    keys = [k for k, v in runs[0].items() if isinstance(v, float)]
    return {"runs": runs,
            "median": {k: statistics.median(r[k] for r in runs) for k in keys},
            "range": {k: (min(r[k] for r in runs), max(r[k] for r in runs)) for k in keys}}
