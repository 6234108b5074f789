""":class:`TorchJob`: the compression phase's transport in a torchrun job (the DDP face), on a
torch.distributed process group alone, without Horovod."""
from __future__ import annotations

import torch

from .base import JobTransport
from .torch_distributed import TorchTransport


class TorchJob(JobTransport):
    """The 1-bit stages and the exact sums on one torch.distributed process group (Gloo for CPU
    tensors, NCCL for CUDA ones). Exact sums are an allgather of each tensor summed in rank
    order, so every rank gets the same bits whatever the backend's reduction order. The
    collectives stay flat: no node layout is read.

    Args:
        group: the process group (every rank of it builds this at the same point).
    """

    exact_average = True

    def __init__(self, group):
        self.group = group
        self._stages = TorchTransport(group=group)
        self.name = self._stages.name

    def stages(self, device: torch.device) -> TorchTransport:
        """The stage transport for a collective on ``device``."""
        return TorchTransport(device=device, group=self.group)

    def exact_mean_(self, tensors: list[torch.Tensor], name: str) -> int:
        """The mean over ranks of each tensor, in place (the rank-order sum over the size)."""
        sums, nbytes = self.exact_sum(tensors, name)
        for t, total in zip(tensors, sums):
            t.copy_(total.div_(self.size))
        return nbytes

    def gather_failures(self, failure: str) -> list[str]:
        import torch.distributed as dist

        failures: list = [None] * self.size
        dist.all_gather_object(failures, failure, group=self.group)
        return failures
