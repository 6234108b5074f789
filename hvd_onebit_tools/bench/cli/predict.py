"""`hvd-onebit bench predict`: the scale model's predictions from a calibration, a sweep, or
`--check` against `bench train` runs."""
from __future__ import annotations

import json

import click

from hvd_onebit.config import DEFAULT_BLOCK_SIZE

from ..report import report_head
from ..train import MODELS as TRAIN_MODELS
from .options import (FROZEN_FREEZE_FRACTION, MAX_MS, Finite, block_size_check, comma_list,
                      emit, need_two_ranks, np_option, out_option, parameter_count, plot_file,
                      rates, refresh_options)

# The most each option prices, far beyond any real job, so that every figure stays finite.
MAX_RANKS = 1 << 24
MAX_US = 1e7  # a latency or per-peer cost: 10 s
MAX_STEPS = 10**12
SPEEDUPS = (1e-6, 1e6)  # --kernel-speedup's; --host-speedup's lower bound (and inf)
MS, US = (Finite(min=0, priced=(None, MAX_MS)), Finite(min=0, priced=(None, MAX_US)))
STEPS = click.IntRange(1, MAX_STEPS)


def check_world(nps: list[int], ranks_per_node: int) -> None:
    """Every --np predicts a job that communicates, in whole nodes of --ranks-per-node."""
    need_two_ranks(nps, "a prediction")
    if max(nps) > MAX_RANKS:
        raise click.BadParameter(f"{max(nps)}: a prediction prices at most {MAX_RANKS:,} ranks",
                                 param_hint="--np")
    uneven = [n for n in nps if n % ranks_per_node]
    if uneven:
        raise click.BadParameter(f"{uneven} rank(s) do not fill whole nodes of "
                                 f"--ranks-per-node {ranks_per_node}", param_hint="--np")


# what --check reads from the command line; every other option describes a job to price, and
# --check prices each run with the job its report records
CHECK_OPTIONS = ("calibration", "compute_ms", "adam_ms", "check_dir", "plot", "as_json", "out")


def check_takes_only_its_own_options(ctx: click.Context) -> None:
    """Refuse options --check would ignore, naming them, rather than print pairs that look
    priced with them."""
    from click.core import ParameterSource

    ignored = [p.opts[0] for p in ctx.command.params
               if p.name not in CHECK_OPTIONS and p.name != "help"
               and ctx.get_parameter_source(p.name) not in (None, ParameterSource.DEFAULT)]
    if ignored:
        raise click.UsageError(f"--check prices each run with the job its report records "
                               f"(ranks, links, model, transport): {', '.join(ignored)} would "
                               "be ignored; drop them, or predict without --check")


@click.command("predict")
@click.option("--calibration", default=None, type=click.Path(dir_okay=False),
              help="Constants from `bench calibrate` [default: "
                   "~/.cache/hvd_onebit/calibration.json; without it, the one shipped in "
                   "the package (hvd_onebit_tools/bench/calibrate/predict_calibration.json), with a "
                   "note].")
@np_option(4, "Ranks (e.g. 8,16,...,1024 for a sweep).", sweep=True)
@click.option("--ranks-per-node", default=1, show_default=True, type=click.IntRange(min=1),
              help="Ranks per node (they share the node's link); 1: a link per rank.")
@click.option("--bandwidth", "bandwidths", default="1gbit", show_default=True, callback=rates,
              help="Link rate between nodes (each node's link), comma separated for a sweep.")
@click.option("--intra-bandwidth", default="unlimited", show_default=True,
              callback=lambda c, p, v: rates(c, p, v)[0], help="Each rank's link inside a node.")
@click.option("--latency-us", default=0.0, show_default=True, type=US,
              help="One-way link latency between nodes, microseconds.")
@click.option("--intra-latency-us", default=0.0, show_default=True, type=US,
              help="One-way latency inside a node, microseconds.")
@click.option("--params", default=None, callback=parameter_count,
              help="Parameters (e.g. 350M, 9.4e6; decimal, as model sizes are quoted: K, M, G "
                   "(or B) are 10^3, 10^6, 10^9, so 1M is 1,000,000); default: the --model's.")
@click.option("--model", "bench_model", default=None, type=click.Choice(TRAIN_MODELS),
              help="Take compute time (and parameters) from the calibration's measurement of "
                   "`bench train --model ...` at its default sizes: forward + backward and "
                   "Adam, each timed in lock-step as steps with collectives run them.")
@click.option("--compute-ms", default=None, type=MS,
              help="Compute per step: forward + backward + Adam (e.g. `bench train`'s local "
                   "step); with --check, every run's (for runs of a model the calibration did "
                   "not time).")
@click.option("--adam-ms", default=None, type=MS,
              help="Adam's part of --compute-ms, which the compressed step replaces by its "
                   "kernels [default: 0, no credit; with --model alone: calibrated].")
@click.option("--warmup-frac", default=FROZEN_FREEZE_FRACTION, show_default=True,
              type=Finite(0, 1),
              help="Share of the steps in 1-bit Adam's full-precision warmup, the variance "
                   "frozen after it (variance_refresh=None).")
@click.option("--run-steps", default=10000, show_default=True, type=STEPS,
              help="Steps in the run, for the whole-run figures counted in steps: the fixed "
                   "warmup (--warmup-frac) against the --variance-refresh setting.")
@refresh_options("The refresh setting each 1-bit row is also priced with",
                 "freeze_step of the refresh setting, as a share of --run-steps")
@click.option("--run-lengths", default=None, callback=lambda c, p, v: None if v is None else
              comma_list(STEPS, empty_ok=False)(c, p, v),
              help="Instead: a table (or --json) of the whole-run speed-up over Horovod fp32 "
                   "against run length (e.g. 1000,3000,10000,30000,100000) for 1-bit Adam at "
                   "--warmup-frac and the refresh setting, at each --np and --bandwidth; with "
                   "--plot, drawn against run length.")
@click.option("--colocated", is_flag=True,
              help="All ranks share this machine's cores (as on the emulated cluster): compute "
                   "and kernels at the speeds calibrated with that many processes at once.")
@click.option("--kernel-speedup", default=1.0, show_default=True,
              type=Finite(min=0, min_open=True, priced=SPEEDUPS),
              help="Divide the calibrated kernel and Adam times per element (a faster device).")
@click.option("--host-speedup", default=1.0, show_default=True,
              type=Finite(min=0, min_open=True, allow_inf=True, priced=(SPEEDUPS[0], None)),
              help="Divide the calibrated host cost per byte of collectives (copies, reductions,"
                   " TCP); 'inf' drops it (NIC offload).")
@click.option("--per-peer-us", default=None, type=US,
              help="Replace the calibrated per-peer cost of every collective (microseconds).")
@click.option("--transport", default="auto", show_default=True,
              type=click.Choice(["auto", "torch", "horovod"]),
              help="What carries 1-bit Adam's stages: torch.distributed (Gloo or NCCL; "
                   "hierarchical: collectives of each group) or Horovod's alltoall/allgather; "
                   "auto: torch, as transport='auto' picks in a job that is not elastic.")
@click.option("--hierarchical-ops", default="global", show_default=True,
              type=click.Choice(["global", "group"]),
              help="With --transport horovod: global: each hierarchical stage is a Horovod "
                   "alltoall of all ranks (with splits), as hvd_onebit/comm/hierarchical.py runs "
                   "them there; group: Horovod collectives of the node's ranks and of the ranks "
                   "with one local rank (process sets, which the library does not use).")
@click.option("--intra-node", default="auto", show_default=True,
              type=click.Choice(["auto", "network", "shared_memory"]),
              help="With torch's transport: the hierarchical stages inside a node over the "
                   "node's links (--intra-bandwidth: NVLink, PCIe) or through shared memory (a "
                   "barrier each); auto: the node's links when --intra-bandwidth gives their "
                   "rate (GPU nodes, whose CUDA tensors intra_node='auto' sends over them), else "
                   "shared memory (CPU ranks, as intra_node='auto' runs them).")
@click.option("--block-size", default=DEFAULT_BLOCK_SIZE, show_default=True,
              type=click.IntRange(min=0), callback=block_size_check,
              help="Elements per scale in the 1-bit rows, as the optimizer's block_size; 0: one "
                   "scale per chunk.")
@click.option("--methods", default="horovod_fp32,horovod_fp16,onebit,onebit_hierarchical",
              show_default=True, callback=comma_list(click.Choice(
                  ["horovod_fp32", "horovod_fp16", "onebit", "onebit_hierarchical",
                   "onebit_hierarchical_group", "ddp_adam", "ddp_onebit"]), empty_ok=False),
              help="Methods to predict (ddp_adam and ddp_onebit: the DDP face's rows under "
                   "`bench train`'s names, priced as horovod_fp32 and onebit on "
                   "torch.distributed; onebit_hierarchical_group: with --transport horovod, "
                   "the hierarchical scheme with its stages as Horovod collectives of their own "
                   "groups, which the library does not use; with --transport torch, the same as "
                   "onebit_hierarchical).")
@click.option("--check", "check_dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="Instead: compare predictions with every `bench train` report in this "
                   "folder named train_*.json (its --out file or --json output) and print each "
                   "pair.")
@click.option("--plot", default=None, type=click.Path(dir_okay=False), callback=plot_file,
              help="PNG: speed-up against ranks for a sweep, against run length with "
                   "--run-lengths, else each method's phases.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@out_option
def bench_predict(calibration, nps, ranks_per_node, bandwidths, intra_bandwidth, latency_us,
                  intra_latency_us, params, bench_model, compute_ms, adam_ms, warmup_frac,
                  run_steps, variance_refresh, refresh_freeze_frac, run_lengths, colocated,
                  kernel_speedup, host_speedup, per_peer_us, transport,
                  hierarchical_ops, intra_node, block_size, methods, check_dir, plot,
                  as_json, out) -> None:
    """Predict step time per phase, whole-run speed-up and bytes per rank of Horovod fp32/fp16,
    flat 1-bit and hierarchical 1-bit Adam (as hvd_onebit/comm/hierarchical.py runs it) from the
    constants `bench calibrate` measured. docs/predicting.md has the
    model and its assumptions."""
    from pathlib import Path

    from ..calibrate.files import check_calibration, chosen_path, load_or_shipped
    from ..predict.check import check_report, model_transport, priced_intra_node
    from ..predict.job import Cluster, Job
    from ..predict.model import Model, is_onebit
    from ..predict.runs import (RunSetting, add_run_figures, fp32_step_bytes, frozen_at,
                                print_run_lengths, run_length_sweep, sweep_clusters)
    from ..refresh import option_text, parse_variance_refresh
    from ..predict.sweep import crossovers, sweep
    from ..predict.tables import print_check, print_prediction

    if adam_ms is not None and compute_ms is not None and adam_ms > compute_ms:
        raise click.BadParameter(f"{adam_ms:g} ms is more than --compute-ms {compute_ms:g}, of "
                                 "which it is Adam's part", param_hint="--adam-ms")
    if plot and check_dir:
        raise click.UsageError("--plot draws a prediction; --check prints its pairs with the "
                               "runs and draws nothing: give one of them")
    if check_dir:
        check_takes_only_its_own_options(click.get_current_context())
    if run_lengths and not any(is_onebit(m) for m in methods):
        raise click.BadParameter(f"--run-lengths prices 1-bit Adam's runs: --methods "
                                 f"{','.join(methods)} names no onebit method",
                                 param_hint="--methods")
    try:
        refresh = parse_variance_refresh(variance_refresh)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--variance-refresh") from exc
    try:
        cal = load_or_shipped(calibration, note=lambda s: click.echo(s, err=True))
    except (FileNotFoundError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    if check_dir:
        reports = [json.loads(p.read_text()) for p in sorted(Path(check_dir).glob("train_*.json"))]
        if not reports:
            raise click.ClickException(f"no train_*.json in {check_dir}")
        check_calibration(cal, chosen_path(calibration),  # --check prices colocated runs
                          [r["rows"][0]["np"] for r in reports if r.get("rows")],
                          colocated=True, per_peer=False)
        if adam_ms is not None and compute_ms is None:
            raise click.BadParameter("Adam's share of --compute-ms: give --compute-ms too",
                                     param_hint="--adam-ms")
        try:
            result = check_report(reports, cal, None if compute_ms is None else compute_ms / 1e3,
                                  None if adam_ms is None else adam_ms / 1e3)
        except ValueError as exc:  # runs of a model the calibration did not time
            raise click.ClickException(str(exc)) from exc
        if not emit({**report_head("predict_check"), **result}, as_json, out):
            print_check(result)
        return
    if params is None and bench_model is None:
        raise click.BadParameter("give --params (and --compute-ms) or --model")
    if compute_ms is None and bench_model is None:
        raise click.BadParameter("give --compute-ms, or --model to use a calibrated bench model")
    check_world(nps, ranks_per_node)
    check_calibration(cal, chosen_path(calibration), nps, colocated=colocated,
                      per_peer=per_peer_us is not None)
    timed = cal["compute"][min(cal["compute"], key=int)]["models"]
    if bench_model is not None and bench_model not in timed:
        raise click.ClickException(f"the calibration timed no {bench_model} model (it has "
                                   f"{', '.join(sorted(timed)) or 'none'}): pass --params and "
                                   "--compute-ms, or run `hvd-onebit bench calibrate` again")
    n_params = params if params is not None else int(timed[bench_model]["params"])
    job = Job(params=n_params, model=bench_model,
              compute_s=None if compute_ms is None else compute_ms / 1e3,
              adam_s=None if adam_ms is None else adam_ms / 1e3, warmup_frac=warmup_frac,
              kernel_speedup=kernel_speedup, host_speedup=host_speedup)
    transport = model_transport({"transport": transport})
    if transport == "horovod" and "ddp_onebit" in methods:
        raise click.BadParameter("ddp_onebit is the DDP face's compressed step, which runs on "
                                 "torch.distributed: leave --transport at auto (or torch), or "
                                 "predict onebit", param_hint="--transport")
    if transport != "horovod" and hierarchical_ops != "global":
        raise click.BadParameter("it chooses how Horovod's collectives run the hierarchical "
                                 "stages, and the transport priced is torch.distributed's, "
                                 "whose stages are collectives of each group already: add "
                                 "--transport horovod", param_hint="--hierarchical-ops")
    try:
        intra_node = priced_intra_node(intra_node, transport, intra_bandwidth)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--intra-node") from exc
    model = Model(cal, None if per_peer_us is None else per_peer_us * 1e-6,
                  hierarchical_global_ops=hierarchical_ops == "global", transport=transport,
                  intra_node=intra_node, block_size=block_size or None)
    setting = RunSetting(run_steps, warmup_frac, refresh, refresh_freeze_frac)
    inputs = {"params": n_params, "compute_s": model.compute(job, Cluster(
                  nodes=nps[0], colocated=colocated))[0], "warmup_frac": warmup_frac,
              "run_steps": run_steps, "variance_refresh": option_text(refresh),
              "refresh_freeze_frac": refresh_freeze_frac,
              "ranks_per_node": ranks_per_node, "intra_bps": intra_bandwidth,
              "latency_s": latency_us * 1e-6, "intra_latency_s": intra_latency_us * 1e-6,
              "colocated": colocated, "kernel_speedup": kernel_speedup,
              "host_speedup": host_speedup, "per_peer_s": model.per_peer_s,
              "transport": transport, "hierarchical_ops": hierarchical_ops,
              "intra_node": intra_node}
    if adam_ms is not None and adam_ms / 1e3 > inputs["compute_s"]:
        raise click.BadParameter(f"{adam_ms:g} ms is more than the step's compute, "
                                 f"{inputs['compute_s'] * 1e3:.4g} ms (--model {bench_model}, as "
                                 "calibrated), of which it is Adam's part", param_hint="--adam-ms")
    head = f"{n_params / 1e6:,.0f}M params, compute {inputs['compute_s'] * 1e3:,.0f} ms/step"
    if run_lengths:
        clusters = sweep_clusters(nps, bandwidths, ranks_per_node, intra_bandwidth,
                                  latency_us * 1e-6, intra_latency_us * 1e-6, colocated)
        ms = ("horovod_fp32",) + tuple(m for m in methods if is_onebit(m))
        try:
            rows = run_length_sweep(model, job, clusters, run_lengths, setting, ms)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from exc
        del inputs["run_steps"]
        report = {**report_head("predict_run_lengths"), "calibration": cal.get("machine"),
                  "inputs": {**inputs, "run_lengths": run_lengths},
                  "note": model.hierarchical_note(intra_bandwidth),
                  "pricing": model.pricing_note(job), "rows": rows}
        if plot:
            from ..predict.plots import plot_run_lengths

            plot_run_lengths(rows, plot, f"{head} (predicted)\n1-bit Adam frozen at "
                             f"{frozen_at(warmup_frac, run_lengths)} (solid) vs variance_refresh="
                             f"{option_text(refresh)} frozen at "
                             f"{frozen_at(refresh_freeze_frac, run_lengths)} (dashed)")
            report["plot"] = plot
        if not emit(report, as_json, out):
            print_run_lengths(report)
        return
    try:
        rows = sweep(model, job, nps, bandwidths, ranks_per_node, intra_bandwidth,
                     latency_us * 1e-6, intra_latency_us * 1e-6, colocated, tuple(methods))
    except ValueError as exc:  # e.g. a version-2 calibration without torch.distributed ops
        raise click.ClickException(str(exc)) from exc
    for r in rows:
        cl = Cluster(nodes=r["nodes"], ranks_per_node=r["ranks_per_node"])
        add_run_figures(r["methods"], setting, fp32_step_bytes(job, cl))
    report = {**report_head("predict"), "calibration": cal.get("machine"), "inputs": inputs,
              "run_setting": setting.describe(), "note": model.hierarchical_note(intra_bandwidth),
              "pricing": model.pricing_note(job), "rows": rows, "crossovers": crossovers(rows)}
    if plot:
        from ...cluster.bandwidth import format_bandwidth
        from ..predict.plots import plot_phases, plot_sweep

        title = (f"{head}, {ranks_per_node} ranks/node (predicted); the run: "
                 f"{option_text(refresh)}, frozen at {refresh_freeze_frac:.0%}")
        if len(rows) > 1:
            plot_sweep(rows, plot, title)
        else:
            bw = rows[0]["inter_bps"]
            plot_phases(rows[0]["methods"], plot, f"{title}\n{rows[0]['np']} ranks, "
                        f"{format_bandwidth(int(bw)) if bw else 'unlimited'}")
        report["plot"] = plot
    if not emit(report, as_json, out):
        print_prediction(report)
