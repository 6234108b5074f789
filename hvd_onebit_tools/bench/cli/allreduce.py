"""`hvd-onebit bench allreduce`: fp32, fp16 and 1-bit allreduces, time per call and bytes."""
from __future__ import annotations

import click

from ..allreduce import DEFAULT_METHODS, METHODS, summarize
from ..report import print_table, report_head
from .options import (Finite, check_real_cluster, cluster_for, comma_list, emit, link_rates,
                      need_horovod, need_two_ranks, nodes_options, np_option, out_option, plot_file,
                      positive_count, queue_option, real_cluster_options)


@click.command("allreduce")
@np_option("2,4", "World sizes to run.", sweep=True)
@click.option("--numel", "--sizes", "sizes", default="1M,4M,16M,64M", show_default=True,
              callback=comma_list(positive_count, empty_ok=False),
              help="Buffer sizes in fp32 elements (e.g. 1M, 16M; binary suffixes: 1M is "
                   "1,048,576), comma separated (--sizes: the same).")
@click.option("--bandwidth", "bandwidths", default="local", show_default=True,
              callback=link_rates,
              help="Comma-separated link rates for an emulated cluster (e.g. 100mbit,1gbit,"
                   "10gbit,unlimited); 'local' runs plain horovodrun on loopback without "
                   "emulation. Emulation needs root.")
@click.option("--methods", default=",".join(DEFAULT_METHODS), show_default=True,
              callback=comma_list(str, empty_ok=False),
              help=f"Which allreduces to time, from {', '.join(METHODS)}; onebit_mpi is "
                   "OneBitAllreduce over mpi4py and needs --controller mpi.")
@click.option("--repeats", default=5, show_default=True, type=click.IntRange(1),
              help="Timed calls per size and method.")
@click.option("--controller", type=click.Choice(["gloo", "mpi"]), default="gloo",
              show_default=True, help="Horovod controller for local and --hosts runs.")
@real_cluster_options
@queue_option
@nodes_options
@click.option("--timeout", default=1800.0, show_default=True,
              type=Finite(min=0, min_open=True), help="Seconds per job.")
@click.option("--plot", default=None, type=click.Path(dir_okay=False), callback=plot_file,
              help="Write a PNG of speed-up over fp32: against the link rate for a sweep of "
                   "two or more emulated --bandwidth rates, else against buffer size (on "
                   "loopback, a real cluster or one emulated rate).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@out_option
def bench_allreduce(nps, sizes, bandwidths, methods, repeats, controller, hosts,
                    shared_dir, queue_ms, ranks_per_node, intra_bandwidth, timeout, plot,
                    as_json, out) -> None:
    """fp32 hvd.allreduce vs Compression.fp16 vs OneBitAllreduce: time per call and bytes."""
    from ...cluster.jobs import run_job

    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise click.BadParameter(f"unknown methods {bad}; choose from {METHODS}",
                                 param_hint="--methods")
    if len(set(methods)) != len(methods):
        raise click.BadParameter(f"{','.join(methods)!r}: name each method once",
                                 param_hint="--methods")
    need_two_ranks(nps, "an allreduce job")
    need_horovod()
    check_real_cluster(hosts, shared_dir, nps)
    if "onebit_mpi" in methods and (controller != "mpi" or any(b != "local" for b in bandwidths)):
        raise click.BadParameter("onebit_mpi needs --controller mpi and --bandwidth local")
    jobs = [(n, bw) for bw in bandwidths for n in nps]
    rows = []
    with click.progressbar(jobs, label="allreduce jobs", file=click.get_text_stream("stderr"),
                           item_show_func=lambda j: j and f"np={j[0]} {j[1]}") as bar:
        for n, bw in bar:
            kwargs = {"sizes": sizes, "methods": tuple(methods), "repeats": repeats}
            with cluster_for(n, None if hosts else bw, queue_ms, ranks_per_node,
                              intra_bandwidth) as cluster:
                job = run_job("hvd_onebit_tools.bench.allreduce:allreduce_worker", np=n,
                              controller=controller, kwargs=kwargs, timeout=timeout,
                              cluster=cluster, hosts=hosts, shared_dir=shared_dir)
            for r in job.results[0]:
                r["bandwidth"] = "real" if hosts else bw
                rows.append(r)
    summarize(rows)
    report = {**report_head("allreduce"), "controller": controller, "queue_ms": queue_ms,
              "ranks_per_node": ranks_per_node, "intra_bandwidth": intra_bandwidth,
              "rows": rows}
    if plot:
        from ..allreduce import plot as plot_allreduce

        plot_allreduce(rows, plot)
        report["plot"] = plot
    if emit(report, as_json, out):
        return
    for r in rows:
        r["mb"] = r["bytes_per_rank"] / 1e6
        r["ms"] = r["median_s"] * 1e3
        m = r.get("measured_tx_bytes_per_call")
        r["measured_mb"] = None if m is None else m / 1e6
    print_table(rows, [("bandwidth", "bandwidth", ""), ("np", "np", "d"), ("elements", "numel", ",d"),
                       ("method", "method", ""), ("median ms", "ms", ",.1f"),
                       ("speed-up vs fp32", "speedup_vs_fp32", ".2f"),
                       ("MB/rank", "mb", ",.2f"), ("measured MB/rank", "measured_mb", ",.2f"),
                       ("bytes vs fp32", "bytes_ratio_vs_fp32", ".4f")])
