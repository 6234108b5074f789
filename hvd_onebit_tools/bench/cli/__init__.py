"""`hvd-onebit bench`: the benchmark commands (tables by default, JSON with --json), one module
per command (:mod:`.kernel`, :mod:`.allreduce`, :mod:`.train`, :mod:`.calibrate`,
:mod:`.predict`, :mod:`.memory`, :mod:`.zoo`), the options they share in :mod:`.options`.
Importing this imports no Horovod: the commands import what they run when they run."""
from __future__ import annotations

import click

from . import allreduce, calibrate, kernel, memory, predict, train, zoo


@click.group()
def bench() -> None:
    """Benchmarks; every command prints a table, or JSON with --json."""


for command in (kernel.bench_kernel, allreduce.bench_allreduce, train.bench_train,
                calibrate.bench_calibrate, predict.bench_predict, memory.bench_memory_command,
                zoo.bench_zoo):
    bench.add_command(command)
