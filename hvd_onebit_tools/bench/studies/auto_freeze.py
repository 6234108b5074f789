"""freeze_step="auto" against fixed warmups and Adam, on examples/train_lm.py or train_digits.py.

Runs the example on the same ranks, seed and data four times: Horovod Adam, and 1-bit Adam with
``--warmup-frac auto`` (freeze once the variance has settled), a deliberately early fixed freeze
(2% of the steps) and a late one (50%). Writes ``OUT_DIR/<example>_auto_freeze.png`` (validation
loss against step, each freeze marked), each run's JSON summary and log under OUT_DIR/<run>/,
and prints one JSON object:

    runs.<name>.final_val_loss, .ratio_to_adam     the last validation loss, and / Adam's
    runs.<name>.freeze_step, .freeze_fraction      where the variance froze (1-bit runs)
    runs.<name>.total_bytes_per_rank               bytes one rank sent over the run
    runs.<name>.failed                             instead, why the run failed (e.g. the example
                                                   stops at a non-finite loss: a divergence)
    auto_freeze_decision                           the step, the figure that triggered it, history
    auto_in_10_30_percent, auto_within_1_01_of_adam  the automatic freeze's two targets

``refresh_5pct``, ``refresh_3pct`` and ``refresh_auto`` (not run by default) add ``variance_refresh`` (``--variance-refresh``,
default doubling) to 1-bit Adam frozen at 5% (or 3%) of the steps, and at ``"auto"`` with a
short ``auto_freeze`` minimum (``--auto-min-steps``, default 20): early freezes, which a refresh
schedule makes the recommended setting.
They also report ``bytes_vs_auto`` (their bytes per rank / the ``auto`` run's) and
``steps_by_kind`` (warmup, refresh and compressed steps, from the schedule and the freeze).

``adam_reordered`` (not run by default) is Horovod Adam again with only the order of the batches
changed (the example's ``--data-seed``): its ratio to Adam is how far the final loss moves with
the batch order alone, the scale against which the other ratios are read. ``--seeds 0,1,2``
repeats everything per seed (``--seed`` to the example; ``OUT_DIR/seed<s>/``) and adds
``per_seed`` (each seed's result as above) and ``summary.<run>``: each seed's ratio to that
seed's Adam, their mean, and for ``auto`` each seed's freeze fraction.

Bytes: 1-bit runs report what they sent (warmup: the ring-allreduce figure 2 (n-1)/n * 4 bytes
per parameter per step; compression: bytes on the wire); Adam's are that ring figure every step.

Usage:
    python benchmarks/auto_freeze.py --example lm        # 4 ranks, train_lm.py's 1000 steps
    python benchmarks/auto_freeze.py --example digits    # 4 ranks, train_digits.py's 300 steps
    python benchmarks/auto_freeze.py --example digits --seeds 0,1,2,3,4 --runs adam,adam_reordered,auto
    python benchmarks/auto_freeze.py --example digits --seeds 0,1,2,3,4,5 --runs adam,auto,refresh_5pct,refresh_auto
    python benchmarks/auto_freeze.py --example lm --runs adam,auto,refresh_5pct,refresh_auto
    python benchmarks/auto_freeze.py --example lm --np 2 -- --steps 200   # args after -- go to the example
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from hvd_onebit_tools.bench.studies.convergence import split_argv
from hvd_onebit_tools.bench.lm import TrainingFailed, train_lm
from hvd_onebit_tools.bench.refresh import parse_variance_refresh
from hvd_onebit_tools.bench.report import provenance
from hvd_onebit.layout import ring_allreduce_bytes

REPO = Path(__file__).resolve().parents[3]
SCRIPTS = {"lm": REPO / "examples" / "train_lm.py", "digits": REPO / "examples" / "train_digits.py"}
RUNS = {"adam": ("adam", None), "auto": ("onebit", "auto"), "early_2pct": ("onebit", "0.02"),
        "late_50pct": ("onebit", "0.5"), "adam_reordered": ("adam", None),
        "refresh_5pct": ("onebit", "0.05"), "refresh_3pct": ("onebit", "0.03"),
        "refresh_auto": ("onebit", "auto"), "frozen_20pct": ("onebit", "0.2")}
REFRESH_RUNS = ("refresh_5pct", "refresh_3pct", "refresh_auto")  # with --variance-refresh
AUTO_RUNS = ("auto", "refresh_auto")  # freeze_step="auto"
DEFAULT_RUNS = ("adam", "auto", "early_2pct", "late_50pct")
REFRESH_AUTO_MIN_STEPS = 20  # auto_freeze's min_steps for refresh_auto (its own default: 50)
EXAMPLE_SEEDS = {"lm": 1337, "digits": 0}  # each example's --seed default
REORDERED_DATA_SEED = 1000  # added to the run's seed: another batch order, same model and split


def summarize(name: str, summary: dict, wall: float) -> dict:
    steps = summary["config"]["steps"]
    world = summary["world_size"]
    if summary["optimizer"] == "adam":
        total_bytes = steps * ring_allreduce_bytes(4 * summary["params"], world)
    else:
        total_bytes = summary["total_bytes_per_rank"]
    freeze = summary.get("freeze_step")
    out = {"final_val_loss": summary["final_val_loss"], "freeze_step": freeze,
           "freeze_fraction": freeze / steps if freeze else None,
           "total_bytes_per_rank": total_bytes, "wall_seconds": wall,
           "val_curve": [(c["step"], c["val_loss"]) for c in summary["val_curve"]]}
    if summary.get("variance_refresh", "none") != "none":
        out["variance_refresh"] = summary["variance_refresh"]
        out["steps_by_kind"] = summary.get("steps_by_kind")
    return out


def plot(runs: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    for i, (name, r) in enumerate(runs.items()):
        color = f"C{i}"
        steps, losses = zip(*r["val_curve"])
        ax.plot(steps, losses, "-" if name == "adam" else "--", color=color, marker="o",
                markersize=2, label=f"{name} (final {r['final_val_loss']:.4f}, "
                                    f"{r['total_bytes_per_rank'] / 1e6:.0f} MB/rank)")
        if r["freeze_step"]:
            ax.axvline(r["freeze_step"], color=color, ls=":", lw=1)
    losses = [v for r in runs.values() for _, v in r["val_curve"]]
    top = max(min(losses) + 1.5, 1.1 * max(r["final_val_loss"] for r in runs.values()))
    ax.set_ylim(min(losses) - 0.05, min(max(losses), top))  # every final loss in view
    ax.set_xlabel("step (dotted: where each 1-bit run froze the variance)")
    ax.set_ylabel("validation loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def seed_arg(extra: list[str]) -> Optional[int]:
    """The ``--seed`` among the example's arguments, or None."""
    for i, arg in enumerate(extra):
        if arg == "--seed" and i + 1 < len(extra):
            return int(extra[i + 1])
        if arg.startswith("--seed="):
            return int(arg.split("=", 1)[1])
    return None


def example_seed(example: str, extra: list[str]) -> int:
    """The ``--seed`` among the example's arguments, else the example's default."""
    seed = seed_arg(extra)
    return EXAMPLE_SEEDS[example] if seed is None else seed


def train_args_for(name: str, args, extra: list[str]) -> list[str]:
    """The example's arguments for run ``name`` (after ``extra``, the arguments after --)."""
    _, frac = RUNS[name]
    train_args = list(extra) + (["--warmup-frac", frac] if frac else [])
    if name == "adam_reordered":
        reordered = example_seed(args.example, extra) + REORDERED_DATA_SEED
        train_args += ["--data-seed", str(reordered)]
    if name in REFRESH_RUNS:
        train_args += ["--variance-refresh", args.variance_refresh]
    elif RUNS[name][0] == "onebit":  # the other 1-bit runs keep the variance frozen, whatever
        train_args += ["--variance-refresh", "none"]  # the examples' default refresh
    if name == "refresh_auto":
        train_args += ["--auto-freeze-min-steps", str(args.auto_min_steps)]
    return train_args


def run_all(args, names: list[str], extra: list[str], out_dir: Path, command: str) -> dict:
    """Every run in ``names`` on the example with ``extra``; the result object described above."""
    runs = {}
    for name in names:
        optimizer, _ = RUNS[name]
        run_dir = out_dir / name
        run_dir.mkdir(parents=True, exist_ok=True)
        train_args = train_args_for(name, args, extra)
        try:
            run = train_lm(optimizer, args.np, train_args, run_dir, args.timeout,
                           script=SCRIPTS[args.example])
        except TrainingFailed as exc:
            lines = str(exc).splitlines()
            reason = [x for x in lines if "FloatingPointError:" in x] or \
                [x for x in lines if "Error" in x] or [str(exc)[-300:]]
            runs[name] = {"failed": reason[0]}
            print(f"[auto_freeze] {name}: failed: {runs[name]['failed']}", file=sys.stderr,
                  flush=True)
            continue
        runs[name] = summarize(name, run.summary, run.wall_seconds)
        if name in AUTO_RUNS:
            runs[name]["decision"] = run.summary.get("freeze_decision")
        print(f"[auto_freeze] {name}: final val {runs[name]['final_val_loss']:.4f}, freeze "
              f"{runs[name]['freeze_step']}, {run.wall_seconds:.0f}s", file=sys.stderr, flush=True)
    adam = runs.get("adam", {}).get("final_val_loss")
    done = {name: r for name, r in runs.items() if "failed" not in r}
    auto_bytes = done.get("auto", {}).get("total_bytes_per_rank")
    for name, r in done.items():
        r["ratio_to_adam"] = r["final_val_loss"] / adam if adam else None
        if name in REFRESH_RUNS and auto_bytes:
            r["bytes_vs_auto"] = r["total_bytes_per_rank"] / auto_bytes
    if "refresh_auto" in done:
        done["refresh_auto"]["freeze_decision"] = done["refresh_auto"].pop("decision")
    result = {"example": args.example, "np": args.np, "command": command, **provenance(),
              "runs": runs}
    for name in REFRESH_RUNS:
        r = done.get(name)
        if r and r.get("ratio_to_adam") is not None:
            result[f"{name}_within_1_01_of_adam"] = r["ratio_to_adam"] <= 1.01
        if r and "bytes_vs_auto" in r:
            result[f"{name}_bytes_within_0_6_of_auto"] = r["bytes_vs_auto"] <= 0.6
    if "auto" in done:
        auto = done["auto"]
        result["auto_freeze_decision"] = auto.pop("decision")
        frac = auto["freeze_fraction"]  # None: it never froze (a run shorter than max_steps)
        result["auto_in_10_30_percent"] = frac is not None and 0.1 <= frac <= 0.3
        if adam:
            result["auto_within_1_01_of_adam"] = auto["ratio_to_adam"] <= 1.01
    png = out_dir / f"{args.example}_auto_freeze.png"
    plot(done, png, f"{SCRIPTS[args.example].name} on {args.np} ranks: where to freeze")
    result["plot"] = str(png)
    (out_dir / "summary.json").write_text(json.dumps(result, indent=1))
    return result


def across_seeds(per_seed: dict) -> dict:
    """Per run: each seed's ratio to its Adam and their mean; for auto, where it froze."""
    summary: dict = {}
    for seed, result in per_seed.items():
        for name, r in result["runs"].items():
            if name == "adam":
                continue
            row = summary.setdefault(name, {"ratio_to_adam": {}, "failed": {}})
            if "failed" in r:
                row["failed"][seed] = r["failed"]
            elif r.get("ratio_to_adam") is not None:
                row["ratio_to_adam"][seed] = r["ratio_to_adam"]
            if name in AUTO_RUNS and "failed" not in r:
                row.setdefault("freeze_fraction", {})[seed] = r["freeze_fraction"]
            if "bytes_vs_auto" in r:
                row.setdefault("bytes_vs_auto", {})[seed] = r["bytes_vs_auto"]
    for row in summary.values():
        ratios = list(row["ratio_to_adam"].values())
        row["mean_ratio_to_adam"] = sum(ratios) / len(ratios) if ratios else None
        row["range_ratio_to_adam"] = [min(ratios), max(ratios)] if ratios else None
        if row.get("bytes_vs_auto"):
            b = list(row["bytes_vs_auto"].values())
            row["mean_bytes_vs_auto"] = sum(b) / len(b)
        if not row["failed"]:
            del row["failed"]
    return summary


def main(argv=None) -> dict:
    command, argv, extra = split_argv(argv, "auto_freeze.py")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Arguments after -- go to the example script.")
    p.add_argument("--example", choices=sorted(SCRIPTS), default="lm")
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--runs", default=",".join(DEFAULT_RUNS), help=f"subset of {','.join(RUNS)}")
    p.add_argument("--seeds", default=None,
                   help="comma-separated seeds: everything once per seed (--seed to the example)")
    p.add_argument("--out-dir", default=None, help="default results/auto_freeze_<example>")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per training run")
    p.add_argument("--variance-refresh", default="doubling",
                   help="the refresh runs' schedule: doubling or a JSON object of its fields")
    p.add_argument("--auto-min-steps", type=int, default=REFRESH_AUTO_MIN_STEPS,
                   help="refresh_auto's auto_freeze min_steps")
    args = p.parse_args(argv)
    try:
        parse_variance_refresh(args.variance_refresh)
    except ValueError as exc:
        p.error(str(exc))
    names = args.runs.split(",")
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        p.error(f"--runs: unknown {', '.join(unknown)}; choose from {', '.join(RUNS)}")
    out_dir = Path(args.out_dir or REPO / "results" / f"auto_freeze_{args.example}")
    if args.seeds is None:
        result = run_all(args, names, extra, out_dir, command)
    else:
        if seed_arg(extra) is not None:
            p.error("--seeds sets the example's --seed: do not pass --seed after --")
        if "adam" not in names:
            p.error("--seeds compares every run with its seed's Adam: include adam in --runs")
        per_seed = {}
        for seed in (int(s) for s in args.seeds.split(",")):
            print(f"[auto_freeze] seed {seed}", file=sys.stderr, flush=True)
            per_seed[str(seed)] = run_all(args, names, list(extra) + ["--seed", str(seed)],
                                          out_dir / f"seed{seed}", command)
        result = {"example": args.example, "np": args.np, "command": command, **provenance(),
                  "seeds": list(per_seed), "summary": across_seeds(per_seed),
                  "per_seed": per_seed}
        (out_dir / "summary.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1), flush=True)
    return result


if __name__ == "__main__":
    main()
