"""Worker functions for hvd_onebit's elastic state handler (tests/test_elastic.py)."""
from __future__ import annotations

import copy
import warnings

import horovod.torch as hvd
import torch
import torch.nn as nn

import hvd_onebit
from tests.workers_optimizer import batch, make_model, params_hash


def _train(model, opt, steps, start=0):
    for step in range(start, start + steps):
        opt.zero_grad()
        x, y = batch(step, hvd.rank())
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def sync_from_the_rank_that_holds_the_state(freeze_step=2, steps=5):
    """Both ranks train into the compression phase; then rank 0 is made fresh (as a worker that
    just joined at rank 0 would be). The elastic sync must restore everyone from rank 1."""
    warnings.simplefilter("ignore")
    model = make_model()
    opt = hvd_onebit.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                          named_parameters=model.named_parameters(),
                                          freeze_step=freeze_step)
    fresh_model, fresh_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=0)
    handler = [type(state._handlers[k]).__name__ for k in ("model", "optimizer")]
    _train(model, opt, steps)
    trained = params_hash(model)
    if hvd.rank() == 0:
        model.load_state_dict(fresh_model)
        opt.load_state_dict(fresh_opt)
    before = {"steps": opt.steps, "hash": params_hash(model)}
    state.sync()
    after = {"steps": opt.steps, "phase": opt.phase, "hash": params_hash(model),
             "v": opt.state[next(model.parameters())]["exp_avg_sq"].clone()}
    _train(model, opt, 3, start=steps)
    return {"handler": handler, "trained": trained, "before": before, "after": after,
            "final": params_hash(model)}
