"""`hvd-onebit cluster run`: a command on N emulated hosts joined by rate-limited links."""
from __future__ import annotations

import json
import sys
from typing import Optional

import click

from ..params import Finite
from .bandwidth import format_bandwidth, parse_bandwidth
from .launcher import EmulatedCluster
from .network import MAX_RANKS
from .processes import EXIT_SIGTERM, Terminated, sigterm_unwinds
from .results import RunResult
from .system import EmulatorError

# What the CLI exits with when it did not get a rank's status (shell conventions).
EXIT_TIMEOUT = 124
EXIT_SIGINT = 130


def _log_dir(path: str) -> str:
    """``--log-dir``, made now: a folder that cannot be made is refused before the cluster is
    built (it was a traceback after)."""
    import os

    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise click.BadParameter(f"cannot make the folder {path!r}: {exc.strerror}") from None
    return path


def _bandwidth(ctx, param, value: str) -> Optional[int]:
    try:
        return parse_bandwidth(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _np(value) -> Optional[int]:
    """--np through the one parser every command uses; one count, at most MAX_RANKS."""
    if value is None:
        return None
    from ..bench.cli.options import parse_np

    nps = parse_np(value, one=True)
    if len(nps) != 1 or nps[0] > MAX_RANKS:
        raise click.BadParameter(f"{value!r}: one rank count from 1 to {MAX_RANKS}",
                                 param_hint="--np")
    return nps[0]


def _env_pairs(ctx, param, values) -> dict[str, str]:
    env = {}
    for item in values:
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE")
        env[key] = val
    return env


@click.group()
def cluster() -> None:
    """An emulated cluster on this machine, with a rate-limited network (needs root).

    Each rank gets its own network, UTS (hostname) and PID namespace, joined to a bridge by a
    veth pair shaped with tc tbf at the chosen rate in both directions; addresses are taken from
    198.18.0.0/15 and never leave this machine.
    """


@cluster.command("run", context_settings={"ignore_unknown_options": True,
                                          "allow_interspersed_args": False})
@click.option("--np", "-n", "np_", callback=lambda c, p, v: _np(v), default=None,
              help="Number of ranks. Alone, each is its own emulated host (node0, node1, ...) "
                   "with one Horovod slot, so local_size is 1 and cross_size is NP; with "
                   "--ranks-per-node, NP / RANKS_PER_NODE nodes, as in `bench train`. With "
                   "--nodes, optional (NODES x RANKS_PER_NODE).")
@click.option("--nodes", type=click.IntRange(1, MAX_RANKS), default=None,
              help="Emulated nodes (hosts). Each runs --ranks-per-node ranks that share its "
                   "network namespace: their traffic to each other stays on the node, only "
                   "traffic between nodes crosses the shaped links, and HOROVOD_LOCAL_* / "
                   "HOROVOD_CROSS_* are set as horovodrun -H node0:L,node1:L,... would.")
@click.option("--ranks-per-node", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Ranks on each node (with --np or --nodes).")
@click.option("--intra-bandwidth", default="unlimited", show_default=True, callback=_bandwidth,
              help="Rate of the traffic inside a node (its loopback), standing in for NVLink or "
                   "PCIe; 'unlimited' leaves it unshaped.")
@click.option("--bandwidth", "-b", default="1gbit", show_default=True, callback=_bandwidth,
              help="Link rate of every host, each direction (full duplex), in tc's bit units, "
                   "1000-based: e.g. 10mbit, 100mbit, 1gbit, 2.5gbit, 10gbit; or 'unlimited' "
                   "for no shaping (veth speed, CPU-bound).")
@click.option("--queue-ms", type=Finite(min=0), default=2.0, show_default=True,
              help="Queue depth of every link beyond one burst, in milliseconds of line rate, "
                   "never below 256 KiB (a switch port's buffer). Shallow queues drop packets "
                   "under incast.")
@click.option("--timeout", "-t", type=Finite(min=0, min_open=True), default=None,
              metavar="SECONDS",
              help=f"Kill every rank after this many seconds of wall time and exit "
                   f"{EXIT_TIMEOUT}. Default: no limit.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the report as one JSON object on stdout (rank output then goes to "
                   "stderr): per rank hostname, address, exit_code, killed, tx_bytes, rx_bytes, "
                   "log_path; plus wall_seconds, timed_out, returncode.")
@click.option("--log-dir", type=click.Path(file_okay=False, writable=True), default=None,
              callback=lambda ctx, param, value: value and _log_dir(value),
              help="Also write each rank's stdout+stderr to DIR/rank.<r>.log.")
@click.option("--quiet", "-q", is_flag=True,
              help="Do not echo the ranks' output live (it is still written to --log-dir).")
@click.option("--env", "-e", "env", multiple=True, callback=_env_pairs, metavar="KEY=VALUE",
              help="Extra environment variable for every rank (repeatable). The ranks inherit "
                   "this environment anyway; HOROVOD_* launch variables are set for you.")
@click.option("--kill-grace", type=Finite(min=0), default=3.0, show_default=True,
              metavar="SECONDS",
              help="When ranks must be killed (a rank failed, timeout, Ctrl-C, SIGTERM): "
                   "seconds between SIGTERM and SIGKILL.")
@click.option("--torchrun", is_flag=True,
              help="Run COMMAND (a script and its arguments, or -m MODULE ...) under one "
                   "'python -m torch.distributed.run --nnodes --node_rank --nproc_per_node "
                   "--master_addr=<node0>' per node, as a DDP job is launched on a cluster; "
                   "the report then has one line per node.")
@click.option("--verbose", "-v", is_flag=True, help="Log the setup steps to stderr.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(np_: Optional[int], nodes: Optional[int], ranks_per_node: int,
        intra_bandwidth: Optional[int], bandwidth: Optional[int], queue_ms: float,
        timeout: Optional[float], as_json: bool, log_dir: Optional[str], quiet: bool, env: dict,
        kill_grace: float, torchrun: bool, verbose: bool, command: tuple) -> None:
    """Run COMMAND once per rank, as a Horovod (Gloo) job over the emulated network.

    \b
    Examples:
      hvd-onebit cluster run --np 4 --bandwidth 1gbit -- python train.py --epochs 1
      hvd-onebit cluster run --np 4 --ranks-per-node 2 --bandwidth 1gbit -- python train.py
      hvd-onebit cluster run --np 4 --ranks-per-node 2 --torchrun -- ddp_train.py

    Every rank gets exactly the environment 'horovodrun --gloo' would give it (HOROVOD_RANK,
    HOROVOD_SIZE, HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT, HOROVOD_GLOO_IFACE=emu0, ...), so an
    unmodified Horovod script runs as is. If any rank exits non-zero, the others are killed, as
    horovodrun does. At the end a table (or --json) reports per rank the exit status and the bytes
    its host sent and received on its link during the run (with several ranks per node: an even
    share of the node's link, and per node in the JSON's node_bytes), plus the wall time.

    Exit status: 0 if every rank exited 0; else the first failing rank's status; 124 on
    --timeout; 130 on Ctrl-C; 143 on SIGTERM; 1 if the cluster cannot be built (e.g. not root).
    Everything created (namespaces, links, bridge, /etc/netns entries) is removed in every case.
    """
    np_ = _ranks(np_, nodes, ranks_per_node)
    out = sys.stderr if as_json else sys.stdout
    width = len(str(np_ - 1))

    def echo_line(rank: int, line: str) -> None:
        out.write(f"[{rank:>{width}}] {line}" if line.endswith("\n") else f"[{rank}] {line}\n")
        out.flush()

    try:
        with sigterm_unwinds(), EmulatedCluster(np=np_, bandwidth=bandwidth, log_dir=log_dir,
                             verbose=verbose, queue_ms=queue_ms, ranks_per_node=ranks_per_node,
                             intra_bandwidth=intra_bandwidth) as emu:
            options = dict(env=env, timeout=timeout, kill_grace=kill_grace,
                           on_output=None if quiet else echo_line)
            if torchrun:
                from .torchrun import run_torchrun

                result = run_torchrun(emu, list(command), **options)
            else:
                result = emu.run(list(command), **options)
    except EmulatorError as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        click.echo("hvd-onebit cluster: interrupted (SIGINT); ranks killed, cluster removed",
                   err=True)
        sys.exit(EXIT_SIGINT)
    except Terminated:
        click.echo("hvd-onebit cluster: terminated (SIGTERM); ranks killed, cluster removed",
                   err=True)
        sys.exit(EXIT_SIGTERM)

    if as_json:
        report = result.to_dict()
        report["command"] = list(command)
        report["log_dir"] = log_dir
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(format_report(result))
    sys.exit(result.returncode)


def _ranks(np_: Optional[int], nodes: Optional[int], ranks_per_node: int) -> int:
    """The number of ranks from --np and/or --nodes x --ranks-per-node (they must agree); --np
    with --ranks-per-node alone makes NP / RANKS_PER_NODE nodes, as the bench commands do."""
    if nodes is None:
        if np_ is None:
            raise click.UsageError("give --np (and --ranks-per-node), or --nodes")
        if np_ % ranks_per_node:
            raise click.UsageError(f"--np {np_} is not a multiple of --ranks-per-node "
                                   f"{ranks_per_node}")
        return np_
    if np_ is not None and np_ != nodes * ranks_per_node:
        raise click.UsageError(f"--np {np_} is not --nodes {nodes} x --ranks-per-node "
                               f"{ranks_per_node}")
    if nodes * ranks_per_node > MAX_RANKS:
        raise click.UsageError(f"at most {MAX_RANKS} ranks")
    return nodes * ranks_per_node


def format_report(result: RunResult) -> str:
    """The human-readable end-of-run table: one line per rank, then totals and wall time."""
    rows = [("rank" if result.launches == "rank" else "node", "host", "address", "exit",
             "tx bytes", "rx bytes", "tx MB/s", "rx MB/s")]
    secs = max(result.wall_seconds, 1e-9)
    for r in result.ranks:
        status = "-" if r.exit_code is None else str(r.exit_code)
        if r.killed:
            status += " (killed)"
        rows.append((str(r.rank), r.hostname, r.address, status, f"{r.tx_bytes:,}",
                     f"{r.rx_bytes:,}", f"{r.tx_bytes / secs / 1e6:.2f}",
                     f"{r.rx_bytes / secs / 1e6:.2f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) if i >= 3 else cell.ljust(w)
                       for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    outcome = ("TIMED OUT" if result.timed_out else "ok" if result.ok
               else f"FAILED (first: {result.launches} {result.first_failed_rank})"
               if result.first_failed_rank is not None else "FAILED")
    lines.append(f"np={result.np} bandwidth={format_bandwidth(result.bandwidth_bps)} "
                 f"wall={result.wall_seconds:.2f}s total tx={result.tx_bytes:,} bytes "
                 f"(MB/s averaged over the wall time) -> {outcome}")
    return "\n".join(lines)
