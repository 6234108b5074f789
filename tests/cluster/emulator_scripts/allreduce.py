"""One timed hvd.allreduce over the emulated network; prints a JSON line per rank.

Usage: python allreduce.py [MBYTES] [--crash-rank R]
  MBYTES        size of the float32 tensor to allreduce (default 4)
  --crash-rank  that rank exits with status 3 right after hvd.init()
"""
import argparse
import json
import socket
import sys
import time

import horovod.torch as hvd
import torch

parser = argparse.ArgumentParser()
parser.add_argument("mbytes", type=float, nargs="?", default=4.0)
parser.add_argument("--crash-rank", type=int, default=-1)
args = parser.parse_args()

hvd.init()
if hvd.rank() == args.crash_rank:
    print(f"rank {hvd.rank()} crashing on purpose", flush=True)
    sys.exit(3)
hvd.allreduce(torch.ones(4), name="warmup")  # connections are set up before the timed part
x = torch.ones(int(args.mbytes * 1e6 / 4), dtype=torch.float32)
t0 = time.perf_counter()
y = hvd.allreduce(x, op=hvd.Sum, name="big")
seconds = time.perf_counter() - t0
assert float(y[0]) == hvd.size(), float(y[0])
print(json.dumps({"rank": hvd.rank(), "size": hvd.size(), "hostname": socket.gethostname(),
                  "local_size": hvd.local_size(), "cross_size": hvd.cross_size(),
                  "bytes": x.numel() * 4, "seconds": seconds}), flush=True)
