"""The emulated network: one namespace per host, veth links to a bridge, tbf on both ends.

Each host is:

* its own network namespace (``hob-<id>-r<rank>``) holding one interface, ``emu0``, the end of a
  veth pair whose other end (``hob<id>v<rank>``) is a port of a Linux bridge (``hobr<id>``) in the
  root namespace;
* an ``/etc/netns/<ns>/hosts`` file (``ip netns exec`` bind-mounts it over ``/etc/hosts``) mapping
  every ``node<r>`` to its address.

``tc qdisc ... tbf`` on *both* ends of every veth caps what each host can send and receive at the
requested rate, like a full-duplex NIC; ``unlimited`` installs no qdisc. A host may run several
ranks (a node): their traffic to each other goes to the host's own address, which the kernel
delivers over the namespace's loopback, so it never crosses the shaped link; ``intra_bandwidth``
shapes that loopback too (a stand-in for NVLink or PCIe; default unshaped).

Addresses come only from 198.18.0.0/15 (RFC 2544 benchmarking space): one free /24 per network;
the bridge is ``.1`` and rank ``r`` is ``.(r + 2)``. Nothing is routed off the machine.

A record of each live network is kept under ``/run/hvd-onebit-emulator`` so that one whose owner
was SIGKILLed is removed by the next network (or by :func:`cleanup_stale`).
"""
from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import random
import re
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from .bandwidth import DEFAULT_QUEUE_MS, tbf_params
from .system import EmulatorError, link_exists, read_counter, sh

ADDRESS_POOL = ipaddress.ip_network("198.18.0.0/15")  # the only addresses this module ever uses
IFACE = "emu0"  # the rank's interface name inside its namespace (HOROVOD_GLOO_IFACE)
MAX_RANKS = 253  # .2 ... .254 of one /24
STATE_DIR = Path("/run/hvd-onebit-emulator")
STARTED_PREFIX = "hob-started-"  # a run's folder of start markers, then the cluster id
NETNS_ETC = Path("/etc/netns")
_PREFIX = "hob"  # every name this module creates starts with it (h-vd o-ne b-it)


@dataclass(frozen=True)
class Host:
    rank: int
    hostname: str  # node<rank>, inside its own UTS namespace
    netns: str  # hob-<id>-r<rank>
    host_veth: str  # hob<id>v<rank>, the bridge port in the root namespace (<= 15 chars)
    address: str


@contextlib.contextmanager
def _state_lock():
    """Serialise subnet/name allocation and /etc/netns edits between concurrent networks."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _used_subnets() -> set[ipaddress.IPv4Network]:
    """The /24s of 198.18.0.0/15 already assigned to an interface in the root namespace."""
    out = sh("ip", "-4", "-o", "addr", "show").stdout
    used = set()
    for m in re.finditer(r"inet (\d+\.\d+\.\d+\.\d+)/", out):
        addr = ipaddress.ip_address(m.group(1))
        if addr in ADDRESS_POOL:
            used.add(ipaddress.ip_network(f"{addr}/24", strict=False))
    return used


# ----------------------------------------------------------------------------- stale networks


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
        if link_exists(veth):
            p = sh("ip", "link", "del", veth, check=False)
            if p.returncode and link_exists(veth):
                errors.append(f"veth {veth}: {p.stderr.strip()}")
    for ns in netns:
        if os.path.exists(f"/run/netns/{ns}"):
            p = sh("ip", "netns", "del", ns, check=False)
            if p.returncode and os.path.exists(f"/run/netns/{ns}"):
                errors.append(f"netns {ns}: {p.stderr.strip()}")
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    if bridge and link_exists(bridge):
        p = sh("ip", "link", "del", bridge, check=False)
        if p.returncode and link_exists(bridge):
            errors.append(f"bridge {bridge}: {p.stderr.strip()}")
    with contextlib.suppress(OSError):
        NETNS_ETC.rmdir()  # only if empty: other networks' entries keep it
    return errors


def cleanup_stale() -> list[str]:
    """Remove networks whose owning process is gone (e.g. it was SIGKILLed). Returns their ids."""
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
            for started in Path(tempfile.gettempdir()).glob(f"{STARTED_PREFIX}{state['id']}-*"):
                shutil.rmtree(started, ignore_errors=True)  # its run's start markers
            path.unlink(missing_ok=True)
            removed.append(state["id"])
    return removed


# ----------------------------------------------------------------------------- the network


class Network:
    """``np`` hosts on a bridge, links shaped at ``bandwidth_bps`` (None: unshaped), each host's
    loopback at ``intra_bandwidth_bps`` (None: unshaped).

    :meth:`create` builds it (about 0.1 s per host), :meth:`remove` tears it down (idempotent,
    safe after a partial :meth:`create`). ``log`` receives progress messages.
    """

    def __init__(self, np: int, bandwidth_bps: Optional[int],
                 queue_ms: float = DEFAULT_QUEUE_MS, log=lambda msg: None,
                 intra_bandwidth_bps: Optional[int] = None):
        self.np = np
        self.bandwidth_bps = bandwidth_bps
        self.intra_bandwidth_bps = intra_bandwidth_bps
        self.queue_ms = queue_ms
        self._log = log
        self.id = ""
        self.bridge = ""
        self.bridge_address = ""
        self._prefixlen = 24
        self.hosts: list[Host] = []
        self._created_veths: list[str] = []
        self._created_netns: list[str] = []
        self._bridge_created = False

    def create(self) -> None:
        with _state_lock():
            self._allocate()
            self._write_state()
            self._create_bridge()
        for host in self.hosts:
            self._create_host(host)
        self._write_hosts_files()

    def remove(self) -> list[str]:
        """Delete everything this network created; returns what could not be removed."""
        with _state_lock():
            errors = _remove_resources(self.bridge if self._bridge_created else None,
                                       self._created_veths, self._created_netns)
            if not errors and self.id:
                (STATE_DIR / f"{self.id}.json").unlink(missing_ok=True)
        return errors

    def counters(self) -> list[tuple[int, int]]:
        """Cumulative ``(tx_bytes, rx_bytes)`` of each host's link since the network was created.

        Read on the root-side veth, where the directions are mirrored: what the bridge port
        transmits the host receives.
        """
        return [(read_counter(h.host_veth, "rx_bytes"), read_counter(h.host_veth, "tx_bytes"))
                for h in self.hosts]

    # -- steps of create()

    def _allocate(self) -> None:
        """Pick an unused id (names) and /24 (addresses). Called under the state lock."""
        for _ in range(100):
            cid = secrets.token_hex(3)  # 6 hex digits: 'hob' + id + 'v' + rank fits in 15 chars
            if not link_exists(f"{_PREFIX}r{cid}") and not (STATE_DIR / f"{cid}.json").exists():
                break
        else:  # pragma: no cover
            raise EmulatorError("could not find an unused cluster id")
        used = _used_subnets()  # one `ip addr` for every candidate /24, not one each
        free = [n for n in ADDRESS_POOL.subnets(new_prefix=24) if n not in used]
        if not free:  # pragma: no cover
            raise EmulatorError("all 512 /24 subnets of 198.18.0.0/15 are in use")
        subnet = random.choice(free)
        base = subnet.network_address
        self.id = cid
        self.bridge = f"{_PREFIX}r{cid}"
        self.bridge_address = str(base + 1)
        self._prefixlen = subnet.prefixlen
        self.hosts = [Host(rank=r, hostname=f"node{r}", netns=f"{_PREFIX}-{cid}-r{r}",
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
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        # No IPv6 link-local addresses: their router/MLD chatter would pollute the byte counters.
        sh("ip", "link", "set", self.bridge, "addrgenmode", "none")
        sh("ip", "addr", "add", f"{self.bridge_address}/{self._prefixlen}", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")

    def _create_host(self, h: Host) -> None:
        self._log(f"rank {h.rank}: netns {h.netns}, {h.host_veth} <-> {IFACE} {h.address}")
        self._created_netns.append(h.netns)  # recorded first, as for the bridge
        sh("ip", "netns", "add", h.netns)
        # The peer is created directly inside the namespace, so 'emu0' never clashes in the root ns.
        self._created_veths.append(h.host_veth)
        sh("ip", "link", "add", h.host_veth, "type", "veth", "peer", "name", IFACE,
           "netns", h.netns)
        sh("ip", "link", "set", h.host_veth, "addrgenmode", "none")
        sh("ip", "-n", h.netns, "link", "set", IFACE, "addrgenmode", "none")
        sh("ip", "link", "set", h.host_veth, "master", self.bridge, "up")
        sh("ip", "-n", h.netns, "addr", "add", f"{h.address}/{self._prefixlen}", "dev", IFACE)
        sh("ip", "-n", h.netns, "link", "set", IFACE, "up")
        sh("ip", "-n", h.netns, "link", "set", "lo", "up")
        if self.bandwidth_bps is not None:
            tbf = tbf_params(self.bandwidth_bps, self.queue_ms).tc_args()
            # Root side shapes what the host receives, namespace side what it sends.
            sh("tc", "qdisc", "add", "dev", h.host_veth, "root", *tbf)
            sh("tc", "-n", h.netns, "qdisc", "add", "dev", IFACE, "root", *tbf)
        if self.intra_bandwidth_bps is not None:
            tbf = tbf_params(self.intra_bandwidth_bps, self.queue_ms).tc_args()
            sh("tc", "-n", h.netns, "qdisc", "add", "dev", "lo", "root", *tbf)

    def _write_hosts_files(self) -> None:
        """/etc/netns/<ns>/hosts: every node name -> its veth address (Gloo resolves hostnames).
        Each IPv4 address also under its IPv4-mapped IPv6 form, as a dual-stack socket (torch's
        TCPStore) sees its peers, with a name of its own: a name lookup of such an address
        misses the IPv4 line, falls through to DNS, which the namespace cannot reach, and torch
        warned of every connection; the names the job resolves keep their IPv4 address only."""
        named = [("127.0.0.1", "localhost"), (self.bridge_address, "emu-gateway")]
        named += [(h.address, h.hostname) for h in self.hosts]
        lines = [f"{a}\t{name}" for a, name in named]
        lines.insert(1, "::1\tlocalhost ip6-localhost ip6-loopback")
        lines += [f"::ffff:{a}\t{name}-ipv4-mapped" for a, name in named]
        text = "\n".join(lines) + "\n"
        with _state_lock():
            for h in self.hosts:
                d = NETNS_ETC / h.netns
                d.mkdir(parents=True, exist_ok=True)
                (d / "hosts").write_text(text)
