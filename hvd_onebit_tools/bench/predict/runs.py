"""Whole runs counted in steps: 1-bit Adam with a ``variance_refresh`` schedule against 1-bit
Adam at a fixed warmup, over a run of ``S`` steps (`bench predict --run-steps`,
`--variance-refresh`, `--run-lengths`).

A refresh step is a full-precision step inside the compression phase (Horovod's fp32 allreduce,
then Adam's update from the exact average), priced as the warmup step is: the Horovod fp32
step. So a run frozen at ``F`` with ``R`` refreshes (:func:`hvd_onebit_tools.bench.refresh.run_steps`)
takes::

    run_s = (F + R) * t_fp32 + (S - F - R) * t_compressed
    speed-up over Horovod fp32 = S * t_fp32 / run_s
    bytes per rank = (F + R) * b_fp32 + (S - F - R) * b_compressed

The refresh setting freezes at ``round(refresh_freeze_frac * S)`` (at least 1); the fixed
setting at ``round(warmup_frac * S)`` with no refresh, the same rounding `bench train` uses.
The library's ``freeze_step`` is at least 1, so a fraction that rounds to step 0 is priced (and
printed, :func:`frozen_at`) as a freeze after step 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hvd_onebit.config import FREEZE_FRACTION
from hvd_onebit.layout import ring_allreduce_bytes
from hvd_onebit.variance_refresh import DOUBLING
from ..refresh import Option, freeze_step_for, option_text, run_steps
from .job import Cluster, Job
from .model import Model, is_onebit, priced_as


@dataclass
class RunSetting:
    """What the whole-run figures compare: ``run_steps`` steps, 1-bit Adam frozen at
    ``warmup_frac`` (no refresh) against ``variance_refresh`` frozen at
    ``refresh_freeze_frac``."""

    run_steps: int = 10000
    warmup_frac: float = 0.15
    variance_refresh: Option = "doubling"
    refresh_freeze_frac: float = FREEZE_FRACTION

    def describe(self) -> str:
        """The two settings in words, the refresh setting (the library's default unless
        changed) first."""
        S = [self.run_steps]
        return (f"a {self.run_steps:,}-step run with variance_refresh="
                f"{option_text(self.variance_refresh)} frozen at "
                f"{frozen_at(self.refresh_freeze_frac, S)}"
                f"{defaults_note(self.variance_refresh, self.refresh_freeze_frac)}; fixed: the "
                f"same run with variance_refresh=None frozen at {frozen_at(self.warmup_frac, S)}")


def defaults_note(variance_refresh: Option, freeze_frac: float) -> str:
    """Words to add where a refresh setting is the library's default (variance_refresh=
    "doubling" with freeze_step at 5% of the run, as the settings table recommends), else
    nothing."""
    default = (option_text(variance_refresh) == option_text(DOUBLING)
               and freeze_frac == FREEZE_FRACTION)
    return " (the library's default, as the docs recommend)" if default else ""


def frozen_at(frac: float, run_lengths: list[int]) -> str:
    """Where ``frac`` of each run freezes, as priced (:func:`freeze_step_for`: rounded, at least
    step 1, the library's least ``freeze_step``): 'step 500 (5%)' for one run length, '5% of
    each run' for several, saying where the rounding gives step 0 and step 1 is priced."""
    clamped = [S for S in run_lengths if round(frac * S) < 1]
    note = "freeze_step is at least 1"
    if len(run_lengths) == 1:
        S = run_lengths[0]
        F = freeze_step_for(frac, S)
        return f"step {F:,} ({100 * F / S:.3g}%" + (f", {note})" if clamped else ")")
    if len(clamped) == len(run_lengths):
        return f"step 1 of each run ({100 * frac:.3g}% rounds to 0; {note})"
    text = f"{100 * frac:.3g}% of each run"
    if clamped:
        text += f" (step 1 at {', '.join(f'{S:,}' for S in clamped)} steps: {note})"
    return text


def whole_run(steps: dict, fp32_step_s: float, compressed_step_s: float, fp32_bytes: float,
              compressed_bytes: float) -> dict:
    """``steps`` (:func:`run_steps`'s dict) priced: the run's seconds, its speed-up over a
    Horovod fp32 run of as many steps, and the bytes one rank sends over it."""
    fp, comp = steps["full_precision_steps"], steps["compressed_steps"]
    run_s = fp * fp32_step_s + comp * compressed_step_s
    return {**steps, "run_s": run_s,
            "run_speedup_vs_fp32": steps["run_steps"] * fp32_step_s / run_s,
            "bytes_per_rank_run": fp * fp32_bytes + comp * compressed_bytes}


def add_run_figures(methods: dict, setting: RunSetting, fp32_bytes: float) -> dict:
    """To each 1-bit row of ``predict_all``'s dict (which carries the fp32 step time as
    ``warmup_step_s``; ``fp32_bytes``: a Horovod fp32 step's bytes per rank): ``run_fixed`` and
    ``run_refresh`` (:func:`whole_run` of each setting), and the refresh setting against the
    fixed one (``refresh_vs_fixed_run_speedup``, ``refresh_vs_fixed_bytes``). Changes
    ``methods`` in place and returns it."""
    S = setting.run_steps
    fixed_steps = run_steps(S, freeze_step_for(setting.warmup_frac, S))
    refresh_steps = run_steps(S, freeze_step_for(setting.refresh_freeze_frac, S),
                              setting.variance_refresh)
    for name, row in methods.items():
        if not is_onebit(name):
            continue
        args = (row["warmup_step_s"], row["compression_step_s"], fp32_bytes,
                row["bytes_per_rank"])
        fixed, refresh = whole_run(fixed_steps, *args), whole_run(refresh_steps, *args)
        row["run_fixed"], row["run_refresh"] = fixed, refresh
        row["refresh_vs_fixed_run_speedup"] = fixed["run_s"] / refresh["run_s"]
        row["refresh_vs_fixed_bytes"] = refresh["bytes_per_rank_run"] / fixed["bytes_per_rank_run"]
    return methods


def fp32_step_bytes(job: Job, cl: Cluster) -> int:
    """Bytes one rank sends in a Horovod fp32 step (and so in a warmup or refresh step)."""
    return ring_allreduce_bytes(4 * job.params, cl.n)


def run_length_sweep(model: Model, job: Job, clusters: list[Cluster], run_lengths: list[int],
                     setting: RunSetting, methods=("horovod_fp32", "onebit")) -> list[dict]:
    """One row per (cluster, run length, 1-bit method): the whole-run speed-up over Horovod fp32
    at the fixed warmup and with the refresh schedule, their full-precision steps and bytes."""
    rows = []
    for cl in clusters:
        per_step = model.predict_all(job, cl, tuple(methods))
        for S in run_lengths:
            s = RunSetting(S, setting.warmup_frac, setting.variance_refresh,
                           setting.refresh_freeze_frac)
            ms = add_run_figures({k: dict(v) for k, v in per_step.items()}, s,
                                 fp32_step_bytes(job, cl))
            for name, row in ms.items():
                if not is_onebit(name):
                    continue
                fx, rf = row["run_fixed"], row["run_refresh"]
                rows.append({"np": cl.n, "ranks_per_node": cl.ranks_per_node,
                             "inter_bps": cl.inter_bps, "method": name, "run_steps": S,
                             "compressed_step_speedup_vs_fp32": row["step_speedup_vs_fp32"],
                             "fixed_full_precision_steps": fx["full_precision_steps"],
                             "fixed_run_speedup_vs_fp32": fx["run_speedup_vs_fp32"],
                             "refresh_freeze_step": rf["freeze_step"],
                             "refresh_steps": rf["refresh_steps"],
                             "refresh_full_precision_steps": rf["full_precision_steps"],
                             "refresh_run_speedup_vs_fp32": rf["run_speedup_vs_fp32"],
                             "refresh_vs_fixed_run_speedup": row["refresh_vs_fixed_run_speedup"],
                             "refresh_vs_fixed_bytes": row["refresh_vs_fixed_bytes"]})
    return rows


def sweep_clusters(nps, bandwidths_bps, ranks_per_node: int = 1, intra_bps=None,
                   inter_latency_s: float = 0.0, intra_latency_s: float = 0.0,
                   colocated: bool = False) -> list[Cluster]:
    """The clusters of `bench predict`'s grid (as :func:`.sweep.sweep` builds them)."""
    out = []
    for bps in bandwidths_bps:
        for n in nps:
            L = ranks_per_node if n % ranks_per_node == 0 and n >= ranks_per_node else 1
            out.append(Cluster(nodes=n // L, ranks_per_node=L, inter_bps=bps, intra_bps=intra_bps,
                               inter_latency_s=inter_latency_s, intra_latency_s=intra_latency_s,
                               colocated=colocated))
    return out


def print_run_lengths(report: dict, echo=None) -> None:
    """`bench predict --run-lengths`'s table."""
    import click

    from ..report import print_table
    from .tables import link_text

    echo = echo or click.echo
    inputs = report["inputs"]
    lengths = inputs["run_lengths"]
    echo(f"{inputs['params']:,} parameters, compute {inputs['compute_s'] * 1e3:,.1f} ms/step; "
         f"whole-run speed-up over Horovod fp32: refresh: variance_refresh="
         f"{inputs['variance_refresh']} frozen at "
         f"{frozen_at(inputs['refresh_freeze_frac'], lengths)}"
         f"{defaults_note(inputs['variance_refresh'], inputs['refresh_freeze_frac'])}; fixed: "
         f"variance_refresh=None frozen at "
         f"{frozen_at(inputs['warmup_frac'], lengths)}")
    if report.get("note") and any(priced_as(r["method"]) != "onebit" for r in report["rows"]):
        echo(report["note"])  # a hierarchical row: how its stages are priced
    table = [{**r, "bw": link_text(r["inter_bps"]),
              "fp": f"{r['refresh_full_precision_steps']:,} ({r['refresh_freeze_step']:,}"
                    f" + {r['refresh_steps']})"}
             for r in report["rows"]]
    print_table(table, [("np", "np", "d"), ("link", "bw", ""), ("method", "method", ""),
                        ("steps", "run_steps", ",d"),
                        ("compressed step x", "compressed_step_speedup_vs_fp32", ".2f"),
                        ("refresh: fp steps (F + R)", "fp", ""),
                        ("refresh: run x fp32", "refresh_run_speedup_vs_fp32", ".2f"),
                        ("fixed: fp steps", "fixed_full_precision_steps", ",d"),
                        ("fixed: run x fp32", "fixed_run_speedup_vs_fp32", ".2f"),
                        ("refresh / fixed, speed", "refresh_vs_fixed_run_speedup", ".2f"),
                        ("refresh / fixed, bytes", "refresh_vs_fixed_bytes", ".3f")])
    if report.get("pricing"):
        echo(report["pricing"])


def refresh_columns(row: dict) -> Optional[dict]:
    """The refresh setting's figures of one 1-bit row, for `bench predict`'s table."""
    rf = row.get("run_refresh")
    if rf is None:
        return None
    return {"run_ref_x": rf["run_speedup_vs_fp32"],
            "fp_steps": f"{rf['full_precision_steps']:,}/{rf['run_steps']:,}",
            "bytes_ratio": row["refresh_vs_fixed_bytes"]}
