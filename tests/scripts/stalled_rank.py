"""A DDP-face job in which rank 0 takes one more step() than the others, which do not follow it
into the collectives (they sleep, then exit): rank 0 waits, in its step (a compressed step) or in
backward for DDP's allreduce (a warmup step), until the stall watch (:mod:`hvd_onebit.stall`)
warns and then ends it.

    torchrun --standalone --nproc_per_node 2 stalled_rank.py [--steps N] [--freeze-step F]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_onebit.ddp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--sleep", type=float, default=60.0)
    ap.add_argument("--freeze-step", type=int, default=2,
                    help="past --steps: the extra step is a warmup one, waiting in backward")
    ap.add_argument("--unbuilt", action="store_true",
                    help="rank 1 does not build the optimizer: rank 0 waits in its building")
    ap.add_argument("--reset-after", type=int, default=0,
                    help="every rank calls reset_collectives() after this many steps (0: never)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 4))
    if args.unbuilt and rank == 1:
        time.sleep(args.sleep)
        return
    opt = hvd_onebit.ddp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                              model, freeze_step=args.freeze_step,
                                              variance_refresh=None)
    for step in range(args.steps + (1 if rank == 0 else 0)):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step * 10 + rank))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if step + 1 == args.reset_after:
            opt.reset_collectives()
    print(f"rank {rank}: {opt.steps} steps, phase {opt.phase}", flush=True)
    time.sleep(args.sleep)  # not in a collective: rank 0's last step waits for nobody


if __name__ == "__main__":
    main()
