"""Horovod process sets in a 4-rank job (registered at run time: the test's ranks run with
HOROVOD_DYNAMIC_PROCESS_SETS=1): two optimizers on two sets of two ranks each, and ranks outside
an optimizer's set, which step alone as Horovod's own optimizer does there."""
from __future__ import annotations

import horovod.torch as hvd
import torch

from tests.scenarios import run_scenarios
from tests.workers_optimizer import batch, make_model, params_bytes

STEPS, FREEZE = 8, 3


def _train(process_set, transport: str = "auto", **options) -> dict:
    """The toy model trained on this rank's batches through both phases."""
    import hvd_onebit

    model = make_model()
    opt = hvd_onebit.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                          named_parameters=model.named_parameters(),
                                          freeze_step=FREEZE, process_set=process_set,
                                          transport=transport, **options)
    for step in range(STEPS):
        x, y = batch(step, hvd.rank())
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {"params": params_bytes(model), "phase": opt.phase,
            "bytes": opt.telemetry()["total_bytes"]}


def _plain_adam() -> list:
    """torch.optim.Adam alone on this rank's batches."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = batch(step, hvd.rank())
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return params_bytes(model)


def _refused(process_set, **options) -> str | None:
    """What building the optimizer with ``options`` raised (None: nothing)."""
    try:
        _train(process_set, **options)
    except ValueError as exc:
        return str(exc)
    return None


def _removed() -> str | None:
    gone = hvd.add_process_set([0, 2])
    hvd.remove_process_set(gone)
    return _refused(gone)


def suite() -> dict:
    first, second = hvd.add_process_set([0, 1]), hvd.add_process_set([2, 3])
    mine = first if hvd.rank() < 2 else second
    try:
        return run_scenarios({
            "two_sets": lambda: _train(mine),
            "outside": lambda: dict(_train(first), plain=_plain_adam()),
            "torch_transport": lambda: _refused(mine, transport="torch"),
            "hierarchical_auto": lambda: _train(mine, hierarchical="auto"),
            "hierarchical_true": lambda: _refused(mine, hierarchical=True),
            "removed": _removed,
        }, hvd.rank())
    finally:
        hvd.remove_process_set(second)
        hvd.remove_process_set(first)
