"""Convergence of 1-bit Adam against Horovod Adam on examples/train_lm.py.

Runs examples/train_lm.py twice on the same number of local ranks (``horovodrun --gloo``), once
with ``--optimizer adam`` (hvd.DistributedOptimizer) and once with ``--optimizer onebit``
(hvd_onebit.DistributedOptimizer, freeze_step = warmup_frac * steps), with the same seed and so the
same initialisation and the same data order. It writes both validation-loss curves to
``OUT_DIR/convergence.png``, each run's summary and log to OUT_DIR, and prints one JSON object:

    final_val_loss_adam, final_val_loss_onebit   validation loss at the last step
    ratio_onebit_over_adam                       final_val_loss_onebit / final_val_loss_adam
    target_ratio, meets_target                   the target is <= 1.01
    loss_threshold, threshold_rule               a loss both runs reach (see below)
    steps_to_threshold_adam / _onebit            first evaluated step at or below it
    total_bytes_per_rank_adam / _onebit          bytes one rank sent over the whole run
    bytes_ratio_adam_over_onebit                 communication reduction
    bytes_per_step_adam, bytes_per_step_onebit_warmup, bytes_per_step_onebit_compression
    samples_per_sec_adam, samples_per_sec_onebit_warmup, samples_per_sec_onebit_compression
    steps_onebit_warmup / _refresh / _compression  1-bit Adam's steps by kind; the refresh's
                                                 full-precision steps after the freeze have
                                                 their own bytes_per_step_ and samples_per_sec_
    wall_seconds_adam, wall_seconds_onebit, wall_seconds_total   (launch included)

Threshold: 2% above the worse of the two final validation losses, so both runs reach it by
construction; the steps to reach it say how quickly each got close to its final loss. Steps are
only known at evaluation points (every --eval-every steps).

Bytes: Adam's are the ring-allreduce estimate 2*(n-1)/n * 4 bytes per parameter per step (what
hvd_onebit reports for its own warmup too); the compression phase's are the bytes 1-bit Adam
actually put on the wire.

With ``--nodes N`` the ranks run as N "nodes" (horovodrun hosts that are names of this machine,
so Horovod sets local and cross ranks as on a cluster) and a third run trains with
``--onebit-hierarchical`` (a name horovodrun cannot mistake for an abbreviation of its own
options); the JSON adds ``final_val_loss_onebit_hierarchical`` and
``ratio_hierarchical_over_flat`` (target: within 1%, ``hierarchical_within_1pct``).

Usage:
    python benchmarks/convergence.py                 # 4 ranks, 1000 steps
    python benchmarks/convergence.py --nodes 2       # 2 nodes x 2 ranks: flat vs hierarchical
    python benchmarks/convergence.py --quick         # 2 ranks, tiny model, a few steps (tests)
    python benchmarks/convergence.py --steps 2000 --np 8 --out-dir results/conv8 -- --n-layer 4

With ``--face ddp`` both runs are train_lm.py's DDP face under torchrun (``python -m
torch.distributed.run --standalone``): DDP + AdamW against DDP + ``hvd_onebit.ddp``, the same
data, model, schedule and defaults; the JSON is the same, with ``face``.

Usage (DDP):
    python benchmarks/convergence.py --face ddp --out-dir results/convergence_ddp

Arguments after ``--`` are passed to train_lm.py unchanged.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hvd_onebit_tools.bench.lm import plot_val_loss, train_lm
from hvd_onebit_tools.bench.report import provenance

REPO = Path(__file__).resolve().parents[3]
TRAIN_LM = REPO / "examples" / "train_lm.py"
TARGET_RATIO = 1.01
QUICK_ARGS = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--context", "32",
              "--batch-size", "4", "--eval-batches", "2"]


def first_step_at_or_below(curve: list[dict], threshold: float):
    for point in curve:
        if point["val_loss"] <= threshold:
            return point["step"]
    return None


def compare(adam: dict, onebit: dict, wall_adam: float, wall_onebit: float) -> dict:
    fa, fo = adam["final_val_loss"], onebit["final_val_loss"]
    threshold = 1.02 * max(fa, fo)
    ratio = fo / fa
    ph = onebit["phases"]
    comp, refresh = ph.get("compression", {}), ph.get("refresh", {})
    return {
        "world_size": adam["world_size"],
        "steps": adam["config"]["steps"],
        "freeze_step": onebit["freeze_step"],
        "warmup_frac": onebit["config"]["warmup_frac"],
        "params": adam["params"],
        "final_val_loss_adam": fa,
        "final_val_loss_onebit": fo,
        "ratio_onebit_over_adam": ratio,
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio <= TARGET_RATIO,
        "loss_threshold": threshold,
        "threshold_rule": "1.02 * max(final_val_loss_adam, final_val_loss_onebit)",
        "steps_to_threshold_adam": first_step_at_or_below(adam["val_curve"], threshold),
        "steps_to_threshold_onebit": first_step_at_or_below(onebit["val_curve"], threshold),
        "total_bytes_per_rank_adam": adam["total_bytes_per_rank"],
        "total_bytes_per_rank_onebit": onebit["total_bytes_per_rank"],
        "bytes_ratio_adam_over_onebit": adam["total_bytes_per_rank"]
        / max(onebit["total_bytes_per_rank"], 1),
        "bytes_per_step_adam": adam["phases"]["full_precision"]["bytes_per_step"],
        "bytes_per_step_onebit_warmup": ph["warmup"]["bytes_per_step"],
        "bytes_per_step_onebit_compression": comp.get("bytes_per_step"),
        "samples_per_sec_adam": adam["samples_per_sec"],
        "samples_per_sec_onebit_warmup": ph["warmup"]["samples_per_sec"],
        "samples_per_sec_onebit_compression": comp.get("samples_per_sec"),
        "steps_onebit_warmup": ph["warmup"]["steps"],
        "steps_onebit_refresh": refresh.get("steps", 0),
        "steps_onebit_compression": comp.get("steps", 0),
        "bytes_per_step_onebit_refresh": refresh.get("bytes_per_step"),
        "samples_per_sec_onebit_refresh": refresh.get("samples_per_sec"),
        "skipped_steps_onebit": onebit["telemetry"]["skipped_steps"],
        "wall_seconds_adam": wall_adam,
        "wall_seconds_onebit": wall_onebit,
        "wall_seconds_total": wall_adam + wall_onebit,
    }


def split_argv(argv, script: str) -> tuple[str, list[str], list[str]]:
    """(the command line as typed, this script's arguments, those after ``--`` for the example)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = " ".join(["python", f"benchmarks/{script}"] + argv)
    if "--" not in argv:
        return command, argv, []
    i = argv.index("--")
    return command, argv[:i], argv[i + 1:]


def main(argv=None) -> dict:
    command, argv, extra = split_argv(argv, "convergence.py")
    p = argparse.ArgumentParser(description="1-bit Adam vs Adam on examples/train_lm.py",
                                epilog="Arguments after -- go to train_lm.py.")
    p.add_argument("--np", type=int, default=None, help="ranks (default 4; --quick: 2)")
    p.add_argument("--steps", type=int, default=None, help="default 1000; --quick: 12")
    p.add_argument("--warmup-frac", type=float, default=None,
                   help="freeze_step / steps (default: train_lm.py's, the recommended freeze "
                        "for its --variance-refresh)")
    p.add_argument("--eval-every", type=int, default=None, help="default 50; --quick: 4")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--out-dir", default=str(REPO / "results" / "convergence"))
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per training run (default 900; --quick: 120)")
    p.add_argument("--quick", action="store_true", help="tiny model, 2 ranks, a few steps")
    p.add_argument("--face", choices=("horovod", "ddp"), default="horovod",
                   help="horovod: horovodrun, Horovod Adam vs hvd_onebit; ddp: torchrun, DDP + "
                        "Adam vs DDP + hvd_onebit.ddp")
    p.add_argument("--nodes", type=int, default=1,
                   help="run the ranks as this many nodes (at most 4: names of this machine) "
                        "and add a hierarchical 1-bit run")
    args = p.parse_args(argv)
    np = args.np or (2 if args.quick else 4)
    hosts = None
    if args.nodes > 1 and args.face == "ddp":
        raise SystemExit("--nodes is for the Horovod face")
    if args.nodes > 1:
        names = ["127.0.0.1", "127.1", "127.0.1", "localhost"]
        if args.nodes > len(names) or np % args.nodes:
            raise SystemExit(f"--nodes must divide --np and be at most {len(names)}")
        hosts = ",".join(f"{h}:{np // args.nodes}" for h in names[:args.nodes])
    steps = args.steps or (12 if args.quick else 1000)
    eval_every = args.eval_every or (4 if args.quick else 50)
    timeout = args.timeout or (120.0 if args.quick else 900.0)
    train_args = ["--steps", str(steps), "--eval-every", str(eval_every), "--seed", str(args.seed)]
    if args.warmup_frac is not None:
        train_args += ["--warmup-frac", str(args.warmup_frac)]
    if args.quick:
        train_args += QUICK_ARGS
    train_args += extra

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    face = args.face
    print(f"[convergence] {np} ranks, {face} face, train_lm.py {' '.join(train_args)}; "
          f"output in {out_dir}",
          file=sys.stderr, flush=True)
    adam_run = train_lm("adam", np, train_args, out_dir, timeout, script=TRAIN_LM, hosts=hosts,
                        face=face)
    adam, wall_adam = adam_run.summary, adam_run.wall_seconds
    print(f"[convergence] adam done in {wall_adam:.0f}s: final val {adam['final_val_loss']:.4f}",
          file=sys.stderr, flush=True)
    onebit_run = train_lm("onebit", np, train_args, out_dir, timeout, script=TRAIN_LM,
                          hosts=hosts, face=face)
    onebit, wall_onebit = onebit_run.summary, onebit_run.wall_seconds
    print(f"[convergence] onebit done in {wall_onebit:.0f}s: final val "
          f"{onebit['final_val_loss']:.4f}", file=sys.stderr, flush=True)

    result = compare(adam, onebit, wall_adam, wall_onebit)
    curves = {"adam": adam, "onebit": onebit}
    if hosts:
        hier_run = train_lm("onebit", np, train_args + ["--onebit-hierarchical"], out_dir, timeout,
                            script=TRAIN_LM, hosts=hosts, tag="onebit_hierarchical")
        hier = hier_run.summary
        curves["onebit_hierarchical"] = hier
        print(f"[convergence] hierarchical onebit done in {hier_run.wall_seconds:.0f}s: final val "
              f"{hier['final_val_loss']:.4f}", file=sys.stderr, flush=True)
        ratio = hier["final_val_loss"] / onebit["final_val_loss"]
        result.update({"nodes": args.nodes, "hosts": hosts,
                       "final_val_loss_onebit_hierarchical": hier["final_val_loss"],
                       "ratio_hierarchical_over_flat": ratio,
                       "hierarchical_within_1pct": abs(ratio - 1) <= 0.01,
                       "total_bytes_per_rank_onebit_hierarchical": hier["total_bytes_per_rank"],
                       "wall_seconds_onebit_hierarchical": hier_run.wall_seconds})
    png = out_dir / "convergence.png"
    ddp = face == "ddp"
    plot_val_loss(curves, png,
                  f"train_lm.py{' --face ddp' if ddp else ''} on {adam['world_size']} ranks: "
                  "1-bit Adam vs Adam", threshold=result["loss_threshold"],
                  labels={"adam": "DDP Adam", "onebit": "DDP + 1-bit Adam"} if ddp else None)
    result["plot"] = str(png)
    result["face"] = face
    result["command"] = command
    result["variance_refresh"] = onebit.get("variance_refresh")
    result.update(provenance())
    (out_dir / "summary.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1), flush=True)
    return result


if __name__ == "__main__":
    main()
