"""The `hvd-onebit` console script: the CLI needs the tools extra (click); say so when it is
missing instead of a traceback. A benchmark's job that fails ends the command with what its
ranks said, without the command's own traceback around it. In the commands that start jobs
(`bench`, `cluster`), SIGTERM (a scheduler's, `timeout`'s) unwinds as Ctrl-C does: the jobs
are stopped and the emulated cluster removed, and the command exits 143. Elsewhere (`check`,
a rank of a launched job among them) SIGTERM keeps its default: a process blocked in a
collective ends at once."""
from __future__ import annotations

import contextlib
import importlib.util
import sys


def main() -> None:
    if importlib.util.find_spec("click") is None:
        sys.exit("hvd-onebit needs the tools extra: pip install './hvd_onebit[tools]' from a checkout (click)")
    from .cli import main as cli_main
    from .cluster.jobs import LaunchError, RankFailure
    from .cluster.processes import EXIT_SIGTERM, Terminated, sigterm_unwinds

    words = [a for a in sys.argv[1:] if not a.startswith("-")]
    starts_jobs = bool(words) and words[0] in ("bench", "cluster")
    try:
        with sigterm_unwinds() if starts_jobs else contextlib.nullcontext():
            cli_main()
    except (RankFailure, LaunchError) as exc:
        sys.exit(f"hvd-onebit: {exc}")
    except Terminated:
        print("hvd-onebit: terminated (SIGTERM); the jobs it started were stopped",
              file=sys.stderr)
        sys.exit(EXIT_SIGTERM)
