"""How the benchmarks report: the machine a run was measured on, and plain-text tables."""
from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Optional

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


def library_version() -> Optional[str]:
    """The version of the hvd_onebit this process imports (its ``__version__``: a checkout run
    beside an older install is the checkout's), else its installed metadata; None when neither
    is there."""
    import importlib.metadata

    try:
        from hvd_onebit import __version__
        return __version__
    except ImportError:
        pass
    try:
        return importlib.metadata.version("hvd_onebit")
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(where: Path, *args: str) -> Optional[str]:
    """What ``git args`` prints in folder ``where``, stripped; None where it fails or there is
    no git."""
    import subprocess

    try:
        proc = subprocess.run(["git", *args], cwd=where, capture_output=True, text=True)
    except OSError:  # no git
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def source_commit(package_dir: Path) -> Optional[str]:
    """The commit of the git checkout ``package_dir`` (a package folder) was imported from, or
    None: a copy installed into site-packages (where a git repository around it, e.g. the
    user's own project holding the virtual environment, is not the package's) or no git at
    all. The checkout's top level must be the package folder's parent and track it."""
    top = _git(package_dir.parent, "rev-parse", "--show-toplevel")
    if not top or Path(top).resolve() != package_dir.resolve().parent:
        return None
    if _git(package_dir.parent, "ls-files", "--error-unmatch", "--", package_dir.name) is None:
        return None  # the repository does not track this package
    return _git(package_dir.parent, "rev-parse", "HEAD")


def provenance() -> dict:
    """Where a result was measured, for its JSON: the machine and date, the tools' checkout's
    commit (and whether it had uncommitted changes; both None for an installed copy: see
    :func:`source_commit`), and the versions of hvd_onebit, torch and Horovod."""
    import importlib.metadata

    package = Path(__file__).resolve().parents[1]
    commit = source_commit(package)
    changed = None
    if commit is not None:
        changed = bool(_git(package.parent, "status", "--porcelain", "--untracked-files=no"))
    versions = {"hvd_onebit": library_version()}
    for name in ("torch", "horovod"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    machine = machine_info()
    out = {"machine": machine, "date": machine["date"], "commit": commit,
           "uncommitted_changes": changed,
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
