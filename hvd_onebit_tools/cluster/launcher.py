"""Running a command on every host of the emulated cluster, as the ranks of one Horovod job.

:class:`EmulatedCluster` builds the :class:`~hvd_onebit_tools.cluster.network.Network` and Horovod's
rendezvous (:mod:`~hvd_onebit_tools.cluster.rendezvous`), then :meth:`EmulatedCluster.run` starts the
command once per rank, each rank in its host's network namespace and in its own UTS namespace
(``hostname`` is ``node<host>``) and PID namespace (when a rank ends, or is killed, nothing it
started can survive it). A host is one rank by default; with ``ranks_per_node=L`` it is a node of
L ranks sharing its namespace, so their traffic to each other stays on the node and only traffic
between nodes crosses the shaped links. If one rank fails the others are killed, like horovodrun.

Everything created is torn down by :meth:`EmulatedCluster.close` (also on errors, a crashed rank,
``KeyboardInterrupt`` and, in the CLI, SIGTERM); a cluster whose owner was SIGKILLed is removed by
the next one (or by :func:`~hvd_onebit_tools.cluster.network.cleanup_stale`).

Example::

    with EmulatedCluster(np=4, bandwidth="1gbit") as cluster:
        result = cluster.run(["python", "train.py"], timeout=600)
    print(result.wall_seconds, [r.tx_bytes for r in result.ranks])
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from . import rendezvous
from .bandwidth import DEFAULT_QUEUE_MS, parse_bandwidth
from .network import MAX_RANKS, Host, Network, cleanup_stale
from .results import RankResult, RunResult
from .system import EmulatorError, check_privileges, signals_deferred

_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the forked child
    """preexec_fn: SIGKILL the launcher if we die, which (via --kill-child) ends its PID ns."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class EmulatedCluster:
    """``np`` ranks on emulated hosts joined by links of ``bandwidth`` (see the module docstring).

    :param np: number of ranks, 1..253 hosts' worth.
    :param bandwidth: per-host link rate each way, a :func:`parse_bandwidth` string, bits/s as an
        int, or ``"unlimited"``/``None`` for no shaping.
    :param ranks_per_node: ranks per host (a node); ``np`` must be a multiple of it. Horovod's
        ``HOROVOD_LOCAL_*``/``HOROVOD_CROSS_*`` then describe ``np / ranks_per_node`` nodes.
    :param intra_bandwidth: rate of the traffic inside a node (its loopback), default unshaped.
    :param log_dir: if given, each run writes ``rank.<r>.log`` there (else output is only kept in
        memory, in :attr:`RankResult.output`).
    :param verbose: print the setup commands' progress to stderr.
    :param queue_ms: switch queue depth beyond one burst, in ms of line rate (see
        :func:`~hvd_onebit_tools.cluster.bandwidth.tbf_params`).

    Use as a context manager, or call :meth:`start` and (always) :meth:`close`.
    """

    def __init__(self, np: int, bandwidth: str | int | None = "1gbit",
                 log_dir: str | os.PathLike | None = None, verbose: bool = False,
                 queue_ms: float = DEFAULT_QUEUE_MS, ranks_per_node: int = 1,
                 intra_bandwidth: str | int | None = None):
        if int(ranks_per_node) < 1 or int(np) % int(ranks_per_node):
            raise ValueError(f"np ({np}) must be a positive multiple of ranks_per_node "
                             f"({ranks_per_node})")
        self.ranks_per_node = int(ranks_per_node)
        if not 1 <= int(np) // self.ranks_per_node <= MAX_RANKS:
            raise ValueError(f"np must be between 1 and {MAX_RANKS} hosts' worth, got {np}")
        self.np = int(np)
        self.nodes = self.np // self.ranks_per_node
        self.bandwidth_bps = parse_bandwidth(bandwidth)
        self.intra_bandwidth_bps = parse_bandwidth(intra_bandwidth)
        if queue_ms < 0:
            raise ValueError(f"queue_ms must be >= 0, got {queue_ms}")
        self.queue_ms = float(queue_ms)
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.verbose = verbose
        self.network = Network(self.nodes, self.bandwidth_bps, self.queue_ms, log=self._log,
                               intra_bandwidth_bps=self.intra_bandwidth_bps)
        self.rendezvous_port: Optional[int] = None
        self._rendezvous = None
        self._started = False
        self._runs = 0
        self._procs: list[_RankProcess] = []  # the current run's launchers, for close()

    # -- the network's names and addresses

    @property
    def id(self) -> str:
        return self.network.id

    @property
    def bridge_address(self) -> str:
        return self.network.bridge_address

    @property
    def hosts(self) -> list[Host]:
        """The hosts (nodes), one network namespace each."""
        return self.network.hosts

    def host_of(self, rank: int) -> Host:
        """The host (node) ``rank`` runs on: ranks fill the nodes one after another."""
        return self.hosts[rank // self.ranks_per_node]

    def counters(self) -> list[tuple[int, int]]:
        """Cumulative ``(tx_bytes, rx_bytes)`` of each host's (node's) link since the cluster
        started: the bytes between nodes. Call before and after a workload to get its traffic.
        """
        return self.network.counters()

    # -- lifecycle

    def __enter__(self) -> "EmulatedCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> "EmulatedCluster":
        """Create bridge, namespaces, links, qdiscs and the rendezvous server (about 0.1 s/rank)."""
        if self._started:
            return self
        check_privileges()
        cleanup_stale()
        self._started = True
        try:
            self.network.create()
            self._rendezvous, self.rendezvous_port = rendezvous.start_server(self.bridge_address)
            self._log(f"rendezvous on {self.bridge_address}:{self.rendezvous_port}")
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Tear everything down. Idempotent; safe after a partial :meth:`start`."""
        if not self._started:
            return
        with signals_deferred():
            # Normally run() has reaped its ranks; this covers an interrupt in the middle of it.
            _kill_ranks(self._procs, kill_grace=0.5)
            self._procs = []
            if self._rendezvous is not None:
                with contextlib.suppress(Exception):
                    rendezvous.stop_server(self._rendezvous)
                self._rendezvous = None
            errors = self.network.remove()
            self._started = False
        if errors:
            raise EmulatorError("could not remove: " + "; ".join(errors))

    def _log(self, msg: str) -> None:
        if self.verbose:
            print(f"[emulator {self.id}] {msg}", file=sys.stderr, flush=True)

    # -- Horovod

    def host_alloc_plan(self):
        """Horovod's slot plan: ``ranks_per_node`` slots on each host."""
        return rendezvous.host_alloc_plan([h.hostname for h in self.hosts], self.ranks_per_node)

    def horovod_env(self, rank: int) -> dict[str, str]:
        """The environment ``horovodrun --gloo`` would give ``rank`` (see gloo_run.launch_gloo)."""
        return rendezvous.horovod_env([h.hostname for h in self.hosts], rank,
                                      self.bridge_address, self.rendezvous_port,
                                      self.ranks_per_node)

    # -- running

    def _launch_argv(self, h: Host, command: Sequence[str], started: Path) -> list[str]:
        """The argv that runs ``command`` as one rank on host ``h``."""
        # ip netns exec: network namespace and /etc/netns/<ns>/hosts over /etc/hosts.
        # unshare --uts: own hostname. --pid --fork --kill-child --mount-proc: the command's whole
        # process tree lives in a PID namespace that dies with it (and with the launcher); /proc
        # is remounted so os.getpid() and /proc/<pid> agree for tools like psutil.
        # sh stays as PID 1 (no exec): PID 1 ignores default-action signals, the user's command
        # must not, and sh reports the command's status as 128+N when it is killed by signal N.
        # The command runs in a subshell that first creates ``started`` and then execs it: until
        # that file exists the rank is still in its set-up, where a SIGTERM would either be
        # dropped (unshare blocks it, a namespace's PID 1 ignores it) or kill `hostname` instead
        # of the command, so _kill_ranks signals a rank only once it has started.
        script = 'hostname "$1" || exit 126; shift; started=$1; shift; (: > "$started" && exec "$@")'
        return ["ip", "netns", "exec", h.netns,
                "unshare", "--uts", "--pid", "--fork", "--kill-child", "--mount-proc", "--",
                "sh", "-c", script, "hob-rank", h.hostname, str(started), *command]

    def run(self, command: Sequence[str], env: Optional[Mapping[str, str]] = None,
            timeout: Optional[float] = None, cwd: str | os.PathLike | None = None,
            on_output: Optional[Callable[[int, str], None]] = None,
            kill_grace: float = 3.0) -> RunResult:
        """Run ``command`` (an argv list) once on every rank, as Horovod gloo ranks; wait for all.

        :param env: extra environment on top of this process's (the HOROVOD_* variables win).
        :param timeout: seconds; past it every rank is killed and ``timed_out`` is set.
        :param on_output: called as ``on_output(rank, line)`` for every output line, from
            reader threads, as it arrives (for live display); output is also kept in the result.
        :param kill_grace: seconds between SIGTERM and SIGKILL when ranks must be killed.

        If one rank exits non-zero, the others are killed at once (like horovodrun). On
        KeyboardInterrupt or any other exception every rank is killed before it propagates.
        """
        if not self._started:
            raise EmulatorError("cluster not started: use `with EmulatedCluster(...)` or start()")
        if isinstance(command, str):
            raise TypeError("command must be an argv list, e.g. ['python', 'train.py']")
        self._rendezvous.init(self.host_alloc_plan())  # fresh rendezvous state for every run
        self._runs += 1
        base_env = dict(os.environ)
        base_env.update(env or {})
        logs = self._open_logs()
        before = self.counters()
        procs = self._procs = []
        started_dir = Path(tempfile.mkdtemp(prefix="hob-started-"))
        outputs: list[list[str]] = [[] for _ in range(self.np)]
        readers: list[threading.Thread] = []
        killed = [False] * self.np
        timed_out = False
        first_failed = None
        start = time.monotonic()
        try:
            for rank in range(self.np):
                started = started_dir / f"rank{rank}"
                procs.append(_RankProcess(subprocess.Popen(
                    self._launch_argv(self.host_of(rank), command, started),
                    env={**base_env, **self.horovod_env(rank)},
                    cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, start_new_session=True,
                    preexec_fn=_die_with_parent), started))
            for rank, p in enumerate(procs):
                t = threading.Thread(target=_pump, daemon=True,
                                     args=(p.proc.stdout, rank, outputs[rank], logs[rank],
                                           on_output))
                t.start()
                readers.append(t)
            while True:
                codes = [p.proc.poll() for p in procs]
                if all(c is not None for c in codes):
                    break
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    first_failed = failed[0]
                    self._log(f"rank {first_failed} exited {codes[first_failed]}; killing others")
                    killed = _kill_ranks(procs, kill_grace)
                    break
                if timeout is not None and time.monotonic() - start > timeout:
                    timed_out = True
                    self._log(f"timeout after {timeout}s; killing all ranks")
                    killed = _kill_ranks(procs, kill_grace)
                    break
                time.sleep(0.02)
        except BaseException:
            with signals_deferred():
                _kill_ranks(procs, kill_grace=0.5)
            raise
        finally:
            wall = time.monotonic() - start
            for t in readers:
                t.join(timeout=5)
            for f in logs:
                if f is not None:
                    f.close()
            shutil.rmtree(started_dir, ignore_errors=True)
        after = self.counters()
        node_bytes = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)]
        per_node = self.ranks_per_node
        ranks = []
        for rank, p in enumerate(procs):
            h = self.host_of(rank)
            tx, rx = node_bytes[h.rank]
            ranks.append(RankResult(
                rank=rank, hostname=h.hostname, address=h.address,
                exit_code=_shell_status(p.proc.returncode), killed=killed[rank],
                # a node's link is shared by its ranks: each gets an even share
                tx_bytes=tx // per_node, rx_bytes=rx // per_node, output="".join(outputs[rank]),
                log_path=None if logs[rank] is None else logs[rank].name))
        return RunResult(ranks=ranks, wall_seconds=wall, bandwidth_bps=self.bandwidth_bps,
                         timed_out=timed_out, first_failed_rank=first_failed,
                         node_bytes=node_bytes, ranks_per_node=per_node)

    def _open_logs(self) -> list:
        if self.log_dir is None:
            return [None] * self.np
        self.log_dir.mkdir(parents=True, exist_ok=True)
        suffix = "" if self._runs == 1 else f".run{self._runs}"
        return [open(self.log_dir / f"rank.{rank}{suffix}.log", "w") for rank in range(self.np)]


def _pump(stream, rank: int, sink: list[str], log, on_output) -> None:
    """Copy one rank's output line by line to memory, its log file and the live callback."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        sink.append(line)
        if log is not None:
            log.write(line)
            log.flush()
        if on_output is not None:
            with contextlib.suppress(Exception):
                on_output(rank, line)
    stream.close()


def _shell_status(returncode: Optional[int]) -> Optional[int]:
    """Popen's -N (killed by signal N) as a shell reports it, 128+N."""
    if returncode is not None and returncode < 0:
        return 128 - returncode
    return returncode


@dataclass
class _RankProcess:
    """One rank's launcher process and the file its wrapper creates when the command starts."""

    proc: subprocess.Popen
    started: Path

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


def _kill_ranks(procs: Sequence[_RankProcess], kill_grace: float) -> list[bool]:
    """SIGTERM every still-running rank's process group, SIGKILL after ``kill_grace`` s, reap.

    A rank still in its set-up (namespaces, hostname: its command has not started) gets its
    SIGTERM when the command starts, within the same grace period: a SIGTERM during the set-up
    would be lost or hit the set-up instead, and the rank would report 126 or 137 by chance. So
    a rank killed here reports what its command did with SIGTERM (143 by default), or 137 if it
    (or its set-up) outlived the grace period.

    Returns which ranks were still running (i.e. were killed by us). SIGKILL of the launcher
    group takes the rank's PID 1 with it and so, by the kernel, everything in its PID namespace.
    """
    alive = [p.proc.poll() is None for p in procs]
    if not any(alive):
        return alive
    pending = [p for p, a in zip(procs, alive) if a]
    deadline = time.monotonic() + kill_grace
    while True:
        for p in list(pending):
            if p.proc.poll() is not None:
                pending.remove(p)
            elif p.started.exists():
                p.signal(signal.SIGTERM)
                pending.remove(p)
        if time.monotonic() >= deadline or all(p.proc.poll() is not None for p in procs):
            break
        time.sleep(0.02)
    for p in procs:
        if p.proc.poll() is None:
            p.signal(signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.proc.wait(timeout=10)
    return alive
