"""The tables `bench predict` prints: a prediction's rows per world size, bandwidth and method,
and `--check`'s pairs of predicted and measured step times."""
from __future__ import annotations


def run_seconds(row: dict) -> float:
    """A 1-bit row's whole run at the refresh setting (:func:`.runs.add_run_figures`), or its
    run at the fixed warmup where that was not priced."""
    refresh = row.get("run_refresh")
    return refresh["run_s"] if refresh else row["run_step_s"]


def print_prediction(report: dict, echo=None) -> None:
    """`bench predict`'s table: per world size, bandwidth and method."""
    import click

    from ..report import print_table
    from .model import GROUP_METHOD
    from .runs import refresh_columns
    from .sweep import flat_method

    echo = echo or click.echo
    table = []
    for r in report["rows"]:
        for m, p in r["methods"].items():
            table.append({"run_ref_x": p["run_speedup_vs_fp32"], **(refresh_columns(p) or {}),
                          "np": r["np"], "bw": link_text(r["inter_bps"]), "method": m,
                          "ms": p["step_s"] * 1e3,
                          "phases": " ".join(f"{k}={v * 1e3:,.1f}" for k, v in p["phases_s"].items()),
                          "mb": p["bytes_per_rank"] / 1e6, "step_x": p["step_speedup_vs_fp32"],
                          "run_x": p["run_speedup_vs_fp32"]})
    inputs = report["inputs"]
    per_node = inputs.get("ranks_per_node", 1)
    nodes = ("1 rank per node, each with its link (--ranks-per-node for nodes of several)"
             if per_node == 1 else f"{per_node} ranks per node, sharing its link")
    echo(f"{inputs['params']:,} parameters, compute {inputs['compute_s'] * 1e3:,.1f} ms/step, "
         f"{nodes}; {report['note']}")
    priced = {m for r in report["rows"] for m in r["methods"]}
    if "run_setting" in report:
        fp16 = ("; horovod_fp16: Horovod's fp16 compression, its casts and float16 sums priced "
                "at the calibration's speeds, slower than fp32 where they cost more than the "
                "halved bytes save (CPU hosts; --host-speedup)" if "horovod_fp16" in priced
                else "")
        echo("speed-ups over Horovod fp32 (the fp32 gradient allreduce, as DDP + Adam's"
             f"{fp16}); step: a compressed step's; run: {report['run_setting']}"
             " (fp steps: the run's full-precision steps, warmup + refreshes; bytes: per rank "
             "over the run, run / fixed)")
    print_table(table, [("np", "np", "d"), ("link", "bw", ""), ("method", "method", ""),
                        ("step ms", "ms", ",.1f"), ("MB/rank/step", "mb", ",.2f"),
                        ("step x", "step_x", ".2f"), ("run x", "run_ref_x", ".2f"),
                        ("fp steps", "fp_steps", ""), ("fixed: run x", "run_x", ".2f"),
                        ("bytes x fixed", "bytes_ratio", ".3f")])
    echo("phases (ms), per row: the step's time by phase")
    for t in table:
        echo(f"  np {t['np']}, {t['bw']}, {t['method']}: {t['phases']}")
    for bw, c in report["crossovers"].items():
        top = max(r["np"] for r in report["rows"] if str(r["inter_bps"]) == bw)

        def from_n(n, holds, never, method=None):  # n None: it never holds in this sweep
            if n is None:
                return f"{never} up to n={top}"
            if method is None:
                return f"{holds} from n={n}"
            # by how much there, over the run the table heads with (the refresh setting): a
            # margin of a few percent is within the model's error
            ms = next(r["methods"] for r in report["rows"]
                      if str(r["inter_bps"]) == bw and r["np"] == n)
            margin = run_seconds(ms[flat_method(ms)]) / run_seconds(ms[method]) - 1
            return f"{holds} from n={n} (by {margin:.0%} over the run there)"
        parts = []  # the verdicts of the methods priced
        if "flat_onebit_stops_paying_at" in c:
            parts.append(from_n(c["flat_onebit_stops_paying_at"], "flat 1-bit stops paying",
                                "flat 1-bit pays at every n"))
        if "hierarchical_beats_flat_from" in c and "onebit_hierarchical" in priced:
            parts.append(from_n(c["hierarchical_beats_flat_from"], "hierarchical beats flat",
                                "hierarchical does not beat flat", "onebit_hierarchical"))
        if "hierarchical_group_beats_flat_from" in c and GROUP_METHOD in priced:
            parts.append(from_n(c["hierarchical_group_beats_flat_from"],
                                "group hierarchical beats flat",
                                "group hierarchical does not beat flat", GROUP_METHOD))
        if parts:
            echo(f"link {link_text(bw)}: " + ", ".join(parts))
    if report.get("pricing"):
        echo(report["pricing"])


def link_text(bps) -> str:
    """A link rate in bit/s as the tables print it (a number, or its text as a crossover's key
    holds it; None or 0: unlimited)."""
    if bps in (None, "None") or not float(bps):
        return "unlimited"
    return f"{float(bps) / 1e9:g} Gbit/s"


def print_check(result: dict, echo=None) -> None:
    from ..report import print_table

    rows = [{**p, "pred_ms": p["predicted_s"] * 1e3, "meas_ms": p["measured_s"] * 1e3,
             "range": f"{p['measured_min_s'] * 1e3:,.1f}-{p['measured_max_s'] * 1e3:,.1f}",
             "ok": ("yes" if p["within"] else "NO") + f" ({p['bound']:.0%})"}
            for p in result["pairs"]]
    print_table(rows, [("np", "np", "d"), ("L", "ranks_per_node", "d"),
                       ("link", "bandwidth", ""), ("model", "model", ""),
                       ("method", "method", ""), ("phase", "phase", ""),
                       ("predicted ms", "pred_ms", ",.1f"), ("measured ms", "meas_ms", ",.1f"),
                       ("measured range", "range", ""), ("runs", "runs", "d"),
                       ("steps", "timed_steps", "d"),
                       ("pred/meas", "ratio", ".2f"), ("within", "ok", "")])
    import click

    echo = echo or click.echo
    if result.get("compute") == "given":
        echo("compute: --compute-ms (and --adam-ms) for every run, not the calibration's bench "
             "models")
    echo(f"{result['met']} of {result['total']} pairs within their bound; the methods' step times "
         f"(all but local, the compute input): {result['methods_met']} of "
         f"{result['methods_total']}; compressed steps: {result['compressed_met']} of "
         f"{result['compressed_total']}")
    echo("compressed steps, ms: predicted phases | measured breakdown (median over runs; "
         "'wait' is both stages' waits, and for onebit_hierarchical the node mean and compress too)")
    for p in result["pairs"]:
        if p["phase"] != "compression" or not p["predicted_phases_s"]:
            continue
        pred = " ".join(f"{k}={v * 1e3:.1f}" for k, v in p["predicted_phases_s"].items())
        meas = " ".join(f"{k}={v * 1e3:.1f}" for k, v in p["measured_breakdown_s"].items())
        echo(f"np={p['np']} L={p['ranks_per_node']} {p['bandwidth']} {p['model']} {p['method']}"
             f" ({p['transport']}): {pred} | {meas}")
