"""Session-wide test set-up: a count of the processes the test session launches.

Every process this pytest process starts (``subprocess.Popen``, ``os.posix_spawn``,
``os.system``, ``os.fork``) is seen through an audit hook (:func:`sys.addaudithook`), sorted by
what it launches, and one line at the end of the session says how many of each kind ran:
``launches: 31 (horovodrun 9, mpirun 4, cli 3, other python 12, other 3 [ip 2, tc 1])``.
Launches made by the launched processes themselves (a launcher's ranks) are not counted.

This file uses only the standard library and pytest's own hooks, so the same file dropped into
another tree's tests/ counts that tree's launches.
"""
from __future__ import annotations

import collections
import os
import shlex
import sys

KINDS = ("horovodrun", "mpirun", "torchrun", "cli", "other python", "fork", "other")
_launches: collections.Counter = collections.Counter()
# the programs behind the "other" launches (ip, tc, ...), by name
_others: collections.Counter = collections.Counter()


def _argv(args) -> list[str]:
    """The launch's command line as a list of strings, whatever form it was given in."""
    if args is None:
        return []
    if isinstance(args, (str, bytes, os.PathLike)):
        text = os.fsdecode(args)
        try:
            return shlex.split(text)
        except ValueError:
            return text.split()
    return [os.fsdecode(a) if isinstance(a, (bytes, os.PathLike)) else str(a) for a in args]


def _is_python(program: str) -> bool:
    name = os.path.basename(program)
    return name.startswith("python") or program == sys.executable


def _unwrapped(argv: list[str]) -> list[str]:
    """The command line ``argv`` runs: a shell's ``-c`` line, and past ``env``, ``timeout``,
    ``nice`` prefixes."""
    argv = list(argv)
    while argv:
        name = os.path.basename(argv[0])
        if name in ("sh", "bash") and "-c" in argv[1:-1]:
            argv = _argv(argv[argv.index("-c") + 1])
        elif name in ("env", "nice", "timeout", "setsid", "stdbuf"):
            rest = argv[1:]
            while rest and (rest[0].startswith("-") or "=" in rest[0]
                            or (name in ("timeout", "nice") and rest[0][:1].isdigit())):
                rest = rest[1:]
            argv = rest
        else:
            break
    return argv


def classify(argv: list[str]) -> str:
    """Which of :data:`KINDS` the command line ``argv`` launches (a shell's ``-c`` line is
    looked into, as are ``env``, ``timeout`` and ``nice`` prefixes)."""
    argv = _unwrapped(argv)
    if not argv:
        return "other"
    name = os.path.basename(argv[0])
    if name == "horovodrun":
        return "horovodrun"
    if name in ("mpirun", "mpiexec", "orterun"):
        return "mpirun"
    if name == "torchrun":
        return "torchrun"
    if _is_python(argv[0]):
        if "-m" in argv[1:]:
            module = argv[argv.index("-m", 1) + 1] if argv.index("-m", 1) + 1 < len(argv) else ""
            if module == "torch.distributed.run":
                return "torchrun"
            if module == "hvd_onebit_tools.cli":
                return "cli"
        return "other python"
    return "other"


def _audit(event: str, args: tuple) -> None:
    if event == "subprocess.Popen":
        executable, argv = args[0], args[1]
        line = _argv(argv)
        if executable is not None and not line:
            line = [os.fsdecode(executable)]
    elif event in ("os.posix_spawn", "os.posix_spawnp"):
        if sys._getframe(1).f_code.co_filename.endswith("subprocess.py"):
            return  # subprocess.Popen's own way of starting a process: counted as that Popen
        line = _argv(args[1])
    elif event == "os.system":
        line = _argv(args[0])
    elif event == "os.fork":
        _launches["fork"] += 1
        return
    else:
        return
    try:
        kind = classify(line)
        if kind == "other":
            program = _unwrapped(line)
            _others[os.path.basename(program[0]) if program else "?"] += 1
    except Exception:  # noqa: BLE001 - counting must never break a launch
        kind = "other"
    _launches[kind] += 1


sys.addaudithook(_audit)


def launch_summary() -> str:
    """``launches: N (kind n, ...)`` for the launches seen so far, kinds in :data:`KINDS` order;
    the "other" launches' most frequent programs follow theirs in brackets."""
    parts = [f"{kind} {_launches[kind]}" for kind in KINDS if _launches[kind]]
    if _others:
        top = ", ".join(f"{name} {n}" for name, n in _others.most_common(4))
        parts[-1] += f" [{top}{', ...' if len(_others) > 4 else ''}]"
    total = sum(_launches.values())
    return f"launches: {total}" + (f" ({', '.join(parts)})" if parts else "")


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: ARG001 - pytest's hook
    terminalreporter.write_line(launch_summary())
