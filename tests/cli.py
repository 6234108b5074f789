"""The `hvd-onebit` command line run inside the test process, through click's CliRunner.

For the commands whose test needs no process of their own (``--help``, a bad argument, a
prediction): no interpreter and torch to start. A test that checks what a process boundary gives
(a launched job, the exit status of a real run) runs ``python -m hvd_onebit_tools.cli``.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

from click.testing import CliRunner, Result


def hvd_onebit(args: Sequence[str], env: Optional[Mapping[str, str]] = None) -> Result:
    """``hvd-onebit ARGS`` in this process: ``.exit_code``, ``.stdout``, ``.stderr``,
    ``.output`` (both) and ``.exception`` (an error click did not turn into a message)."""
    from hvd_onebit_tools.cli import main

    return CliRunner().invoke(main, list(args), env=dict(env or {}), prog_name="hvd-onebit")
