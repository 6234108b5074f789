"""A rank of a torchrun job on the emulated cluster: sets up Gloo from torchrun's environment, sums
every rank's rank across the job, and prints one JSON line (torchrun's variables, the host name,
the sum)."""
import json
import os
import socket
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank())])
dist.all_reduce(total)
# One write of the whole line: a node's ranks share torchrun's output, and unbuffered (as the
# jobs run) print() writes the text and its newline apart, so two ranks' lines could interleave.
sys.stdout.write(json.dumps({
    "hostname": socket.gethostname(),
    "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                           "GROUP_RANK", "MASTER_ADDR")},
    "sum": float(total),
}) + "\n")
sys.stdout.flush()
dist.destroy_process_group()
