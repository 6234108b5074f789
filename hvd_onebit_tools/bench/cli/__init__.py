"""`hvd-onebit bench`: the benchmark commands (tables by default, JSON with --json), one module
per command (:mod:`.kernel`, :mod:`.allreduce`, :mod:`.train`, :mod:`.calibrate`,
:mod:`.predict`, :mod:`.memory`, :mod:`.tensors`, :mod:`.zoo`), the options they share in
:mod:`.options`. A user's commands sit on ``bench``; the developer's (kernel throughput, memory,
host cost per tensor, the convergence zoo) on ``bench dev``. Importing this imports no Horovod:
the commands import what they run when they run."""
from __future__ import annotations

import click

from . import allreduce, calibrate, kernel, memory, predict, tensors, train, zoo


@click.group()
def bench() -> None:
    """Benchmarks; every command prints a table, or JSON with --json."""


@bench.group()
def dev() -> None:
    """Developer benchmarks: kernel throughput, memory per phase, host cost per tensor, the
    convergence zoo."""


for command in (train.bench_train, allreduce.bench_allreduce, calibrate.bench_calibrate,
                predict.bench_predict):
    bench.add_command(command)
for command in (kernel.bench_kernel, memory.bench_memory_command, tensors.bench_tensors_command,
                zoo.bench_zoo):
    dev.add_command(command)
