"""The measurable targets of ``variance_refresh``, end to end, as one JSON object.

Runs, as subprocesses (each part's own output under OUT_DIR):

* ``digits``: ``benchmarks/auto_freeze.py --example digits --seeds 0,...,5 --runs
  adam,auto,refresh_5pct,refresh_auto`` (300 steps, 4 ranks): each seed's final validation loss
  over its Adam's, and the mean. Target: the refresh setting's mean ratio <= 1.01.
* ``lm``: ``benchmarks/auto_freeze.py --example lm --runs adam,auto,refresh_5pct,refresh_auto
  -- --steps 1000``: the final validation loss over Adam's (target <= 1.01) and the bytes per
  rank over the run over 1-bit Adam's at its auto freeze (target <= 0.6).
* ``train``: ``hvd-onebit bench train --np 4 --bandwidth 1gbit --model embedding --steps 600
  --methods onebit,onebit_refresh --warmup-frac 0.15 --json``, three times: each run's whole-run
  wall time of 1-bit Adam at 15% warmup over the refresh setting's (target >= 1.4) and the
  bytes ratio. Needs root (the emulated links).

``recommended`` (``--variance-refresh`` and ``--refresh-freeze-frac``) is the setting every part
measures. ``--dry-run`` prints the commands instead of running them.

Usage:
    python benchmarks/variance_refresh.py                       # everything (hours)
    python benchmarks/variance_refresh.py --parts train --train-repeats 1
    python benchmarks/variance_refresh.py --variance-refresh '{"first_interval": 16, "updates_per_interval": 4}'
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
from hvd_onebit_tools.bench.refresh import parse_variance_refresh

PARTS = ("digits", "lm", "train")
REFRESH_RUNS = ("refresh_5pct", "refresh_auto")
AUTO_FREEZE_RUNS = "adam,auto," + ",".join(REFRESH_RUNS)
TARGETS = {"digits_mean_ratio_to_adam": 1.01, "lm_ratio_to_adam": 1.01, "lm_bytes_vs_auto": 0.6,
           "train_run_speedup_vs_onebit": 1.4}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"subset of {','.join(PARTS)}")
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--variance-refresh", default="doubling",
                   help="the refresh setting: doubling or a JSON object of its fields")
    p.add_argument("--refresh-freeze-frac", type=float, default=0.05,
                   help="bench train's onebit_refresh freeze (auto_freeze.py's refresh_5pct is 5%%)")
    p.add_argument("--auto-min-steps", type=int, default=20, help="refresh_auto's min_steps")
    p.add_argument("--digits-seeds", default="0,1,2,3,4,5")
    p.add_argument("--lm-steps", type=int, default=1000)
    p.add_argument("--train-steps", type=int, default=600)
    p.add_argument("--train-repeats", type=int, default=3)
    p.add_argument("--bandwidth", default="1gbit", help="bench train's emulated links")
    p.add_argument("--out-dir", default=str(REPO / "results" / "variance_refresh"))
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    if [x for x in parts if x not in PARTS]:
        p.error(f"--parts: choose from {','.join(PARTS)}")
    try:
        parse_variance_refresh(args.variance_refresh)
    except ValueError as exc:
        p.error(str(exc))
    args.parts = parts
    return args


def commands(args) -> dict:
    """Per part, the command lines it runs (train: one per repeat)."""
    out = Path(args.out_dir)
    py = sys.executable
    refresh = ["--variance-refresh", args.variance_refresh, "--auto-min-steps",
               str(args.auto_min_steps)]
    cmds = {
        "digits": [[py, "-m", "hvd_onebit_tools.bench.studies.auto_freeze", "--example", "digits",
                    "--np", str(args.np), "--seeds", args.digits_seeds, "--runs",
                    AUTO_FREEZE_RUNS, *refresh, "--out-dir", str(out / "digits")]],
        "lm": [[py, "-m", "hvd_onebit_tools.bench.studies.auto_freeze", "--example", "lm", "--np",
                str(args.np), "--runs", AUTO_FREEZE_RUNS, *refresh, "--out-dir", str(out / "lm"),
                "--", "--steps", str(args.lm_steps)]],
        "train": [[py, "-m", "hvd_onebit_tools.cli", "bench", "train", "--np", str(args.np),
                   "--bandwidth", args.bandwidth, "--model", "embedding", "--steps",
                   str(args.train_steps), "--methods", "onebit,onebit_refresh",
                   "--warmup-frac", "0.15", "--variance-refresh", args.variance_refresh,
                   "--refresh-freeze-frac", str(args.refresh_freeze_frac), "--json"]
                  for _ in range(args.train_repeats)],
    }
    return {part: cmds[part] for part in args.parts}


def last_json(text: str) -> dict:
    """The last top-level JSON object a command printed (after its progress lines)."""
    start = text.rfind("\n{")
    start = 0 if text.startswith("{") and start < 0 else start + 1
    return json.JSONDecoder().raw_decode(text[start:])[0]


def digits_figures(result: dict) -> dict:
    """auto_freeze.py --seeds' result: per run, each seed's ratio to Adam and the mean."""
    runs = {name: {"ratio_to_adam": r["ratio_to_adam"], "mean": r["mean_ratio_to_adam"],
                   **({"failed": r["failed"]} if "failed" in r else {})}
            for name, r in result["summary"].items()}
    met = {name: runs[name]["mean"] is not None
           and runs[name]["mean"] <= TARGETS["digits_mean_ratio_to_adam"]
           for name in REFRESH_RUNS if name in runs}
    return {"runs": runs, "target": f"mean ratio to Adam <= {TARGETS['digits_mean_ratio_to_adam']}",
            "met": met}


def lm_figures(result: dict) -> dict:
    """auto_freeze.py's single-seed result: final loss, ratio to Adam, bytes vs auto."""
    runs = {}
    for name, r in result["runs"].items():
        runs[name] = ({"failed": r["failed"]} if "failed" in r else
                      {k: r.get(k) for k in ("final_val_loss", "ratio_to_adam",
                                             "total_bytes_per_rank", "bytes_vs_auto",
                                             "freeze_step", "steps_by_kind")})
    met = {}
    for name in REFRESH_RUNS:
        r = runs.get(name, {})
        if "ratio_to_adam" in r:
            met[name] = (r["ratio_to_adam"] is not None
                         and r["ratio_to_adam"] <= TARGETS["lm_ratio_to_adam"]
                         and r.get("bytes_vs_auto") is not None
                         and r["bytes_vs_auto"] <= TARGETS["lm_bytes_vs_auto"])
    return {"runs": runs, "target": f"ratio to Adam <= {TARGETS['lm_ratio_to_adam']} and bytes "
            f"vs auto <= {TARGETS['lm_bytes_vs_auto']}", "met": met}


def train_figures(reports: list[dict]) -> dict:
    """bench train --json reports: per run, each method's whole-run seconds and bytes, and
    onebit's over onebit_refresh's."""
    runs = []
    for rep in reports:
        by = {r["method"]: r for r in rep["rows"]}
        ob, rf = by["onebit"], by["onebit_refresh"]
        runs.append({"onebit_run_s": ob["run_seconds"], "refresh_run_s": rf["run_seconds"],
                     "run_speedup_vs_onebit": ob["run_seconds"] / rf["run_seconds"],
                     "onebit_bytes_per_rank": ob.get("run_bytes_per_rank"),
                     "refresh_bytes_per_rank": rf.get("run_bytes_per_rank"),
                     "measured_bytes_vs_onebit": rep["summary"].get(
                         "onebit_refresh_measured_bytes_vs_onebit"),
                     "refresh_steps_by_kind": rf.get("steps_by_kind"),
                     "onebit_compression_step_s": ob.get("compression_step_s"),
                     "refresh_compression_step_s": rf.get("compression_step_s")})
    ratios = [r["run_speedup_vs_onebit"] for r in runs]
    return {"runs": runs, "median_run_speedup_vs_onebit": statistics.median(ratios) if ratios
            else None, "range": [min(ratios), max(ratios)] if ratios else None,
            "target": f"every run >= {TARGETS['train_run_speedup_vs_onebit']}",
            "met": bool(ratios) and min(ratios) >= TARGETS["train_run_speedup_vs_onebit"]}


def run(cmd: list[str]) -> str:
    print(f"[variance_refresh] {' '.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=str(REPO))
    if proc.returncode:
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd)}\n{proc.stdout[-3000:]}")
    return proc.stdout


def main(argv=None) -> dict:
    args = parse_args(argv)
    cmds = commands(args)
    result = {"benchmark": "variance_refresh", "variance_refresh": args.variance_refresh,
              "refresh_freeze_frac": args.refresh_freeze_frac, "np": args.np,
              "commands": {k: [" ".join(c) for c in v] for k, v in cmds.items()}}
    if args.dry_run:
        print(json.dumps(result, indent=1))
        return result
    start = time.monotonic()
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    figures = {"digits": digits_figures, "lm": lm_figures}
    for part, part_cmds in cmds.items():
        try:
            if part == "train":
                reports = [last_json(run(c)) for c in part_cmds]
                (Path(args.out_dir) / "train.json").write_text(json.dumps(reports, indent=1))
                result[part] = train_figures(reports)
            else:
                result[part] = figures[part](last_json(run(part_cmds[0])))
        except (RuntimeError, KeyError, ValueError) as exc:
            result[part] = {"failed": str(exc)[-2000:]}
    result["wall_seconds"] = time.monotonic() - start
    (Path(args.out_dir) / "summary.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1), flush=True)
    return result


if __name__ == "__main__":
    main()
