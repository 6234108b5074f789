"""What the emulator needs from the machine: privileges, the ``ip``/``tc`` commands, counters."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading

_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21


class EmulatorError(RuntimeError):
    """The emulated cluster could not be set up (permissions, missing tools, a failed command)."""


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


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run one setup/teardown command (ip, tc); raise EmulatorError with its stderr on failure."""
    proc = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=30)
    if check and proc.returncode != 0:
        raise EmulatorError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): "
                            f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def link_exists(name: str) -> bool:
    return os.path.exists(f"/sys/class/net/{name}")


def read_counter(iface: str, name: str) -> int:
    with open(f"/sys/class/net/{iface}/statistics/{name}") as f:
        return int(f.read())


@contextlib.contextmanager
def signals_deferred():
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
