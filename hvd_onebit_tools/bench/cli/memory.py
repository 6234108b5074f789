"""`hvd-onebit bench dev memory`: memory beyond Adam's own per phase."""
from __future__ import annotations

from typing import Optional

import click

from ..report import print_table, report_head
from .options import (Finite, cluster_for, emit, link_rate, need_horovod, need_two_ranks,
                      np_option, out_option)


@click.command("memory")
@np_option(2, "World size (Horovod ranks, or virtual ranks with --world inprocess).")
@click.option("--bandwidth", default="local", show_default=True, callback=link_rate,
              help="Emulated link rate of every rank (e.g. 1gbit; root needed) for --world "
                   "horovod; 'local' runs plain horovodrun on loopback.")
@click.option("--layers", default=4, show_default=True, type=click.IntRange(min=1),
              help="Linear layers of the model.")
@click.option("--width", default=1024, show_default=True, type=click.IntRange(min=1),
              help="Each layer is width x width.")
@click.option("--warmup", default=3, show_default=True, type=click.IntRange(min=1),
              help="Adam steps before the freeze.")
@click.option("--compressed", default=3, show_default=True, type=click.IntRange(min=1),
              help="1-bit steps measured.")
@click.option("--world", "transport", type=click.Choice(["horovod", "inprocess"]),
              default="horovod",
              show_default=True, help="horovod: a job through both phases; inprocess: the "
              "compression engine alone on virtual ranks (threads).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--bucket-size-mb", "bucket_mb", type=Finite(min=0, min_open=True),
              default=None, help="Bucket size in MiB [default: the optimizer's].")
@click.option("--memory", "memory_mode", type=click.Choice(["lean", "fast", "auto"]),
              default="lean", show_default=True,
              help="The optimizer's memory option (lean: CUDA's default; fast: the CPU's).")
@click.option("--variance-refresh", default="none", show_default=True,
              help="The optimizer's variance_refresh (none, doubling or a JSON object); its "
                   "refresh steps are measured apart, as phase 'refresh'.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@out_option
def bench_memory_command(np_: int, bandwidth: str, layers: int, width: int, warmup: int,
                         compressed: int, transport: str, device: str,
                         bucket_mb: Optional[float], memory_mode: str, variance_refresh: str,
                         as_json: bool, out: Optional[str]) -> None:
    """Memory beyond Adam's own per phase, as a ratio to the parameters' fp32 bytes
    (compression-phase target: <= 1.25, peak included)."""
    import torch

    from ..memory import bench_memory
    from ..refresh import parse_variance_refresh

    try:
        refresh = parse_variance_refresh(variance_refresh)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--variance-refresh") from exc
    if device == "cuda" and not torch.cuda.is_available():
        raise click.BadParameter("this torch sees no CUDA device (torch.cuda.is_available() "
                                 "is False)", param_hint="--device")
    need_two_ranks(np_, "the compression phase's memory")
    if transport == "horovod":
        need_horovod()
    if transport == "inprocess" and bandwidth not in ("local", "none", ""):
        raise click.UsageError("--bandwidth emulates links between processes: --world horovod")
    if transport == "inprocess" and refresh is not None:
        raise click.UsageError("--variance-refresh: refresh steps average through Horovod, "
                               "which virtual ranks do not run: --world horovod")
    with cluster_for(np_, bandwidth) as cluster:
        result = bench_memory(ranks=np_, layers=layers, width=width, warmup=warmup,
                              compressed=compressed, transport=transport, device=device,
                              bucket_size_mb=bucket_mb, memory=memory_mode,
                              variance_refresh=refresh, cluster=cluster)
    result = {**report_head("memory"), **result}
    if emit(result, as_json, out):
        return
    print_table([{"phase": ph, "held": e["held_ratio"], "peak": e["peak_ratio"],
                  "held_mb": e["held_bytes"]["total"] / 2**20,
                  "transient_mb": e["step_transient_bytes"] / 2**20}
                 for ph, e in result["phases"].items()],
                [("phase", "phase", ""), ("held x params", "held", ".3f"),
                 ("peak x params", "peak", ".3f"), ("held MiB", "held_mb", ".1f"),
                 ("step transient MiB", "transient_mb", ".1f")])
    click.echo(f"{result['ranks']} ranks ({transport}, {device}), "
               f"{result['param_bytes'] / 2**20:.1f} MiB of fp32 parameters, "
               f"{result['buckets']} bucket(s); peak: {result['peak_method']}")
