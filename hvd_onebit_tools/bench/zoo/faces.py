"""The two faces a zoo job runs under: how the worker reaches the other ranks and wraps a cell's
model and optimizer.

* :class:`HorovodFace` (horovodrun): ``hvd.DistributedOptimizer`` for Adam,
  ``hvd_onebit.DistributedOptimizer`` for 1-bit Adam, the model broadcast from rank 0, the
  gradients as one grouped allreduce per step (see :mod:`.worker`).
* :class:`DDPFace` (torchrun, Gloo): the model in ``DistributedDataParallel`` (which broadcasts
  rank 0's parameters and buffers), the cell's Adam alone for Adam, wrapped by
  ``hvd_onebit.ddp.DistributedOptimizer`` for 1-bit Adam. Imports no Horovod. BatchNorm's running
  statistics stay each rank's own (``broadcast_buffers=False``), as under Horovod.

Both take the same options for a cell (:func:`.grid.optimizer_options`), so a 1-bit cell is the
same scheme under either face.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .grid import ADAM, optimizer_options

FACES = ("horovod", "ddp")


@dataclass(frozen=True)
class Wrapped:
    """A cell's model as the training steps call it (the DDP module under DDP) and its
    distributed optimizer."""

    model: torch.nn.Module
    optimizer: Any


class HorovodFace:
    name = "horovod"

    def __init__(self):
        import horovod.torch as hvd

        self.hvd = hvd
        self.rank, self.size = hvd.rank(), hvd.size()

    def wrap(self, task, cell: dict) -> Wrapped:
        import hvd_onebit

        named = task.model.named_parameters()
        if cell["method"] == ADAM:
            optimizer = self.hvd.DistributedOptimizer(task.optimizer, named_parameters=named,
                                                      groups=1)
        else:
            optimizer = hvd_onebit.DistributedOptimizer(task.optimizer, named_parameters=named,
                                                        groups=1, **optimizer_options(cell))
        self.hvd.broadcast_parameters(task.model.state_dict(), root_rank=0)
        return Wrapped(task.model, optimizer)

    def average_(self, tensors: list[torch.Tensor], name: str) -> None:
        """Every rank's ``tensors`` replaced by their mean over the ranks (one grouped
        allreduce)."""
        for t, mean in zip(tensors, self.hvd.grouped_allreduce(tensors, op=self.hvd.Average,
                                                               name=name)):
            t.copy_(mean)

    def sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return self.hvd.allreduce(tensor, op=self.hvd.Sum, name=name)

    def prepare(self) -> None:
        """Horovod's optimizer waits for its allreduces spinning on sched_yield; 4 ranks on 2
        cores then take CPU from the ranks still computing. Make it sleep, as hvd_onebit's own
        waits do (timing only: the results are the same)."""
        from ..train import _sleeping_horovod_waits

        _sleeping_horovod_waits(True)


class DDPFace:
    name = "ddp"

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def wrap(self, task, cell: dict) -> Wrapped:
        from torch.nn.parallel import DistributedDataParallel as DDP

        import hvd_onebit.ddp

        model = DDP(task.model, broadcast_buffers=False)
        optimizer = task.optimizer
        if cell["method"] != ADAM:
            optimizer = hvd_onebit.ddp.DistributedOptimizer(optimizer, model,
                                                            **optimizer_options(cell))
        return Wrapped(model, optimizer)

    def average_(self, tensors: list[torch.Tensor], name: str) -> None:
        for t in tensors:
            self.dist.all_reduce(t)
            t.div_(self.size)

    def sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        self.dist.all_reduce(tensor)
        return tensor

    def prepare(self) -> None:
        """Nothing to set: Gloo's waits block."""


def make_face(name: str):
    """The face called ``name``, set up in this rank (Horovod initialised, or torch.distributed's
    group already up, as torchrun's rank entry leaves it)."""
    if name == "horovod":
        return HorovodFace()
    if name == "ddp":
        return DDPFace()
    raise ValueError(f"unknown face {name!r}; choose from {', '.join(FACES)}")


def distributed_optimizer(face: str) -> Callable:
    """The 1-bit factory a face's cells are built with (for checking a scheme's options)."""
    if face not in FACES:
        raise ValueError(f"unknown face {face!r}; choose from {', '.join(FACES)}")
    if face == "ddp":
        import hvd_onebit.ddp

        return hvd_onebit.ddp.DistributedOptimizer
    import hvd_onebit

    return hvd_onebit.DistributedOptimizer


def option_names(face: str) -> set[str]:
    """The keyword options a face's 1-bit factory takes."""
    return {name for name, p in inspect.signature(distributed_optimizer(face)).parameters.items()
            if p.kind is not inspect.Parameter.VAR_KEYWORD}
