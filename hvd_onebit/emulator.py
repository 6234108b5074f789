"""A bandwidth-limited cluster on one machine: N Horovod ranks joined by rate-limited links.

Each rank is an emulated *host*:

* its own network namespace (``hob-<id>-r<rank>``) holding one interface, ``emu0``, the end of a
  veth pair whose other end (``hob<id>v<rank>``) is a port of a Linux bridge (``hobr<id>``) in the
  root namespace;
* its own UTS namespace, so ``hostname`` is ``node<rank>``, and an ``/etc/netns/<ns>/hosts`` file
  (``ip netns exec`` bind-mounts it over ``/etc/hosts``) mapping every ``node<r>`` to its address;
* its own PID namespace, so when a rank ends (or is killed) nothing it started can survive it.

``tc qdisc ... tbf`` on *both* ends of every veth caps what each host can send and receive at the
requested rate, like a full-duplex NIC; ``unlimited`` installs no qdisc.

Addresses come only from 198.18.0.0/15 (RFC 2544 benchmarking space): one free /24 per cluster;
the bridge is ``.1`` and rank ``r`` is ``.(r + 2)``. Nothing is routed off the machine.

Horovod is launched the way ``horovodrun --gloo`` would launch it, without horovodrun: this module
runs Horovod's own rendezvous server on the bridge address and gives every rank exactly the
``HOROVOD_*`` environment of :func:`horovod.runner.gloo_run.launch_gloo`, with one slot per host
(``local_size`` 1, ``cross_size`` N) so that every collective crosses the emulated links.

Everything created is torn down by :meth:`EmulatedCluster.close` (also on errors, a crashed rank,
``KeyboardInterrupt`` and, in the CLI, SIGTERM). A record of each live cluster is kept under
``/run/hvd-onebit-emulator`` so that one whose owner was SIGKILLed is removed by the next cluster
(or by :func:`cleanup_stale`).

Example::

    with EmulatedCluster(np=4, bandwidth="1gbit") as cluster:
        result = cluster.run(["python", "train.py"], timeout=600)
    print(result.wall_seconds, [r.tx_bytes for r in result.ranks])
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import ipaddress
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

__all__ = [
    "EmulatedCluster", "EmulatorError", "RankResult", "RunResult", "TbfParams",
    "check_privileges", "cleanup_stale", "format_bandwidth", "parse_bandwidth", "tbf_params",
]

ADDRESS_POOL = ipaddress.ip_network("198.18.0.0/15")  # the only addresses this module ever uses
IFACE = "emu0"  # the rank's interface name inside its namespace (HOROVOD_GLOO_IFACE)
MAX_RANKS = 253  # .2 ... .254 of one /24
STATE_DIR = Path("/run/hvd-onebit-emulator")
NETNS_ETC = Path("/etc/netns")
_PREFIX = "hob"  # every name this module creates starts with it (h-vd o-ne b-it)

_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


class EmulatorError(RuntimeError):
    """The emulated cluster could not be set up (permissions, missing tools, a failed command)."""


# ----------------------------------------------------------------------------- bandwidth


def parse_bandwidth(text: str | int | None) -> Optional[int]:
    """Parse a link rate into bits per second; ``None`` means unlimited (no qdisc).

    Accepts ``tc``'s bit units, 1000-based: ``"10mbit"``, ``"1.5gbit"``, ``"100kbit"``, ``"1tbit"``,
    a plain number of bits/s (``"5000000"``), and ``"unlimited"`` / ``"none"`` / ``"inf"``.
    Byte-per-second spellings (``"mbps"``, ``"MB/s"``) are rejected as ambiguous: in ``tc``
    ``mbps`` means megaBYTES per second, to most people megaBITS.
    """
    if text is None:
        return None
    if isinstance(text, int):
        if text <= 0:
            raise ValueError(f"bandwidth must be positive, got {text}")
        return text
    s = str(text).strip().lower()
    if s in ("unlimited", "none", "inf", "infinite", "off"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)", s)
    unit = m.group(2) if m else ""
    if not m or (unit and unit not in _UNITS):
        raise ValueError(f"cannot parse bandwidth {text!r}: use e.g. 100mbit, 1gbit, 10gbit, "
                         "500kbit or unlimited")
    bps = int(round(float(m.group(1)) * _UNITS[unit or "bit"]))
    if bps < 8000:
        raise ValueError(f"bandwidth {text!r} is below 8kbit, too slow to run anything")
    return bps


def format_bandwidth(bps: Optional[int]) -> str:
    """``10**9 -> '1gbit'``, ``None -> 'unlimited'``: the inverse of :func:`parse_bandwidth`."""
    if bps is None:
        return "unlimited"
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bps >= _UNITS[unit] and bps % _UNITS[unit] == 0:
            return f"{bps // _UNITS[unit]}{unit}"
    return f"{bps}bit"


@dataclass(frozen=True)
class TbfParams:
    """Token-bucket settings for one veth end. All sizes in bytes, rate in bits/s."""

    rate_bps: int
    burst_bytes: int
    limit_bytes: int

    def tc_args(self) -> list[str]:
        return ["tbf", "rate", f"{self.rate_bps}bit", "burst", str(self.burst_bytes),
                "limit", str(self.limit_bytes)]


DEFAULT_QUEUE_MS = 2.0
MIN_QUEUE_BYTES = 256 * 1024  # a switch port's buffer is bytes, whatever the line rate


def tbf_params(bps: int, queue_ms: float = DEFAULT_QUEUE_MS) -> TbfParams:
    """Choose tbf burst and queue limit (bytes) for a rate in bits/s; tuned from 10mbit to 10gbit.

    * burst: 1 ms worth of line rate, but at least 96 KiB. Below ~64 KiB tbf has to split the
      64 KiB GSO super-packets that veth carries, which costs CPU and throughput; much above 1 ms
      the link visibly runs faster than its rate in short bursts.
    * limit (the queue): burst + 2 ms of line rate, at least 2 bursts -- a shallow, switch-like
      buffer. Gloo's ring allreduce is a lock-step exchange of chunks, so every millisecond of
      queueing delay is paid at every step: with a 50 ms queue a 50 MB allreduce between 2 ranks
      at 1gbit took 3.4 s (wire time 0.4 s); with this one it takes ~0.55 s, while a plain TCP
      stream still gets ~119 MB/s at 1gbit and ~12 MB/s at 100mbit.
    * ``queue_ms`` deepens the queue (limit = burst + queue_ms of line rate), and the queue is
      never below ``MIN_QUEUE_BYTES`` (256 KiB): a switch port's buffer is a number of bytes, so
      at low rates it holds many milliseconds (21 ms at 100mbit, 2 ms at 1gbit). A queue of a
      few KB drops packets when several peers send to one host at once (an alltoall's incast),
      and TCP's 200 ms minimum retransmission timeout then dominates short exchanges: at
      100mbit a 4-rank 16M-element OneBitAllreduce took 612 ms with a 2 ms (25 KB) queue and
      476 ms with 20 ms, while the fp32 ring allreduce was unchanged (8.7 s vs 8.9 s). Model
      your own switches' buffers.
    """
    if queue_ms < 0:
        raise ValueError(f"queue_ms must be >= 0, got {queue_ms}")
    rate_bytes = bps / 8.0
    burst = max(96 * 1024, int(rate_bytes * 0.001))
    limit = max(2 * burst, burst + max(MIN_QUEUE_BYTES, int(rate_bytes * queue_ms / 1000)))
    return TbfParams(rate_bps=bps, burst_bytes=burst, limit_bytes=limit)


# ----------------------------------------------------------------------------- privileges


def _effective_caps() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def check_privileges() -> None:
    """Raise :class:`EmulatorError` naming the problem unless this process can build the cluster.

    Needs CAP_NET_ADMIN (namespaces' links, addresses, qdiscs) and CAP_SYS_ADMIN (creating
    network/UTS/PID namespaces and the ``/run/netns`` bind mounts), i.e. in practice root, plus the
    ``ip``, ``tc``, ``unshare`` and ``hostname`` programs.
    """
    missing_tools = [t for t in ("ip", "tc", "unshare", "hostname") if shutil.which(t) is None]
    if missing_tools:
        raise EmulatorError(f"missing program(s) {', '.join(missing_tools)}: install iproute2, "
                            "util-linux and hostname")
    caps = _effective_caps()
    lacking = [name for bit, name in ((_CAP_NET_ADMIN, "CAP_NET_ADMIN"),
                                      (_CAP_SYS_ADMIN, "CAP_SYS_ADMIN")) if not caps >> bit & 1]
    if lacking:
        who = "root" if os.geteuid() == 0 else f"uid {os.geteuid()}"
        raise EmulatorError(
            f"the cluster emulator needs {' and '.join(lacking)} (running as {who} without them) "
            "to create network namespaces, veth links and tc qdiscs; run it as root "
            "(e.g. with sudo) outside a capability-restricted container"
        )


# ----------------------------------------------------------------------------- commands


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run one setup/teardown command (ip, tc); raise EmulatorError with its stderr on failure."""
    proc = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=30)
    if check and proc.returncode != 0:
        raise EmulatorError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): "
                            f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _link_exists(name: str) -> bool:
    return os.path.exists(f"/sys/class/net/{name}")


def _read_counter(iface: str, name: str) -> int:
    with open(f"/sys/class/net/{iface}/statistics/{name}") as f:
        return int(f.read())


@contextlib.contextmanager
def _state_lock():
    """Serialise subnet/name allocation and /etc/netns edits between concurrent clusters."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _signals_deferred():
    """Hold off SIGINT/SIGTERM while tearing down, so a second Ctrl-C cannot leave debris."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    old = {s: signal.signal(s, lambda signum, _frame: pending.append(signum))
           for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        for s in pending[:1]:  # re-deliver the first one, now that we are clean
            os.kill(os.getpid(), s)


def _used_subnets() -> set[ipaddress.IPv4Network]:
    """The /24s of 198.18.0.0/15 already assigned to an interface in the root namespace."""
    out = _sh("ip", "-4", "-o", "addr", "show").stdout
    used = set()
    for m in re.finditer(r"inet (\d+\.\d+\.\d+\.\d+)/", out):
        addr = ipaddress.ip_address(m.group(1))
        if addr in ADDRESS_POOL:
            used.add(ipaddress.ip_network(f"{addr}/24", strict=False))
    return used


# ----------------------------------------------------------------------------- stale clusters


def _pid_alive(pid: int, start_time: Optional[str]) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return start_time is None or fields[19] == start_time  # field 22: start time, pid reuse check


def _own_start_time() -> str:
    with open("/proc/self/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]


def _remove_resources(bridge: Optional[str], host_veths: Sequence[str],
                      netns: Sequence[str]) -> list[str]:
    """Delete the given links, namespaces and /etc/netns dirs; tolerate ones already gone.

    Host-side veths are deleted explicitly: deleting a namespace destroys its end only when the
    kernel gets round to it (asynchronously), and the root-side end can linger for seconds.
    Returns error messages of deletions that failed (and whose object still exists).
    """
    errors = []
    for veth in host_veths:
        if _link_exists(veth):
            p = _sh("ip", "link", "del", veth, check=False)
            if p.returncode and _link_exists(veth):
                errors.append(f"veth {veth}: {p.stderr.strip()}")
    for ns in netns:
        if os.path.exists(f"/run/netns/{ns}"):
            p = _sh("ip", "netns", "del", ns, check=False)
            if p.returncode and os.path.exists(f"/run/netns/{ns}"):
                errors.append(f"netns {ns}: {p.stderr.strip()}")
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    if bridge and _link_exists(bridge):
        p = _sh("ip", "link", "del", bridge, check=False)
        if p.returncode and _link_exists(bridge):
            errors.append(f"bridge {bridge}: {p.stderr.strip()}")
    with contextlib.suppress(OSError):
        NETNS_ETC.rmdir()  # only if empty: other clusters' entries keep it
    return errors


def cleanup_stale() -> list[str]:
    """Remove clusters whose owning process is gone (e.g. it was SIGKILLed). Returns their ids."""
    removed = []
    if not STATE_DIR.is_dir():
        return removed
    with _state_lock():
        for path in STATE_DIR.glob("*.json"):
            try:
                state = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if _pid_alive(state["pid"], state.get("start_time")):
                continue
            _remove_resources(state["bridge"], state["host_veths"], state["netns"])
            path.unlink(missing_ok=True)
            removed.append(state["id"])
    return removed


# ----------------------------------------------------------------------------- results


@dataclass
class RankResult:
    """What one rank did during one :meth:`EmulatedCluster.run`.

    ``exit_code``: the command's exit status as a shell reports it (128 + N if killed by signal N);
    ``killed``: it was still running when the emulator killed the job (another rank failed,
    timeout, interrupt); it may still have exited with its own status in the grace period;
    ``tx_bytes`` / ``rx_bytes``: bytes the rank's host sent / received on its link during the run
    (Ethernet frames, so including TCP/IP headers and Horovod's control traffic);
    ``output``: its stdout and stderr, interleaved; ``log_path``: where that was also written.
    """

    rank: int
    hostname: str
    address: str
    exit_code: Optional[int]
    killed: bool
    tx_bytes: int
    rx_bytes: int
    output: str = field(repr=False, default="")
    log_path: Optional[str] = None


@dataclass
class RunResult:
    """One command run on every rank. ``wall_seconds``: launch to last rank's exit."""

    ranks: list[RankResult]
    wall_seconds: float
    bandwidth_bps: Optional[int]
    timed_out: bool = False
    first_failed_rank: Optional[int] = None

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(r.exit_code == 0 for r in self.ranks)

    @property
    def returncode(self) -> int:
        """0 on success, 124 on timeout, else the exit code of the first rank that failed."""
        if self.timed_out:
            return 124
        if self.first_failed_rank is not None:
            return self.ranks[self.first_failed_rank].exit_code or 1
        return next((r.exit_code or 1 for r in self.ranks if r.exit_code != 0), 0)

    @property
    def tx_bytes(self) -> int:
        return sum(r.tx_bytes for r in self.ranks)

    def to_dict(self, with_output: bool = False) -> dict:
        ranks = [asdict(r) for r in self.ranks]
        if not with_output:
            for r in ranks:
                r.pop("output")
        return {"np": len(self.ranks), "bandwidth": format_bandwidth(self.bandwidth_bps),
                "bandwidth_bps": self.bandwidth_bps, "wall_seconds": round(self.wall_seconds, 3),
                "timed_out": self.timed_out, "first_failed_rank": self.first_failed_rank,
                "returncode": self.returncode, "ranks": ranks}


# ----------------------------------------------------------------------------- the cluster


@dataclass(frozen=True)
class _Host:
    rank: int
    hostname: str  # node<rank>, inside its own UTS namespace
    netns: str  # hob-<id>-r<rank>
    host_veth: str  # hob<id>v<rank>, the bridge port in the root namespace (<= 15 chars)
    address: str


_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the forked child
    """preexec_fn: SIGKILL the launcher if we die, which (via --kill-child) ends its PID ns."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class EmulatedCluster:
    """``np`` emulated hosts joined by links of ``bandwidth`` (see the module docstring).

    :param np: number of ranks/hosts, 1..253.
    :param bandwidth: per-host link rate each way, a :func:`parse_bandwidth` string, bits/s as an
        int, or ``"unlimited"``/``None`` for no shaping.
    :param log_dir: if given, each run writes ``rank.<r>.log`` there (else output is only kept in
        memory, in :attr:`RankResult.output`).
    :param verbose: print the setup commands' progress to stderr.
    :param queue_ms: switch queue depth beyond one burst, in ms of line rate (see
        :func:`tbf_params`).

    Use as a context manager, or call :meth:`start` and (always) :meth:`close`.
    """

    def __init__(self, np: int, bandwidth: str | int | None = "1gbit",
                 log_dir: str | os.PathLike | None = None, verbose: bool = False,
                 queue_ms: float = DEFAULT_QUEUE_MS):
        if not 1 <= int(np) <= MAX_RANKS:
            raise ValueError(f"np must be between 1 and {MAX_RANKS}, got {np}")
        self.np = int(np)
        self.bandwidth_bps = parse_bandwidth(bandwidth)
        if queue_ms < 0:
            raise ValueError(f"queue_ms must be >= 0, got {queue_ms}")
        self.queue_ms = float(queue_ms)
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.verbose = verbose
        self.id = ""
        self.bridge = ""
        self.bridge_address = ""
        self._prefixlen = 24
        self.hosts: list[_Host] = []
        self.rendezvous_port: Optional[int] = None
        self._rendezvous = None
        self._created_veths: list[str] = []
        self._created_netns: list[str] = []
        self._bridge_created = False
        self._started = False
        self._runs = 0
        self._procs: list[_RankProcess] = []  # the current run's launchers, for close()

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
            with _state_lock():
                self._allocate()
                self._write_state()
                self._create_bridge()
            for host in self.hosts:
                self._create_host(host)
            self._write_hosts_files()
            self._start_rendezvous()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Tear everything down. Idempotent; safe after a partial :meth:`start`."""
        if not self._started:
            return
        with _signals_deferred():
            # Normally run() has reaped its ranks; this covers an interrupt in the middle of it.
            _kill_ranks(self._procs, kill_grace=0.5)
            self._procs = []
            if self._rendezvous is not None:
                with contextlib.suppress(Exception):
                    self._rendezvous.stop()
                    self._rendezvous._httpd.server_close()
                self._rendezvous = None
            with _state_lock():
                errors = _remove_resources(self.bridge if self._bridge_created else None,
                                           self._created_veths, self._created_netns)
                if not errors:
                    (STATE_DIR / f"{self.id}.json").unlink(missing_ok=True)
            self._started = False
        if errors:
            raise EmulatorError("could not remove: " + "; ".join(errors))

    # -- setup steps

    def _log(self, msg: str) -> None:
        if self.verbose:
            print(f"[emulator {self.id}] {msg}", file=sys.stderr, flush=True)

    def _allocate(self) -> None:
        """Pick an unused id (names) and /24 (addresses). Called under the state lock."""
        for _ in range(100):
            cid = secrets.token_hex(3)  # 6 hex digits: 'hob' + id + 'v' + rank fits in 15 chars
            if not _link_exists(f"{_PREFIX}r{cid}") and not (STATE_DIR / f"{cid}.json").exists():
                break
        else:  # pragma: no cover
            raise EmulatorError("could not find an unused cluster id")
        free = [n for n in ADDRESS_POOL.subnets(new_prefix=24) if n not in _used_subnets()]
        if not free:  # pragma: no cover
            raise EmulatorError("all 512 /24 subnets of 198.18.0.0/15 are in use")
        subnet = random.choice(free)
        base = subnet.network_address
        self.id = cid
        self.bridge = f"{_PREFIX}r{cid}"
        self.bridge_address = str(base + 1)
        self._prefixlen = subnet.prefixlen
        self.hosts = [_Host(rank=r, hostname=f"node{r}", netns=f"{_PREFIX}-{cid}-r{r}",
                            host_veth=f"{_PREFIX}{cid}v{r}", address=str(base + 2 + r))
                      for r in range(self.np)]

    def _write_state(self) -> None:
        state = {"id": self.id, "pid": os.getpid(), "start_time": _own_start_time(),
                 "bridge": self.bridge, "host_veths": [h.host_veth for h in self.hosts],
                 "netns": [h.netns for h in self.hosts]}
        (STATE_DIR / f"{self.id}.json").write_text(json.dumps(state))

    def _create_bridge(self) -> None:
        self._log(f"bridge {self.bridge} {self.bridge_address}/{self._prefixlen}")
        # Recorded before creating, so an interrupt between the two cannot orphan the object.
        self._bridge_created = True
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        # No IPv6 link-local addresses: their router/MLD chatter would pollute the byte counters.
        _sh("ip", "link", "set", self.bridge, "addrgenmode", "none")
        _sh("ip", "addr", "add", f"{self.bridge_address}/{self._prefixlen}", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")

    def _create_host(self, h: _Host) -> None:
        self._log(f"rank {h.rank}: netns {h.netns}, {h.host_veth} <-> {IFACE} {h.address}")
        self._created_netns.append(h.netns)  # recorded first, as for the bridge
        _sh("ip", "netns", "add", h.netns)
        # The peer is created directly inside the namespace, so 'emu0' never clashes in the root ns.
        self._created_veths.append(h.host_veth)
        _sh("ip", "link", "add", h.host_veth, "type", "veth", "peer", "name", IFACE,
            "netns", h.netns)
        _sh("ip", "link", "set", h.host_veth, "addrgenmode", "none")
        _sh("ip", "-n", h.netns, "link", "set", IFACE, "addrgenmode", "none")
        _sh("ip", "link", "set", h.host_veth, "master", self.bridge, "up")
        _sh("ip", "-n", h.netns, "addr", "add", f"{h.address}/{self._prefixlen}", "dev", IFACE)
        _sh("ip", "-n", h.netns, "link", "set", IFACE, "up")
        _sh("ip", "-n", h.netns, "link", "set", "lo", "up")
        if self.bandwidth_bps is not None:
            tbf = tbf_params(self.bandwidth_bps, self.queue_ms).tc_args()
            # Root side shapes what the host receives, namespace side what it sends.
            _sh("tc", "qdisc", "add", "dev", h.host_veth, "root", *tbf)
            _sh("tc", "-n", h.netns, "qdisc", "add", "dev", IFACE, "root", *tbf)

    def _write_hosts_files(self) -> None:
        """/etc/netns/<ns>/hosts: every node name -> its veth address (Gloo resolves hostnames)."""
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
                 f"{self.bridge_address}\temu-gateway"]
        lines += [f"{h.address}\t{h.hostname}" for h in self.hosts]
        text = "\n".join(lines) + "\n"
        with _state_lock():
            for h in self.hosts:
                d = NETNS_ETC / h.netns
                d.mkdir(parents=True, exist_ok=True)
                (d / "hosts").write_text(text)

    def _start_rendezvous(self) -> None:
        """Horovod's own rendezvous HTTP server, bound to the bridge address only."""
        from horovod.runner.http.http_server import (RendezvousHandler, RendezvousHTTPServer,
                                                     RendezvousServer)
        from horovod.runner.util.threads import in_thread

        server = RendezvousServer(verbose=0)
        # RendezvousServer.start() binds to all addresses on a random port; we want the bridge only.
        server._httpd = RendezvousHTTPServer((self.bridge_address, 0), RendezvousHandler, 0)
        server._listen_thread = in_thread(target=server._httpd.serve_forever)
        self._rendezvous = server
        self.rendezvous_port = server._httpd.server_address[1]
        self._log(f"rendezvous on {self.bridge_address}:{self.rendezvous_port}")

    # -- queries

    def counters(self) -> list[tuple[int, int]]:
        """Cumulative ``(tx_bytes, rx_bytes)`` of each rank's link since the cluster started.

        Read on the root-side veth, where the directions are mirrored: what the bridge port
        transmits the rank receives. Call before and after a workload to get its traffic.
        """
        return [(_read_counter(h.host_veth, "rx_bytes"), _read_counter(h.host_veth, "tx_bytes"))
                for h in self.hosts]

    def host_alloc_plan(self):
        """Horovod's slot plan: one host per rank, one slot per host (local_size 1)."""
        from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts

        hosts = parse_hosts(",".join(f"{h.hostname}:1" for h in self.hosts))
        return get_host_assignments(hosts, self.np)

    def horovod_env(self, rank: int) -> dict[str, str]:
        """The environment ``horovodrun --gloo`` would give ``rank`` (see gloo_run.launch_gloo)."""
        from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars

        slot = self.host_alloc_plan()[rank]
        env = {k: str(v) for k, v in create_slot_env_vars(slot).items()}
        env.update({k: str(v) for k, v in create_run_env_vars(
            self.bridge_address, [IFACE], self.rendezvous_port).items()})
        env["PYTHONUNBUFFERED"] = "1"  # as horovodrun does, so output interleaves sensibly
        return env

    # -- running

    def _launch_argv(self, h: _Host, command: Sequence[str], started: Path) -> list[str]:
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
        outputs: list[list[str]] = [[] for _ in self.hosts]
        readers: list[threading.Thread] = []
        killed = [False] * self.np
        timed_out = False
        first_failed = None
        start = time.monotonic()
        try:
            for h in self.hosts:
                started = started_dir / f"rank{h.rank}"
                procs.append(_RankProcess(subprocess.Popen(
                    self._launch_argv(h, command, started),
                    env={**base_env, **self.horovod_env(h.rank)},
                    cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, start_new_session=True,
                    preexec_fn=_die_with_parent), started))
            for h, p in zip(self.hosts, procs):
                t = threading.Thread(target=_pump, daemon=True,
                                     args=(p.proc.stdout, h.rank, outputs[h.rank], logs[h.rank],
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
            with _signals_deferred():
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
        ranks = [RankResult(rank=h.rank, hostname=h.hostname, address=h.address,
                            exit_code=_shell_status(p.proc.returncode), killed=killed[h.rank],
                            tx_bytes=after[h.rank][0] - before[h.rank][0],
                            rx_bytes=after[h.rank][1] - before[h.rank][1],
                            output="".join(outputs[h.rank]),
                            log_path=None if logs[h.rank] is None else logs[h.rank].name)
                 for h, p in zip(self.hosts, procs)]
        return RunResult(ranks=ranks, wall_seconds=wall, bandwidth_bps=self.bandwidth_bps,
                         timed_out=timed_out, first_failed_rank=first_failed)

    def _open_logs(self) -> list:
        if self.log_dir is None:
            return [None] * self.np
        self.log_dir.mkdir(parents=True, exist_ok=True)
        suffix = "" if self._runs == 1 else f".run{self._runs}"
        return [open(self.log_dir / f"rank.{h.rank}{suffix}.log", "w") for h in self.hosts]


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
