"""Driving CompressedStep directly, without Horovod's optimizer class: on the in-process transport
(virtual ranks as threads) or inside a Horovod job. Returns data; the tests assert."""
from __future__ import annotations

import warnings
from typing import Optional

import numpy as np
import torch

from hvd_onebit.engine import NOT_FROZEN, CompressedStep
from hvd_onebit.config import OneBitConfig

SHAPES = [(40, 30), (30,), (30, 20), (20,), (20, 1), (1,)]  # several buckets at 0.004 MiB
LR, BETAS, EPS = 1e-2, (0.9, 0.999), 1e-8
WARM_STEPS = 4  # Adam steps "taken" before the freeze


def initial_state(seed: int = 0) -> tuple[list[torch.Tensor], dict]:
    """Parameters and an Adam state as after a warmup of WARM_STEPS steps (the same on every
    rank): momentum and a positive variance."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g) for s in SHAPES]
    state = {p: {"step": torch.tensor(float(WARM_STEPS)),
                 "exp_avg": torch.randn(p.shape, generator=g) * 0.01,
                 "exp_avg_sq": torch.rand(p.shape, generator=g) * 1e-4 + 1e-6,
                 "frozen_variance_step": NOT_FROZEN} for p in params}
    return params, state


def gradient(step: int, rank: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * step + 31 * rank + len(shape))
    return torch.randn(shape, generator=g) * (1 + rank) * 0.01


def run_engine(rank: int, transport=None, steps: int = 6, bad: Optional[tuple] = None,
               block_size: Optional[int] = None, memory: str = "auto") -> dict:
    """``steps`` compressed steps; ``bad`` = (step, rank, parameter index) puts an inf into that
    gradient. Returns per step whether it was skipped, and the parameters/momenta after each."""
    params, state = initial_state()
    config = OneBitConfig.from_options(freeze_step=WARM_STEPS, bucket_size_mb=0.004, block_size=block_size,
                          memory=memory)
    engine = CompressedStep(config, state, decoupled=lambda group: False, transport=transport)
    groups = [{"params": params, "lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": 0.0}]
    out = {"skipped": [], "params": [], "momenta": [], "errors": []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(steps):
            engine.ensure_ready(params)
            grads = {p: gradient(step, rank, p.shape) for p in params}
            if bad is not None and (step, rank) == bad[:2]:
                grads[params[bad[2]]][0] = float("inf")
            try:
                engine.step(groups, grads)
                out["skipped"].append(False)
            except FloatingPointError as exc:
                out["skipped"].append(True)
                out["errors"].append(str(exc))
            out["params"].append([p.clone().numpy() for p in params])
            out["momenta"].append([state[p]["exp_avg"].clone().numpy() for p in params])
    out["buckets"] = len(engine.buckets)
    return out


def horovod_job(**kwargs) -> dict:
    """run_engine in a Horovod job (Horovod transport over the global process set)."""
    import horovod.torch as hvd

    return run_engine(hvd.rank(), **kwargs)


def reference(n: int, steps: int = 6, precondition: bool = True) -> list[list[np.ndarray]]:
    """The same steps from ALGORITHM.md in NumPy: local momenta (over their frozen denominator
    and clamped at bc1 times Adam's bound, ``precondition``), the 1-bit allreduce reference of each bucket, the momentum back from the
    average, Adam's update with the frozen variance, each step clamped at lr times Adam's own
    bound. Parameters after each step."""
    from tests.onebit_reference import ReferenceOneBit, adam_bound

    params, state = initial_state()
    w = [p.numpy().astype(np.float64) for p in params]
    m = [state[p]["exp_avg"].numpy().copy() for p in params]
    v = [state[p]["exp_avg_sq"].numpy().astype(np.float64) for p in params]
    # the engine's buckets, 0.004 MiB = 1048 float32 each, planned from the last parameter: the
    # five small ones (671 elements), then the (40, 30) weight cut after 377 elements so the
    # first bucket is full, its other 823 in the second. As (parameter, start, count).
    buckets = [[(5, 0, 1), (4, 0, 20), (3, 0, 20), (2, 0, 600), (1, 0, 30), (0, 0, 377)],
               [(0, 377, 823)]]
    refs = [ReferenceOneBit(sum(count for _, _, count in b), n) for b in buckets]
    bc2 = 1 - BETAS[1] ** WARM_STEPS
    denoms = [(np.sqrt(x / bc2) + EPS).astype(np.float32) for x in v]
    history = []
    for step in range(steps):
        t = WARM_STEPS + step + 1
        bc1 = 1 - BETAS[0] ** t
        for b, ref in zip(buckets, refs):
            scale = [denoms[i].reshape(-1)[a:a + k] if precondition else 1 for i, a, k in b]
            inputs = [np.concatenate([
                (np.float32(BETAS[0]) * m[i].reshape(-1)[a:a + k] + np.float32(1 - BETAS[0])
                 * gradient(step, r, params[i].shape).numpy().reshape(-1)[a:a + k]) / d
                for (i, a, k), d in zip(b, scale)])
                for r in range(n)]
            if precondition:  # each rank's u kept where Adam's own momentum could be
                inputs = [np.clip(x, -bc1 * adam_bound(t), bc1 * adam_bound(t)) for x in inputs]
            avg = ref.allreduce(inputs)
            new_m = {}
            at = 0
            for (i, a, k), d in zip(b, scale):
                new_m[(i, a)] = avg[at:at + k] * d
                at += k
            for (i, a), piece in new_m.items():
                flat = m[i].reshape(-1).copy()
                flat[a:a + piece.size] = piece
                m[i] = flat.reshape(params[i].shape)
        for i in range(len(params)):
            step = LR / bc1 * m[i] / (np.sqrt(v[i] / bc2) + EPS)
            w[i] = w[i] - np.clip(step, -LR * adam_bound(t), LR * adam_bound(t))
        history.append([x.astype(np.float32) for x in w])
    return history
