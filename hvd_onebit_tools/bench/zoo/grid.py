"""The zoo's grid: which runs make up a zoo, and how one run (a cell) is named.

A cell is one training run: a family, a learning-rate rule, a seed, and either plain Horovod
Adam (the reference) or hvd_onebit at one freeze setting under one scheme. A scheme is a dict
of extra keyword arguments for :func:`hvd_onebit.DistributedOptimizer` (its research knobs in
one :class:`hvd_onebit.Experimental`), so comparing the compression phase's variants needs no
code here. A finished cell's record holds its options flat (:func:`options_record`), as JSON.
"""
from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, Iterable, Optional, Union

from hvd_onebit import Experimental

from .models import FAMILIES, family

BOUNDED = Experimental(step_bound="adam", precondition=True)
SCHEMES: dict[str, dict[str, Any]] = {
    # the library's compressed step with the variance frozen for the rest of the run
    # (variance_refresh=None, the other options the defaults): the preconditioned momentum
    # compressed, each step clamped at Adam's own bound
    "bounded": {"experimental": BOUNDED},
    # the paper's scheme: the momentum itself compressed, the unbounded frozen-variance step
    "unbounded": {"experimental": Experimental(step_bound=None, precondition=False)},
    # each mechanism alone, to choose between them
    "bound_only": {"experimental": Experimental(step_bound="adam", precondition=False)},
    "precondition_only": {"experimental": Experimental(step_bound=None, precondition=True)},
    # frozen-variance Adam with the exact average of the momentum (no compression), bounded as
    # "bounded" is: what a cell loses to freezing the variance alone, apart from the 1-bit scale
    "frozen_exact": {"experimental": replace(BOUNDED, compressor="none")},
    # finer scales (one per 512 elements: +1/16 of the 1-bit bytes), to tell a cell's loss to
    # the sign compression's scale granularity
    "bounded_blocks512": {"experimental": BOUNDED, "block_size": 512},
    "default": {},                       # whatever the installed hvd_onebit does by default
    # the defaults with finer scales (+1/16 of the 1-bit bytes at 512, +1/64 at 2048): the
    # scale granularity decided on the whole grid, the refresh schedule left as the default's
    "default_blocks512": {"block_size": 512},
    "default_blocks2048": {"block_size": 2048},
    "default_chunk": {"block_size": None},  # one scale per chunk: the coarsest, fewest bytes
    # what elements with a zero variance at the freeze cost: trained with Adam's eps as their
    # denominator, or with their parameter's smallest variance
    "bounded_eps": {"experimental": replace(BOUNDED, zero_variance="eps")},
    "bounded_floor": {"experimental": replace(BOUNDED, zero_variance="floor")},
    # the variance kept current: "bounded" with refresh steps, on a sparse schedule
    # (bounded_refresh: 16-step gaps growing after 4 refreshes) and on 0/1 Adam's doubling one
    # (bounded_refresh_doubling: variance_refresh="doubling", the tuning page's setting for
    # long runs); each cell against "bounded"'s
    "bounded_refresh": {"variance_refresh": "doubling", "experimental": replace(
        BOUNDED, refresh_schedule={"first_interval": 16, "updates_per_interval": 4})},
    "bounded_refresh_doubling": {"variance_refresh": "doubling", "experimental": BOUNDED},
    # what a refresh run gains or loses, one mechanism at a time: the exact momentum average
    # between refreshes (no compression), 512-element scales, the errors folded instead of
    # rescaled, 0/1 Adam's single variance update, the momentum itself compressed (no
    # preconditioning)
    "refresh_exact": {"variance_refresh": "doubling",
                      "experimental": replace(BOUNDED, compressor="none")},
    "refresh_fold": {"variance_refresh": "doubling", "experimental": replace(
        BOUNDED, refresh_schedule={"error_feedback": "fold"})},
    "refresh_single": {"variance_refresh": "doubling", "experimental": replace(
        BOUNDED, refresh_schedule={"variance_update": "single"})},
    "refresh_blocks512": {"variance_refresh": "doubling", "experimental": BOUNDED,
                          "block_size": 512},
    "refresh_unpreconditioned": {"variance_refresh": "doubling",
                                 "experimental": Experimental(step_bound="adam",
                                                              precondition=False)},
}
# Null changes, not schemes of the library's: "bounded" with the compression phase's learning
# rate scaled by a factor too close to 1 to matter (the warmup is untouched, so the freeze sees
# the same state). Against "bounded" (``--against bounded``), the cells a null change moves by
# more than 1% are the zoo's cell-by-cell floor: what a change of trajectory gains or loses by
# chaos alone, which a real scheme's count against the same base is to be read beside.
COMPRESSION_LR_FACTORS: dict[str, float] = {"null_lr_up_1ppm": 1.0 + 1e-6,
                                             "null_lr_down_1ppm": 1.0 - 1e-6}
SCHEMES.update({name: dict(SCHEMES["bounded"]) for name in COMPRESSION_LR_FACTORS})
DEFAULT_SCHEMES = ("bounded", "unbounded")
# Freeze settings: a fraction of the run's steps, or "auto" (bounded so it always compresses).
FREEZES: dict[str, Union[float, str]] = {"10%": 0.1, "20%": 0.2, "50%": 0.5, "auto": "auto"}
# Learning-rate rules: Horovod's convention (scale by the number of ranks) and the base rate.
LR_RULES = ("scaled", "base")
ADAM = "adam"
CELL_KEYS = ("family", "lr_rule", "seed", "method", "scheme", "freeze", "steps", "batch")


def freeze_options(freeze: str, steps: int) -> dict[str, Any]:
    """hvd_onebit.DistributedOptimizer's freeze arguments for a freeze setting of a run of
    ``steps``. "auto" waits at least ``max(10, steps // 10)`` steps (at most half the run)
    and at most half the run, so a short run always reaches the compression phase."""
    value = FREEZES[freeze]
    if value == "auto":
        half = steps // 2
        return {"freeze_step": "auto",
                "auto_freeze": {"min_steps": min(max(10, steps // 10), half), "max_steps": half}}
    return {"freeze_step": max(1, round(value * steps))}


def optimizer_options(cell: dict) -> dict:
    """hvd_onebit.DistributedOptimizer's options for a 1-bit cell: its scheme's and its freeze
    setting's, the automatic freeze's settings joining the scheme's Experimental."""
    options = {**freeze_options(cell["freeze"], cell["steps"]), **cell.get("options", {})}
    if not on_defaults(cell):  # a scheme that names no refresh keeps the variance frozen
        options.setdefault("variance_refresh", None)
    auto = options.pop("auto_freeze", None)
    if auto is not None:
        options["experimental"] = replace(experimental(cell), auto_freeze=auto)
    return options


def on_defaults(cell: dict) -> bool:
    """Whether a cell's scheme is the library's defaults ("default", or "default_" and what it
    changes), whose refresh schedule is the default's rather than a frozen variance."""
    scheme = cell.get("scheme") or ""
    return scheme == "default" or scheme.startswith("default_")


def experimental(cell: dict) -> Experimental:
    """The research knobs a cell runs with (the library's defaults where its scheme sets none)."""
    return cell.get("options", {}).get("experimental") or Experimental()


def options_record(options: dict) -> dict:
    """A scheme's options as a record holds them (JSON): the Experimental knobs that differ from
    their defaults beside the other options, flat."""
    record = {k: v for k, v in options.items() if k != "experimental"}
    knobs = options.get("experimental")
    if knobs is not None:
        record.update({f.name: getattr(knobs, f.name) for f in fields(knobs)
                       if getattr(knobs, f.name) != f.default})
    return record


def learning_rate(base_lr: float, rule: str, world: int) -> float:
    """The learning rate of ``rule``: ``base_lr * world`` (Horovod's) or ``base_lr``."""
    if rule not in LR_RULES:
        raise ValueError(f"unknown lr rule {rule!r}; choose from {', '.join(LR_RULES)}")
    return base_lr * world if rule == "scaled" else base_lr


def cell_key(cell: dict) -> tuple:
    """What identifies a cell (a finished record or a planned one)."""
    return tuple(cell.get(k) for k in CELL_KEYS)


def reference_key(cell: dict) -> tuple:
    """The Adam cell a cell is compared with: same family, lr rule, seed, steps and batch."""
    return (cell["family"], cell["lr_rule"], cell["seed"], cell["steps"], cell["batch"])


def plan_family(name: str, seeds: Iterable[int], schemes: Iterable[str],
                freezes: Iterable[str] = tuple(FREEZES), lr_rules: Iterable[str] = LR_RULES,
                steps: Optional[int] = None, batch: Optional[int] = None,
                adam: bool = True) -> list[dict]:
    """The cells of one family, in the order a job runs them: per (lr rule, seed), Adam first,
    then every scheme at every freeze setting."""
    fam = family(name)
    steps = steps or fam.steps
    batch = batch or fam.batch
    schemes, freezes = list(schemes), list(freezes)
    for s in schemes:
        if s not in SCHEMES:
            raise ValueError(f"unknown scheme {s!r}; choose from {', '.join(SCHEMES)}")
    for f in freezes:
        if f not in FREEZES:
            raise ValueError(f"unknown freeze setting {f!r}; choose from {', '.join(FREEZES)}")
    cells = []
    for rule in lr_rules:
        learning_rate(fam.base_lr, rule, 1)  # validates the rule
        for seed in seeds:
            common = {"family": name, "lr_rule": rule, "seed": int(seed), "steps": steps,
                      "batch": batch}
            if adam:
                cells.append({**common, "method": ADAM, "scheme": None, "freeze": None})
            for scheme in schemes:
                for freeze in freezes:
                    cells.append({**common, "method": "onebit", "scheme": scheme,
                                  "freeze": freeze, "options": dict(SCHEMES[scheme]),
                                  **_null_change(scheme)})
    return cells


def _null_change(scheme: str) -> dict[str, float]:
    """The worker's extra key for a null change (``COMPRESSION_LR_FACTORS``), else nothing."""
    factor = COMPRESSION_LR_FACTORS.get(scheme)
    return {} if factor is None else {"compression_lr_factor": factor}


def all_families() -> list[str]:
    return list(FAMILIES)
