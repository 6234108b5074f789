"""Worker functions for hvd_onebit's elastic state handler (tests/test_elastic.py)."""
from __future__ import annotations

import copy
import warnings

import horovod.torch as hvd
import torch
import torch.nn as nn
from horovod.common.exceptions import HorovodInternalError

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
                                          freeze_step=freeze_step, flush_on_commit=True)
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
    final = params_hash(model)
    return {"handler": handler, "trained": trained, "before": before, "after": after,
            "final": final, "failed_flush": failed_flush(state, model, opt, steps + 3)}


def failed_flush(state, model, opt, start: int) -> dict:
    """A commit whose flush fails in Horovod (a stand-in failure, as a lost peer raises it) yet
    does not shut Horovod down: the commit saves, the next step() raises so the job resets,
    and after the restore training goes on from the commit."""
    def failing():
        raise HorovodInternalError("a stand-in for a peer lost during the flush")

    opt.flush_error_feedback = failing
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state.save()
    del opt.flush_error_feedback
    committed = {"steps": opt.steps, "hash": params_hash(model)}
    try:
        _train(model, opt, 1, start=start)
        raised = None
    except HorovodInternalError as exc:
        raised = str(exc)
    state.restore()
    _train(model, opt, 1, start=start)
    return {"warned": [str(w.message) for w in caught if "hvd_onebit" in str(w.message)],
            "raised": raised, "committed": committed, "steps_after": opt.steps}
