"""`hvd-onebit bench train`: end-to-end training steps per method and phase, samples/s and
bytes."""
from __future__ import annotations

import sys

import click
from click.core import ParameterSource

from hvd_onebit.transport.registry import TRANSPORTS

from ..report import print_table, report_head
from ..train import MALLOC_REUSE_ENV
from ..train import DEFAULT_METHODS as TRAIN_DEFAULT_METHODS
from ..train import METHODS as TRAIN_METHODS
from ..train import MODELS as TRAIN_MODELS
from ..train import REFRESH_METHODS
from ..train import WAITS as TRAIN_WAITS
from ..world import HOROVOD_FREE
from .options import (FROZEN_FREEZE_FRACTION, Finite, block_size_check, check_real_cluster,
                      cluster_for, comma_list, emit, link_rate, need_two_ranks, nodes_options,
                      np_option, out_option, plot_file, queue_option, real_cluster_options,
                      refresh_options)

POSITIVE = click.IntRange(min=1)


def _without_horovod(methods: list, hosts) -> list:
    """Where Horovod does not import, the methods that run without it, under torchrun: the
    default list's (with a note), or the user's; a method that needs Horovod is refused,
    naming the ones that do not."""
    needs = [m for m in methods if m not in HOROVOD_FREE]
    if hosts:
        raise click.UsageError("--hosts runs its ranks through horovodrun, and Horovod does not "
                               f"import in this Python ({sys.executable})")
    if not needs:
        return methods
    if click.get_current_context().get_parameter_source("methods") is ParameterSource.DEFAULT:
        kept = [m for m in methods if m in HOROVOD_FREE]
        click.echo(f"note: Horovod does not import in this Python: {', '.join(needs)} left "
                   f"out, {', '.join(kept)} run under torchrun", err=True)
        return kept
    raise click.BadParameter(f"{', '.join(needs)} need{'s' if len(needs) == 1 else ''} "
                             "Horovod, which does not import in this "
                             f"Python ({sys.executable}): install it (docs/install.md), or "
                             f"choose from {', '.join(HOROVOD_FREE)}, which run under torchrun",
                             param_hint="--methods")


def refresh_share_note(kinds: dict, refresh, freeze_frac: float, long_run: int = 10000,
                       method: str = "onebit_refresh") -> str:
    """How many of this run's steps the refresh setting took in full precision (``method``,
    one of :data:`..train.REFRESH_METHODS`), beside the share it takes over a long run: a
    short run's whole-run figure is mostly full-precision steps, and says little about a
    training run's."""
    from ..refresh import freeze_step_for, run_steps

    long = run_steps(long_run, freeze_step_for(freeze_frac, long_run), refresh)
    return (f"{method}: {kinds['full_precision_steps']} of {kinds['run_steps']} steps in "
            f"full precision (warmup {kinds['freeze_step']}, refreshes "
            f"{kinds['refresh_steps']}); the same setting over {long_run:,} steps takes "
            f"{long['full_precision_steps']:,} ({long['full_precision_steps'] / long_run:.1%}): "
            "`bench predict --run-steps N` prices a run of yours")


def _check_warmups(methods, steps: int, warmup_frac: float, refresh_freeze_frac: float) -> None:
    """Each 1-bit method needs a warmup step and a compression step within ``steps``: refused
    before the run, naming the option, rather than a run whose summary has no compressed step."""
    from ..refresh import freeze_step_for
    from ..train import ONEBIT_METHODS

    from ..train_ddp import DDP_ONEBIT_METHODS

    checks = [("--warmup-frac", warmup_frac,
               [m for m in methods if m in ONEBIT_METHODS + DDP_ONEBIT_METHODS
                and m not in REFRESH_METHODS]),
              ("--refresh-freeze-frac", refresh_freeze_frac,
               [m for m in methods if m in REFRESH_METHODS])]
    for option, frac, users in checks:
        freeze = freeze_step_for(frac, steps)
        if users and freeze >= steps:
            raise click.BadParameter(
                f"{frac} x --steps {steps} freezes at step {freeze}, leaving no compressed step "
                f"for {', '.join(users)}: give a smaller fraction or more --steps",
                param_hint=option)


@click.command("train")
@np_option(4, "Ranks (2 or more).")
@click.option("--bandwidth", default="1gbit", show_default=True, callback=link_rate,
              help="Emulated link rate (e.g. 100mbit, 1gbit, 10gbit, unlimited); 'local' runs "
                   "plain horovodrun on loopback. Emulation needs root.")
@click.option("--steps", default=40, show_default=True, type=click.IntRange(min=2),
              help="Optimizer steps per method (each phase's median leaves out its first step "
                   "when the phase has 3 or more).")
@click.option("--warmup-frac", default=FROZEN_FREEZE_FRACTION, show_default=True,
              type=Finite(0, 1),
              help="The onebit and ddp_onebit methods' warmup (variance_refresh=None): "
                   "freeze_step = warmup_frac * steps.")
@refresh_options("onebit_refresh's and ddp_onebit_refresh's variance_refresh",
                 "onebit_refresh's and ddp_onebit_refresh's warmup: freeze_step = "
                 "refresh_freeze_frac * steps")
@click.option("--model", default="embedding", show_default=True, type=click.Choice(TRAIN_MODELS),
              help="mlp: a wide MLP (width x depth). embedding: an embedding-bag table "
                   "(vocab x embed-dim, dense gradient) with an MLP head of --width.")
@click.option("--width", default=2048, show_default=True, type=POSITIVE, help="MLP hidden width.")
@click.option("--depth", default=3, show_default=True, type=click.IntRange(min=0),
              help="MLP hidden layers.")
@click.option("--vocab", default=32768, show_default=True, type=POSITIVE,
              help="Embedding rows (--model embedding).")
@click.option("--embed-dim", default=256, show_default=True, type=POSITIVE,
              help="Embedding width (--model embedding).")
@click.option("--tokens", default=2048, show_default=True, type=POSITIVE,
              help="Token ids per sample (--model embedding).")
@click.option("--batch-size", "--batch", "batch", default=4, show_default=True, type=POSITIVE,
              help="Samples per rank per step (--batch: the same).")
@click.option("--malloc", "malloc_mode", default="reuse", show_default=True,
              type=click.Choice(["reuse", "system"]),
              help="reuse: the ranks' glibc keeps freed memory for reuse, so the large gradient "
                   "tensors every step allocates do not page-fault afresh (the same for every "
                   "method); system: glibc's defaults.")
@click.option("--wait", default="sleep", show_default=True, type=click.Choice(TRAIN_WAITS),
              help="How Horovod's optimizer waits for its allreduces: sleep (as hvd_onebit "
                   "does; fair when ranks share cores) or spin (Horovod's own sched_yield loop).")
@click.option("--powersgd-start", default=10, show_default=True, type=click.IntRange(min=0),
              help="Plain-allreduce iterations before PowerSGD starts compressing.")
@click.option("--methods", default=",".join(TRAIN_DEFAULT_METHODS), show_default=True,
              callback=comma_list(str),
              help=f"Which methods to run, from {', '.join(TRAIN_METHODS)} "
              "(onebit: variance_refresh=None, frozen at --warmup-frac; onebit_sync: "
              "overlap=False, the exchange starts in step(); onebit_hierarchical: "
              "hierarchical=True, for nodes of several ranks (--ranks-per-node, or --hosts); "
              "onebit_refresh: --variance-refresh frozen at --refresh-freeze-frac, against "
              "onebit's whole run; onebit_blocks: onebit with --block-size elements per scale; "
              "ddp_adam: DDP over Gloo with its own allreduce; ddp_onebit: the same DDP model "
              "under hvd_onebit.ddp.DistributedOptimizer, frozen as onebit is; ddp_onebit_refresh: "
              "the DDP face with onebit_refresh's settings, against ddp_onebit's whole run).")
@click.option("--transport", default="auto", show_default=True,
              type=click.Choice(TRANSPORTS),
              help="1-bit Adam's transport for the compression phase.")
@click.option("--bucket-size-mb", default=None, type=Finite(min=0, min_open=True),
              help="1-bit Adam's bucket_size_mb [default: the optimizer's].")
@click.option("--block-size", default=0, show_default=True, type=click.IntRange(0),
              callback=block_size_check,
              help="onebit_blocks' block_size: elements per scale (a multiple of 8), or 0: one "
                   "scale per chunk (the default's granularity is 512).")
@click.option("--intra-node", default="auto", show_default=True,
              type=click.Choice(["auto", "shared_memory", "network"]),
              help="1-bit Adam's intra_node (onebit_hierarchical's stages inside a node); auto is "
                   "network when --intra-bandwidth is set, so the emulated links carry them.")
@click.option("--gradient-as-bucket-view", is_flag=True,
              help="DDP's gradient_as_bucket_view=True for every DDP method (the gradients are "
                   "views into DDP's buckets: no copy into them or back in a step).")
@real_cluster_options
@queue_option
@nodes_options
@click.option("--timeout", default=3600.0, show_default=True,
              type=Finite(min=0, min_open=True), help="Seconds for the job.")
@click.option("--plot", default=None, type=click.Path(dir_okay=False), callback=plot_file,
              help="Write a PNG bar chart of samples/s per method and phase.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@out_option
def bench_train(np_, bandwidth, steps, warmup_frac, variance_refresh, refresh_freeze_frac,
                model, width, depth, vocab, embed_dim, tokens, batch, malloc_mode, wait,
                powersgd_start, methods, transport, bucket_size_mb, block_size, intra_node,
                gradient_as_bucket_view, hosts, shared_dir, queue_ms, ranks_per_node,
                intra_bandwidth, timeout, plot, as_json, out) -> None:
    """End-to-end samples/s and bytes per step: Horovod Adam (fp32, fp16), DDP Adam, DDP +
    PowerSGD and 1-bit Adam through either face, with the paper's settings and with the
    library's defaults, per phase and over a whole run. Also reports what share of the Horovod
    fp32 step is communication (the 'local' method runs the same step without any)."""
    from ..refresh import parse_variance_refresh
    from ..train import summarize as summarize_train
    from ...cluster.jobs import horovod_installed, run_job
    from ...cluster.torchrun import run_torchrun_job

    bad = [m for m in methods if m not in TRAIN_METHODS]
    if bad:
        raise click.BadParameter(f"unknown methods {bad}; choose from {TRAIN_METHODS}",
                                 param_hint="--methods")
    if not methods or len(set(methods)) != len(methods):
        raise click.BadParameter(f"{','.join(methods)!r}: name each method once, at least one",
                                 param_hint="--methods")
    need_two_ranks(np_, "a comparison of training steps")
    horovod = horovod_installed()
    if not horovod:
        methods = _without_horovod(methods, hosts)
    _check_warmups(methods, steps, warmup_frac, refresh_freeze_frac)
    check_real_cluster(hosts, shared_dir, np_)
    # transport="mpi" exchanges through mpi4py: the ranks must be launched by MPI
    controller = "mpi" if transport == "mpi" else "gloo"
    if controller == "mpi" and bandwidth not in (None, "", "none", "local") and not hosts:
        raise click.UsageError("--transport mpi needs ranks launched by MPI; the emulated "
                               "cluster launches them over Gloo: use --bandwidth local, "
                               "--hosts, or another --transport")
    try:
        refresh = parse_variance_refresh(variance_refresh)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--variance-refresh") from exc
    kwargs = {"methods": tuple(methods), "steps": steps, "warmup_frac": warmup_frac,
              "variance_refresh": refresh, "refresh_freeze_frac": refresh_freeze_frac,
              "model": model, "width": width, "depth": depth, "vocab": vocab,
              "embed_dim": embed_dim, "tokens": tokens, "batch": batch, "wait": wait,
              "powersgd_start": powersgd_start, "transport": transport,
              "bucket_size_mb": bucket_size_mb, "block_size": block_size,
              "gradient_as_bucket_view": gradient_as_bucket_view,
              "intra_node": ("network" if intra_node == "auto" and intra_bandwidth != "unlimited"
                             else intra_node)}
    click.echo(f"training {len(methods)} methods x {steps} steps on {np_} ranks "
               f"({'real hosts' if hosts else bandwidth}, "
               f"{'horovodrun' if horovod else 'torchrun'})...", err=True)
    target, env = "hvd_onebit_tools.bench.train:train_worker", (
        MALLOC_REUSE_ENV if malloc_mode == "reuse" else None)
    with cluster_for(np_, None if hosts else bandwidth, queue_ms, ranks_per_node,
                      intra_bandwidth) as cluster:
        if horovod:
            job = run_job(target, np=np_, kwargs=kwargs, controller=controller,
                          timeout=timeout, cluster=cluster, hosts=hosts,
                          shared_dir=shared_dir, env=env)
        else:  # DDP's methods, as a DDP user launches them
            job = run_torchrun_job(target, cluster, kwargs=kwargs, timeout=timeout, env=env,
                                   np=np_)
    rows = job.results[0]
    summary = summarize_train(rows)
    report = {**report_head("train"), "launcher": "horovodrun" if horovod else "torchrun",
              "bandwidth": "real" if hosts else bandwidth, "queue_ms": queue_ms,
              "ranks_per_node": ranks_per_node, "intra_bandwidth": intra_bandwidth,
              "config": {**kwargs, "malloc": malloc_mode}, "rows": rows,
              "summary": summary, "wall_seconds": job.wall_seconds}
    if plot:
        from ..train import plot as plot_train

        plot_train(rows, plot, report["bandwidth"])
        report["plot"] = plot
    if emit(report, as_json, out):
        return
    table = []
    for r in rows:
        for phase in ("all", "warmup", "compression", "refresh"):
            if f"{phase}_step_s" not in r:
                continue
            measured = r.get(f"{phase}_measured_tx_bytes_per_step")
            table.append({"method": r["method"], "phase": phase if phase != "all" else "-",
                          "steps": r[f"{phase}_steps"], "ms": r[f"{phase}_step_s"] * 1e3,
                          "sps": r[f"{phase}_samples_per_s"],
                          "mb": None if measured is None else measured / 1e6,
                          "run_s": r["run_seconds"],
                          "run_mb": (r["run_bytes_per_rank"] / 1e6 if "run_bytes_per_rank" in r
                                     else None)})
    shape = (f"MLP {width}x{depth}" if model == "mlp" else
             f"embedding bag {vocab}x{embed_dim} ({tokens} tokens/sample) + MLP head {width}")
    click.echo(f"model: {shape}, {rows[0]['params']:,} parameters, {batch} samples/rank/step, "
               f"{np_} ranks, {report['bandwidth']}, "
               + (f"Horovod waits: {wait}" if horovod else "torchrun") + f", malloc: {malloc_mode}")
    print_table(table, [("method", "method", ""), ("phase", "phase", ""), ("steps", "steps", "d"),
                        ("median step ms", "ms", ",.1f"), ("samples/s", "sps", ",.1f"),
                        # rank 0's link counter: with nodes of several ranks, its node's link
                        ("measured MB/step/rank" if ranks_per_node == 1 else
                         "measured MB/step/node link", "mb", ",.2f"), ("run s", "run_s", ",.2f"),
                        # the payload the methods send (ring formula, 1-bit wire bytes), not
                        # the link counter, which also counts the transports' own framing
                        ("run payload MB/rank", "run_mb", ",.1f")])
    for r in rows:
        if r["method"] in REFRESH_METHODS:
            click.echo(refresh_share_note(r["steps_by_kind"], refresh, refresh_freeze_frac,
                                          method=r["method"]))
    for r in rows:
        parts = r.get("compression_breakdown_s")
        if parts:
            click.echo(f"{r['method']} compressed step, median ms: " + ", ".join(
                f"{k} {v * 1e3:.1f}" for k, v in parts.items()))
    for k, v in summary.items():
        click.echo(f"{k}: {'-' if v is None else format(v, '.3f')}")
