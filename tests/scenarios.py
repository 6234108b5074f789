"""Many scenarios in one multi-rank job, each failing on its own.

Launching a Horovod job is expensive, so a test module runs one job that goes through all its
scenarios. Left alone, one scenario's exception would end that job and turn every test of the
module into the same error. Instead the worker runs its scenarios through :func:`run_scenarios`,
which returns an exception as data (the scenario's name, the rank and the traceback text), and each
test asks :func:`scenario` for the results of the scenarios it checks: only the tests of the
scenario that raised fail, with the worker's traceback in their message.

What this cannot isolate: a scenario that raises on some ranks while the others wait in a
collective. Those wait until the job's timeout, and the module's fixture fails as before.
(Scenarios are SPMD code with shared inputs, so a bug usually raises on every rank alike.)
"""
from __future__ import annotations

import traceback
from typing import Any, Callable, Mapping

ERROR_KEY = "scenario_error"


def run_scenarios(scenarios: Mapping[str, Callable[[], Any]], rank: int | None = None) -> dict:
    """Worker side: ``{name: fn()}`` for every scenario, in order; a scenario that raises gives
    ``{"scenario_error": traceback text, "scenario": name, "rank": rank}`` and the next one runs."""
    out = {}
    for name, fn in scenarios.items():
        try:
            out[name] = fn()
        except Exception:  # noqa: BLE001 - any failure is that scenario's, reported as data
            out[name] = {ERROR_KEY: traceback.format_exc(), "scenario": name, "rank": rank}
    return out


def failure(value: Any) -> str | None:
    """The traceback text if ``value`` is a failed scenario's result, else None."""
    if isinstance(value, dict) and ERROR_KEY in value:
        return value[ERROR_KEY]
    return None


def scenario(results: list[dict], name: str) -> list[Any]:
    """Test side: scenario ``name``'s result on every rank, in rank order; fails the calling test
    (only it) with each failing rank's traceback if the scenario raised or never ran."""
    import pytest  # the workers import this module too, and have no need of pytest

    problems, values = [], []
    for rank, per_rank in enumerate(results):
        if name not in per_rank:
            problems.append(f"rank {rank}: scenario {name!r} did not run "
                            f"(ran: {list(per_rank)})")
            continue
        tb = failure(per_rank[name])
        if tb is not None:
            problems.append(f"rank {rank}: scenario {name!r} raised:\n{tb}")
        values.append(per_rank[name])
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)
    return values
