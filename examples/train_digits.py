"""Train a small CNN on scikit-learn's bundled handwritten digits with Horovod, Adam or 1-bit Adam.

A second, different kind of model for the same one-line switch: a convolutional image
classifier on ``sklearn.datasets.load_digits`` (1,797 8x8 grey-scale images of the digits 0-9,
shipped inside scikit-learn, so nothing is downloaded). 20% of the images are held out.

    horovodrun -np 4 -H localhost:4 --gloo python examples/train_digits.py --optimizer onebit

As in train_lm.py, ``--optimizer`` changes only the line that wraps the optimizer
(``hvd.DistributedOptimizer`` or ``hvd_onebit.DistributedOptimizer`` with ``freeze_step``); the
model, the seed, the data each rank sees and the constant learning rate are the same.

Needs scikit-learn (``pip install scikit-learn``) for the data set only.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F

import hvd_onebit
from train_lm import (WARMUP_FRAC_HELP, add_onebit_arguments, check_freeze, held_out_fraction,
                      onebit_options, positive_float, positive_int, refresh_summary,
                      warmup_frac)


class SmallCNN(nn.Module):
    """Two 3x3 convolutions and two linear layers, with GELU activations.

    GELU rather than ReLU on purpose: a dead ReLU unit gives some weights exactly zero gradient
    throughout the warmup, so their frozen Adam variance is 0. In 1-bit Adam's compression phase
    every momentum element arrives as +-scale of its block, and an element with zero variance then
    steps by lr * scale / eps, which diverges within a few steps.
    """

    def __init__(self, width: int = 16, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc1 = nn.Linear(2 * width * 4 * 4, 64)
        self.fc2 = nn.Linear(64, classes)

    def forward(self, x):  # x: [B, 1, 8, 8]
        x = F.gelu(self.conv1(x))
        x = F.max_pool2d(F.gelu(self.conv2(x)), 2)  # -> [B, 2w, 4, 4]
        return self.fc2(F.gelu(self.fc1(x.flatten(1))))


def load_data(seed: int, val_frac: float):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixels are 0..16
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(x) * val_frac)
    val, train = perm[:n_val], perm[n_val:]
    return x[train], y[train], x[val], y[val]


def check_split(n_train: int, n_val: int, val_frac: float, world: int) -> None:
    """Raise ValueError when --val-frac holds out no image, or leaves a rank no training image
    (each rank draws its batches from every world-th one)."""
    total = n_train + n_val
    if n_val < 1:
        raise ValueError(f"--val-frac {val_frac} holds out none of the {total} images; raise "
                         f"--val-frac to at least 1/{total}")
    if n_train < world:
        raise ValueError(f"--val-frac {val_frac} leaves {n_train} of the {total} images for "
                         f"training, fewer than one per rank on {world} ranks; lower --val-frac "
                         f"or use fewer ranks")


@torch.no_grad()
def evaluate(model, x, y):
    """Loss and accuracy on (x, y); each rank takes every world-th example, then an allreduce."""
    model.eval()
    xs, ys = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    logits = model(xs)
    stats = torch.tensor([F.cross_entropy(logits, ys, reduction="sum").item(),
                          (logits.argmax(1) == ys).sum().item(), len(ys)], dtype=torch.float64)
    model.train()
    stats = hvd.allreduce(stats, op=hvd.Sum, name="eval_stats")
    return float(stats[0] / stats[2]), float(stats[1] / stats[2])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--optimizer", choices=["adam", "onebit"], default="onebit")
    p.add_argument("--steps", type=positive_int, default=300)
    p.add_argument("--batch-size", type=positive_int, default=32, help="images per rank per step")
    p.add_argument("--lr", type=positive_float, default=2e-3, help="constant learning rate")
    p.add_argument("--warmup-frac", type=warmup_frac, default=None, help=WARMUP_FRAC_HELP)
    p.add_argument("--compressor", choices=["onebit", "none"], default="onebit",
                   help="1-bit Adam's compression phase: 1-bit momentum, or 'none': the momentum "
                        "averaged in full precision (Adam with a frozen variance, for comparison)")
    p.add_argument("--width", type=positive_int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-seed", type=int, default=None,
                   help="seeds only the order of the batches each rank draws (default: --seed); "
                        "a run that differs from another only here shows how much the final "
                        "loss moves with the batch order alone")
    p.add_argument("--eval-every", type=positive_int, default=50)
    p.add_argument("--val-frac", type=held_out_fraction, default=0.2,
                   help="the share of the images held out for validation")
    p.add_argument("--threads", type=positive_int,
                   default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    add_onebit_arguments(p)
    p.add_argument("--out", "--json-out", dest="out", default=None,
                   help="write a JSON summary here (rank 0); --json-out is an alias")
    return p


def parse_args(argv=None):
    """The options, each checked alone by its type and together here, so a bad value stops
    every rank with the same argument error before any rank starts talking to the others."""
    p = build_parser()
    args = p.parse_args(argv)
    check_freeze(p, args)
    return args


def build_model_and_adam(args):
    """The model from ``args.seed`` and its local optimizer."""
    torch.manual_seed(args.seed)
    model = SmallCNN(args.width)
    return model, torch.optim.Adam(model.parameters(), lr=args.lr)


def main(argv=None):
    args = parse_args(argv)
    x_train, y_train, x_val, y_val = load_data(args.seed, args.val_frac)
    try:  # before any rank starts: a split no world size could train on
        check_split(len(x_train), len(x_val), args.val_frac, 1)
    except ValueError as exc:
        build_parser().error(str(exc))

    hvd.init()
    torch.set_num_threads(args.threads)
    rank, world = hvd.rank(), hvd.size()
    log = print if rank == 0 else (lambda *a, **k: None)
    try:  # every rank splits alike, so every rank stops alike
        check_split(len(x_train), len(x_val), args.val_frac, world)
    except ValueError as exc:
        build_parser().error(str(exc))
    # Each rank owns every world-th training image and samples its batches from them.
    x_shard, y_shard = x_train[rank::world], y_train[rank::world]
    data_seed = args.seed if args.data_seed is None else args.data_seed
    gen = torch.Generator().manual_seed(data_seed * 1000 + rank)

    model, optimizer = build_model_and_adam(args)
    freeze = onebit_options(args, compressor=args.compressor)
    # ---- the one line that differs ----------------------------------------------------------
    if args.optimizer == "adam":
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    else:
        optimizer = hvd_onebit.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                                    **freeze)
    # -----------------------------------------------------------------------------------------
    # Same start on every rank: rank 0's parameters. A fresh optimizer's state is zeros on every
    # rank: no hvd.broadcast_optimizer_state, which on a fresh torch optimizer takes one step
    # with zero gradients and would start plain Adam one step ahead (see examples/train_lm.py).
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    log(f"world={world} train={len(x_train)} val={len(x_val)} optimizer={args.optimizer} "
        f"freeze_step={freeze['freeze_step'] if args.optimizer == 'onebit' else '-'}")

    curve, phase_switch_step, total_bytes = [], None, 0
    start = time.perf_counter()
    for step in range(args.steps):
        phase = optimizer.phase if args.optimizer == "onebit" else "full_precision"
        if phase == "compression" and phase_switch_step is None:
            phase_switch_step = step
        ix = torch.randint(len(x_shard), (args.batch_size,), generator=gen)
        loss = F.cross_entropy(model(x_shard[ix]), y_shard[ix])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"non-finite training loss at step {step}")
        if args.optimizer == "onebit":
            total_bytes += optimizer.telemetry()["last_step_bytes"]
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val_loss, val_acc = evaluate(model, x_val, y_val)
            curve.append({"step": step + 1, "val_loss": val_loss, "val_acc": val_acc,
                          "train_loss": loss.item(), "phase": phase})
            log(f"step {step + 1:4d} | train {loss.item():.4f} | val {val_loss:.4f} "
                f"| acc {val_acc:.3f} | phase {phase}")

    summary = {"optimizer": args.optimizer, "world_size": world,
               "freeze_step": optimizer.freeze_step if args.optimizer == "onebit" else None,
               "freeze_decision": optimizer.freeze_decision if args.optimizer == "onebit" else None,
               "params": sum(p.numel() for p in model.parameters()),
               "phase_switch_step": phase_switch_step, "val_curve": curve,
               "final_val_loss": curve[-1]["val_loss"], "final_val_acc": curve[-1]["val_acc"],
               "total_bytes_per_rank": total_bytes if args.optimizer == "onebit" else None,
               "telemetry": optimizer.telemetry() if args.optimizer == "onebit" else None,
               **refresh_summary(args, optimizer),
               "wall_seconds": time.perf_counter() - start, "config": vars(args)}
    log(f"done: val accuracy {summary['final_val_acc']:.3f} in {summary['wall_seconds']:.0f}s")
    if rank == 0 and args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
