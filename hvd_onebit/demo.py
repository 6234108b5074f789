"""`make demo`: Horovod Adam vs 1-bit Adam on an emulated 4-rank, 1 Gbit/s cluster.

Trains ``examples/train_lm.py`` (a byte-level GPT on the Python docs every CPython ships) twice,
changing only the optimizer wrapper, and prints a side-by-side table: throughput in each phase,
bytes on the wire per step (each rank's own link counter, and the optimizer's count), and the
final validation loss; writes the loss curves to ``results/demo/``.

Without the privileges to create network namespaces it says so and runs on plain loopback.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import click

from .testing import REPO_ROOT as REPO
from .testing import job_environment

EXAMPLE = REPO / "examples" / "train_lm.py"


def _run_one(optimizer: str, np_: int, bandwidth: str, steps: int, out_dir: Path,
             emulate: bool, extra: list[str]) -> dict:
    json_out = out_dir / f"{optimizer}.json"
    argv = [sys.executable, str(EXAMPLE), "--optimizer", optimizer, "--steps", str(steps),
            "--eval-every", str(max(1, steps // 12)), "--json-out", str(json_out), *extra]
    env = job_environment(f"demo-{optimizer}-{os.getpid()}")
    click.echo(f"\n=== {optimizer}: {np_} ranks, "
               f"{bandwidth if emulate else 'loopback (no emulation)'}, {steps} steps")
    start = time.monotonic()
    measured = None
    if emulate:
        from .emulator import EmulatedCluster

        def show(rank: int, line: str) -> None:
            if rank == 0:
                click.echo(f"  {line.rstrip()}")

        with EmulatedCluster(np=np_, bandwidth=bandwidth) as cluster:
            result = cluster.run(argv, env=env, timeout=1800, cwd=REPO, on_output=show)
        if not result.ok:
            raise click.ClickException(f"the {optimizer} run failed (exit {result.returncode}):\n"
                                       + result.ranks[result.first_failed_rank or 0].output[-3000:])
        measured = sum(r.tx_bytes for r in result.ranks) / len(result.ranks)
    else:
        cmd = ["horovodrun", "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", *argv]
        proc = subprocess.run(cmd, env=env, cwd=REPO, timeout=1800)
        if proc.returncode != 0:
            raise click.ClickException(f"the {optimizer} run failed (exit {proc.returncode})")
    summary = json.loads(json_out.read_text())
    summary["demo_wall_seconds"] = time.monotonic() - start
    summary["measured_tx_bytes_per_rank"] = measured
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


def _plot(summaries: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, s in summaries.items():
        curve = s["val_curve"]
        ax.plot([c["step"] for c in curve], [c["val_loss"] for c in curve], marker=".",
                label=f"{'1-bit Adam' if name == 'onebit' else 'Horovod Adam'} "
                      f"(final {s['final_val_loss']:.3f})")
    freeze = summaries.get("onebit", {}).get("freeze_step")
    if freeze:
        ax.axvline(freeze, color="grey", ls="--", lw=0.8, label=f"freeze_step {freeze}")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


@click.command()
@click.option("--np", "np_", default=4, show_default=True, help="Ranks.")
@click.option("--bandwidth", default="1gbit", show_default=True, help="Emulated link rate.")
@click.option("--steps", default=300, show_default=True, help="Training steps per optimizer.")
@click.option("--out-dir", default=str(REPO / "results" / "demo"), show_default=True,
              type=click.Path(file_okay=False), help="Where the JSON summaries and plot go.")
@click.option("--no-emulation", is_flag=True, help="Run on plain loopback.")
@click.argument("extra", nargs=-1)
def main(np_: int, bandwidth: str, steps: int, out_dir: str, no_emulation: bool, extra) -> None:
    """Train the byte-level LM with Horovod Adam and with 1-bit Adam; compare them.

    EXTRA arguments after -- go to examples/train_lm.py (e.g. -- --d-model 256).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    emulate = not no_emulation
    if emulate:
        from .emulator import EmulatorError, check_privileges

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
    _plot(summaries, plot, f"Byte-level LM on pydoc_data.topics, {where}")

    from .cli_bench import machine_info, print_table

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
