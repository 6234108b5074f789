"""The `hvd-onebit` console script: the CLI needs the tools extra (click); say so when it is
missing instead of a traceback. A benchmark's job that fails ends the command with what its
ranks said, without the command's own traceback around it."""
from __future__ import annotations

import importlib.util
import sys


def main() -> None:
    if importlib.util.find_spec("click") is None:
        sys.exit("hvd-onebit needs the tools extra: pip install './hvd_onebit[tools]' from a checkout (click)")
    from .cli import main as cli_main
    from .cluster.jobs import RankFailure

    try:
        cli_main()
    except RankFailure as exc:
        sys.exit(f"hvd-onebit: {exc}")
