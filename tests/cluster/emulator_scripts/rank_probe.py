"""A Horovod-free rank program: reports what its emulated host looks like, then fails or sleeps.

Usage: python rank_probe.py [--fail-rank R] [--exit-code C] [--sleep S]
Prints one JSON line (rank, hostname, what the hostname resolves to, the HOROVOD_* environment,
PID-namespace view), then 'rank <r> ready'; then rank R exits with C and every other rank
sleeps S seconds (so tests can crash, time out, interrupt or terminate a job quickly).
"""
import argparse
import json
import os
import socket
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--fail-rank", type=int, default=-1)
parser.add_argument("--exit-code", type=int, default=3)
parser.add_argument("--sleep", type=float, default=0.0)
args = parser.parse_args()

rank = int(os.environ["HOROVOD_RANK"])
hostname = socket.gethostname()
print(json.dumps({
    "rank": rank,
    "hostname": hostname,
    "resolved": socket.gethostbyname(hostname),
    "peers": {f"node{r}": socket.gethostbyname(f"node{r}")
              for r in range(int(os.environ["HOROVOD_CROSS_SIZE"]))},
    "env": {k: v for k, v in os.environ.items()
            if k.startswith(("HOROVOD_", "NCCL_")) or k in ("PYTHONUNBUFFERED", "HOB_TEST_EXTRA")},
    "pid": os.getpid(),
}), flush=True)
print(f"rank {rank} ready", flush=True)
if rank == args.fail_rank:
    sys.exit(args.exit_code)
time.sleep(args.sleep)
