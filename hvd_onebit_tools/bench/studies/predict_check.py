"""Check the scale model against the emulated cluster: predicted vs measured step times.

    python benchmarks/predict_check.py run --out check/ [--repeats 3]   # measure (root; ~25 min)
    python benchmarks/predict_check.py compare check/                   # print every pair

``run`` calibrates (`hvd-onebit bench calibrate`), then runs `hvd-onebit bench train --json`
for np in {2, 4} x bandwidth in {100mbit, 1gbit, 10gbit} x model in {embedding, mlp} (flat
1-bit on the default transport, 'auto': torch.distributed), and the hierarchical check:
``--np 4 --ranks-per-node 2`` (2 emulated nodes of 2 ranks) at ``--hier-bandwidths`` with
``onebit_hierarchical``, ``--repeats`` times (one whole sweep after another, so slow spells of a
shared machine spread over all configurations), then calibrates again (unless
``--no-calibrate-after``); every JSON lands in ``--out``.
``compare`` predicts each configuration with `hvd-onebit bench predict` from the first
calibration (``--calibration`` for another) and prints, per configuration and method phase, the
predicted and measured step times (median and range over the runs) and their ratio, and which
pairs are within the bounds (25%; 15% for the compressed step at 1 Gbit/s), then three counts:
every pair, the methods' pairs (all but ``local``, which checks the compute input) and the
compressed steps'.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import click

NPS = (2, 4)
BANDWIDTHS = ("100mbit", "1gbit", "10gbit")
MODELS = ("embedding", "mlp")
METHODS = "local,horovod_fp32,horovod_fp16,onebit"
HIER_BANDWIDTHS = ("1gbit", "100mbit")
HIER_METHODS = "local,horovod_fp32,onebit,onebit_hierarchical"
# steps per method: at 100 Mbit/s an fp32 step takes seconds, so fewer
STEPS = {"100mbit": 6, "1gbit": 16, "10gbit": 16}
WARMUP_FRAC = 0.25
CLI = [sys.executable, "-m", "hvd_onebit_tools.cli", "bench"]


@click.group()
def main() -> None:
    """Predicted vs measured step times on the emulated cluster."""


@main.command()
@click.option("--out", required=True, type=click.Path(file_okay=False))
@click.option("--repeats", default=3, show_default=True)
@click.option("--np", "nps", default=",".join(map(str, NPS)), show_default=True)
@click.option("--bandwidths", default=",".join(BANDWIDTHS), show_default=True)
@click.option("--models", default=",".join(MODELS), show_default=True)
@click.option("--hier-bandwidths", default=",".join(HIER_BANDWIDTHS), show_default=True,
              help="Rates of the 2 nodes x 2 ranks runs with onebit_hierarchical ('' for none).")
@click.option("--hier-models", default=",".join(MODELS), show_default=True)
@click.option("--steps-factor", default=1.0, show_default=True,
              help="Scale every run's steps (a reduced check on a short quiet spell).")
@click.option("--calibrate-first/--no-calibrate-first", default=True, show_default=True,
              help="--no-calibrate-first: OUT/calibration.json is already there (just made).")
@click.option("--calibrate-after/--no-calibrate-after", default=True, show_default=True)
def run(out, repeats, nps, bandwidths, models, hier_bandwidths, hier_models, steps_factor,
        calibrate_first, calibrate_after) -> None:
    """Calibrate, run every bench train configuration --repeats times, calibrate again."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    def call(args, path):
        start = time.monotonic()
        proc = subprocess.run(CLI + args, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"FAILED {' '.join(args)}\n{proc.stderr[-3000:]}", file=sys.stderr, flush=True)
            return
        if path is not None:
            path.write_text(proc.stdout)
        print(f"{time.monotonic() - start:6.1f} s  {' '.join(args)}", file=sys.stderr, flush=True)

    if calibrate_first:
        call(["calibrate", "--out", str(out / "calibration.json")], None)
    def steps(bw):
        return str(max(4, round(STEPS.get(bw, 20) * steps_factor)))

    for rep in range(repeats):
        for bw in [b for b in bandwidths.split(",") if b]:
            for n in nps.split(","):
                for model in models.split(","):
                    call(["train", "--np", n, "--bandwidth", bw, "--model", model,
                          "--steps", steps(bw), "--warmup-frac", str(WARMUP_FRAC),
                          "--methods", METHODS, "--json"],
                         out / f"train_np{n}_{bw}_{model}_run{rep}.json")
        for bw in [b for b in hier_bandwidths.split(",") if b]:
            for model in hier_models.split(","):
                call(["train", "--np", "4", "--ranks-per-node", "2", "--bandwidth", bw,
                      "--model", model, "--steps", steps(bw), "--warmup-frac", str(WARMUP_FRAC),
                      "--methods", HIER_METHODS, "--json"],
                     out / f"train_np4_rpn2_{bw}_{model}_run{rep}.json")
    if calibrate_after:
        call(["calibrate", "--out", str(out / "calibration_after.json")], None)


@main.command()
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.option("--calibration", default=None, help="Default: FOLDER/calibration.json.")
@click.option("--json", "as_json", is_flag=True)
def compare(folder, calibration, as_json) -> None:
    """Predicted vs measured, for every bench train JSON in FOLDER (`bench predict --check`)."""
    args = ["predict", "--check", folder, "--calibration",
            calibration or str(Path(folder) / "calibration.json")]
    sys.exit(subprocess.call(CLI + args + (["--json"] if as_json else [])))


if __name__ == "__main__":
    main()
