"""Running a command on every host of the emulated cluster, as the ranks of one Horovod job.

:class:`EmulatedCluster` builds the :class:`~hvd_onebit_tools.cluster.network.Network` and Horovod's
rendezvous (:mod:`~hvd_onebit_tools.cluster.rendezvous`), then :meth:`EmulatedCluster.run` starts the
command once per rank, each rank in its host's network namespace and in its own UTS namespace
(``hostname`` is ``node<host>``) and PID namespace (when a rank ends, or is killed, nothing it
started can survive it). A host is one rank by default; with ``ranks_per_node=L`` it is a node of
L ranks sharing its namespace, so their traffic to each other stays on the node and only traffic
between nodes crosses the shaped links. If one rank fails the others are killed, like horovodrun.
:meth:`EmulatedCluster.run_per_node` starts one command per node instead, in the same namespaces:
a launcher that starts the node's ranks itself, as torchrun does
(:mod:`~hvd_onebit_tools.cluster.torchrun`).

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
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from . import rendezvous
from .bandwidth import DEFAULT_QUEUE_MS, parse_bandwidth
from .network import MAX_RANKS, STARTED_PREFIX, Host, Network, cleanup_stale
from .processes import RankProcess, die_with_parent, kill_ranks, pump, shell_status
from .results import RankResult, RunResult
from .system import EmulatorError, check_privileges, signals_deferred

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
        self._procs: list[RankProcess] = []  # the current run's launchers, for close()

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
        """Create bridge, namespaces, links and qdiscs (about 0.1 s/rank)."""
        if self._started:
            return self
        check_privileges()
        cleanup_stale()
        self._started = True
        try:
            self.network.create()
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
            kill_ranks(self._procs, kill_grace=0.5)
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

    def _horovod_rendezvous(self) -> None:
        """Horovod's rendezvous server, started at the first Horovod run (a cluster that runs
        only torchrun jobs never imports Horovod)."""
        if self._rendezvous is None:
            self._rendezvous, self.rendezvous_port = rendezvous.start_server(self.bridge_address)
            self._log(f"rendezvous on {self.bridge_address}:{self.rendezvous_port}")

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
        # of the command, so kill_ranks signals a rank only once it has started.
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
        self._check_runnable(command)
        self._horovod_rendezvous()
        self._rendezvous.init(self.host_alloc_plan())  # fresh rendezvous state for every run
        return self._run_launches(
            [(self.host_of(rank), list(command), self.horovod_env(rank))
             for rank in range(self.np)], env, timeout, cwd, on_output, kill_grace)

    def run_per_node(self, commands: Sequence[Sequence[str]],
                     env: Optional[Mapping[str, str]] = None, timeout: Optional[float] = None,
                     cwd: str | os.PathLike | None = None,
                     on_output: Optional[Callable[[int, str], None]] = None,
                     kill_grace: float = 3.0) -> RunResult:
        """Run ``commands[k]`` once on node k, in its namespaces (e.g. one torchrun per node,
        which starts the node's ranks itself: :mod:`~hvd_onebit_tools.cluster.torchrun`); wait
        for all, as :meth:`run` does. The result has one entry per node (``launches="node"``),
        each with its node's whole link bytes; no Horovod environment is set."""
        if len(commands) != self.nodes:
            raise ValueError(f"one command per node: {self.nodes} nodes, {len(commands)} commands")
        for command in commands:
            self._check_runnable(command)
        return self._run_launches([(h, list(c), {}) for h, c in zip(self.hosts, commands)],
                                  env, timeout, cwd, on_output, kill_grace, per_node=True)

    def _check_runnable(self, command: Sequence[str]) -> None:
        if not self._started:
            raise EmulatorError("cluster not started: use `with EmulatedCluster(...)` or start()")
        if isinstance(command, str):
            raise TypeError("command must be an argv list, e.g. ['python', 'train.py']")

    def _run_launches(self, launches: list[tuple[Host, list[str], dict[str, str]]],
                      env: Optional[Mapping[str, str]], timeout: Optional[float], cwd,
                      on_output, kill_grace: float, per_node: bool = False) -> RunResult:
        """Start each (host, argv, its own environment) in the host's namespaces, wait for all
        (killing the others when one fails or the time is up), and count the links' bytes."""
        self._runs += 1
        count = len(launches)
        base_env = dict(os.environ)
        base_env.update(env or {})
        logs = self._open_logs(count, "node" if per_node else "rank")
        before = self.counters()
        procs = self._procs = []
        # named after the cluster: cleanup_stale() removes one its SIGKILLed owner left
        started_dir = Path(tempfile.mkdtemp(prefix=f"{STARTED_PREFIX}{self.id}-"))
        outputs: list[list[str]] = [[] for _ in range(count)]
        readers: list[threading.Thread] = []
        killed = [False] * count
        timed_out = False
        first_failed = None
        start = time.monotonic()
        try:
            for index, (host, command, own_env) in enumerate(launches):
                started = started_dir / f"launch{index}"
                procs.append(RankProcess(subprocess.Popen(
                    self._launch_argv(host, command, started),
                    env={**base_env, **own_env},
                    cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, start_new_session=True,
                    preexec_fn=die_with_parent), started))
            for index, p in enumerate(procs):
                readers.append(threading.Thread(target=pump, daemon=True, args=(
                    p.proc.stdout, index, outputs[index], logs[index], on_output)))
                readers[-1].start()
            while True:
                codes = [p.proc.poll() for p in procs]
                if all(c is not None for c in codes):
                    break
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    first_failed = failed[0]
                    self._log(f"launch {first_failed} exited {codes[first_failed]}; "
                              "killing the others")
                    killed = kill_ranks(procs, kill_grace)
                    break
                if timeout is not None and time.monotonic() - start > timeout:
                    timed_out = True
                    self._log(f"timeout after {timeout}s; killing all ranks")
                    killed = kill_ranks(procs, kill_grace)
                    break
                time.sleep(0.02)
        except BaseException:
            with signals_deferred():
                kill_ranks(procs, kill_grace=0.5)
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
        # a node's link is shared by the ranks launched on it: each gets an even share
        share = 1 if per_node else self.ranks_per_node
        ranks = []
        for index, (p, (h, _, _)) in enumerate(zip(procs, launches)):
            tx, rx = node_bytes[h.rank]
            ranks.append(RankResult(
                rank=index, hostname=h.hostname, address=h.address,
                exit_code=shell_status(p.proc.returncode), killed=killed[index],
                tx_bytes=tx // share, rx_bytes=rx // share, output="".join(outputs[index]),
                log_path=None if logs[index] is None else logs[index].name))
        return RunResult(ranks=ranks, wall_seconds=wall, bandwidth_bps=self.bandwidth_bps,
                         timed_out=timed_out, first_failed_rank=first_failed,
                         node_bytes=node_bytes, ranks_per_node=self.ranks_per_node,
                         launches="node" if per_node else "rank")

    def _open_logs(self, count: int, what: str) -> list:
        if self.log_dir is None:
            return [None] * count
        self.log_dir.mkdir(parents=True, exist_ok=True)
        suffix = "" if self._runs == 1 else f".run{self._runs}"
        return [open(self.log_dir / f"{what}.{i}{suffix}.log", "w") for i in range(count)]
