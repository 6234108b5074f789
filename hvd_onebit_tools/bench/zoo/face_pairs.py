"""One zoo against others cell by cell, e.g. the DDP face's cells against the Horovod face's
(``hvd-onebit bench dev zoo --against-face DIR``).

Two cells pair when they share family, learning-rate rule, seed, scheme, freeze setting, steps
and batch; each side's figure is its own ratio to its own Adam cell (:func:`.report.compare`:
a divergence counts as an infinite ratio). Over a group (the same cell over its seeds) this zoo
**stays within** the others' figures when none of its cells diverged and its largest ratio is at
most the largest ratio any of the others has in that group: the faces differ in the last bits
of their averaging (Horovod's grouped allreduce, DDP's bucketed Gloo allreduce), which moves a
run's loss by what a change of trajectory moves it, so a cell-by-cell equality is not expected.
Over seeds, as :mod:`.pairs` reads a scheme against a base, a group is **worse beyond seed
noise** against another when the geometric mean of its ratio of ratios is above
:data:`.pairs.MARGIN` and its mean log more than :data:`.pairs.NOISE_SE` standard errors above 0.
"""
from __future__ import annotations

import math
import statistics
from typing import Optional

from ..report import print_table
from .pairs import MARGIN, NOISE_SE
from .report import compare

PAIR_KEYS = ("family", "lr_rule", "seed", "scheme", "freeze", "steps", "batch")
GROUP_KEYS = tuple(k for k in PAIR_KEYS if k != "seed")


def _key(row: dict, keys: tuple) -> tuple:
    return tuple(row.get(k) for k in keys)


def _largest(values: list[Optional[float]]) -> Optional[float]:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def over_seeds(ours: list[Optional[float]], theirs: list[Optional[float]]) -> dict:
    """The ratio of ratios over the seeds both sides have: geometric mean, standard error of the
    mean log, and whether ours is worse beyond seed noise (a divergence of ours alone is)."""
    pairs = [(a, b) for a, b in zip(ours, theirs) if a is not None and b is not None]
    if any(math.isinf(a) and not math.isinf(b) for a, b in pairs):
        return {"geo_mean_ratio_of_ratios": math.inf, "se_of_mean_log": None,
                "worse_beyond_seed_noise": True}
    logs = [math.log(a / b) for a, b in pairs if math.isfinite(a) and math.isfinite(b)]
    if not logs:
        return {"geo_mean_ratio_of_ratios": None, "se_of_mean_log": None,
                "worse_beyond_seed_noise": None}
    mean = statistics.fmean(logs)
    se = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else None
    worse = (se is not None and math.exp(mean) > MARGIN and mean > NOISE_SE * se)
    return {"geo_mean_ratio_of_ratios": math.exp(mean), "se_of_mean_log": se,
            "worse_beyond_seed_noise": worse}


def against_faces(ours: list[dict], others: dict[str, list[dict]], metric: str = "final") -> dict:
    """``ours`` (a zoo's records) against each of ``others`` ({label: records}): ``cells``, one
    row per 1-bit cell of ours with its ratio and each other's (None where the other has no such
    cell), and ``groups``, each group's largest ratios, ``divergences`` (ours) and ``within``."""
    theirs = {label: {_key(r, PAIR_KEYS): r["ratio"] for r in compare(records, metric)}
              for label, records in others.items()}
    cells = []
    for r in compare(ours, metric):
        row = {k: r.get(k) for k in PAIR_KEYS}
        row.update(face=r.get("face"), ratio=r["ratio"], diverged=r["diverged"],
                   others={label: by.get(_key(r, PAIR_KEYS)) for label, by in theirs.items()})
        cells.append(row)
    groups: dict[tuple, dict] = {}
    for row in cells:
        g = groups.setdefault(_key(row, GROUP_KEYS), {
            **{k: row[k] for k in GROUP_KEYS}, "seeds": 0, "divergences": 0, "ratios": [],
            "others": {label: [] for label in others}})
        g["seeds"] += 1
        g["divergences"] += int(row["diverged"])
        g["ratios"].append(row["ratio"])
        for label, ratio in row["others"].items():
            g["others"][label].append(ratio)
    out = []
    for g in groups.values():
        ratios, by_other = g.pop("ratios"), g.pop("others")
        largest = _largest(ratios)
        others_largest = {label: _largest(v) for label, v in by_other.items()}
        bound = _largest(list(others_largest.values()))
        within = (g["divergences"] == 0 and largest is not None and bound is not None
                  and math.isfinite(largest) and largest <= bound)
        out.append({**g, "max_ratio": largest, "others_max_ratio": others_largest,
                    "within": within,
                    "over_seeds": {label: over_seeds(ratios, v) for label, v in by_other.items()}})
    return {"metric": metric, "others": list(others), "cells": cells, "groups": out,
            "divergences": sum(g["divergences"] for g in out),
            "within_every_group": bool(out) and all(g["within"] for g in out),
            "worse_beyond_seed_noise": [
                f"{g['family']} {g['lr_rule']} {g['scheme']}/{g['freeze']} against {label}"
                for g in out for label, o in g["over_seeds"].items()
                if o["worse_beyond_seed_noise"]]}


def _text(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return "DIV" if math.isinf(x) else f"{x:.3f}"


def _table(rows: list[dict]) -> None:
    print_table(rows, [(k, k, "") for k in rows[0]] if rows else [])


def print_against_faces(result: dict, label: str = "this zoo") -> None:
    """The cells side by side, then the groups."""
    others = result["others"]
    print(f"held-out loss ({result['metric']}) over each side's own Adam, cell by cell: "
          f"{label} against {', '.join(others)}")
    _table([{"family": c["family"], "lr": c["lr_rule"], "seed": str(c["seed"]),
             "scheme": c["scheme"], "freeze": c["freeze"], label: _text(c["ratio"]),
             **{o: _text(c["others"][o]) for o in others}} for c in result["cells"]])
    print()
    _table([{"family": g["family"], "lr": g["lr_rule"], "scheme": g["scheme"],
             "freeze": g["freeze"], "seeds": str(g["seeds"]), f"{label} max": _text(g["max_ratio"]),
             **{f"{o} max": _text(g["others_max_ratio"][o]) for o in others},
             **{f"vs {o} geo": _text(g["over_seeds"][o]["geo_mean_ratio_of_ratios"])
                for o in others},
             "divergences": str(g["divergences"]), "within": str(g["within"])}
            for g in result["groups"]])
    worse = result["worse_beyond_seed_noise"]
    print(f"\nworse beyond seed noise: {', '.join(worse) if worse else 'none'}")
