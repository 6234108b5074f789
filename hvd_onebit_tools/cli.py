"""`hvd-onebit`: check an environment, benchmark 1-bit Adam, and emulate a bandwidth-limited
cluster on one machine."""
from __future__ import annotations

import shutil

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hvd_onebit")
def main() -> None:
    """1-bit Adam for Horovod: environment check, benchmarks and an emulated slow network.

    \b
    hvd-onebit check            what this environment will use, each part OK or the fix
    hvd-onebit bench ...        train, allreduce, calibrate and predict (developers: bench dev)
    hvd-onebit cluster run ...  run a command on N ranks joined by a rate-limited network
    """


@main.command("check")
def check() -> None:
    """Print torch and its device, Horovod's controllers (or torch.distributed), the native
    kernels, triton, /dev/shm and MPI's thread level, each OK or the fix; exit status 1 when a
    job cannot run here."""
    from .check import FIX, findings, report

    found = findings()
    click.echo(report(found))
    if any(f.required and f.status == FIX for f in found):
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

if __name__ == "__main__":
    main()
