"""`hvd-onebit bench calibrate`: measure the scale model's constants and save them."""
from __future__ import annotations

import json
import math

import click

from .options import (link_rate, need_horovod, need_two_ranks, np_option, output_file,
                      parse_count, queue_option)


def process_counts(ctx, param, value) -> list[int]:
    """``--procs``: a comma-separated list of process counts, each 1 or more."""
    try:
        procs = [int(v) for v in str(value).split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a process count or a comma-separated list "
                                 "of them (e.g. 1,2,4)") from None
    if not procs or min(procs) < 1:
        raise click.BadParameter(f"{value!r}: process counts are 1 or more (e.g. 1,2,4)")
    return procs


def element_count(ctx, param, value) -> int:
    """``--numel``: a positive element count (e.g. 4M, 65536)."""
    try:
        n = parse_count(value)
    except (ValueError, OverflowError):
        n = 0
    if n < 1:
        raise click.BadParameter(f"{value!r} is not a positive element count (e.g. 4M, 65536)")
    return n


def check_worlds(nps: list[int], numel: int) -> None:
    """Every --np is a job that communicates, and splits --numel into its ranks' equal rows
    (the full-precision alltoall views the buffer as one row per rank); two world sizes or more,
    for the per-peer cost of each op (the slope of its time against the world size)."""
    need_two_ranks(nps, "a collectives job")
    uneven = [n for n in nps if numel % n]
    if uneven:
        step = math.lcm(*nps)
        raise click.BadParameter(f"{numel:,} elements do not split evenly over {uneven} "
                                 f"rank(s): give a --numel that every --np divides (e.g. "
                                 f"{-(-numel // step) * step})", param_hint="--numel")
    if len(set(nps)) < 2:
        raise click.BadParameter(f"{','.join(map(str, nps))}: the per-peer cost of each op is the "
                                 "slope of its time against the world size, which one world size "
                                 "cannot give (`bench predict` would price every op at any --np "
                                 "as at this one): give two or more (e.g. 2,4)", param_hint="--np")


@click.command("calibrate")
@click.option("--out", default=None, type=click.Path(dir_okay=False), callback=output_file,
              help="Where to save the constants (JSON) [default: "
                   "~/.cache/hvd_onebit/calibration.json].")
@click.option("--procs", default="1,2,4", show_default=True, callback=process_counts,
              help="Processes timing compute and kernels at once (ranks sharing the cores).")
@np_option("2,4", "Ranks of the emulated collectives jobs (2 or more).", sweep=True)
@click.option("--bandwidth", "link", default="1gbit", show_default=True, callback=link_rate,
              help="Shaped link rate at which the links' efficiency is measured.")
@click.option("--numel", default="4M", show_default=True, callback=element_count,
              help="Elements of the large collectives' buffer (every --np must divide it); "
                   "binary suffixes: K, M, G are 2^10, 2^20, 2^30, so 1M is 1,048,576.")
@click.option("--repeats", default=7, show_default=True, type=click.IntRange(min=1),
              help="Timed calls per measurement.")
@queue_option
@click.option("--json", "as_json", is_flag=True, help="Print the constants as JSON too.")
def bench_calibrate(out, procs, nps, link, numel, repeats, queue_ms, as_json) -> None:
    """Measure the scale model's constants on this machine and save them (needs root: the
    collectives run on the emulated cluster). `bench predict` loads them."""
    from ..calibrate.files import DEFAULT_PATH, save
    from ..calibrate.run import calibrate
    from ..predict.constants import constants

    check_worlds(nps, numel)
    need_horovod()
    cal = calibrate(procs=tuple(procs), nps=tuple(nps), link=link, numel=numel,
                    repeats=repeats, queue_ms=queue_ms, progress=lambda s: click.echo(s, err=True))
    path = save(cal, out or DEFAULT_PATH)
    click.echo(f"saved {path} ({cal['seconds']:.0f} s)", err=True)
    if as_json:
        click.echo(json.dumps(cal, indent=2))
        return
    for k, v in constants(cal).items():
        click.echo(f"{k}: {v}")
