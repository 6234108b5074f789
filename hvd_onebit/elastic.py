"""Elastic Horovod: a worker that joins in the compression phase gets the committed state.

``hvd.elastic.TorchState(model=..., optimizer=opt)`` picks a state handler for each object from
Horovod's handler registry. This module puts two of its own first, used for hvd_onebit optimizers
and for models whose parameters such an optimizer trains (others keep Horovod's):

* their ``sync()`` (run on every rank after every reset, and at the start) broadcasts from a rank
  that holds the committed state: the lowest rank among those whose optimizer has taken the most
  steps. Horovod's handlers always use rank 0; Horovod gives the oldest hosts the lowest ranks,
  so that is normally a survivor too, and then both choices agree. The other objects of the
  state (e.g. a batch counter) are synced by Horovod from rank 0.
* every rank drops its fused buckets and 1-bit collectives before the optimizer broadcast, so
  survivors and newcomers rebuild them alike at the next compressed step (error feedback restarts
  from zero: it belongs to the old world's rank numbers and chunks). With ``freeze_step="auto"``
  every rank also restarts its record of the variance, so all decide alike (a newcomer has none).
* with ``flush_on_commit=True``, ``save()`` (every ``state.commit()``) first folds every rank's
  error feedback into the momentum (:meth:`flush_error_feedback`), so the committed state loses
  none of it when a reset restores it. Cost: one full-precision allreduce of the momentum per
  commit in the compression phase, ``2 (n-1)/n * 4`` bytes per parameter sent by each rank.
  A rank lost during that flush does not stop the commit: Horovod's state saves its handlers
  one after the other (the model's before the optimizer's), so a commit that stopped there
  would restore the model one step ahead of the optimizer and the batch counter, and the step
  would be taken twice. The commit saves this step everywhere instead, without the fold (a
  warning says so); the next ``step()`` raises ``HorovodInternalError`` unless a reset came
  first, so the reset restores this commit (its error feedback from zero, as after any
  reset) even where the failure did not shut Horovod down.
"""
from __future__ import annotations

import abc
import warnings
import weakref

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HorovodInternalError
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

    def save(self):
        opt = self.value
        if opt.config.flush_on_commit:
            try:
                opt.flush_error_feedback()
            except FloatingPointError as exc:  # the same on every rank; nothing was changed
                warnings.warn(f"hvd_onebit: commit without folding the error feedback: {exc}")
            except HorovodInternalError as exc:  # a rank lost: the momenta were not changed
                warnings.warn(f"hvd_onebit: commit without folding the error feedback: the "
                              f"flush failed in Horovod ({exc}); the reset that follows "
                              f"restores this commit")
                _reset_due[opt] = str(exc)
        super().save()

    def restore(self):
        _reset_due.pop(self.value, None)
        super().restore()
        # A reset restarts the error feedback from zero by design (flush_on_commit=True folds
        # it into the committed state first): the load is not a checkpoint missing its errors.
        self.value.compressed_step.expect_error_feedback(None)

    def sync(self):
        opt = self.value
        _reset_due.pop(opt, None)
        root = committed_root(opt)
        opt.reset_collectives()
        hvd.broadcast_optimizer_state(opt, root_rank=root)
        opt.restart_variance_monitor()


class OneBitModelStateHandler(hvd_state.ModelStateHandler):
    """Horovod elastic state handler for a model: parameters and buffers from the rank that holds
    the committed state when an hvd_onebit optimizer trains the model, from rank 0 otherwise."""

    def sync(self):
        owned = {id(p) for p in self.value.parameters()}
        owners = [opt for opt in list(_live_optimizers)
                  if any(id(p) in owned for g in opt.param_groups for p in g["params"])]
        root = committed_root(owners[0]) if owners else 0
        # bfloat16 travels bit for bit as int16 (Horovod's broadcast takes no bfloat16)
        hvd.broadcast_parameters({k: v.view(torch.int16) if v.dtype == torch.bfloat16 else v
                                  for k, v in self.value.state_dict().items()}, root_rank=root)


_live_optimizers: "weakref.WeakSet" = weakref.WeakSet()
# optimizers whose last commit went on past a failed flush, with the failure: their next step()
# raises it, so that the job resets to that commit
_reset_due: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def raise_if_reset_due(optimizer) -> None:
    """Raise ``HorovodInternalError`` (Horovod elastic's signal to reset) when ``optimizer``'s
    last commit went on past a failed flush and no reset has come since."""
    failure = _reset_due.get(optimizer)
    if failure is not None:
        raise HorovodInternalError(f"hvd_onebit: the last state.commit() went on past a failed "
                                   f"flush of the error feedback ({failure}); this step resets "
                                   f"the job to that commit")


def register_state_handler(optimizer) -> None:
    """Make Horovod's elastic state use this module's handlers for ``optimizer`` (an hvd_onebit
    optimizer) and for models it trains; the registry is extended once per process."""
    OneBitOptimizerType.register(type(optimizer))
    _live_optimizers.add(optimizer)
    registry = hvd_state.get_handler_registry()
    if not any(handler is OneBitStateHandler for _, handler in registry):
        hvd_state.set_handler_registry([(OneBitOptimizerType, OneBitStateHandler),
                                        (torch.nn.Module, OneBitModelStateHandler)]
                                       + list(registry))
