"""One timed hvd.allreduce over the emulated network; prints a JSON line per rank.

Usage: python allreduce.py [MBYTES] [--crash-rank R] [--sleep S]
  MBYTES        size of the float32 tensor to allreduce (default 4)
  --crash-rank  that rank exits with status 3 right after hvd.init() (the others then block)
  --sleep       every rank sleeps S seconds after init (to test SIGINT/SIGTERM/timeouts)
"""
import argparse
import json
import os
import socket
import sys
import time

import horovod.torch as hvd
import torch

parser = argparse.ArgumentParser()
parser.add_argument("mbytes", type=float, nargs="?", default=4.0)
parser.add_argument("--crash-rank", type=int, default=-1)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--pid-file", default=None, help="each rank appends its host PID here")
args = parser.parse_args()

hvd.init()
if args.pid_file:
    # Host-visible PID: /proc/self in the caller's mount namespace is not ours, so use NSpid.
    with open(args.pid_file, "a") as f:
        f.write(f"{hvd.rank()} {socket.gethostname()} {os.getpid()}\n")
if hvd.rank() == args.crash_rank:
    print(f"rank {hvd.rank()} crashing on purpose", flush=True)
    sys.exit(3)
hvd.allreduce(torch.ones(4), name="warmup")  # connections are set up before the timed part
if args.sleep:
    time.sleep(args.sleep)
x = torch.ones(int(args.mbytes * 1e6 / 4), dtype=torch.float32)
t0 = time.perf_counter()
y = hvd.allreduce(x, op=hvd.Sum, name="big")
seconds = time.perf_counter() - t0
assert float(y[0]) == hvd.size(), float(y[0])
print(json.dumps({"rank": hvd.rank(), "size": hvd.size(), "hostname": socket.gethostname(),
                  "local_size": hvd.local_size(), "cross_size": hvd.cross_size(),
                  "bytes": x.numel() * 4, "seconds": seconds}), flush=True)
