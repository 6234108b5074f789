"""Hierarchical against flat 1-bit Adam on emulated nodes, each bandwidth run several times.

Runs ``hvd-onebit bench train --json --np 4 --ranks-per-node 2`` (2 nodes of 2 ranks; the
bandwidth between nodes, the nodes' own loopback and shared memory inside them) ``--repeats``
times (default 3) per bandwidth, with ``--methods horovod_fp32,onebit,onebit_hierarchical`` (Horovod fp32
beside them on the same topology; ``--no-fp32`` leaves it out, it takes ~5 s a
step at 100 Mbit/s) and prints one JSON object: per run the compressed steps, the hierarchical /
flat speed and bytes between nodes (each node's link counter, per compressed step), the
hierarchical step's breakdown; then the median and range of each figure.

Usage:
    python benchmarks/hierarchical.py                          # 100mbit and 1gbit, 3 runs each
    python benchmarks/hierarchical.py --bandwidths 1gbit --repeats 1 --no-fp32
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

from hvd_onebit_tools.bench.report import repeated_runs


def run_once(args, bandwidth: str) -> dict:
    methods = "onebit,onebit_hierarchical" if args.no_fp32 else "horovod_fp32,onebit,onebit_hierarchical"
    cmd = [sys.executable, "-m", "hvd_onebit_tools.cli", "bench", "train", "--json", "--np", "4",
           "--ranks-per-node", "2", "--bandwidth", bandwidth, "--steps", str(args.steps),
           "--warmup-frac", str(args.warmup_frac), "--model", args.model, "--methods", methods,
           "--intra-node", args.intra_node]
    report = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    rows = {r["method"]: r for r in report["rows"]}
    s = report["summary"]
    flat, hier = rows["onebit"], rows["onebit_hierarchical"]
    fig = {"flat_step_ms": flat["compression_step_s"] * 1e3,
           "hier_step_ms": hier["compression_step_s"] * 1e3,
           "hier_vs_flat_speed": s["onebit_hier_compression_step_speedup_vs_onebit"],
           "hier_vs_flat_bytes": s["onebit_hier_measured_bytes_vs_onebit"],
           "flat_node_tx_mb_per_step": flat["compression_measured_tx_bytes_per_step"] / 1e6,
           "hier_node_tx_mb_per_step": hier["compression_measured_tx_bytes_per_step"] / 1e6,
           "hier_breakdown_ms": {k: v * 1e3 for k, v in hier["compression_breakdown_s"].items()}}
    if "horovod_fp32" in rows:
        fig["fp32_step_ms"] = rows["horovod_fp32"]["all_step_s"] * 1e3
        fig["fp32_node_tx_mb_per_step"] = \
            rows["horovod_fp32"]["all_measured_tx_bytes_per_step"] / 1e6
    return fig


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bandwidths", default="100mbit,1gbit")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup-frac", type=float, default=0.1)
    p.add_argument("--model", default="embedding", choices=["embedding", "mlp"])
    p.add_argument("--intra-node", default="auto", choices=["auto", "shared_memory", "network"])
    p.add_argument("--no-fp32", action="store_true", help="leave Horovod fp32 out")
    args = p.parse_args(argv)
    result = {"nodes": 2, "ranks_per_node": 2, "steps": args.steps, "model": args.model,
              "intra_node": args.intra_node, "bandwidths": {}}
    for bandwidth in args.bandwidths.split(","):
        result["bandwidths"][bandwidth] = repeated_runs(
            lambda: run_once(args, bandwidth), args.repeats, f"hierarchical {bandwidth}")
    print(json.dumps(result, indent=1), flush=True)
    return result


if __name__ == "__main__":
    main()
