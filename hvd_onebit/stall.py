"""A watch on the optimizer's collective calls that do not return.

Every rank must take the same kind of step, with the same parameters, at the same call: a rank
whose peers are elsewhere (a checkpoint loaded on some ranks only, ``requires_grad`` changed on
some ranks only, one more ``step()`` or ``flush_error_feedback()`` on some ranks, uneven batches
under ``join()``) waits in its collectives for ever, and its peers in theirs. Horovod's stall
check sees only Horovod's own operations, and the 1-bit stages travel outside them; so while a
rank is inside ``step()`` or ``flush_error_feedback()``, or building the optimizer (its checks
are one collective), or (DDP face) DDP's own allreduce of a gradient bucket is in flight, one
thread per process watches the clock:

- after ``HVD_ONEBIT_STALL_WARNING_S`` seconds in one call (default 60; 0: never), or
  :data:`SLOWER` times the slowest call that returned so far if that is longer, it prints, once
  per call, which call this rank is in (the ``step()`` calls before it, the step count and
  kind of step, the trainable parameters) and the usual causes;
- after ``HVD_ONEBIT_STALL_SHUTDOWN_S`` seconds (default 0: never) it ends the process with exit
  status :data:`EXIT_STATUS`, so that the launcher ends the job (torchrun's ``--max-restarts``
  starts it again) instead of holding its machines.

So a job whose steps are slow (a very large model on a very slow link) is warned about at most
once, in its first call; raise the limit for such a job.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Optional

from .values import is_number

WARNING_VARIABLE = "HVD_ONEBIT_STALL_WARNING_S"
SHUTDOWN_VARIABLE = "HVD_ONEBIT_STALL_SHUTDOWN_S"
DEFAULT_WARNING_S = 60.0
EXIT_STATUS = 75
SLOWER = 10  # a call this many times slower than any before it is a stall, not a slow step

CAUSES = (
    "the other ranks are probably not in the same call: every rank must take the same kind of "
    "step with the same parameters. Usual causes: a checkpoint loaded on some ranks only (load "
    "it on every rank, or on rank 0 and broadcast it), requires_grad changed on some ranks "
    "only, one more step() or flush_error_feedback() on some ranks (uneven batches, join(), a "
    "rank that raised), several optimizers stepped in another order on some ranks, a "
    "parameter the forward uses on some ranks only in a DDP model built without "
    "find_unused_parameters=True, a rank busy alone between steps for longer than this "
    "limit (a checkpoint written or an evaluation run on rank 0 only: the others wait for it in "
    "their next collective), or a step slower than this limit")


def building(face: str, group: str) -> str:
    """How the watch names an optimizer being built (its checks are collective)."""
    return (f"building {face} (its checks compare every rank's parameters and options in one "
            f"collective over {group}: every rank of it must build the optimizer, with the same "
            f"{group})")


@dataclass(frozen=True)
class StallSettings:
    """Seconds in one call before the warning and before the shutdown (0: never)."""

    warning_s: float = DEFAULT_WARNING_S
    shutdown_s: float = 0.0

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> "StallSettings":
        """The settings the two variables give; a ValueError naming a variable whose value is
        not a finite number of seconds >= 0."""
        def seconds(name: str, default: float) -> float:
            text = environ.get(name, "").strip()
            if not text:
                return default
            try:
                value = float(text)
            except ValueError:
                value = float("nan")
            if not (is_number(value) and value >= 0):
                raise ValueError(f"hvd_onebit: {name}={text!r} is not a number of seconds >= 0 "
                                 "(0 turns it off)")
            return value

        return cls(seconds(WARNING_VARIABLE, DEFAULT_WARNING_S), seconds(SHUTDOWN_VARIABLE, 0.0))

    @property
    def on(self) -> bool:
        return self.warning_s > 0 or self.shutdown_s > 0


@dataclass
class _Call:
    describe: Callable[[], str]
    since: float
    warned: bool = False


@dataclass(frozen=True)
class Due:
    """What the watch must do now: print ``message``; with ``shutdown``, then end the process."""

    message: str
    shutdown: bool


class StallWatch:
    """The calls of one process, watched: a block of code (:meth:`watching`, the outermost one
    per thread: ranks as threads each have theirs), or an operation from :meth:`begin` to
    :meth:`end`, whatever thread ends it. :meth:`due` is the decision, apart from the thread that
    acts on it."""

    def __init__(self, settings: StallSettings, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self._clock = clock
        self._lock = threading.Lock()
        self._calls: dict[object, _Call] = {}  # a thread's id, or a begin() token -> its call
        self._started = False
        self._slowest = 0.0  # seconds, of the calls that returned

    @contextmanager
    def watching(self, describe: Callable[[], str]) -> Iterator[None]:
        """Watch the call inside; ``describe()`` names it in the message (called only then).
        A call inside a watched one is part of it."""
        me = threading.get_ident()
        outer = self.settings.on and me not in self._calls
        if outer:
            self._add(me, describe)
        try:
            yield
        finally:
            if outer:
                self.end(me)

    def begin(self, describe: Callable[[], str]) -> object:
        """Watch an operation until :meth:`end` is called with the token returned."""
        token = object()
        if self.settings.on:
            self._add(token, describe)
        return token

    def end(self, token: object) -> None:
        with self._lock:
            call = self._calls.pop(token, None)
            if call is not None:
                self._slowest = max(self._slowest, self._clock() - call.since)

    def _add(self, key: object, describe: Callable[[], str]) -> None:
        with self._lock:
            self._calls[key] = _Call(describe, self._clock())
            start, self._started = not self._started, True
        if start:
            self._start()

    def due(self, now: float) -> Optional[Due]:
        """What the watch must do at ``now``, if anything (a warning once per call; the call
        waiting longest first)."""
        with self._lock:
            if not self._calls:
                return None
            call = min(self._calls.values(), key=lambda c: c.since)
            waited = now - call.since
            s = self.settings
            shutdown = 0 < s.shutdown_s <= waited
            limit = max(s.warning_s, SLOWER * self._slowest)
            if not shutdown and (call.warned or s.warning_s <= 0 or waited < limit):
                return None
            call.warned = True
        try:
            name = call.describe()
        except Exception as exc:  # noqa: BLE001 - the watch must tell, whatever naming raised
            name = f"a watched call (naming it raised {type(exc).__name__})"
        what = f"{name} has not returned after {waited:.0f} s"
        if shutdown:
            return Due(f"hvd_onebit: {what}; ending this process (exit status {EXIT_STATUS}, "
                       f"{SHUTDOWN_VARIABLE}={s.shutdown_s:g}): {CAUSES}", True)
        ending = ("" if s.shutdown_s > 0 else
                  f". This rank waits on; {SHUTDOWN_VARIABLE}=SECONDS ends a stalled process "
                  "instead, so that the launcher ends or restarts the job")
        return Due(f"hvd_onebit: {what} ({WARNING_VARIABLE}={s.warning_s:g}"
                   + (f", {SLOWER} times the slowest call before it: {limit:.0f} s"
                      if limit > s.warning_s else "") + f"): {CAUSES}{ending}", False)

    def _start(self) -> None:
        s = self.settings
        tick = min(1.0, max(0.05, min(v for v in (s.warning_s, s.shutdown_s) if v > 0) / 10))
        threading.Thread(target=self._run, args=(tick,), daemon=True,
                         name="hvd_onebit stall watch").start()

    def _run(self, tick: float) -> None:
        while True:
            time.sleep(tick)
            due = self.due(self._clock())
            if due is None:
                continue
            sys.stderr.write(due.message + "\n")  # one write: ranks sharing a stream stay apart
            sys.stderr.flush()
            if due.shutdown:
                sys.stdout.flush()
                os._exit(EXIT_STATUS)


_WATCH: list[StallWatch] = []


def watch() -> StallWatch:
    """This process's watch, its settings read from the environment at the first call (a
    ValueError naming a bad variable: every optimizer asks for it when it is built)."""
    if not _WATCH:
        _WATCH.append(StallWatch(StallSettings.from_environment()))
    return _WATCH[0]
