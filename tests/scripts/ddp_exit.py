"""A DDP-face run that ends as a script may: the model and the optimizer dropped, then one last
collective, and the process exits at once while torch.distributed's Gloo threads still hold
that collective's tensor.

    torchrun --standalone --nproc_per_node 2 ddp_exit.py --steps 6

Each rank prints one JSON line: whether the optimizer it dropped (with its model) was freed,
and the phase and the step count it ended on. Then it starts an allreduce, drops the handle (a
Gloo thread then holds the last reference to its work), waits for the result while holding the
GIL (the switch interval is raised so that the interpreter never hands it over unasked), and
exits: the Gloo thread drops the work, and with it the tensor, only once it gets the GIL.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import weakref

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_onebit.ddp


def train(steps: int) -> tuple[weakref.ref, str, int]:
    """``steps`` steps of a small model, two of them warmup; a weak reference to the optimizer
    and the phase and step count it ended on. The model and the optimizer go when this returns."""
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(),
                                    torch.nn.Linear(32, 4)))
    opt = hvd_onebit.ddp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                              model, freeze_step=2, variance_refresh=None,
                                              bucket_size_mb=0.002)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return weakref.ref(opt), opt.phase, opt.telemetry()["steps"]


parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
args = parser.parse_args()
dist.init_process_group("gloo")
ref, phase, done = train(args.steps)
gc.collect()
# one write per line: the ranks share torchrun's output pipe, unbuffered (PYTHONUNBUFFERED),
# where print() writes the text and its newline apart and two ranks' lines can run together
sys.stdout.write(json.dumps({"rank": dist.get_rank(), "freed": ref() is None, "phase": phase,
                             "steps": done}) + "\n")
sys.stdout.flush()
sys.setswitchinterval(100.0)  # from here the GIL is released only by blocking calls
last = torch.ones(1000)  # held to the end of the process, as a script's own tensors are
dist.all_reduce(last, async_op=True)  # the handle dropped: Gloo's thread holds the work
while last[0].item() != dist.get_world_size():
    pass
