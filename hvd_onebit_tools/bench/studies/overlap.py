"""The compressed step against its targets, each configuration run several times.

Runs ``hvd-onebit bench train --json`` ``--repeats`` times (default 3) for each configuration and
prints one JSON object with every run's figures and their median:

* ``embedding`` and ``mlp``: ``--methods local,horovod_fp32,onebit``; the compressed step's
  speed-up over Horovod fp32's step, the whole run's, and the compressed step over the ``local``
  step (no communication), plus where the compressed step's time went (backward, compress, wait,
  server, decode: rank 0's own accounting).
* ``buckets``: a model with several buckets (the MLP with ``--bucket-size-mb``, default 8),
  ``--methods onebit,onebit_sync``: the compressed step with the exchange started from the
  gradient hooks (overlap) over the same step started in step().

Usage:
    python benchmarks/overlap.py                       # 3 runs each, 4 ranks, 1 Gbit/s
    python benchmarks/overlap.py --repeats 1 --configs embedding --steps 20
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

from hvd_onebit_tools.bench.report import repeated_runs

CONFIGS = ("embedding", "mlp", "buckets")


def run_once(args, config: str) -> dict:
    model = "embedding" if config == "embedding" else "mlp"
    methods = "onebit,onebit_sync" if config == "buckets" else "local,horovod_fp32,onebit"
    cmd = [sys.executable, "-m", "hvd_onebit_tools.cli", "bench", "train", "--json", "--np", str(args.np),
           "--bandwidth", args.bandwidth, "--steps", str(args.steps), "--model", model,
           "--methods", methods]
    if config == "buckets":
        cmd += ["--bucket-size-mb", str(args.bucket_size_mb)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    report = json.loads(out)
    rows = {r["method"]: r for r in report["rows"]}
    s = report["summary"]
    onebit = rows["onebit"]
    fig = {"compressed_step_ms": onebit["compression_step_s"] * 1e3,
           "breakdown_ms": {k: v * 1e3 for k, v in onebit["compression_breakdown_s"].items()},
           "buckets_bytes_per_step": onebit.get("compression_bytes_per_step")}
    if config == "buckets":
        fig["sync_step_ms"] = rows["onebit_sync"]["compression_step_s"] * 1e3
        fig["overlap_vs_sync"] = s["onebit_overlap_step_vs_sync"]
    else:
        fig["fp32_step_ms"] = rows["horovod_fp32"]["all_step_s"] * 1e3
        fig["local_step_ms"] = rows["local"]["all_step_s"] * 1e3
        fig["compressed_step_speedup_vs_fp32"] = s["onebit_compression_step_speedup_vs_fp32"]
        fig["run_speedup_vs_fp32"] = s["onebit_run_speedup_vs_fp32"]
        fig["compressed_step_vs_local"] = s["onebit_compression_step_vs_local"]
    return fig


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {','.join(CONFIGS)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--bandwidth", default="1gbit")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--bucket-size-mb", type=float, default=8.0,
                   help="the 'buckets' configuration's bucket size (the MLP is 36 MiB)")
    args = p.parse_args(argv)
    result = {"np": args.np, "bandwidth": args.bandwidth, "steps": args.steps, "configs": {}}
    for config in args.configs.split(","):
        result["configs"][config] = repeated_runs(lambda: run_once(args, config), args.repeats,
                                                  f"overlap {config}")
    print(json.dumps(result, indent=1), flush=True)
    return result


if __name__ == "__main__":
    main()
