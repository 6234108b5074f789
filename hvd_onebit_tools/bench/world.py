"""The job a benchmark's ranks run in: a Horovod job (horovodrun, or the emulated cluster's
Horovod launch) or a torchrun job, where Horovod may not be installed. The worker asks it for
its rank and the job's size, a start line every rank crosses together, and every rank's figures
gathered."""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from .train_ddp import DDP_METHODS

#: The methods of `bench train` that run in a job without Horovod: the step without any
#: communication and DDP's (its own allreduce, PowerSGD, the DDP face of 1-bit Adam with the
#: paper's settings, ``ddp_onebit``, and with the library's defaults, ``ddp_onebit_refresh``).
HOROVOD_FREE = ("local",) + DDP_METHODS


@dataclass(frozen=True)
class World:
    """This rank in its job; ``horovod``: the collectives go through Horovod, else through
    torch.distributed's default group (initialised by the launcher's rank entry)."""

    rank: int
    size: int
    horovod: bool

    @classmethod
    def of_this_job(cls) -> "World":
        """Horovod's when this process initialised Horovod, else torch.distributed's."""
        hvd = sys.modules.get("horovod.torch")
        if hvd is not None and hvd.is_initialized():
            return cls(hvd.rank(), hvd.size(), True)
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("neither Horovod nor torch.distributed is initialised in this "
                               "rank: run it under horovodrun or torchrun")
        return cls(dist.get_rank(), dist.get_world_size(), False)

    def start_line(self, name: str) -> None:
        """Every rank leaves here together (a one-element allreduce)."""
        if self.horovod:
            import horovod.torch as hvd

            hvd.allreduce(torch.zeros(1), name=name)
        else:
            import torch.distributed as dist

            dist.all_reduce(torch.zeros(1))

    def gather_rows(self, row: torch.Tensor, name: str) -> torch.Tensor:
        """Every rank's ``row`` (a [1, k] tensor), stacked in rank order: [size, k]."""
        if self.horovod:
            import horovod.torch as hvd

            return hvd.allgather(row, name=name)
        import torch.distributed as dist

        rows = [torch.empty_like(row) for _ in range(self.size)]
        dist.all_gather(rows, row)
        return torch.cat(rows)
