"""``--variance-refresh`` as the benchmarks and examples take it, and a run's steps by kind.

One parser for every command line that sets ``variance_refresh`` (`bench predict`, `bench
train`, ``examples/train_*.py``, ``benchmarks/auto_freeze.py``): ``none``, ``doubling`` or a
JSON dict of :class:`~hvd_onebit.variance_refresh.RefreshSchedule`'s fields, validated by the
schedule itself, so a typo fails before any rank starts.

A run of ``S`` steps frozen at ``F`` with ``R`` refresh steps (``schedule.count(S, F)``) takes
``F + R`` full-precision steps (the warmup, then the refreshes: Horovod's fp32 allreduce and
Adam's update) and ``S - F - R`` compressed steps. :func:`run_steps` counts them.
"""
from __future__ import annotations

import json
from typing import Optional, Union

from hvd_onebit.variance_refresh import DOUBLING, RefreshSchedule

NONE = "none"
Option = Union[None, str, dict]


def parse_variance_refresh(text: Optional[str]) -> Option:
    """``"none"`` (or None, "") -> None; ``"doubling"`` -> "doubling"; a JSON object -> that
    dict. Raises ValueError naming what is wrong (the schedule's own checks included)."""
    if text is None:
        return None
    t = str(text).strip()
    if t.lower() in ("", NONE):
        return None
    if t.lower() == DOUBLING:
        return DOUBLING
    if not t.startswith("{"):
        raise ValueError(f"--variance-refresh must be {NONE}, {DOUBLING} or a JSON object of "
                         f"RefreshSchedule's fields, got {text!r}")
    try:
        option = json.loads(t)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--variance-refresh: not valid JSON ({exc}): {text!r}") from exc
    RefreshSchedule.from_option(option)  # raises on an unknown field or a bad value
    return option


def option_text(option: Option) -> str:
    """The inverse of :func:`parse_variance_refresh` (for command lines and summaries)."""
    if option is None:
        return NONE
    if isinstance(option, str):
        return option
    return json.dumps(option, sort_keys=True, separators=(",", ":"))


def freeze_step_for(frac: float, steps: int) -> int:
    """``freeze_step`` for a warmup fraction, as `bench train` and the examples round it."""
    return max(1, round(frac * steps))


def run_steps(run_steps: int, freeze_step: int, option: Option = None) -> dict:
    """A run's steps by kind: ``freeze_step`` (F, the warmup's full-precision steps, at most
    the run), ``refresh_steps`` (R), ``full_precision_steps`` (F + R) and
    ``compressed_steps`` (S - F - R)."""
    if run_steps < 1:
        raise ValueError(f"run_steps must be >= 1, got {run_steps}")
    F = min(max(0, int(freeze_step)), run_steps)
    schedule = RefreshSchedule.from_option(option)
    R = schedule.count(run_steps, F) if schedule is not None else 0
    return {"run_steps": run_steps, "freeze_step": F, "refresh_steps": R,
            "full_precision_steps": F + R, "compressed_steps": run_steps - F - R}


def whole_run_ceilings(fixed: dict, refreshed: dict) -> dict:
    """What bounds a refresh run's speed-up over a fixed-warmup run, from two ``bench train``
    rows of one job (each with its ``steps_by_kind``, ``warmup_step_s``, ``compression_step_s``
    and, for the refreshed one, ``refresh_step_s``): the speed-up it would reach if its refresh
    steps cost what a warmup step costs (``..._at_warmup_cost``), and if it took no
    full-precision step after its own warmup (``..._no_refreshes``) or none at all
    (``..._any_schedule``: every step compressed, the ceiling of any schedule; over a fixed run
    frozen at fraction w it is about ``w * r + (1 - w)``, r the ratio of a warmup step to a
    compressed one). Empty when a figure is missing."""
    try:
        warm, comp = refreshed["warmup_step_s"], refreshed["compression_step_s"]
        kinds, base = refreshed["steps_by_kind"], fixed["run_seconds"]
        steps, freeze = kinds["run_steps"], kinds["freeze_step"]
    except KeyError:
        return {}
    fp = kinds["full_precision_steps"]
    return {
        "warmup_over_compressed_step": warm / comp,
        "refresh_over_warmup_step": (refreshed["refresh_step_s"] / warm
                                     if refreshed.get("refresh_step_s") else None),
        "onebit_refresh_speedup_at_warmup_cost": base / (fp * warm + (steps - fp) * comp),
        "onebit_refresh_speedup_no_refreshes": base / (freeze * warm + (steps - freeze) * comp),
        "onebit_refresh_speedup_any_schedule": base / (steps * comp),
    }


def refresh_run_figures(name: str, refreshed: Optional[dict], fixed: Optional[dict],
                        baseline: Optional[dict], names: tuple, ceilings_prefix: str = "") -> dict:
    """A refresh method's whole run (``name``'s row ``refreshed``) against its face's Adam
    (``baseline``) and the fixed-warmup method (``fixed``), one per face in ``bench train``'s
    summary; ``names`` are those two's as the keys name them (baseline's, fixed's):
    ``{name}_run_speedup_vs_{each}``, ``{name}_bytes_vs_{fixed}`` (computed bytes per rank) and
    ``{name}_measured_bytes_vs_{fixed}`` (rank 0's emulated link; absent off the emulator), then
    :func:`whole_run_ceilings` against ``fixed``, each key after ``ceilings_prefix``. A figure
    whose rows are missing is left out."""
    out: dict = {}
    if not refreshed:
        return out
    baseline_name, fixed_name = names
    if baseline:
        out[f"{name}_run_speedup_vs_{baseline_name}"] = (baseline["run_seconds"]
                                                         / refreshed["run_seconds"])
    if not fixed:
        return out
    out[f"{name}_run_speedup_vs_{fixed_name}"] = fixed["run_seconds"] / refreshed["run_seconds"]
    for key, figure in (("bytes", "run_bytes_per_rank"),
                        ("measured_bytes", "run_measured_tx_bytes")):
        if refreshed.get(figure) and fixed.get(figure):
            out[f"{name}_{key}_vs_{fixed_name}"] = refreshed[figure] / fixed[figure]
    out.update({ceilings_prefix + k: v for k, v in whole_run_ceilings(fixed, refreshed).items()})
    return out


def optimizer_options(variance_refresh: Option = None, **options) -> dict:
    """``hvd_onebit.DistributedOptimizer``'s keyword arguments from options as the command lines
    hold them, flat: the research knobs (``compressor``, ``precondition``, ``step_bound``,
    ``zero_variance``, ``intra_node``, ``auto_freeze``) gathered into one
    ``experimental=Experimental(...)``, and a schedule's dict (``--variance-refresh '{...}'``)
    passed as ``variance_refresh="doubling"`` refined by ``Experimental(refresh_schedule=...)``."""
    from hvd_onebit import Experimental
    from hvd_onebit.config import MOVED

    knobs = {k: options.pop(k) for k in MOVED if k in options}
    if isinstance(variance_refresh, (dict, RefreshSchedule)):
        knobs["refresh_schedule"] = variance_refresh
        variance_refresh = DOUBLING
    options["variance_refresh"] = variance_refresh  # None: frozen, whatever the default
    if knobs:
        options["experimental"] = Experimental(**knobs)
    return options
