"""`hvd-onebit bench calibrate`: measure the scale model's constants and save them."""
from __future__ import annotations

import json

import click

from .options import comma_list, np_option, parse_count, queue_option


@click.command("calibrate")
@click.option("--out", default=None, type=click.Path(dir_okay=False),
              help="Where to save the constants (JSON) [default: "
                   "~/.cache/hvd_onebit/calibration.json].")
@click.option("--procs", default="1,2,4", show_default=True, callback=comma_list(int),
              help="Processes timing compute and kernels at once (ranks sharing the cores).")
@np_option("2,4", "Ranks of the emulated collectives jobs.", sweep=True)
@click.option("--bandwidth", "link", default="1gbit", show_default=True,
              help="Shaped link rate at which the links' efficiency is measured.")
@click.option("--numel", default="4M", show_default=True,
              callback=lambda c, p, v: parse_count(v),
              help="Elements of the large collectives' buffer.")
@click.option("--repeats", default=7, show_default=True, help="Timed calls per measurement.")
@queue_option
@click.option("--json", "as_json", is_flag=True, help="Print the constants as JSON too.")
def bench_calibrate(out, procs, nps, link, numel, repeats, queue_ms, as_json) -> None:
    """Measure the scale model's constants on this machine and save them (needs root: the
    collectives run on the emulated cluster). `bench predict` loads them."""
    from ..calibrate.files import DEFAULT_PATH, save
    from ..calibrate.run import calibrate
    from ..predict.constants import constants

    cal = calibrate(procs=tuple(procs), nps=tuple(nps), link=link, numel=numel,
                    repeats=repeats, queue_ms=queue_ms, progress=lambda s: click.echo(s, err=True))
    path = save(cal, out or DEFAULT_PATH)
    click.echo(f"saved {path} ({cal['seconds']:.0f} s)", err=True)
    if as_json:
        click.echo(json.dumps(cal, indent=2))
        return
    for k, v in constants(cal).items():
        click.echo(f"{k}: {v}")
