"""Elastic Horovod: a worker that joins in the compression phase gets the committed state.

``hvd.elastic.TorchState(model=..., optimizer=opt)`` picks a state handler for each object from
Horovod's handler registry. For hvd_onebit optimizers this module puts its own handler first:

* its ``sync()`` (run on every rank after every reset, and at the start) broadcasts the optimizer
  state from a rank that holds the committed state: the lowest rank among those with the most
  optimizer steps. Horovod's own handler always uses rank 0; Horovod gives the oldest hosts the
  lowest ranks, so that is normally a survivor too, and then both choices agree. Parameters are
  re-broadcast from that root with the optimizer state (the optimizer owns them); module buffers
  and the other objects of the state are synced by Horovod from rank 0.
* every rank drops its fused buckets and 1-bit collectives before the broadcast, so survivors and
  newcomers rebuild them alike at the next compressed step (error feedback restarts from zero:
  it belongs to the old world's rank numbers and chunks).
"""
from __future__ import annotations

import abc

import horovod.torch as hvd
import torch
from horovod.torch.elastic import state as hvd_state


class OneBitOptimizerType(abc.ABC):
    """Virtual base of every class :func:`hvd_onebit.DistributedOptimizer` builds (for isinstance
    checks: the classes are made per wrapped optimizer class)."""


def committed_root(optimizer, process_set=hvd.global_process_set) -> int:
    """The lowest rank among those whose optimizer has taken the most steps (one allgather)."""
    steps = torch.tensor([[int(optimizer.steps)]], dtype=torch.int64)
    everyone = hvd.allgather(steps, name="hvd_onebit.elastic.steps",
                             process_set=process_set).flatten().tolist()
    return everyone.index(max(everyone))


class OneBitStateHandler(hvd_state.OptimizerStateHandler):
    """Horovod elastic state handler for hvd_onebit optimizers (see the module docstring)."""

    def sync(self):
        opt = self.value
        root = committed_root(opt)
        opt.reset_collectives()
        if root != 0:
            params = [p for g in opt.param_groups for p in g["params"]]
            # bfloat16 travels bit for bit as int16 (Horovod's broadcast takes no bfloat16)
            hvd.broadcast_parameters(
                [(f"hvd_onebit.elastic.param.{i}",
                  p.data.view(torch.int16) if p.dtype == torch.bfloat16 else p.data)
                 for i, p in enumerate(params)], root_rank=root)
        hvd.broadcast_optimizer_state(opt, root_rank=root)


def register_state_handler(cls: type | None = None) -> None:
    """Mark ``cls`` as an hvd_onebit optimizer class and put :class:`OneBitStateHandler` first in
    Horovod's elastic handler registry (once)."""
    if cls is not None:
        OneBitOptimizerType.register(cls)
    registry = hvd_state.get_handler_registry()
    if not any(handler is OneBitStateHandler for _, handler in registry):
        hvd_state.set_handler_registry([(OneBitOptimizerType, OneBitStateHandler)] + list(registry))
