"""`hvd-onebit bench`: the benchmark commands."""
from __future__ import annotations

import click


@click.group()
def bench() -> None:
    """Benchmarks; every command prints a table, or JSON with --json."""
