"""`make demo`: Horovod Adam vs 1-bit Adam on an emulated 4-rank, 1 Gbit/s cluster.

Trains ``examples/train_lm.py`` (a byte-level GPT on the Python docs every CPython ships) twice,
changing only the optimizer wrapper, and prints a side-by-side table: throughput in each phase,
bytes on the wire per step (each rank's own link counter, and the optimizer's count), and the
final validation loss; writes the loss curves to ``results/demo/``.

Without the privileges to create network namespaces it says so and runs on plain loopback.
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from .lm import TrainingFailed, find_train_lm, plot_val_loss, train_lm


def _run_one(optimizer: str, np_: int, bandwidth: str, steps: int, out_dir: Path,
             emulate: bool, extra: list[str]) -> dict:
    train_args = ["--steps", str(steps), "--eval-every", str(max(1, steps // 12)), *extra]
    click.echo(f"\n=== {optimizer}: {np_} ranks, "
               f"{bandwidth if emulate else 'loopback (no emulation)'}, {steps} steps")
    try:
        if emulate:
            from ..cluster import EmulatedCluster

            def show(rank: int, line: str) -> None:
                if rank == 0:
                    click.echo(f"  {line.rstrip()}")

            with EmulatedCluster(np=np_, bandwidth=bandwidth) as cluster:
                run = train_lm(optimizer, np_, train_args, out_dir, 1800, cluster=cluster,
                               on_output=show, log_to_file=False)
        else:
            run = train_lm(optimizer, np_, train_args, out_dir, 1800, log_to_file=False)
    except TrainingFailed as exc:
        raise click.ClickException(str(exc)) from None
    summary = run.summary
    summary["demo_wall_seconds"] = run.wall_seconds
    summary["measured_tx_bytes_per_rank"] = run.measured_tx_bytes_per_rank
    return summary


def _row(s: dict, steps: int) -> dict:
    phases = s["phases"]
    warm = phases.get("warmup") or phases.get("full_precision") or {}
    comp = phases.get("compression", {})
    measured = s.get("measured_tx_bytes_per_rank")
    return {
        "optimizer": "1-bit Adam" if s["optimizer"] == "onebit" else "Horovod Adam",
        "warmup_sps": warm.get("samples_per_sec"),
        "compression_sps": comp.get("samples_per_sec"),
        "warmup_mb": warm.get("bytes_per_step", 0) / 1e6 if warm else None,
        "compression_mb": comp.get("bytes_per_step", 0) / 1e6 if comp else None,
        "measured_mb": None if measured is None else measured / steps / 1e6,
        "val_loss": s["final_val_loss"],
        "wall_s": s["wall_seconds"],
    }


@click.command()
@click.option("--np", "np_", default=4, show_default=True, help="Ranks.")
@click.option("--bandwidth", default="1gbit", show_default=True, help="Emulated link rate.")
@click.option("--steps", default=300, show_default=True, help="Training steps per optimizer.")
@click.option("--out-dir", default=str(Path("results") / "demo"), show_default=True,
              type=click.Path(file_okay=False), help="Where the JSON summaries and plot go.")
@click.option("--no-emulation", is_flag=True, help="Run on plain loopback.")
@click.argument("extra", nargs=-1)
def main(np_: int, bandwidth: str, steps: int, out_dir: str, no_emulation: bool, extra) -> None:
    """Train the byte-level LM with Horovod Adam and with 1-bit Adam; compare them.

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
    summaries = {opt: _run_one(opt, np_, bandwidth, steps, out, emulate, list(extra))
                 for opt in ("adam", "onebit")}
    rows = [_row(summaries[k], steps) for k in ("adam", "onebit")]
    where = f"{np_} ranks, emulated {bandwidth} links" if emulate else f"{np_} ranks, loopback"
    plot = out / "demo_val_loss.png"
    plot_val_loss(summaries, plot, f"Byte-level LM on pydoc_data.topics, {where}")

    from .report import machine_info, print_table

    info = machine_info()
    click.echo(f"\nResults ({where}; {steps} steps; {info['date']}; {info['cpu_count']} CPUs):")
    print_table(rows, [("optimizer", "optimizer", ""),
                       ("warmup samples/s", "warmup_sps", ",.0f"),
                       ("compression samples/s", "compression_sps", ",.0f"),
                       ("MB/step warmup", "warmup_mb", ".3f"),
                       ("MB/step compression", "compression_mb", ".4f"),
                       ("measured MB/step (all traffic)", "measured_mb", ".3f"),
                       ("final val loss", "val_loss", ".4f"), ("train s", "wall_s", ",.0f")])
    adam, onebit = summaries["adam"], summaries["onebit"]
    report = {"machine": info, "where": where, "steps": steps, "rows": rows, "plot": str(plot),
              "val_loss_ratio": onebit["final_val_loss"] / adam["final_val_loss"],
              "bytes_ratio": onebit["total_bytes_per_rank"] / max(adam["total_bytes_per_rank"], 1)}
    (out / "demo.json").write_text(json.dumps(report, indent=1))
    click.echo(f"val loss ratio (1-bit / Adam): {report['val_loss_ratio']:.4f}; bytes sent per "
               f"rank, 1-bit / Adam: {report['bytes_ratio']:.3f}")
    click.echo(f"plot: {plot}\nsummary: {out / 'demo.json'}")


if __name__ == "__main__":
    main()
