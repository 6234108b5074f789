"""The zoo's report: every cell's held-out loss over Adam's, per scheme, as a table, JSON and a
heat map.

Input: the JSON lines the rank worker writes (one record per run). Each 1-bit cell is compared
with the Adam cell of the same family, learning-rate rule, seed, steps and batch:

* ``ratio`` = the cell's final held-out loss / Adam's (``metric="tail"``: the mean of the last
  evaluations instead of the last one, which is less noisy on short runs);
* a cell *diverged* if its loss was non-finite at any point or its final held-out loss is above
  its initial one; a diverged cell's ratio counts as infinite in every summary figure (median,
  maximum, cells over 1.05), so a scheme cannot look better by diverging;
* cells whose Adam run itself diverged are listed but left out of the summaries (the targets
  are about cells where Adam converges).

Per scheme the summary gives the zoo's three targets (no divergence where Adam converges,
median ratio <= 1.01, every cell <= 1.05), and per family the mean fraction of elements whose
step met the bound (how often it engages), the fraction held for a zero variance and where
``"auto"`` froze.

    python -m hvd_onebit_tools.bench.zoo.report results/zoo      # table, summary.json, heat map
"""
from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from typing import Iterable, Optional

from ..report import print_table, report_head
from . import pairs
from .grid import ADAM, FREEZES, LR_RULES, reference_key
from .models import FAMILIES
from .runner import RESULTS, read_cells

TARGET_MEDIAN = 1.01
TARGET_MAX = 1.05
METRICS = {"final": "final_loss", "tail": "tail_loss"}


def compare(records: Iterable[dict], metric: str = "final") -> list[dict]:
    """One row per 1-bit cell: the record's figures plus ``adam_loss``, ``ratio`` (inf where the
    cell diverged, None without a converged Adam run to compare with) and ``adam_converged``."""
    key = METRICS[metric]
    records = list(records)
    adam = {reference_key(r): r for r in records if r["method"] == ADAM}
    rows = []
    for r in records:
        if r["method"] == ADAM:
            continue
        ref = adam.get(reference_key(r))
        converged = ref is not None and not ref["diverged"] and ref.get(key) is not None
        row = dict(r, adam_loss=ref.get(key) if ref else None, adam_converged=converged,
                   adam_diverged=bool(ref and ref["diverged"]), loss=r.get(key))
        if r["diverged"] or row["loss"] is None:
            row["ratio"] = math.inf
        elif converged:
            row["ratio"] = row["loss"] / ref[key]
        else:
            row["ratio"] = None
        rows.append(row)
    return rows


def _median(values: list[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def _mean(values: Iterable[Optional[float]]) -> Optional[float]:
    vs = [v for v in values if v is not None]
    return sum(vs) / len(vs) if vs else None


def scheme_summary(rows: list[dict]) -> dict:
    """The targets' figures over one scheme's rows where Adam converged."""
    judged = [r for r in rows if r["adam_converged"]]
    ratios = [r["ratio"] for r in judged]
    finite = [x for x in ratios if math.isfinite(x)]
    divergences = [r for r in judged if r["diverged"]]
    median = _median(ratios)
    worst = max(ratios) if ratios else None
    return {
        "cells": len(rows), "judged": len(judged),
        "adam_diverged": sum(r["adam_diverged"] for r in rows),
        "divergences": len(divergences),
        "diverged_cells": [_cell_name(r) for r in divergences],
        "median_ratio": median, "max_ratio": worst,
        "max_finite_ratio": max(finite) if finite else None,
        "over_1_05": sum(x > TARGET_MAX for x in ratios),
        "targets": {"no_divergence": not divergences,
                    f"median_le_{TARGET_MEDIAN}": median is not None and median <= TARGET_MEDIAN,
                    f"every_cell_le_{TARGET_MAX}": worst is not None and worst <= TARGET_MAX},
    }


def family_summary(rows: list[dict]) -> dict:
    """Per family: how often the bound engaged, the held share, where auto froze, the ratios."""
    out: dict[str, dict] = {}
    for fam in dict.fromkeys(r["family"] for r in _order(rows)):
        mine = [r for r in rows if r["family"] == fam]
        auto = [r for r in mine if r["freeze"] == "auto" and r.get("freeze_step")]
        judged = [r["ratio"] for r in mine if r["adam_converged"]]
        out[fam] = {
            "clamped_fraction_mean": _mean(r.get("clamped_fraction") for r in mine),
            "input_clamped_fraction_mean": _mean(r.get("input_clamped_fraction") for r in mine),
            "clamped_fraction_max": max((r["clamped_max"] for r in mine
                                         if r.get("clamped_max") is not None), default=None),
            "held_fraction_mean": _mean(r.get("held_fraction") for r in mine),
            "auto_freeze_fraction": _mean(r["freeze_step"] / r["steps"] for r in auto),
            "median_ratio": _median(judged), "max_ratio": max(judged) if judged else None,
            "divergences": sum(r["diverged"] for r in mine if r["adam_converged"]),
        }
    return out


def summarize(records: Iterable[dict], metric: str = "final") -> dict:
    """Everything the report shows, as one JSON-able object (infinities as the string "inf")."""
    records = list(records)
    rows = compare(records, metric)
    schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    adam_runs = [r for r in records if r["method"] == ADAM]
    families = list(dict.fromkeys(r["family"] for r in records))
    return {
        "metric": metric,
        "runs": len(records),
        "adam": {"runs": len(adam_runs), "diverged": [_cell_name(r) for r in adam_runs
                                                      if r["diverged"]]},
        "schemes": {s: scheme_summary([r for r in rows if r["scheme"] == s]) for s in schemes},
        "families": {s: family_summary([r for r in rows if r["scheme"] == s]) for s in schemes},
        # wall seconds per run, and the CPU seconds of all its ranks (about what the run
        # takes on idle cores, times their number, whatever else the machine ran)
        "seconds": {"total": sum(r["seconds"] for r in records),
                    "per_family_mean": {f: _mean(r["seconds"] for r in records
                                                 if r["family"] == f) for f in families},
                    "cpu_per_family_mean": {f: _mean(r.get("cpu_seconds") for r in records
                                                     if r["family"] == f) for f in families}},
        "cells": [{k: r.get(k) for k in ("family", "lr_rule", "lr", "seed", "scheme", "freeze",
                                         "steps", "freeze_step", "loss", "adam_loss", "ratio",
                                         "diverged", "nonfinite_at", "clamped_fraction",
                                         "held_fraction", "skipped_steps", "seconds")}
                  for r in rows],
    }


def _cell_name(r: dict) -> str:
    what = "adam" if r["method"] == ADAM else f"{r['scheme']}/{r['freeze']}"
    return f"{r['family']} {r['lr_rule']} seed {r['seed']} {what}"


def json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else ("-inf" if x < 0 else "nan")
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def _ratio_text(r: dict) -> str:
    if r["diverged"]:
        return "DIV"
    return "?" if r["ratio"] is None else f"{r['ratio']:.3f}"


def _order(rows: list[dict]) -> list[dict]:
    # the families in the zoo's order (unknown names last, by name), then lr, scheme, freeze
    freezes, families = list(FREEZES), list(FAMILIES)
    return sorted(rows, key=lambda r: (families.index(r["family"]) if r["family"] in families
                                       else len(families), r["family"],
                                       LR_RULES.index(r["lr_rule"]),
                                       str(r["scheme"]), freezes.index(r["freeze"]), r["seed"]))


def print_report(summary: dict, rows: list[dict]) -> None:
    """The per-cell table (one line per family, lr, scheme and freeze; one ratio per seed) and
    the summaries."""
    groups: dict[tuple, list[dict]] = {}
    for r in _order(rows):
        groups.setdefault((r["family"], r["lr_rule"], r["scheme"], r["freeze"]), []).append(r)
    table = []
    for (fam, rule, scheme, freeze), rs in groups.items():
        table.append({
            "family": fam, "lr": f"{rule} {rs[0]['lr']:g}", "scheme": scheme, "freeze": freeze,
            "ratios": " ".join(_ratio_text(r) for r in rs),
            "adam": " ".join("?" if r["adam_loss"] is None else
                             ("DIV" if r["adam_diverged"] else f"{r['adam_loss']:.4f}")
                             for r in rs),
            "froze": " ".join(str(r.get("freeze_step")) for r in rs),
            "clamped": _mean(r.get("clamped_fraction") for r in rs),
            "held": _mean(r.get("held_fraction") for r in rs)})
    print(f"held-out loss ({summary['metric']}) over Adam's, same family, lr and seed "
          "(one figure per seed; DIV: diverged)")
    print_table(table, [("family", "family", ""), ("lr", "lr", ""), ("scheme", "scheme", ""),
                        ("freeze", "freeze", ""), ("ratio to Adam", "ratios", ""),
                        ("Adam loss", "adam", ""), ("froze at", "froze", ""),
                        ("clamped", "clamped", ".2%"), ("held", "held", ".2%")])
    print()
    srows = []
    for name, s in summary["schemes"].items():
        srows.append({"scheme": name, "judged": s["judged"], "div": s["divergences"],
                      "median": s["median_ratio"], "max": s["max_ratio"],
                      "over": s["over_1_05"],
                      "met": ", ".join(k for k, v in s["targets"].items() if v) or "none"})
    print("per scheme, over cells where Adam converged (a divergence counts as an infinite ratio)")
    print_table(srows, [("scheme", "scheme", ""), ("cells", "judged", "d"),
                        ("divergences", "div", "d"), ("median ratio", "median", ".4f"),
                        ("max ratio", "max", ".4f"), ("cells > 1.05", "over", "d"),
                        ("targets met", "met", "")])
    print()
    frows = [{"scheme": s, "family": f, **v} for s, fams in summary["families"].items()
             for f, v in fams.items()]
    print("per family: elements whose momentum met the input bound (preconditioned) and whose "
          "step met the step bound (mean, max over steps), elements held for a zero variance, "
          "where auto froze")
    print_table(frows, [("scheme", "scheme", ""), ("family", "family", ""),
                        ("input clamped", "input_clamped_fraction_mean", ".2%"),
                        ("clamped mean", "clamped_fraction_mean", ".2%"),
                        ("clamped max", "clamped_fraction_max", ".2%"),
                        ("held", "held_fraction_mean", ".2%"),
                        ("auto froze at", "auto_freeze_fraction", ".0%"),
                        ("median ratio", "median_ratio", ".4f"), ("max ratio", "max_ratio", ".4f"),
                        ("divergences", "divergences", "d")])
    if summary["adam"]["diverged"]:
        print("Adam itself diverged in: " + "; ".join(summary["adam"]["diverged"]))


def heat_map(rows: list[dict], path: Path, metric: str = "final") -> None:
    """One panel per scheme: rows family x lr rule, columns freeze setting x seed; colour the
    ratio to Adam on a log scale centred at 1; a diverged cell is grey with a black x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    schemes = list(dict.fromkeys(r["scheme"] for r in _order(rows)))
    lines = list(dict.fromkeys((r["family"], r["lr_rule"]) for r in _order(rows)))
    freezes = [f for f in FREEZES if any(r["freeze"] == f for r in rows)]
    seeds = sorted({r["seed"] for r in rows})
    cols = [(f, s) for f in freezes for s in seeds]
    fig, axes = plt.subplots(1, len(schemes), squeeze=False, layout="constrained",
                             figsize=(2.5 + (0.5 * len(cols) + 1.8) * len(schemes),
                                      1.8 + 0.42 * len(lines)))
    norm = TwoSlopeNorm(vmin=math.log(0.9), vcenter=0.0, vmax=math.log(1.25))
    cmap = matplotlib.colormaps["RdBu_r"].with_extremes(bad="0.8")
    lookup = {(r["scheme"], r["family"], r["lr_rule"], r["freeze"], r["seed"]): r for r in rows}
    image = None
    for ax, scheme in zip(axes[0], schemes):
        grid = np.full((len(lines), len(cols)), np.nan)
        for i, (fam, rule) in enumerate(lines):
            for j, (freeze, seed) in enumerate(cols):
                r = lookup.get((scheme, fam, rule, freeze, seed))
                if r is None:
                    continue
                if r["diverged"]:
                    ax.plot(j, i, "kx", markersize=9, mew=2)
                elif r["ratio"] is not None:
                    grid[i, j] = math.log(r["ratio"])
                    ax.text(j, i, f"{r['ratio']:.2f}", ha="center", va="center", fontsize=6.5,
                            color="white" if abs(grid[i, j]) > 0.1 else "black")
        image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=norm, aspect="auto")
        for k in range(1, len(freezes)):
            ax.axvline(k * len(seeds) - 0.5, color="black", lw=1.2)
        for i in range(1, len(lines)):
            if lines[i][0] != lines[i - 1][0]:
                ax.axhline(i - 0.5, color="black", lw=0.6)
        ax.set_xticks(range(len(cols)))
        ax.set_xticklabels([f"{f}\ns{s}" if s == seeds[0] else f"\ns{s}" for f, s in cols],
                           fontsize=7)
        ax.set_yticks(range(len(lines)))
        ax.set_yticklabels([f"{fam} {rule}" for fam, rule in lines], fontsize=8)
        ax.set_title(f"scheme: {scheme}", fontsize=10)
    cbar = fig.colorbar(image, ax=axes[0].tolist(), shrink=0.9)
    ticks = [0.9, 0.95, 1.0, 1.05, 1.1, 1.25]
    cbar.set_ticks([math.log(t) for t in ticks])
    cbar.set_ticklabels([f"{t:g}" for t in ticks])
    cbar.set_label(f"held-out loss ({metric}) / Adam's")
    fig.suptitle("convergence zoo: 1-bit Adam's held-out loss over Horovod Adam's (same family, "
                 "lr, seed); x: diverged", fontsize=10)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def write_report(out_dir: Path, metric: str = "final", plot: bool = True,
                 show: bool = True, against: Optional[str] = None) -> dict:
    """Read ``out_dir/cells.jsonl``; print the report; write ``summary.json`` and
    ``heat_map.png`` beside it. With ``against`` (a scheme), the summary's ``"against"`` holds
    every other scheme's cells compared pair by pair with that scheme's (:mod:`.pairs`).
    Returns the summary."""
    out_dir = Path(out_dir)
    records = read_cells(out_dir / RESULTS)
    if not records:
        raise FileNotFoundError(f"no zoo results in {out_dir / RESULTS}")
    summary = summarize(records, metric)
    # where the report was made (the runs' own commit is the caller's to record)
    summary["report_provenance"] = report_head("zoo")
    rows = compare(records, metric)
    if plot and rows:
        png = out_dir / "heat_map.png"
        heat_map(rows, png, metric)
        summary["plot"] = str(png)
    if against is not None:
        summary["against"] = {"base": against, "schemes": pairs.against(rows, against)}
    (out_dir / "summary.json").write_text(json.dumps(json_safe(summary), indent=1))
    if show:
        print_report(summary, rows)
        if against is not None:
            print()
            pairs.print_against(summary["against"]["schemes"], against)
        print(f"\nwrote {out_dir / 'summary.json'}" + (f" and {summary['plot']}"
                                                       if "plot" in summary else ""))
    return summary


def main(argv: Optional[list[str]] = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="The convergence zoo's report from its results.")
    p.add_argument("out_dir", help="the zoo's output folder (holding cells.jsonl)")
    p.add_argument("--metric", choices=sorted(METRICS), default="final")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    try:
        write_report(Path(args.out_dir), args.metric, plot=not args.no_plot)
    except FileNotFoundError as exc:
        sys.exit(str(exc))


if __name__ == "__main__":
    main()
