"""`hvd-onebit`: check an environment, benchmark 1-bit Adam, and emulate a bandwidth-limited
cluster on one machine."""
from __future__ import annotations

import json
import shutil

import click

from .bench.cli.options import MAX_MS, Finite, need_two_ranks, np_option, parameter_count


def print_version(ctx: click.Context, param, value) -> None:
    """``--version``: hvd_onebit's version, installed or not (a checkout run with ``python -m
    hvd_onebit_tools.cli`` has no package metadata: the package's own ``__version__``)."""
    if not value or ctx.resilient_parsing:
        return
    from .bench.report import library_version

    click.echo(f"{ctx.find_root().info_name}, version {library_version()}")
    ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True,
              callback=print_version, help="Show the version and exit.")
def main() -> None:
    """1-bit Adam for Horovod and DDP: environment check, benchmarks and an emulated slow network.

    \b
    hvd-onebit check            what this environment will use, each part OK or the fix
    hvd-onebit bench ...        train, allreduce, calibrate and predict (developers: bench dev)
    hvd-onebit cluster run ...  run a command on N ranks joined by a rate-limited network
    """


@main.command("check")
@click.option("--probe", is_flag=True,
              help="Under a launcher (horovodrun, torchrun): also probe the link between the "
                   "job's ranks with a short allreduce and predict 1-bit Adam's step there "
                   "(needs --params and --compute-ms).")
@np_option(None, "Probe as --probe does, and first check that the job has this many ranks (2 "
                 "or more; under horovodrun, as torchrun's own parser takes --np for itself).")
@click.option("--params", default=None,  # checked now, kept as written for the messages
              callback=lambda ctx, param, value: parameter_count(ctx, param, value) and value,
              help="Parameters of your model for the prediction (e.g. 350M; decimal: 1M is "
                   "1,000,000).")
@click.option("--compute-ms", default=None,
              type=Finite(min=0, min_open=True, priced=(None, MAX_MS)),
              help="Your step's compute (forward, backward, Adam) for the prediction.")
@click.option("--calibration", default=None, type=click.Path(dir_okay=False),
              help="The scale model's constants (`bench calibrate`) [default: the cached or "
                   "the shipped ones].")
@click.option("--json", "as_json", is_flag=True,
              help="Print JSON instead: ready, blocking, each face's readiness, each part's "
                   "fields, and with --probe the link and the prediction.")
def check(np_, probe, params, compute_ms, calibration, as_json) -> None:
    """Print torch and its device, Horovod's controllers, torch.distributed's backends, the
    native kernels, triton, /dev/shm and MPI's thread level, each OK or the fix, and which faces
    can run here (Horovod's, DDP's); exit status 1 when neither can. Under a launcher, each
    node's first rank prints. With --probe, under horovodrun or torchrun: the link and the
    predicted speed-up (from rank 0)."""
    from . import check_probe
    from .check import blocking, findings, report, report_dict

    link, link_lines = None, []
    if np_ is None and not probe and (params is not None or compute_ms is not None
                                      or calibration is not None):
        raise click.UsageError("--params, --compute-ms and --calibration price the link that "
                               "--probe measures under a launcher: give --probe too")
    if np_ is not None or probe:
        if np_ is not None:
            need_two_ranks(np_, "a probe of the link")
        if params is None or compute_ms is None:
            raise click.UsageError("--probe needs --params and --compute-ms for the "
                                   "prediction")
        if not check_probe.launched():
            n, args = np_ or 4, f"--params {params} --compute-ms {compute_ms:g}"
            raise click.UsageError(f"the probe measures a running job: horovodrun -np {n} "
                                   f"hvd-onebit check --probe {args}, or torchrun "
                                   f"--nproc_per_node {n} -m hvd_onebit_tools.cli check --probe "
                                   f"{args}")
        if np_ is None:  # every rank of the job alike
            need_two_ranks(check_probe.launched_size(), "a probe of the link (this job's "
                           "size)")
        try:
            link = check_probe.probe(np_, calibration=calibration)
        except check_probe.JobSizeError as exc:
            raise click.UsageError(str(exc)) from None
        except click.ClickException as exc:  # a calibration every rank refuses, each in turn
            check_probe.stop_together(exc)
        if link.rank == 0:  # the probe's lines; each other node's first rank its report
            link_lines = check_probe.predict(link, params, compute_ms, calibration)
        else:
            link = None
    found = findings()
    if link is None and not check_probe.reports_for_its_node():
        raise SystemExit(1 if blocking(found) else 0)  # its node's first rank prints the report
    if as_json:
        out = report_dict(found)
        if link is not None:
            out["probe"] = {"ranks": link.ranks, "ranks_per_node": link.per_node,
                            "via": link.via, "device": link.device, "allreduce_s": link.seconds,
                            "transport": link.transport,
                            "bus_bps": link.bus_bps, "lines": link_lines}
        click.echo(json.dumps(out, indent=2))
    else:
        click.echo(report(found))
        for line in link_lines:
            click.echo(line)
    if blocking(found):
        raise SystemExit(1)


def _cluster_unavailable(reason: str) -> click.Command:
    @click.command("cluster", context_settings={"ignore_unknown_options": True},
                   help=f"Unavailable here: {reason}.", short_help=f"(unavailable: {reason})")
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def cluster(args) -> None:
        raise click.UsageError(f"the emulated cluster is unavailable here: {reason}")
    return cluster


def _register() -> None:
    from .bench.cli import bench

    main.add_command(bench)
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        main.add_command(_cluster_unavailable(f"{' and '.join(missing)} not found (install "
                                              f"iproute2)"))
        return
    try:
        from .cluster.cli import cluster
    except ImportError as exc:
        main.add_command(_cluster_unavailable(f"it does not import ({exc})"))
        return
    main.add_command(cluster)


_register()

if __name__ == "__main__":  # python -m hvd_onebit_tools.cli: as the console script runs
    from .entry import main as entry_main

    entry_main()
