"""`hvd-onebit`: benchmarks of 1-bit Adam and a bandwidth-limited cluster on one machine."""
from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hvd_onebit")
def main() -> None:
    """1-bit Adam for Horovod: benchmarks and an emulated slow-network cluster.

    \b
    hvd-onebit bench ...        kernel, allreduce and end-to-end training benchmarks
    hvd-onebit cluster run ...  run a command on N ranks joined by a rate-limited network
    """


def _register() -> None:
    from .bench.cli import bench

    main.add_command(bench)
    try:
        from .cluster.cli import cluster
    except ImportError:  # the emulator is optional on machines without iproute2
        return
    main.add_command(cluster)


_register()

if __name__ == "__main__":
    main()
