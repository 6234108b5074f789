"""`hvd-onebit bench dev tensors`: the compressed step's host cost per parameter tensor."""
from __future__ import annotations

from typing import Optional

import click

from ..report import print_table, report_head
from .options import (Finite, comma_list, emit, need_two_ranks, np_option, out_option,
                      parameter_count)


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a tensor count") from None
    if n < 1:
        raise ValueError(f"{text!r} is not a positive tensor count")
    return n


def _counts(ctx, param, value):
    counts = comma_list(_count, empty_ok=False)(ctx, param, value)
    if len(set(counts)) < 2:
        raise click.BadParameter(f"{value!r}: give two or more distinct tensor counts (the "
                                 "cost per tensor is the slope over them)")
    return counts


@click.command("tensors")
@np_option(2, "World size (torchrun ranks on this machine, Gloo, CPU).")
@click.option("--counts", default="10,100,1000,3000", show_default=True, callback=_counts,
              help="Tensor counts the model's parameters are cut into, comma separated.")
@click.option("--params", default="2M", show_default=True, callback=parameter_count,
              help="The model's parameters, whatever the tensor count (e.g. 2M).")
@click.option("--steps", default=20, show_default=True, type=click.IntRange(min=1),
              help="Steps measured per count and method (compressed steps for 1-bit).")
@click.option("--reps", default=3, show_default=True, type=click.IntRange(min=1),
              help="Repetitions of the whole sweep (the ranges are over them).")
@click.option("--timeout", default=1800.0, show_default=True,
              type=Finite(min=0, min_open=True), help="Seconds the job may take.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@out_option
def bench_tensors_command(np_: int, counts: list[int], params: int, steps: int, reps: int,
                          timeout: float, as_json: bool, out: Optional[str]) -> None:
    """Host cost per parameter tensor: DDP + fused Adam against the DDP face's compressed
    step, at one parameter count cut into more and more tensors."""
    from ..tensors import bench_tensors

    need_two_ranks(np_, "the compressed step's exchange")
    result = {**report_head("tensors"), **bench_tensors(np_, counts, params, steps, reps,
                                                        timeout)}
    if emit(result, as_json, out):
        return
    print_table([{"tensors": e["tensors"], "adam": e["ddp_adam"]["whole_ms"],
                  "onebit": e["ddp_onebit"]["whole_ms"], "ratio": e["ratio"],
                  "low": e["ratio_range"][0], "high": e["ratio_range"][1]}
                 for e in result["counts"]],
                [("tensors", "tensors", ""), ("DDP+Adam ms", "adam", ".1f"),
                 ("1-bit ms", "onebit", ".1f"), ("ratio", "ratio", ".2f"),
                 ("ratio low", "low", ".2f"), ("ratio high", "high", ".2f")])
    per = result["us_per_tensor"]
    extra = result["extra_us_per_tensor"]
    print(f"per tensor: DDP+Adam {per['ddp_adam']['median']:.1f} us, 1-bit "
          f"{per['ddp_onebit']['median']:.1f} us; 1-bit adds {extra['median']:.1f} us "
          f"(from {extra['range'][0]:.1f} to {extra['range'][1]:.1f} over {reps} runs)")
