"""A DDP-face training run that checkpoints and survives a worker's death under
``torchrun --max-restarts=1``.

    torchrun --standalone --nproc_per_node 2 --max-restarts=1 ddp_restart.py --dir DIR

Every ``--every`` steps in the compression phase each rank saves its checkpoint (the model, the
optimizer's ``state_dict()`` and its own ``error_feedback_state_dict()``) under
``DIR/checkpoints/step<k>/``; once every rank has saved, rank 0 marks that step complete. On the
first attempt (``TORCHELASTIC_RESTART_COUNT`` 0) the last rank kills itself with SIGKILL at step
``--kill-at``; torchrun then stops the others and starts the group again, and each rank resumes
from the last complete checkpoint. At the end each rank writes what it did to
``DIR/rank<r>.pt``: the attempt, the step it resumed from, its losses and parameters, and the
parameters of the same run taken without interruption in the same process, for comparison.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_onebit.ddp


def make_model() -> DDP:
    torch.manual_seed(0)
    return DDP(torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(),
                                   torch.nn.Linear(32, 4)))


def make_optimizer(model: DDP, freeze_step: int):
    return hvd_onebit.ddp.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2), model, freeze_step=freeze_step,
        variance_refresh=None, bucket_size_mb=0.002)


def train_step(model: DDP, opt, step: int, rank: int) -> float:
    g = torch.Generator().manual_seed(1009 * step + 97 * rank)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 4, generator=g)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return float(loss)


def last_complete(checkpoints: Path) -> int:
    """The last step every rank saved (0: none)."""
    done = [int(p.parent.name[len("step"):]) for p in checkpoints.glob("step*/complete")]
    return max(done, default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--freeze-step", type=int, default=4)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=11)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    out, checkpoints = Path(args.dir), Path(args.dir) / "checkpoints"
    model = make_model()
    opt = make_optimizer(model, args.freeze_step)
    start = last_complete(checkpoints)
    if start:
        saved = torch.load(checkpoints / f"step{start}" / f"rank{rank}.pt", weights_only=False)
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        opt.load_error_feedback_state_dict(saved["error_feedback"])
    losses = []
    for step in range(start, args.steps):
        if attempt == 0 and step == args.kill_at and rank == size - 1:
            (out / "killed.json").write_text(json.dumps({"rank": rank, "step": step}))
            os.kill(os.getpid(), signal.SIGKILL)
        losses.append(train_step(model, opt, step, rank))
        if (step + 1) % args.every == 0 and opt.phase == "compression":
            folder = checkpoints / f"step{step + 1}"
            folder.mkdir(parents=True, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "error_feedback": opt.error_feedback_state_dict()},
                       folder / f"rank{rank}.pt")
            dist.barrier()  # every rank's file is written before the step counts as saved
            if rank == 0:
                (folder / "complete").touch()

    # the same run without interruption, in this process, for comparison
    uninterrupted = make_model()
    uninterrupted_opt = make_optimizer(uninterrupted, args.freeze_step)
    for step in range(args.steps):
        train_step(uninterrupted, uninterrupted_opt, step, rank)
    torch.save({"rank": rank, "size": size, "attempt": attempt, "resumed_from": start,
                "losses": losses, "steps": opt.steps, "phase": opt.phase,
                "params": [p.detach().clone() for p in model.module.parameters()],
                "uninterrupted": [p.detach().clone() for p in uninterrupted.module.parameters()]},
               out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
