"""`hvd-onebit bench dev zoo`: the convergence zoo, 1-bit Adam against Adam over model families."""
from __future__ import annotations

import json

import click

from .options import (Finite, cluster_for, comma_list, link_rate, need_horovod, need_two_ranks,
                      np_option)


@click.command("zoo")
@click.option("--families", default=None, callback=lambda c, p, v: v and comma_list(str)(c, p, v),
              help="Comma-separated model families [default: all: mnist_cnn, dropout_cnn, "
                   "resnet_bn, gru_lm, transformer_lm, embedding_bag, mlp].")
@click.option("--schemes", default="bounded,unbounded", show_default=True, callback=comma_list(str),
              help="Compression-phase schemes (extra DistributedOptimizer options, "
                   "hvd_onebit_tools/bench/zoo/grid.py): bounded (the library's step, "
                   "preconditioned and bounded, with the variance frozen), unbounded (the "
                   "paper's: neither), bound_only, precondition_only, bounded_eps / "
                   "bounded_floor (zero_variance), frozen_exact (frozen variance, exact "
                   "momentum: what freezing alone costs), "
                   "bounded_blocks512, bounded_refresh / bounded_refresh_doubling "
                   "(variance_refresh) and refresh_exact / refresh_fold / refresh_single / "
                   "refresh_blocks512 / refresh_unpreconditioned (one refresh mechanism "
                   "changed each), default (the installed defaults) and default_blocks512 / "
                   "default_blocks2048 (the defaults with finer scales).")
@click.option("--seeds", default=3, show_default=True, type=click.IntRange(1),
              help="Seeds per family and learning rate (0, 1, ...).")
@click.option("--freezes", default="10%,20%,50%,auto", show_default=True, callback=comma_list(str),
              help="Freeze settings: fractions of the run among 10%, 20%, 50%, and auto.")
@click.option("--lrs", default="scaled,base", show_default=True, callback=comma_list(str),
              help="Learning-rate rules: scaled (Horovod's base_lr * size) and base.")
@click.option("--steps", default=None, type=click.IntRange(10),
              help="Steps per run for every family [default: each family's, 120-150].")
@click.option("--batch-size", "--batch", "batch", default=None, type=click.IntRange(1),
              help="Samples per rank per step for every family (--batch: the same) [default: "
                   "each family's].")
@np_option(4, "Ranks.")
@click.option("--face", type=click.Choice(["horovod", "ddp"]), default="horovod",
              show_default=True, help="horovod: horovodrun, Horovod Adam against "
              "hvd_onebit.DistributedOptimizer; ddp: torchrun, DDP + Adam against DDP + "
              "hvd_onebit.ddp.DistributedOptimizer (loopback only).")
@click.option("--bandwidth", default="local", show_default=True, callback=link_rate,
              help="Emulated link rate of every rank (e.g. 1gbit; root needed); 'local' runs "
                   "plain horovodrun on loopback. Convergence does not depend on it.")
@click.option("--out-dir", default="results/zoo", show_default=True,
              type=click.Path(file_okay=False),
              help="Folder for cells.jsonl (one line per run), summary.json and heat_map.png.")
@click.option("--timeout", default=1800.0, show_default=True,
              type=Finite(min=0, min_open=True),
              help="Seconds per family's job (a family is one job of 54 runs by default).")
@click.option("--resume", is_flag=True,
              help="Keep the runs already in OUT_DIR/cells.jsonl and run only the missing ones.")
@click.option("--report-only", is_flag=True, help="Only print and write the report of OUT_DIR.")
@click.option("--metric", type=click.Choice(["final", "tail"]), default="final",
              show_default=True, help="final: the last held-out loss; tail: the mean of the "
              "last three evaluations (less noisy).")
@click.option("--against", default=None, metavar="SCHEME",
              help="Also compare every other scheme with this one cell by cell (same family, "
              "lr, seed and freeze): how many cells are worse, by how much; and over seeds: how "
              "many cells (all seeds together) are worse beyond the seeds' noise.")
@click.option("--against-face", "against_face", multiple=True, metavar="DIR",
              type=click.Path(file_okay=False, exists=True),
              help="Also compare OUT_DIR's cells with the same cells in DIR (another zoo's output, "
              "e.g. the other face's), cell by cell and per cell over seeds; writes "
              "OUT_DIR/faces.json. Repeatable.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON instead of "
              "tables.")
def bench_zoo(families, schemes, seeds, freezes, lrs, steps, batch, np_, face, bandwidth,
              out_dir, timeout,
              resume, report_only, metric, against, against_face, as_json) -> None:
    """Convergence zoo: Adam vs 1-bit Adam, either face, on seven model families, two learning
    rates, four freeze settings and several seeds, on NP ranks; every cell's final held-out
    loss over Adam's on the same seed, divergences marked (table, summary.json, heat_map.png)."""
    from pathlib import Path

    from ..zoo.grid import SCHEMES, all_families
    from ..zoo.report import write_report

    need_two_ranks(np_, "a comparison with Adam")
    if face == "horovod" and not report_only:
        need_horovod()
    if against is not None and against not in SCHEMES:
        raise click.BadParameter(f"unknown scheme {against!r}; choose from "
                                 f"{', '.join(SCHEMES)}", param_hint="--against")
    out = Path(out_dir)
    if not report_only:
        from ..zoo.runner import run_zoo

        try:
            with cluster_for(np_, bandwidth) as cluster:
                result = run_zoo(families or all_families(), out, seeds=range(seeds),
                                 schemes=schemes, freezes=freezes, lr_rules=lrs, steps=steps,
                                 batch=batch, np=np_, timeout=timeout, resume=resume,
                                 progress=lambda s: click.echo(s, err=True), cluster=cluster,
                                 face=face)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from exc
        click.echo(f"[zoo] {result['seconds']:.0f}s; results in {result['results']}", err=True)
        for name, why in result["failures"].items():
            click.echo(f"[zoo] {name} failed:\n{why[-3000:]}", err=True)
    try:
        summary = write_report(out, metric, show=not as_json, against=against)
    except (FileNotFoundError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        from ..zoo.report import json_safe

        click.echo(json.dumps(json_safe({k: v for k, v in summary.items() if k != "cells"}),
                              indent=2))
    if against_face:
        from ..zoo.face_pairs import against_faces, print_against_faces
        from ..zoo.report import json_safe
        from ..zoo.runner import RESULTS, read_cells

        from ..report import report_head

        others = {d: read_cells(Path(d) / RESULTS) for d in against_face}
        result = against_faces(read_cells(out / RESULTS), others, metric)
        result.update(report_head("zoo_faces"))
        (out / "faces.json").write_text(json.dumps(json_safe(result), indent=1))
        if not as_json:
            click.echo()
            print_against_faces(result, str(out))
        click.echo(f"[zoo] wrote {out / 'faces.json'}", err=True)
