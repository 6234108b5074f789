"""1-bit Adam in a plain DDP script under torchrun (CPU, Gloo; no Horovod needed).

    torchrun --nproc_per_node 2 examples/ddp_train.py --optimizer onebit

A small classifier learns labels a fixed random "teacher" network gives to random inputs (made
from a seed, so nothing is downloaded). ``--optimizer`` changes only the line that wraps Adam:
``adam`` is DDP + Adam, ``onebit`` wraps the same Adam with ``hvd_onebit.ddp``. Rank 0 prints a
JSON summary at the end.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_onebit.ddp
from hvd_onebit.config import FREEZE_FRACTION


def teacher_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random inputs (from ``seed``) and the teacher's labels; one teacher for every set."""
    g = torch.Generator().manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        x = torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))
        return x, teacher(x).argmax(dim=1)


def number_in(kind, what: str, ok):
    """An argparse type: a finite ``kind`` for which ``ok(value)`` holds, or an error naming it."""
    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value
    return convert


positive_int = number_in(int, "a positive integer", lambda v: v >= 1)
positive_float = number_in(float, "a positive number", lambda v: v > 0)
fraction_of_steps = number_in(float, "a fraction of --steps from 0 to 1", lambda v: 0 <= v <= 1)


def parse_args(argv=None) -> argparse.Namespace:
    """The options, checked before any rank starts: a bad value stops every rank with the same
    argument error."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=("adam", "onebit"), default="onebit")
    parser.add_argument("--steps", type=positive_int, default=200)
    parser.add_argument("--warmup-frac", type=fraction_of_steps, default=FREEZE_FRACTION,
                        help="freeze_step = round(warmup_frac * steps), at least 1 and below "
                             "--steps (default: %(default)s)")
    parser.add_argument("--batch-size", type=positive_int, default=32,
                        help="samples per rank per step (default: %(default)s)")
    parser.add_argument("--lr", type=positive_float, default=3e-3)
    args = parser.parse_args(argv)
    args.freeze_step = max(1, round(args.warmup_frac * args.steps))
    if args.optimizer == "onebit" and args.freeze_step >= args.steps:
        parser.error(f"argument --warmup-frac: {args.warmup_frac} x --steps {args.steps} freezes "
                     f"at step {args.freeze_step}, leaving no compressed step; give a smaller "
                     f"--warmup-frac or more --steps")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("examples/ddp_train.py runs under torchrun, which starts its ranks: "
                         "torchrun --nproc_per_node=2 examples/ddp_train.py")
    dist.init_process_group("gloo")  # torchrun sets the rank, the world size and the address
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model everywhere (DDP broadcasts rank 0's anyway)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                    torch.nn.Linear(64, 4)))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if args.optimizer == "onebit":
        opt = hvd_onebit.ddp.DistributedOptimizer(
            opt, model, freeze_step=args.freeze_step)

    x, y = teacher_data(4096, seed=1)
    x_val, y_val = teacher_data(1024, seed=2)
    shard = torch.arange(rank, len(x), size)  # each rank its own part of the data
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(args.steps):
        idx = shard[torch.randint(len(shard), (args.batch_size,), generator=g)]
        opt.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()

    with torch.no_grad():
        val = F.cross_entropy(model(x_val), y_val).item()
        accuracy = (model(x_val).argmax(dim=1) == y_val).float().mean().item()
    summary = {"optimizer": args.optimizer, "ranks": size, "steps": args.steps,
               "train_loss": loss.item(), "val_loss": val, "val_accuracy": accuracy}
    if args.optimizer == "onebit":
        summary.update(phase=opt.phase, telemetry={k: v for k, v in opt.telemetry().items()
                                                   if k in ("steps", "total_bytes",
                                                            "last_step_bytes", "skipped_steps")})
    if rank == 0:
        print(json.dumps(summary, indent=1))
    # The DDP model first: its reducer holds the process group, whose Gloo threads, left
    # running to the interpreter's exit, can abort the process there.
    del model, opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
