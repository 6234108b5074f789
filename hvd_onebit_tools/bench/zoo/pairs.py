"""Schemes against a base scheme, cell by cell: the zoo's answer to "is this variant worse
anywhere than the one it replaces?".

Two cells pair when they share family, learning-rate rule, seed, freeze setting, steps and batch
and differ only in the scheme. Per scheme the comparison gives how many of its cells have a
higher ratio to Adam than the base scheme's cell (a divergence counts as an infinite ratio, as in
:mod:`.report`), by how much at most, the median of the ratio of ratios, and the worst cells.

Cell by cell, any change of trajectory moves a final loss by a few percent either way, so the
comparison also groups the pairs over seeds (same cell but for the seed): a group is **worse
beyond seed noise** when the geometric mean of its ratio of ratios is above :data:`MARGIN` and
its mean log is more than :data:`NOISE_SE` standard errors above 0 (over at least two seeds),
i.e. the loss is consistent across seeds rather than one seed's draw. A group in which only
this scheme diverged counts as worse. Both readings are reported; the cell-by-cell one is the
stricter.
"""
from __future__ import annotations

import math
import statistics
from typing import Optional

PAIR_KEYS = ("family", "lr_rule", "seed", "freeze", "steps", "batch")
GROUP_KEYS = tuple(k for k in PAIR_KEYS if k != "seed")  # a cell over its seeds
WORST_SHOWN = 8
NOISE_SE = 2.0  # standard errors of the mean log ratio of ratios a group must be above 0
MARGIN = 1.01  # "worse by over 1%": a cell's, or a group's geometric mean, ratio of ratios
TARGET = 1.05  # a cell "over 1.05": its loss more than 5% above Adam's


def _pair_key(row: dict) -> tuple:
    return tuple(row.get(k) for k in PAIR_KEYS)


def _cell(row: dict) -> str:
    return f"{row['family']} {row['lr_rule']} seed {row['seed']} {row['freeze']}"


def against(rows: list[dict], base: str) -> dict:
    """Every other scheme of ``rows`` (:func:`.report.compare`'s) against ``base``, over the pairs
    where both cells have a ratio (Adam converged). Per scheme: ``pairs``, ``worse`` (cells whose
    ratio is above the base's), ``worse_by_over_1pct`` (above it by more than 1% of it),
    ``better_by_over_1pct`` (below it by more than 1% of it), ``newly_over_1_05`` and
    ``no_longer_over_1_05`` (cells over :data:`TARGET` here but not in the base, and the
    reverse), ``max_excess`` (the largest ratio - base ratio; inf where only this one diverged),
    ``median_ratio_of_ratios`` and ``worst`` (up to WORST_SHOWN cells, worst first); over seeds,
    ``seed_groups``, ``groups_worse_beyond_seed_noise`` and ``worst_groups`` (those groups,
    worst first: ``group``, ``seeds``, ``geo_mean_ratio_of_ratios``, ``se_of_mean_log``).

    Raises:
        ValueError: ``base`` has no cells in ``rows``.
    """
    base_rows = {_pair_key(r): r for r in rows if r["scheme"] == base and r["ratio"] is not None}
    if not base_rows:
        raise ValueError(f"no cells of base scheme {base!r} to compare with")
    out: dict[str, dict] = {}
    for scheme in dict.fromkeys(r["scheme"] for r in rows):
        if scheme == base:
            continue
        pairs = [(r, base_rows[_pair_key(r)]) for r in rows
                 if r["scheme"] == scheme and r["ratio"] is not None and _pair_key(r) in base_rows]
        excess = [(_excess(r["ratio"], b["ratio"]), r, b) for r, b in pairs]
        quotients = [r["ratio"] / b["ratio"] for r, b in pairs
                     if math.isfinite(r["ratio"]) and math.isfinite(b["ratio"])]
        worse = sorted((e for e in excess if e[0] > 0), key=lambda e: -e[0])
        out[scheme] = {
            "pairs": len(pairs),
            "worse": len(worse),
            "worse_by_over_1pct": sum(r["ratio"] > MARGIN * b["ratio"] for _, r, b in worse),
            "better_by_over_1pct": sum(MARGIN * r["ratio"] < b["ratio"] for r, b in pairs),
            "newly_over_1_05": sum(r["ratio"] > TARGET >= b["ratio"] for r, b in pairs),
            "no_longer_over_1_05": sum(b["ratio"] > TARGET >= r["ratio"] for r, b in pairs),
            "max_excess": worse[0][0] if worse else 0.0,
            "median_ratio_of_ratios": statistics.median(quotients) if quotients else None,
            "worst": [{"cell": _cell(r), "ratio": r["ratio"], "base_ratio": b["ratio"]}
                      for _, r, b in worse[:WORST_SHOWN]],
            **_over_seeds(pairs),
        }
    return out


def _over_seeds(pairs: list[tuple[dict, dict]]) -> dict:
    """The seed groups of ``pairs`` ((row, base row), both with a ratio) and those worse beyond
    seed noise (module docstring)."""
    groups: dict[tuple, list[tuple[dict, dict]]] = {}
    for r, b in pairs:
        groups.setdefault(tuple(r.get(k) for k in GROUP_KEYS), []).append((r, b))
    worse = []
    for members in groups.values():
        r0 = members[0][0]
        name = f"{r0['family']} {r0['lr_rule']} {r0['freeze']}"
        if any(math.isinf(r["ratio"]) and math.isfinite(b["ratio"]) for r, b in members):
            worse.append({"group": name, "seeds": len(members),
                          "geo_mean_ratio_of_ratios": math.inf, "se_of_mean_log": None})
            continue
        logs = [math.log(r["ratio"] / b["ratio"]) for r, b in members
                if math.isfinite(r["ratio"]) and math.isfinite(b["ratio"])]
        if len(logs) < 2:
            continue
        mean = statistics.fmean(logs)
        se = statistics.stdev(logs) / math.sqrt(len(logs))
        if math.exp(mean) > MARGIN and mean > NOISE_SE * se:
            worse.append({"group": name, "seeds": len(logs),
                          "geo_mean_ratio_of_ratios": math.exp(mean), "se_of_mean_log": se})
    worse.sort(key=lambda g: -g["geo_mean_ratio_of_ratios"])
    return {"seed_groups": len(groups), "groups_worse_beyond_seed_noise": len(worse),
            "worst_groups": worse[:WORST_SHOWN]}


def _excess(ratio: float, base_ratio: float) -> float:
    if math.isinf(ratio) and math.isinf(base_ratio):
        return 0.0  # both diverged: not worse
    return ratio - base_ratio


def print_against(result: dict, base: str, show: Optional[int] = None) -> None:
    """The comparison as lines of text, one block per scheme."""
    for scheme, s in result.items():
        med = s["median_ratio_of_ratios"]
        print(f"{scheme} against {base}: {s['worse']} of {s['pairs']} cells worse "
              f"({s['worse_by_over_1pct']} by over 1%), largest excess {s['max_excess']:.4f}, "
              f"median ratio of ratios " + ("-" if med is None else f"{med:.4f}"))
        print(f"  {s['better_by_over_1pct']} better by over 1%; over {TARGET:g}: "
              f"{s['newly_over_1_05']} newly, {s['no_longer_over_1_05']} no longer")
        for w in s["worst"][:show]:
            print(f"  {w['cell']}: {w['ratio']:.4f} vs {w['base_ratio']:.4f}")
        print(f"{scheme} against {base} over seeds: {s['groups_worse_beyond_seed_noise']} of "
              f"{s['seed_groups']} groups "
              f"worse beyond seed noise (geometric mean > {MARGIN:g} and > {NOISE_SE:g} standard "
              f"errors)")
        for g in s["worst_groups"][:show]:
            se = "-" if g["se_of_mean_log"] is None else f"{g['se_of_mean_log']:.4f}"
            print(f"  {g['group']} ({g['seeds']} seeds): ratio of ratios "
                  f"{g['geo_mean_ratio_of_ratios']:.4f}, standard error of the log {se}")
