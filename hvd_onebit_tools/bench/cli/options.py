"""What several `hvd-onebit bench` commands share: parsing of counts and comma-separated
lists, the options for real clusters, emulated nodes and link queues, and the emulated cluster
a command runs its jobs on."""
from __future__ import annotations

import contextlib
import math
import tempfile
from typing import Optional

import click

from hvd_onebit.config import FREEZE_FRACTION, FROZEN_FREEZE_FRACTION

from ...params import Finite

SIZE_SUFFIX = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
PLOT_FORMATS = {"png", "pdf", "svg", "jpg", "jpeg", "eps", "ps", "tif", "tiff", "webp"}  # --plot
MAX_PARAMS = 10**15  # a thousand times today's largest models; beyond it the figures overflow
MAX_MS = 1e7  # compute per step: 10,000 s, the most a prediction prices


def parse_count(text: str) -> int:
    """'16M' -> 16777216 elements, '1e6' -> 1000000; a count that is not whole raises a
    ValueError, an infinite one an OverflowError."""
    t = text.strip().lower()
    scale = SIZE_SUFFIX[t[-1]] if t and t[-1] in SIZE_SUFFIX else 1
    try:
        value = float(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        raise ValueError(f"{text!r} is not an element count (e.g. 1M, 16M, 1e6)") from None
    if math.isinf(value):
        raise OverflowError(f"{text!r} is not finite")
    if not value.is_integer():
        raise ValueError(f"{text!r} is not a whole element count (e.g. 1M, 16M, 1e6)")
    return int(value)


def positive_count(text: str) -> int:
    """:func:`parse_count`, refusing a count under one element."""
    n = parse_count(text)
    if n < 1:
        raise ValueError(f"{text!r} is not a positive element count (e.g. 1M, 16M)")
    return n


def comma_list(kind, empty_ok: bool = True):
    """A click callback: the comma-separated value as a list of ``kind`` (e.g. int, or a click
    type such as ``click.IntRange(1)``). ``empty_ok=False``: a value naming nothing is refused."""
    def convert(ctx, param, value):
        try:
            items = [kind(v) for v in value.split(",") if v.strip()]
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from exc
        except OverflowError:  # e.g. int(float("1e400"))
            raise click.BadParameter(f"{value!r} is not finite") from None
        if not items and not empty_ok:
            raise click.BadParameter(f"{value!r} names nothing: give one or more, comma "
                                     "separated")
        return items
    return convert


def block_size_check(ctx, param, value):
    """A click callback for ``--block-size``: 0 (one scale per chunk) or a multiple of 8."""
    if value % 8:
        raise click.BadParameter(f"{value} is not a multiple of 8 (or 0: one scale per chunk)")
    return value


def parse_np(text, one: bool = False) -> list:
    """``--np``'s one parser: a rank count or a comma-separated list of them (e.g. 4 or 2,4,8);
    ``one``: the command takes a single count, and its message says so."""
    try:
        nps = [int(v) for v in str(text).split(",")]
    except ValueError:
        what = ("a rank count (e.g. 4)" if one else
                "a rank count or a comma-separated list of them (e.g. 4 or 2,4,8)")
        raise click.BadParameter(f"{text!r} is not {what}", param_hint="--np") from None
    if not nps or min(nps) < 1:
        raise click.BadParameter(f"{text!r}: rank counts are positive integers",
                                 param_hint="--np")
    if len(set(nps)) != len(nps):
        raise click.BadParameter(f"{text!r}: name each rank count once", param_hint="--np")
    return nps


def need_horovod() -> None:
    """Refuse, before anything is set up (an emulated cluster), a command whose ranks are a
    Horovod job where Horovod does not import."""
    import sys

    from ...cluster.jobs import NO_HOROVOD, horovod_installed

    if not horovod_installed():
        raise click.UsageError(NO_HOROVOD.format(python=sys.executable))


def need_two_ranks(nps, what: str) -> None:
    """Refuse a --np under 2 where ``what`` (the command's job) times what the ranks send."""
    least = min(nps) if isinstance(nps, (list, tuple)) else nps
    if least < 2:
        raise click.BadParameter(f"{least}: {what} needs 2 or more ranks (one rank sends "
                                 "nothing)", param_hint="--np")


def parameter_count(ctx, param, value):
    """``--params``'s one parser: a positive count (e.g. 350M, 9.4e6), or None if not given."""
    from ..predict.job import parse_params

    if value is None:
        return None
    try:
        n = parse_params(value)
    except ValueError:
        n = 0
    except OverflowError:  # inf, 1e400
        n = MAX_PARAMS + 1
    if n < 1:
        raise click.BadParameter(f"{value!r} is not a positive parameter count (e.g. 350M, "
                                 "9.4e6)", param_hint="--params")
    if n > MAX_PARAMS:
        raise click.BadParameter(f"{value!r} is over {MAX_PARAMS:,} parameters, the most the "
                                 "model prices", param_hint="--params")
    return n


def np_option(default, help: str, sweep: bool = False):
    """``--np`` as every command spells it, parsed by :func:`parse_np`. ``sweep``: the command
    runs every count given (a list); otherwise it takes one, and a list is refused. A default
    of None: the option is optional (None when not given)."""
    def convert(ctx, param, value):
        if value is None:
            return None
        nps = parse_np(value, one=not sweep)
        if sweep:
            return nps
        if len(nps) != 1:
            raise click.BadParameter(f"{value!r}: this command runs one world, give one rank "
                                     "count", param_hint="--np")
        return nps[0]
    return click.option("--np", "nps" if sweep else "np_",
                        default=None if default is None else str(default),
                        show_default=default is not None, callback=convert,
                        help=help + (" A comma-separated list runs each." if sweep else ""))


def bits_per_second(text: str) -> Optional[int]:
    """``parse_bandwidth(text)`` (None: unlimited), its errors as click's, naming ``text``."""
    from ...cluster.bandwidth import parse_bandwidth

    try:
        return parse_bandwidth(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    except OverflowError:
        raise click.BadParameter(f"{text!r} is not a finite link rate") from None


def link_rate(ctx, param, value):
    """A click callback for one ``--bandwidth``-like option: the rate as given (``local`` too),
    refused up front unless it parses as a link rate (e.g. 100mbit, 1gbit, unlimited)."""
    if value in (None, "", "none", "local"):
        return value
    bits_per_second(value)
    return value


def link_rates(ctx, param, value):
    """:func:`link_rate` for a comma-separated list of rates; returns the list as given."""
    given = [link_rate(ctx, param, v.strip()) for v in value.split(",") if v.strip()]
    if not given:
        raise click.BadParameter(f"{value!r} names no link rate (e.g. local or 1gbit,10gbit)")
    return given


# the emulated cluster's options: its links and nodes, which real hosts do not have
EMULATION_OPTIONS = ("bandwidth", "bandwidths", "ranks_per_node", "intra_bandwidth", "queue_ms")


def host_slots(ctx, param, value):
    """A click callback for ``--hosts``: horovodrun -H's ``host:slots`` entries, comma
    separated, each host named and its slots a whole number, 1 or more; the value as given."""
    if value is None:
        return None
    for entry in value.split(","):
        host, colon, slots = entry.strip().rpartition(":")
        if not colon or not host or not (slots.isascii() and slots.isdigit()) \
                or int(slots) < 1:
            where = "" if entry.strip() == value.strip() else f" in {value!r}"
            raise click.BadParameter(f"{entry.strip()!r}{where} is not host:slots, the slots a "
                                     "whole number 1 or more (e.g. h1:4,h2:4)")
    return value


def check_real_cluster(hosts: Optional[str], shared_dir: Optional[str], nps=()) -> None:
    """``--hosts`` needs ``--shared-dir`` (the ranks hand back their results through files),
    slots for every rank of each ``nps`` (a count or a list), and none of the emulated cluster's
    options (:data:`EMULATION_OPTIONS`), which it would ignore."""
    from click.core import ParameterSource

    if not hosts:
        return
    if not shared_dir:
        raise click.UsageError("--hosts needs --shared-dir: a folder every host sees at the same "
                               "path (the ranks hand back their results through it)")
    slots = sum(int(entry.rpartition(":")[2]) for entry in hosts.split(","))
    over = [n for n in ([nps] if isinstance(nps, int) else nps) if n > slots]
    if over:
        raise click.BadParameter(f"{max(over)} ranks do not fit the {slots} slot(s) of --hosts "
                                 f"{hosts}: give more slots or a smaller --np", param_hint="--np")
    ctx = click.get_current_context()
    given = [p.opts[0] for p in ctx.command.params if p.name in EMULATION_OPTIONS
             and ctx.get_parameter_source(p.name) not in (None, ParameterSource.DEFAULT)]
    if given:
        raise click.UsageError(f"--hosts runs the ranks on real machines over their own links: "
                               f"{', '.join(given)} set(s) the emulated cluster and would be "
                               "ignored; drop them, or leave out --hosts to emulate")


def output_file(ctx, param, value):
    """A click callback for a file a command writes after its run: its folder is made now, and
    a path that cannot be written is refused before the run, not after it."""
    import os

    if value is None:
        return None
    folder = os.path.dirname(os.path.abspath(value))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise click.BadParameter(f"cannot make the folder {folder!r}: {exc.strerror}") from None
    if not os.access(folder, os.W_OK):
        raise click.BadParameter(f"the folder {folder!r} is not writable")
    try:  # some folders refuse new files whatever the permissions say (e.g. /proc)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".hvd-onebit-"):
            pass
    except OSError as exc:
        raise click.BadParameter(f"cannot write into {folder!r}: {exc.strerror}") from None
    return value


def out_option(command):
    """``--out FILE`` as every measuring command spells it, checked by :func:`output_file`."""
    return click.option("--out", default=None, type=click.Path(dir_okay=False),
                        callback=output_file,
                        help="Also write the JSON report (with the command, commit and "
                             "machine) to this file.")(command)


def emit(report: dict, as_json: bool, out: Optional[str]) -> bool:
    """Write ``report`` to ``out`` (when given) and print it with ``as_json``, as JSON every
    parser reads; True when printed (the command then prints no table)."""
    from ..report import strict_json

    text = strict_json(report, indent=2)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    if as_json:
        click.echo(text)
    return as_json


def plot_file(ctx, param, value):
    """:func:`output_file` for ``--plot``, in a format matplotlib writes (none: PNG)."""
    import os

    value = output_file(ctx, param, value)
    suffix = "" if value is None else os.path.splitext(value)[1].lower().lstrip(".")
    if suffix and suffix not in PLOT_FORMATS:
        raise click.BadParameter(f"{value!r}: a plot is written as one of "
                                 f"{', '.join(sorted(PLOT_FORMATS))}")
    return value


def real_cluster_options(command):
    """--hosts and --shared-dir: run through horovodrun on real machines instead of emulating."""
    command = click.option("--shared-dir", default=None,
                           type=click.Path(exists=True, file_okay=False, writable=True),
                           help="A folder every host sees at the same path, for --hosts.")(command)
    return click.option("--hosts", default=None, callback=host_slots,
                        help="Run on a real cluster through horovodrun (Horovod on every "
                             "host), e.g. h1:4,h2:4 (no emulation; each host's ranks are a "
                             "node); needs --shared-dir.")(command)


@contextlib.contextmanager
def cluster_for(np_: int, bandwidth: Optional[str], queue_ms: float = 2.0,
                 ranks_per_node: int = 1, intra_bandwidth: Optional[str] = None):
    """An emulated cluster at ``bandwidth`` (nodes of ``ranks_per_node`` ranks), or nothing
    (plain local launch) for 'local'/None."""
    if bandwidth in (None, "", "none", "local"):
        if ranks_per_node != 1:
            raise click.UsageError("--ranks-per-node needs an emulated --bandwidth")
        yield None
        return
    from ...cluster import EmulatedCluster

    if np_ % ranks_per_node:
        raise click.UsageError(f"--np {np_} is not a multiple of --ranks-per-node "
                               f"{ranks_per_node}")
    with EmulatedCluster(np=np_, bandwidth=bandwidth, queue_ms=queue_ms,
                         ranks_per_node=ranks_per_node,
                         intra_bandwidth=intra_bandwidth) as cluster:
        yield cluster


def nodes_options(command):
    command = click.option(
        "--intra-bandwidth", default="unlimited", show_default=True, callback=link_rate,
        help="With --ranks-per-node: the rate inside a node (its loopback), standing in for "
             "NVLink or PCIe.")(command)
    return click.option(
        "--ranks-per-node", default=1, show_default=True, type=click.IntRange(1, 64),
        help="Emulated nodes of this many ranks: their traffic to each other stays on the node, "
             "only traffic between nodes crosses the shaped links (NP / this = nodes).")(command)


def refresh_options(what: str, freeze_help: str):
    """``--variance-refresh`` and ``--refresh-freeze-frac``, as every command with a refresh
    setting spells them; ``what`` and ``freeze_help`` say what they set there."""
    def decorate(command):
        command = click.option(
            "--refresh-freeze-frac", default=FREEZE_FRACTION, show_default=True,
            type=Finite(0, 1),
            help=freeze_help + " (an early freeze is the recommended setting with a refresh "
                 "schedule).")(command)
        return click.option(
            "--variance-refresh", "variance_refresh", default="doubling", show_default=True,
            help=what + ": none, doubling (0/1 Adam's schedule) or a JSON object of "
                 "RefreshSchedule's fields, e.g. '{\"first_interval\": 16, "
                 "\"updates_per_interval\": 4}'.")(command)
    return decorate


def queue_option(command):
    return click.option("--queue-ms", type=Finite(min=0), default=2.0, show_default=True,
                        help="Emulated links' queue depth beyond one burst, in ms of line "
                             "rate, never below 256 KiB (a switch port's buffer); shallow "
                             "queues drop packets under incast.")(command)


def rates(ctx, param, value):
    bps = [bits_per_second(v) for v in value.split(",") if v.strip()]
    if not bps:
        raise click.BadParameter(f"{value!r} names no link rate (e.g. 1gbit or 1gbit,10gbit)")
    return bps
