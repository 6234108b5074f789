"""`hvd-onebit bench`: the benchmark commands (tables by default, JSON with --json)."""
from __future__ import annotations

import contextlib
import json
from typing import Optional

import click

from .allreduce import DEFAULT_METHODS, METHODS, summarize
from .report import machine_info, print_table
from .train import MALLOC_REUSE_ENV
from .train import DEFAULT_METHODS as TRAIN_DEFAULT_METHODS
from .train import METHODS as TRAIN_METHODS
from .train import MODELS as TRAIN_MODELS
from .train import WAITS as TRAIN_WAITS

SIZE_SUFFIX = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_count(text: str) -> int:
    """'16M' -> 16777216 elements; plain integers pass through."""
    t = text.strip().lower()
    if t and t[-1] in SIZE_SUFFIX:
        return int(float(t[:-1]) * SIZE_SUFFIX[t[-1]])
    return int(t)


def _csv(kind):
    def convert(ctx, param, value):
        try:
            return [kind(v) for v in value.split(",") if v.strip()]
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from exc
    return convert


def _real_cluster_options(command):
    """--hosts and --shared-dir: run through horovodrun on real machines instead of emulating."""
    command = click.option("--shared-dir", default=None,
                           help="A folder every host sees at the same path, for --hosts.")(command)
    return click.option("--hosts", default=None,
                        help="Run on a real cluster through horovodrun, e.g. h1:4,h2:4 (no "
                             "emulation); needs --shared-dir.")(command)


@click.group()
def bench() -> None:
    """Benchmarks; every command prints a table, or JSON with --json."""


@bench.command("kernel")
@click.option("--numel", default=None, callback=lambda c, p, v: v and _csv(parse_count)(c, p, v),
              help="Elements in the buffer (e.g. 1M, 16M); with --device cuda a list "
                   "[default: 16M on cpu, 16M,64M,128M,256M on cuda].")
@click.option("--ranks", default=4, show_default=True, help="Chunks in the layout (world size).")
@click.option("--threads", default=1, show_default=True, help="torch threads.")
@click.option("--repeats", default=9, show_default=True, help="Timed runs; the median is kept.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="cpu: native and torch kernels; cuda: the Triton (and torch) kernels.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def bench_kernel(numel, ranks: int, threads: int, repeats: int, device: str,
                 as_json: bool) -> None:
    """Compression-kernel throughput as a ratio to torch.add(x, e, out=y) (target >= 0.5)."""
    from .kernel import bench_kernels, bench_kernels_cuda

    if device == "cuda":
        try:
            result = bench_kernels_cuda(numel or [16 << 20, 64 << 20, 128 << 20, 256 << 20],
                                        ranks=ranks, repeats=repeats)
        except RuntimeError as exc:
            raise click.ClickException(str(exc)) from exc
        result["machine"] = machine_info()
        if as_json:
            click.echo(json.dumps(result, indent=2))
            return
        print_table([{"numel": e["numel"], "backend": backend, "kernel": k[:-len("_ratio_to_add")],
                      "ratio": v} for e in result["sizes"] for backend, r in e["backends"].items()
                     for k, v in r.items() if k.endswith("_ratio_to_add")],
                    [("numel", "numel", ""), ("backend", "backend", ""), ("kernel", "kernel", ""),
                     ("ratio to add", "ratio", ".2f")])
        return
    if numel and len(numel) > 1:
        raise click.BadParameter("one size on cpu (a list only with --device cuda)",
                                 param_hint="--numel")
    numel = numel[0] if numel else 16 << 20
    result = bench_kernels(numel=numel, ranks=ranks, threads=threads, repeats=repeats)
    result["machine"] = machine_info()
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(f"{numel} fp32 elements, {ranks} chunks, {threads} thread(s); "
               f"torch.add: {result['add_elems_per_s'] / 1e6:,.0f} M elements/s")
    rows = []
    for backend, b in result["backends"].items():
        for k in ("compress", "server", "decode"):
            rows.append({"backend": backend, "kernel": k,
                         "melem_s": b[f"{k}_elems_per_s"] / 1e6, "ratio": b[f"{k}_ratio_to_add"]})
    print_table(rows, [("backend", "backend", ""), ("kernel", "kernel", ""),
                       ("M elem/s", "melem_s", ",.0f"), ("ratio to add", "ratio", ".2f")])
    fused = result.get("fused_optimizer_passes")
    if fused:
        click.echo(f"optimizer passes (native): momentum+compress {fused['momentum_compress_ms']:.1f}"
                   f" ms vs lerp then compress {fused['lerp_then_compress_ms']:.1f} ms "
                   f"({fused['momentum_compress_speedup']:.2f}x); decode+update "
                   f"{fused['decode_update_ms']:.1f} ms vs decode then addcdiv "
                   f"{fused['decode_then_addcdiv_ms']:.1f} ms ({fused['decode_update_speedup']:.2f}x)")


@contextlib.contextmanager
def _cluster_for(np_: int, bandwidth: Optional[str], queue_ms: float = 2.0,
                 ranks_per_node: int = 1, intra_bandwidth: Optional[str] = None):
    """An emulated cluster at ``bandwidth`` (nodes of ``ranks_per_node`` ranks), or nothing
    (plain local launch) for 'local'/None."""
    if bandwidth in (None, "", "none", "local"):
        if ranks_per_node != 1:
            raise click.UsageError("--ranks-per-node needs an emulated --bandwidth")
        yield None
        return
    from ..cluster import EmulatedCluster

    if np_ % ranks_per_node:
        raise click.UsageError(f"--np {np_} is not a multiple of --ranks-per-node "
                               f"{ranks_per_node}")
    with EmulatedCluster(np=np_, bandwidth=bandwidth, queue_ms=queue_ms,
                         ranks_per_node=ranks_per_node,
                         intra_bandwidth=intra_bandwidth) as cluster:
        yield cluster


def _nodes_options(command):
    command = click.option(
        "--intra-bandwidth", default="unlimited", show_default=True,
        help="With --ranks-per-node: the rate inside a node (its loopback), standing in for "
             "NVLink or PCIe.")(command)
    return click.option(
        "--ranks-per-node", default=1, show_default=True, type=click.IntRange(1, 64),
        help="Emulated nodes of this many ranks: their traffic to each other stays on the node, "
             "only traffic between nodes crosses the shaped links (NP / this = nodes).")(command)


def _queue_option(command):
    return click.option("--queue-ms", type=click.FloatRange(min=0), default=2.0, show_default=True,
                        help="Emulated links' queue depth beyond one burst, in ms of line "
                             "rate, never below 256 KiB (a switch port's buffer); shallow "
                             "queues drop packets under incast.")(command)


@bench.command("allreduce")
@click.option("--np", "nps", default="2,4", show_default=True, callback=_csv(int),
              help="World sizes to run, comma separated.")
@click.option("--sizes", default="1M,4M,16M,64M", show_default=True, callback=_csv(parse_count),
              help="Buffer sizes in fp32 elements, comma separated.")
@click.option("--bandwidth", "bandwidths", default="local", show_default=True,
              callback=_csv(str),
              help="Comma-separated link rates for an emulated cluster (e.g. 100mbit,1gbit,"
                   "10gbit,unlimited); 'local' runs plain horovodrun on loopback without "
                   "emulation. Emulation needs root.")
@click.option("--methods", default=",".join(DEFAULT_METHODS), show_default=True,
              callback=_csv(str), help=f"Which allreduces to time, from {', '.join(METHODS)}; "
              "onebit_mpi is OneBitAllreduce over mpi4py and needs --controller mpi.")
@click.option("--repeats", default=5, show_default=True, help="Timed calls per size and method.")
@click.option("--controller", type=click.Choice(["gloo", "mpi"]), default="gloo",
              show_default=True, help="Horovod controller for local and --hosts runs.")
@_real_cluster_options
@_queue_option
@_nodes_options
@click.option("--timeout", default=1800.0, show_default=True, help="Seconds per job.")
@click.option("--plot", default=None, type=click.Path(dir_okay=False),
              help="Write a PNG of speed-up over fp32 against bandwidth.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def bench_allreduce(nps, sizes, bandwidths, methods, repeats, controller, hosts,
                    shared_dir, queue_ms, ranks_per_node, intra_bandwidth, timeout, plot,
                    as_json) -> None:
    """fp32 hvd.allreduce vs Compression.fp16 vs OneBitAllreduce: time per call and bytes."""
    from ..testing import run_job

    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise click.BadParameter(f"unknown methods {bad}; choose from {METHODS}")
    if "onebit_mpi" in methods and (controller != "mpi" or any(b != "local" for b in bandwidths)):
        raise click.BadParameter("onebit_mpi needs --controller mpi and --bandwidth local")
    jobs = [(n, bw) for bw in bandwidths for n in nps]
    rows = []
    with click.progressbar(jobs, label="allreduce jobs", file=click.get_text_stream("stderr"),
                           item_show_func=lambda j: j and f"np={j[0]} {j[1]}") as bar:
        for n, bw in bar:
            kwargs = {"sizes": sizes, "methods": tuple(methods), "repeats": repeats}
            with _cluster_for(n, None if hosts else bw, queue_ms, ranks_per_node,
                              intra_bandwidth) as cluster:
                job = run_job("hvd_onebit.bench.allreduce:allreduce_worker", np=n,
                              controller=controller, kwargs=kwargs, timeout=timeout,
                              cluster=cluster, hosts=hosts, shared_dir=shared_dir)
            for r in job.results[0]:
                r["bandwidth"] = "real" if hosts else bw
                rows.append(r)
    summarize(rows)
    report = {"benchmark": "allreduce", "machine": machine_info(), "queue_ms": queue_ms,
              "rows": rows}
    if plot:
        from .allreduce import plot as plot_allreduce

        plot_allreduce(rows, plot)
        report["plot"] = plot
    if as_json:
        click.echo(json.dumps(report, indent=2))
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


@bench.command("train")
@click.option("--np", "np_", default=4, show_default=True, help="Ranks.")
@click.option("--bandwidth", default="1gbit", show_default=True,
              help="Emulated link rate (e.g. 100mbit, 1gbit, 10gbit, unlimited); 'local' runs "
                   "plain horovodrun on loopback. Emulation needs root.")
@click.option("--steps", default=40, show_default=True, help="Optimizer steps per method.")
@click.option("--warmup-frac", default=0.15, show_default=True,
              help="1-bit Adam's warmup: freeze_step = warmup_frac * steps.")
@click.option("--model", default="embedding", show_default=True, type=click.Choice(TRAIN_MODELS),
              help="mlp: a wide MLP (width x depth). embedding: an embedding-bag table "
                   "(vocab x embed-dim, dense gradient) with an MLP head of --width.")
@click.option("--width", default=2048, show_default=True, help="MLP hidden width.")
@click.option("--depth", default=3, show_default=True, help="MLP hidden layers.")
@click.option("--vocab", default=32768, show_default=True, help="Embedding rows (--model embedding).")
@click.option("--embed-dim", default=256, show_default=True,
              help="Embedding width (--model embedding).")
@click.option("--tokens", default=2048, show_default=True,
              help="Token ids per sample (--model embedding).")
@click.option("--batch", default=4, show_default=True, help="Samples per rank per step.")
@click.option("--malloc", "malloc_mode", default="reuse", show_default=True,
              type=click.Choice(["reuse", "system"]),
              help="reuse: the ranks' glibc keeps freed memory for reuse, so the large gradient "
                   "tensors every step allocates do not page-fault afresh (the same for every "
                   "method); system: glibc's defaults.")
@click.option("--wait", default="sleep", show_default=True, type=click.Choice(TRAIN_WAITS),
              help="How Horovod's optimizer waits for its allreduces: sleep (as hvd_onebit "
                   "does; fair when ranks share cores) or spin (Horovod's own sched_yield loop).")
@click.option("--powersgd-start", default=10, show_default=True,
              help="Plain-allreduce iterations before PowerSGD starts compressing.")
@click.option("--methods", default=",".join(TRAIN_DEFAULT_METHODS), show_default=True,
              callback=_csv(str), help=f"Which methods to run, from {', '.join(TRAIN_METHODS)} "
              "(onebit_sync: overlap=False, the exchange starts in step(); onebit_hier: "
              "hierarchical=True, for --ranks-per-node > 1).")
@click.option("--transport", default="auto", show_default=True,
              type=click.Choice(["auto", "horovod", "torch", "mpi"]),
              help="1-bit Adam's transport for the compression phase.")
@click.option("--bucket-size-mb", default=None, type=float,
              help="1-bit Adam's bucket_size_mb [default: the optimizer's].")
@click.option("--intra-node", default="auto", show_default=True,
              type=click.Choice(["auto", "shared_memory", "network"]),
              help="1-bit Adam's intra_node (onebit_hier's stages inside a node); auto is "
                   "network when --intra-bandwidth is set, so the emulated links carry them.")
@_real_cluster_options
@_queue_option
@_nodes_options
@click.option("--timeout", default=3600.0, show_default=True, help="Seconds for the job.")
@click.option("--plot", default=None, type=click.Path(dir_okay=False),
              help="Write a PNG bar chart of samples/s per method and phase.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def bench_train(np_, bandwidth, steps, warmup_frac, model, width, depth, vocab, embed_dim, tokens,
                batch, malloc_mode, wait, powersgd_start, methods, transport, bucket_size_mb,
                intra_node, hosts, shared_dir, queue_ms, ranks_per_node, intra_bandwidth, timeout,
                plot, as_json) -> None:
    """End-to-end samples/s and bytes per step: Horovod Adam (fp32, fp16), DDP + PowerSGD and
    1-bit Adam, per phase and over a whole run. Also reports what share of the Horovod fp32
    step is communication (the 'local' method runs the same step without any)."""
    from .train import summarize as summarize_train
    from ..testing import run_job

    bad = [m for m in methods if m not in TRAIN_METHODS]
    if bad:
        raise click.BadParameter(f"unknown methods {bad}; choose from {TRAIN_METHODS}")
    kwargs = {"methods": tuple(methods), "steps": steps, "warmup_frac": warmup_frac,
              "model": model, "width": width, "depth": depth, "vocab": vocab,
              "embed_dim": embed_dim, "tokens": tokens, "batch": batch, "wait": wait,
              "powersgd_start": powersgd_start, "transport": transport,
              "bucket_size_mb": bucket_size_mb,
              "intra_node": ("network" if intra_node == "auto" and intra_bandwidth != "unlimited"
                             else intra_node)}
    click.echo(f"training {len(methods)} methods x {steps} steps on {np_} ranks "
               f"({'real hosts' if hosts else bandwidth})...", err=True)
    with _cluster_for(np_, None if hosts else bandwidth, queue_ms, ranks_per_node,
                      intra_bandwidth) as cluster:
        job = run_job("hvd_onebit.bench.train:train_worker", np=np_, kwargs=kwargs,
                      timeout=timeout, cluster=cluster, hosts=hosts, shared_dir=shared_dir,
                      env=MALLOC_REUSE_ENV if malloc_mode == "reuse" else None)
    rows = job.results[0]
    summary = summarize_train(rows)
    report = {"benchmark": "train", "machine": machine_info(),
              "bandwidth": "real" if hosts else bandwidth, "queue_ms": queue_ms,
              "ranks_per_node": ranks_per_node, "intra_bandwidth": intra_bandwidth,
              "config": {**kwargs, "malloc": malloc_mode}, "rows": rows,
              "summary": summary, "wall_seconds": job.wall_seconds}
    if plot:
        from .train import plot as plot_train

        plot_train(rows, plot, report["bandwidth"])
        report["plot"] = plot
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    table = []
    for r in rows:
        for phase in ("all", "warmup", "compression"):
            if f"{phase}_step_s" not in r:
                continue
            measured = r.get(f"{phase}_measured_tx_bytes_per_step")
            table.append({"method": r["method"], "phase": phase if phase != "all" else "-",
                          "steps": r[f"{phase}_steps"], "ms": r[f"{phase}_step_s"] * 1e3,
                          "sps": r[f"{phase}_samples_per_s"],
                          "mb": None if measured is None else measured / 1e6,
                          "run_s": r["run_seconds"]})
    shape = (f"MLP {width}x{depth}" if model == "mlp" else
             f"embedding bag {vocab}x{embed_dim} ({tokens} tokens/sample) + MLP head {width}")
    click.echo(f"model: {shape}, {rows[0]['params']:,} parameters, {batch} samples/rank/step, "
               f"{np_} ranks, {report['bandwidth']}, Horovod waits: {wait}, malloc: {malloc_mode}")
    print_table(table, [("method", "method", ""), ("phase", "phase", ""), ("steps", "steps", "d"),
                        ("median step ms", "ms", ",.1f"), ("samples/s", "sps", ",.1f"),
                        ("measured MB/step/rank", "mb", ",.2f"), ("run s", "run_s", ",.2f")])
    for r in rows:
        parts = r.get("compression_breakdown_s")
        if parts:
            click.echo(f"{r['method']} compressed step, median ms: " + ", ".join(
                f"{k} {v * 1e3:.1f}" for k, v in parts.items()))
    for k, v in summary.items():
        click.echo(f"{k}: {v:.3f}")


@bench.command("calibrate")
@click.option("--out", default=None, type=click.Path(dir_okay=False),
              help="Where to save the constants (JSON) [default: "
                   "~/.cache/hvd_onebit/calibration.json].")
@click.option("--procs", default="1,2,4", show_default=True, callback=_csv(int),
              help="Processes timing compute and kernels at once (ranks sharing the cores).")
@click.option("--np", "nps", default="2,4", show_default=True, callback=_csv(int),
              help="Ranks of the emulated collectives jobs.")
@click.option("--link", default="1gbit", show_default=True,
              help="Shaped link rate at which the links' efficiency is measured.")
@click.option("--numel", default="4M", show_default=True,
              callback=lambda c, p, v: parse_count(v),
              help="Elements of the large collectives' buffer.")
@click.option("--repeats", default=7, show_default=True, help="Timed calls per measurement.")
@_queue_option
@click.option("--json", "as_json", is_flag=True, help="Print the constants as JSON too.")
def bench_calibrate(out, procs, nps, link, numel, repeats, queue_ms, as_json) -> None:
    """Measure the scale model's constants on this machine and save them (needs root: the
    collectives run on the emulated cluster). `bench predict` loads them."""
    from .calibrate.files import DEFAULT_PATH, save
    from .calibrate.run import calibrate
    from .predict.constants import constants

    cal = calibrate(procs=tuple(procs), nps=tuple(nps), link=link, numel=numel,
                    repeats=repeats, queue_ms=queue_ms, progress=lambda s: click.echo(s, err=True))
    path = save(cal, out or DEFAULT_PATH)
    click.echo(f"saved {path} ({cal['seconds']:.0f} s)", err=True)
    if as_json:
        click.echo(json.dumps(cal, indent=2))
        return
    for k, v in constants(cal).items():
        click.echo(f"{k}: {v}")


def _rates(ctx, param, value):
    from ..cluster.bandwidth import parse_bandwidth

    try:
        return [parse_bandwidth(v) for v in value.split(",") if v.strip()]
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


@bench.command("predict")
@click.option("--calibration", default=None, type=click.Path(dir_okay=False),
              help="Constants from `bench calibrate` [default: "
                   "~/.cache/hvd_onebit/calibration.json].")
@click.option("--np", "nps", default="4", show_default=True, callback=_csv(int),
              help="Ranks, comma separated for a sweep (e.g. 8,16,...,1024).")
@click.option("--ranks-per-node", default=1, show_default=True,
              help="Ranks per node (they share the node's link); 1: a link per rank.")
@click.option("--bandwidth", "bandwidths", default="1gbit", show_default=True, callback=_rates,
              help="Link rate between nodes (each node's link), comma separated for a sweep.")
@click.option("--intra-bandwidth", default="unlimited", show_default=True,
              callback=lambda c, p, v: _rates(c, p, v)[0], help="Each rank's link inside a node.")
@click.option("--latency-us", default=0.0, show_default=True,
              help="One-way link latency between nodes, microseconds.")
@click.option("--intra-latency-us", default=0.0, show_default=True,
              help="One-way latency inside a node, microseconds.")
@click.option("--params", default=None, help="Parameters (e.g. 350M, 9.4e6); default: the "
              "--model's.")
@click.option("--model", "bench_model", default=None, type=click.Choice(TRAIN_MODELS),
              help="Take compute time (and parameters) from the calibration's measurement of "
                   "`bench train --model ...`'s step (the `local` method).")
@click.option("--compute-ms", default=None, type=float,
              help="Compute per step: forward + backward + Adam (e.g. `bench train`'s local step).")
@click.option("--adam-ms", default=None, type=float,
              help="Adam's part of --compute-ms, which the compressed step replaces by its "
                   "kernels [default: 0, no credit; with --model alone: calibrated].")
@click.option("--warmup-frac", default=0.15, show_default=True,
              help="Share of the steps in 1-bit Adam's full-precision warmup.")
@click.option("--colocated", is_flag=True,
              help="All ranks share this machine's cores (as on the emulated cluster): compute "
                   "and kernels at the speeds calibrated with that many processes at once.")
@click.option("--kernel-speedup", default=1.0, show_default=True,
              help="Divide the calibrated kernel and Adam times per element (a faster device).")
@click.option("--host-speedup", default=1.0, show_default=True,
              help="Divide the calibrated host cost per byte of collectives (copies, reductions,"
                   " TCP); 'inf' drops it (NIC offload).")
@click.option("--per-peer-us", default=None, type=float,
              help="Replace the calibrated per-peer cost of every collective (microseconds).")
@click.option("--transport", default="torch", show_default=True,
              type=click.Choice(["torch", "horovod"]),
              help="What carries 1-bit Adam's stages: torch.distributed (Gloo; what "
                   "transport='auto' picks on CPU; hierarchical: collectives of each group) or "
                   "Horovod's alltoall/allgather.")
@click.option("--hierarchical-ops", default="global", show_default=True,
              type=click.Choice(["global", "group"]),
              help="With --transport horovod: global: each hierarchical stage is a Horovod "
                   "alltoall of all ranks (with splits), as hvd_onebit/hierarchical.py runs "
                   "them there; group: Horovod collectives of the node's ranks and of the ranks "
                   "with one local rank (process sets, which the library does not use).")
@click.option("--intra-node", default="network", show_default=True,
              type=click.Choice(["network", "shared_memory"]),
              help="With --transport torch: the hierarchical stages inside a node over the "
                   "node's links (--intra-bandwidth: NVLink, PCIe) or through shared memory (a "
                   "barrier each: CPU ranks, intra_node='auto' on CPU).")
@click.option("--methods", default="horovod_fp32,horovod_fp16,onebit,onebit_hierarchical",
              show_default=True, callback=_csv(click.Choice(
                  ["horovod_fp32", "horovod_fp16", "onebit", "onebit_hierarchical",
                   "onebit_hierarchical_group"])),
              help="Methods to predict (onebit_hierarchical_group: with --transport horovod, "
                   "the hierarchical scheme with its stages as Horovod collectives of their own "
                   "groups, which the library does not use; with --transport torch, the same as "
                   "onebit_hierarchical).")
@click.option("--check", "check_dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="Instead: compare predictions with every `bench train --json` output "
                   "(train_*.json) in this folder and print each pair.")
@click.option("--plot", default=None, type=click.Path(dir_okay=False),
              help="PNG: speed-up against ranks for a sweep, else each method's phases.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def bench_predict(calibration, nps, ranks_per_node, bandwidths, intra_bandwidth, latency_us,
                  intra_latency_us, params, bench_model, compute_ms, adam_ms, warmup_frac,
                  colocated, kernel_speedup, host_speedup, per_peer_us, transport,
                  hierarchical_ops, intra_node, methods, check_dir, plot, as_json) -> None:
    """Predict step time per phase, whole-run speed-up and bytes per rank of Horovod fp32/fp16,
    flat 1-bit and hierarchical 1-bit Adam (as hvd_onebit/hierarchical.py runs it) from the
    constants `bench calibrate` measured. README.md, "Predicting the speed-up at scale", has the
    model and its assumptions."""
    from pathlib import Path

    from .calibrate.files import DEFAULT_PATH, load
    from .predict.check import check_report
    from .predict.job import Cluster, Job, parse_params
    from .predict.model import HIERARCHICAL_NOTE, Model
    from .predict.sweep import crossovers, sweep
    from .predict.tables import print_check, print_prediction

    try:
        cal = load(calibration or DEFAULT_PATH)
    except (FileNotFoundError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    if check_dir:
        reports = [json.loads(p.read_text()) for p in sorted(Path(check_dir).glob("train_*.json"))]
        if not reports:
            raise click.ClickException(f"no train_*.json in {check_dir}")
        result = check_report(reports, cal)
        if as_json:
            click.echo(json.dumps(result, indent=2))
        else:
            print_check(result)
        return
    if params is None and bench_model is None:
        raise click.BadParameter("give --params (and --compute-ms) or --model")
    if compute_ms is None and bench_model is None:
        raise click.BadParameter("give --compute-ms, or --model to use a calibrated bench model")
    n_params = (parse_params(params) if params is not None else
                int(cal["compute"]["1"]["models"][bench_model]["params"]))
    job = Job(params=n_params, model=bench_model,
              compute_s=None if compute_ms is None else compute_ms / 1e3,
              adam_s=None if adam_ms is None else adam_ms / 1e3, warmup_frac=warmup_frac,
              kernel_speedup=kernel_speedup, host_speedup=host_speedup)
    model = Model(cal, None if per_peer_us is None else per_peer_us * 1e-6,
                  hierarchical_global_ops=hierarchical_ops == "global", transport=transport,
                  intra_node=intra_node)
    try:
        rows = sweep(model, job, nps, bandwidths, ranks_per_node, intra_bandwidth,
                     latency_us * 1e-6, intra_latency_us * 1e-6, colocated, tuple(methods))
    except ValueError as exc:  # e.g. a version-2 calibration without torch.distributed ops
        raise click.ClickException(str(exc)) from exc
    report = {"benchmark": "predict", "calibration": cal.get("machine"),
              "inputs": {"params": n_params, "compute_s": model.compute(job, Cluster(
                  nodes=nps[0], colocated=colocated))[0], "warmup_frac": warmup_frac,
                  "ranks_per_node": ranks_per_node, "intra_bps": intra_bandwidth,
                  "latency_s": latency_us * 1e-6, "intra_latency_s": intra_latency_us * 1e-6,
                  "colocated": colocated, "kernel_speedup": kernel_speedup,
                  "host_speedup": host_speedup, "per_peer_s": model.per_peer_s,
                  "transport": transport, "hierarchical_ops": hierarchical_ops,
                  "intra_node": intra_node},
              "note": HIERARCHICAL_NOTE, "rows": rows, "crossovers": crossovers(rows)}
    if plot:
        from ..cluster.bandwidth import format_bandwidth
        from .predict.plots import plot_phases, plot_sweep

        title = (f"{n_params / 1e6:,.0f}M params, compute {report['inputs']['compute_s'] * 1e3:,.0f}"
                 f" ms/step, warmup {warmup_frac:.0%}, {ranks_per_node} ranks/node (predicted)")
        if len(rows) > 1:
            plot_sweep(rows, plot, title)
        else:
            bw = rows[0]["inter_bps"]
            plot_phases(rows[0]["methods"], plot, f"{title}\n{rows[0]['np']} ranks, "
                        f"{format_bandwidth(int(bw)) if bw else 'unlimited'}")
        report["plot"] = plot
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        print_prediction(report)


@bench.command("memory")
@click.option("--ranks", default=2, show_default=True, help="World size (Horovod ranks, or "
              "virtual ranks with --transport inprocess).")
@click.option("--layers", default=4, show_default=True, help="Linear layers of the model.")
@click.option("--width", default=1024, show_default=True, help="Each layer is width x width.")
@click.option("--warmup", default=3, show_default=True, help="Adam steps before the freeze.")
@click.option("--compressed", default=3, show_default=True, help="1-bit steps measured.")
@click.option("--transport", type=click.Choice(["horovod", "inprocess"]), default="horovod",
              show_default=True, help="horovod: a job through both phases; inprocess: the "
              "compression engine alone on virtual ranks (threads).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--bucket-mb", type=float, default=None, help="Bucket size in MiB [default: the "
              "optimizer's].")
@click.option("--memory", "memory_mode", type=click.Choice(["lean", "fast", "auto"]),
              default="lean", show_default=True,
              help="The optimizer's memory option (lean: CUDA's default; fast: the CPU's).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def bench_memory_command(ranks: int, layers: int, width: int, warmup: int, compressed: int,
                         transport: str, device: str, bucket_mb: Optional[float],
                         memory_mode: str, as_json: bool) -> None:
    """Memory beyond Adam's own per phase, as a ratio to the parameters' fp32 bytes
    (compression-phase target: <= 1.25, peak included)."""
    from .memory import bench_memory

    result = bench_memory(ranks=ranks, layers=layers, width=width, warmup=warmup,
                          compressed=compressed, transport=transport, device=device,
                          bucket_size_mb=bucket_mb, memory=memory_mode)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    print_table([{"phase": ph, "held": e["held_ratio"], "peak": e["peak_ratio"],
                  "held_mb": e["held_bytes"]["total"] / 2**20,
                  "transient_mb": e["step_transient_bytes"] / 2**20}
                 for ph, e in result["phases"].items()],
                [("phase", "phase", ""), ("held x params", "held", ".3f"),
                 ("peak x params", "peak", ".3f"), ("held MiB", "held_mb", ".1f"),
                 ("step transient MiB", "transient_mb", ".1f")])
    click.echo(f"{result['ranks']} ranks ({transport}, {device}), "
               f"{result['param_bytes'] / 2**20:.1f} MiB of fp32 parameters, "
               f"{result['buckets']} bucket(s); peak: {result['peak_method']}")


@bench.command("zoo")
@click.option("--families", default=None, callback=lambda c, p, v: v and _csv(str)(c, p, v),
              help="Comma-separated model families [default: all: mnist_cnn, dropout_cnn, "
                   "resnet_bn, gru_lm, transformer_lm, embedding_bag, mlp].")
@click.option("--schemes", default="bounded,unbounded", show_default=True, callback=_csv(str),
              help="Compression-phase schemes (extra DistributedOptimizer options, "
                   "hvd_onebit/bench/zoo/grid.py): bounded (this round's: preconditioned "
                   "and bounded), unbounded (before it: neither), bound_only, "
                   "precondition_only, bounded_eps / bounded_floor (zero_variance), frozen_exact "
                   "(frozen variance, exact momentum: what freezing alone costs), default "
                   "(the installed defaults).")
@click.option("--seeds", default=3, show_default=True, type=click.IntRange(1),
              help="Seeds per family and learning rate (0, 1, ...).")
@click.option("--freezes", default="10%,20%,50%,auto", show_default=True, callback=_csv(str),
              help="Freeze settings: fractions of the run among 10%, 20%, 50%, and auto.")
@click.option("--lrs", default="scaled,base", show_default=True, callback=_csv(str),
              help="Learning-rate rules: scaled (Horovod's base_lr * size) and base.")
@click.option("--steps", default=None, type=click.IntRange(10),
              help="Steps per run for every family [default: each family's, 120-150].")
@click.option("--batch", default=None, type=click.IntRange(1),
              help="Samples per rank per step for every family [default: each family's].")
@click.option("--np", "np_", default=4, show_default=True, help="Ranks.")
@click.option("--out", "out_dir", default="results/zoo", show_default=True,
              type=click.Path(file_okay=False),
              help="Folder for cells.jsonl (one line per run), summary.json and heat_map.png.")
@click.option("--timeout", default=1800.0, show_default=True,
              help="Seconds per family's job (a family is one job of 54 runs by default).")
@click.option("--resume", is_flag=True,
              help="Keep the runs already in OUT/cells.jsonl and run only the missing ones.")
@click.option("--report-only", is_flag=True, help="Only print and write the report of OUT.")
@click.option("--metric", type=click.Choice(["final", "tail"]), default="final",
              show_default=True, help="final: the last held-out loss; tail: the mean of the "
              "last three evaluations (less noisy).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON instead of "
              "tables.")
def bench_zoo(families, schemes, seeds, freezes, lrs, steps, batch, np_, out_dir, timeout,
              resume, report_only, metric, as_json) -> None:
    """Convergence zoo: Horovod Adam vs 1-bit Adam on seven model families, two learning
    rates, four freeze settings and several seeds, on NP ranks; every cell's final held-out
    loss over Adam's on the same seed, divergences marked (table, summary.json, heat_map.png)."""
    from pathlib import Path

    from .zoo.grid import all_families
    from .zoo.report import write_report

    out = Path(out_dir)
    if not report_only:
        from .zoo.runner import run_zoo

        try:
            result = run_zoo(families or all_families(), out, seeds=range(seeds),
                             schemes=schemes, freezes=freezes, lr_rules=lrs, steps=steps,
                             batch=batch, np=np_, timeout=timeout, resume=resume,
                             progress=lambda s: click.echo(s, err=True))
        except ValueError as exc:
            raise click.UsageError(str(exc)) from exc
        click.echo(f"[zoo] {result['seconds']:.0f}s; results in {result['results']}", err=True)
        for name, why in result["failures"].items():
            click.echo(f"[zoo] {name} failed:\n{why[-3000:]}", err=True)
    try:
        summary = write_report(out, metric, show=not as_json)
    except FileNotFoundError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        from .zoo.report import json_safe

        click.echo(json.dumps(json_safe({k: v for k, v in summary.items() if k != "cells"}),
                              indent=2))
