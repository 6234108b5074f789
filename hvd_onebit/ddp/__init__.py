"""hvd_onebit.ddp: 1-bit Adam for ``torch.nn.parallel.DistributedDataParallel`` under torchrun.

::

    model = DDP(model)
    opt = hvd_onebit.ddp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=lr),
                                              model, freeze_step=max(1, total_steps // 20))

The same engine as the Horovod face (:func:`hvd_onebit.DistributedOptimizer`), on
torch.distributed alone: importing this package never imports Horovod.
"""
from .optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
