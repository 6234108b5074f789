"""`make demo`: Horovod Adam vs 1-bit Adam on an emulated 4-rank cluster with 100 Mbit/s links.

Trains ``examples/train_lm.py`` (a byte-level GPT on the Python docs every CPython ships) twice,
changing only the optimizer wrapper, and prints a side-by-side table: per phase the seconds per
step, samples/s and the share of the step spent blocked on communication, bytes on the wire per
step (each rank's own link counter, and the optimizer's count), the final validation loss and the
time of the steps and of the whole run; then what 1-bit Adam's speed-up is made of (warmup,
compression phase, less waiting). Loss curves go to ``results/demo/``.

Both runs wait for their allreduces the same way, by sleeping (``train_lm.py --wait sleep``):
Horovod's own wait spins on ``sched_yield``, and with 4 ranks on a machine's few cores the
spinning ranks take CPU from those still computing, which slows the baseline for a reason that
has nothing to do with compression. ``--spin-baseline`` adds a third run with Horovod's own wait
to show what it costs.

The link: on this CPU model a step's compute is ~0.1-0.2 s; Adam's 2.63 MB of gradients take
21 ms at 1 Gbit/s (communication ~10% of the step, so the demo measured compute) and 210 ms at
100 Mbit/s, where communication is a large share of Adam's step, as for the GPU clusters on
Ethernet that 1-bit Adam is for, whose compute is far faster.

Without the privileges to create network namespaces it says so and runs on plain loopback.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import click

from .cli.options import link_rate
from .lm import TrainingFailed, find_train_lm, plot_val_loss, train_lm


DEFAULT_BANDWIDTH = "100mbit"

RUNS = {  # tag: (train_lm.py --optimizer, its extra arguments, label)
    "adam": ("adam", ["--wait", "sleep"], "Horovod Adam"),
    "adam_spin": ("adam", ["--wait", "spin"], "Horovod Adam, spin wait"),
    "onebit": ("onebit", [], "1-bit Adam"),
}


def _run_one(tag: str, np_: int, bandwidth: str, steps: int, out_dir: Path,
             emulate: bool, extra: list[str]) -> dict:
    optimizer, run_args, label = RUNS[tag]
    train_args = ["--steps", str(steps), "--eval-every", str(max(1, steps // 12)), *run_args,
                  *extra]
    click.echo(f"\n=== {label}: {np_} ranks, "
               f"{bandwidth if emulate else 'loopback (no emulation)'}, {steps} steps")
    try:
        if emulate:
            from ..cluster import EmulatedCluster

            def show(rank: int, line: str) -> None:
                if rank == 0:
                    click.echo(f"  {line.rstrip()}")

            with EmulatedCluster(np=np_, bandwidth=bandwidth) as cluster:
                run = train_lm(optimizer, np_, train_args, out_dir, 1800, cluster=cluster,
                               on_output=show, log_to_file=False, tag=tag)
        else:
            run = train_lm(optimizer, np_, train_args, out_dir, 1800, log_to_file=False, tag=tag)
    except TrainingFailed as exc:
        raise click.ClickException(str(exc)) from None
    summary = run.summary
    summary["demo_wall_seconds"] = run.wall_seconds
    summary["measured_tx_bytes_per_rank"] = run.measured_tx_bytes_per_rank
    return summary


def _phase(s: dict, name: str) -> dict:
    """One phase of a train_lm.py summary; Adam's single phase counts as its warmup."""
    phases = s["phases"]
    if name == "warmup":
        return phases.get("warmup") or phases.get("full_precision") or {}
    return phases.get(name, {})


def _row(tag: str, s: dict, steps: int) -> dict:
    warm, refresh, comp = _phase(s, "warmup"), _phase(s, "refresh"), _phase(s, "compression")
    measured = s.get("measured_tx_bytes_per_rank")
    row = {"run": tag, "optimizer": RUNS[tag][2], "wait": s.get("wait"),
           "measured_mb": None if measured is None else measured / steps / 1e6,
           "val_loss": s["final_val_loss"],
           "train_s": sum(p["seconds"] for p in s["phases"].values()),
           "comm_s": sum(p.get("comm_seconds", 0.0) for p in s["phases"].values()),
           "wall_s": s["wall_seconds"]}
    for name, ph in (("warmup", warm), ("refresh", refresh), ("compression", comp)):
        row[f"{name}_steps"] = ph.get("steps", 0)
        row[f"{name}_sps"] = ph.get("samples_per_sec")
        row[f"{name}_s_per_step"] = ph.get("seconds_per_step")
        row[f"{name}_comm_s_per_step"] = ph.get("comm_seconds_per_step")
        row[f"{name}_comm_share"] = ph.get("comm_share")
        row[f"{name}_mb"] = ph["bytes_per_step"] / 1e6 if ph else None
    return row


def breakdown(rows: dict[str, dict]) -> dict:
    """What 1-bit Adam's speed-up over Horovod Adam (same wait) is made of, in seconds of training
    steps (evaluation left out), phase by phase.

    Adam's steps all cost the same, so each 1-bit phase is set against as many Adam steps:
    ``warmup_s`` and ``compression_s`` are the seconds 1-bit Adam saved in each phase (the
    warmup moves the same bytes as Adam, so it should save about nothing), and ``refresh_s``
    for the variance refresh's full-precision steps after the freeze; the compression
    phase's saving splits into ``compression_comm_s`` (less time blocked on communication) and
    ``compression_other_s`` (the rest: compute, the optimizer step). With a spin-wait run,
    ``spin_wait_s`` is what Horovod's own spinning wait added to Adam's steps.
    """
    adam, onebit = rows["adam"], rows["onebit"]
    t_a = adam["warmup_s_per_step"]
    w_a = adam["warmup_comm_s_per_step"] or 0.0
    out = {"adam_train_s": adam["train_s"], "onebit_train_s": onebit["train_s"],
           "speedup": adam["train_s"] / max(onebit["train_s"], 1e-9),
           "adam_comm_share": adam["warmup_comm_share"]}
    n_w, n_c = onebit["warmup_steps"], onebit["compression_steps"]
    out["warmup_steps"], out["compression_steps"] = n_w, n_c
    out["warmup_s"] = n_w * (t_a - onebit["warmup_s_per_step"]) if n_w else 0.0
    n_r = onebit["refresh_steps"]
    out["refresh_steps"] = n_r
    out["refresh_s"] = n_r * (t_a - onebit["refresh_s_per_step"]) if n_r else 0.0
    if n_c:
        t_c, w_c = onebit["compression_s_per_step"], onebit["compression_comm_s_per_step"] or 0.0
        out["compression_s"] = n_c * (t_a - t_c)
        out["compression_comm_s"] = n_c * (w_a - w_c)
        out["compression_other_s"] = out["compression_s"] - out["compression_comm_s"]
    else:
        out["compression_s"] = out["compression_comm_s"] = out["compression_other_s"] = 0.0
    if "adam_spin" in rows:
        out["adam_spin_train_s"] = rows["adam_spin"]["train_s"]
        out["spin_wait_s"] = rows["adam_spin"]["train_s"] - adam["train_s"]
    return out


def headline(b: dict, rows: dict[str, dict]) -> str:
    adam, onebit = rows["adam"], rows["onebit"]
    text = (f"1-bit Adam's steps took {b['onebit_train_s']:.0f} s against Horovod Adam's "
            f"{b['adam_train_s']:.0f} s with the same sleeping wait ({b['speedup']:.2f}x). "
            f"Adam spent {b['adam_comm_share']:.0%} of its step blocked on communication. "
            f"Warmup ({b['warmup_steps']} steps, same {adam['warmup_mb']:.3f} MB/step as Adam): "
            f"{onebit['warmup_s_per_step']:.3f} vs {adam['warmup_s_per_step']:.3f} s/step, "
            f"{b['warmup_s']:+.0f} s saved. ")
    if b["refresh_steps"]:
        text += (f"Variance refresh ({b['refresh_steps']} full-precision steps after the freeze,"
                 f" {onebit['refresh_mb']:.3f} MB/step): {onebit['refresh_s_per_step']:.3f} s/step,"
                 f" {b['refresh_s']:+.0f} s saved. ")
    if b["compression_steps"]:
        text += (f"Compression phase ({b['compression_steps']} steps, "
                 f"{onebit['compression_mb']:.4f} MB/step): {onebit['compression_s_per_step']:.3f}"
                 f" s/step, {b['compression_s']:+.0f} s saved: {b['compression_comm_s']:+.0f} s less"
                 f" waiting on communication, {b['compression_other_s']:+.0f} s the rest "
                 "(compute, optimizer step).")
    if "spin_wait_s" in b:
        text += (f" With Horovod's own spinning wait Adam's steps took "
                 f"{b['adam_spin_train_s']:.0f} s ({b['spin_wait_s']:+.0f} s against the sleeping "
                 "wait): what spinning costs ranks that share cores, up to this machine's "
                 "run-to-run noise.")
    return text


@click.command()
@click.option("--np", "np_", default=4, show_default=True, help="Ranks.")
@click.option("--bandwidth", default=DEFAULT_BANDWIDTH, show_default=True,
              callback=link_rate,
              help="Emulated link rate.")
@click.option("--steps", default=300, show_default=True, help="Training steps per optimizer.")
@click.option("--spin-baseline", is_flag=True,
              help="Also run Horovod Adam with Horovod's own spinning wait (a third run), to "
                   "show what that wait costs when ranks share cores.")
@click.option("--out-dir", default=str(Path("results") / "demo"), show_default=True,
              type=click.Path(file_okay=False), help="Where the JSON summaries and plot go.")
@click.option("--no-emulation", is_flag=True, help="Run on plain loopback.")
@click.argument("extra", nargs=-1)
def main(np_: int, bandwidth: str, steps: int, spin_baseline: bool, out_dir: str,
         no_emulation: bool, extra) -> None:
    """Train the byte-level LM with Horovod Adam and with 1-bit Adam; compare them.

    Both wait for their allreduces by sleeping (train_lm.py --wait sleep), so the comparison
    measures compression, not how each waits on shared cores.
    EXTRA arguments after -- go to examples/train_lm.py (e.g. -- --d-model 256).
    """
    try:
        find_train_lm()
    except FileNotFoundError as exc:
        raise click.ClickException(str(exc)) from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    emulate = not no_emulation
    if emulate:
        from ..cluster import EmulatorError, check_privileges

        try:
            check_privileges()
        except EmulatorError as exc:
            click.echo(f"NOTE: cannot emulate a {bandwidth} cluster here ({exc}); running on "
                       "plain loopback instead, where the network is not the bottleneck.")
            emulate = False
    tags = ["adam", "onebit"] + (["adam_spin"] if spin_baseline else [])
    started = time.monotonic()
    summaries = {tag: _run_one(tag, np_, bandwidth, steps, out, emulate, list(extra))
                 for tag in tags}
    rows = {tag: _row(tag, summaries[tag], steps) for tag in tags}
    where = f"{np_} ranks, emulated {bandwidth} links" if emulate else f"{np_} ranks, loopback"
    plot = out / "demo_val_loss.png"
    plot_val_loss({k: summaries[k] for k in ("adam", "onebit")}, plot,
                  f"Byte-level LM on pydoc_data.topics, {where}")

    from .report import machine_info, print_table

    info = machine_info()
    s = summaries["adam"]
    click.echo(f"\nResults ({where}; {s['params'] / 1e6:.2f}M parameters; {steps} steps; "
               f"{info['date']}; {info['cpu_count']} CPUs; Adam's single phase shown as its "
               "warmup):")
    print_table(list(rows.values()),
                [("optimizer", "optimizer", ""),
                 ("warmup s/step", "warmup_s_per_step", ".3f"),
                 ("warmup samples/s", "warmup_sps", ",.0f"),
                 ("warmup comm", "warmup_comm_share", ".0%"),
                 ("refresh steps", "refresh_steps", "d"),
                 ("refresh s/step", "refresh_s_per_step", ".3f"),
                 ("compr. s/step", "compression_s_per_step", ".3f"),
                 ("compr. samples/s", "compression_sps", ",.0f"),
                 ("compr. comm", "compression_comm_share", ".0%"),
                 ("MB/step warmup", "warmup_mb", ".3f"),
                 ("MB/step compr.", "compression_mb", ".4f"),
                 ("link MB/step", "measured_mb", ".3f"),
                 ("val loss", "val_loss", ".4f"),
                 ("steps s", "train_s", ",.0f"), ("run s", "wall_s", ",.0f")])
    click.echo("(comm: share of the step rank 0 was blocked on communication, the wire and "
               "waiting for slower ranks; link MB/step: all traffic, measured on the links; "
               "steps s: the training steps; run s: with the evaluations)")
    b = breakdown(rows)
    adam, onebit = summaries["adam"], summaries["onebit"]
    report = {"machine": info, "where": where, "steps": steps, "params": s["params"],
              "rows": list(rows.values()), "breakdown": b, "headline": headline(b, rows),
              "plot": str(plot), "demo_seconds": time.monotonic() - started,
              "val_loss_ratio": onebit["final_val_loss"] / adam["final_val_loss"],
              "bytes_ratio": onebit["total_bytes_per_rank"] / max(adam["total_bytes_per_rank"], 1)}
    (out / "demo.json").write_text(json.dumps(report, indent=1))
    click.echo(f"\n{report['headline']}")
    click.echo(f"val loss ratio (1-bit / Adam): {report['val_loss_ratio']:.4f}; bytes sent per "
               f"rank, 1-bit / Adam: {report['bytes_ratio']:.3f}; the demo's runs took "
               f"{report['demo_seconds']:.0f} s")
    click.echo(f"plot: {plot}\nsummary: {out / 'demo.json'}")


if __name__ == "__main__":
    main()
