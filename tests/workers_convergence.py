"""Convergence of 1-bit Adam against Adam on a teacher-student regression, on n virtual ranks of
the in-process transport (no job launched).

Adam is torch's, stepping on the mean of the ranks' gradients, as Horovod's optimizer gives it.
1-bit Adam is the same Adam for its warmup, then the engine (:class:`CompressedStep`) from the
freeze on: the parts the faces put around the engine are checked bit for bit elsewhere (the
warmup against Horovod's and DDP's Adam, the engine against a Horovod job). Returns data; the
tests assert.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from hvd_onebit.config import OneBitConfig
from hvd_onebit.engine import CompressedStep
from hvd_onebit.state.adam_state import init_adam_state
from hvd_onebit.transport.inprocess import run_threads

RANKS = 4


def teacher_task(noise: float):
    """(teacher, held-out inputs, held-out targets): targets carry Gaussian noise (std
    ``noise``), as real data does, so the loss has a floor."""
    torch.manual_seed(1234)
    teacher = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    gx = torch.Generator().manual_seed(99)
    x_val = torch.randn(512, 16, generator=gx)
    with torch.no_grad():
        y_val = teacher(x_val) + noise * torch.randn(512, 4, generator=gx)
    return teacher, x_val, y_val


def student() -> nn.Module:
    """The model every rank starts from (built outside the ranks' threads: torch's seed is
    global to the process)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 4))


def gradients(model: nn.Module, teacher: nn.Module, step: int, rank: int,
              noise: float) -> list[torch.Tensor]:
    """``rank``'s gradient at ``step``: its own batch of 32."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    x = torch.randn(32, 16, generator=g)
    with torch.no_grad():
        y = teacher(x) + noise * torch.randn(32, 4, generator=g)
    model.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def held_out_loss(model: nn.Module, x_val, y_val) -> float:
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x_val), y_val))


def adam(steps: int, lr: float, noise: float, n: int = RANKS) -> float:
    """Adam on the mean of the n ranks' gradients: the final held-out loss."""
    teacher, x_val, y_val = teacher_task(noise)
    model = student()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for step in range(steps):
        per_rank = [gradients(model, teacher, step, r, noise) for r in range(n)]
        for p, *gs in zip(model.parameters(), *per_rank):
            p.grad = torch.stack(gs).sum(0) / n
        opt.step()
    return held_out_loss(model, x_val, y_val)


def onebit_rank(transport, task, start: nn.Module, steps: int, freeze_step: int, lr: float,
                noise: float) -> dict:
    """One virtual rank of 1-bit Adam from a copy of ``start``: Adam on the mean gradient until
    ``freeze_step``, then the compressed steps. The final held-out loss, and the bytes this rank
    sent."""
    teacher, x_val, y_val = task
    model = copy.deepcopy(start)
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=lr)
    engine, sent = None, 0
    for step in range(steps):
        grads = gradients(model, teacher, step, transport.rank, noise)
        if step < freeze_step:
            flat = torch.cat([g.reshape(1, -1) for g in grads], dim=1)
            every = transport.wait(transport.allgather_async(flat, "warmup"))  # [size, numel]
            mean = every.sum(0) / transport.size
            for p, g in zip(params, mean.split([p.numel() for p in params])):
                p.grad = g.view_as(p)
            opt.step()
            continue
        if engine is None:
            init_adam_state(opt.param_groups, opt.state)
            engine = CompressedStep(OneBitConfig.from_options(freeze_step=freeze_step), opt.state,
                                    decoupled=lambda group: False, transport=transport)
        engine.ensure_ready(params)
        sent += engine.step(opt.param_groups, dict(zip(params, grads)))
    return {"loss": held_out_loss(model, x_val, y_val), "bytes": sent}


def onebit(steps: int, freeze_step: int, lr: float, noise: float, n: int = RANKS) -> list[dict]:
    """1-bit Adam on n virtual ranks: each rank's final held-out loss and bytes sent."""
    task, start = teacher_task(noise), student()
    return run_threads(n, lambda t: onebit_rank(t, task, start, steps, freeze_step, lr, noise),
                       timeout=300)
