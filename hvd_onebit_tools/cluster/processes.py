"""The processes of a run on the emulated cluster: started in their namespaces, their output
pumped, each one's status as a shell reports it, and all of them killed together."""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1
EXIT_SIGTERM = 143  # 128 + SIGTERM, as a shell reports a command it ended


class Terminated(BaseException):
    """SIGTERM turned into an exception (:func:`sigterm_unwinds`), so that the same unwinding
    as Ctrl-C's stops the jobs a command started and removes its emulated cluster."""


def _raise_terminated(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the clean-up short
    raise Terminated()


@contextlib.contextmanager
def sigterm_unwinds():
    """While inside, SIGTERM raises :class:`Terminated` in the main thread; the previous
    handler is put back on the way out."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def die_with_parent() -> None:  # pragma: no cover - runs in the forked child
    """preexec_fn: SIGKILL the launcher if we die, which (via --kill-child) ends its PID ns."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def pump(stream, rank: int, sink: list[str], log, on_output) -> None:
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


def shell_status(returncode: Optional[int]) -> Optional[int]:
    """Popen's -N (killed by signal N) as a shell reports it, 128+N."""
    if returncode is not None and returncode < 0:
        return 128 - returncode
    return returncode


@dataclass
class RankProcess:
    """One rank's launcher process and the file its wrapper creates when the command starts."""

    proc: subprocess.Popen
    started: Path

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


def kill_ranks(procs: Sequence[RankProcess], kill_grace: float) -> list[bool]:
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
