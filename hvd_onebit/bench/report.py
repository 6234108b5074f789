"""How the benchmarks report: the machine a run was measured on, and plain-text tables."""
from __future__ import annotations

import os
import platform
import time

import click


def machine_info() -> dict:
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(),
            "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}


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


