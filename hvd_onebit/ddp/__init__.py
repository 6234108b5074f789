"""hvd_onebit.ddp: 1-bit Adam for ``torch.nn.parallel.DistributedDataParallel`` under torchrun.

::

    model = DDP(model)
    opt = hvd_onebit.ddp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=lr),
                                              model, freeze_step=int(0.05 * total_steps))

The same engine as the Horovod face (:func:`hvd_onebit.DistributedOptimizer`), on
torch.distributed alone: importing this package never imports Horovod.
"""
from .optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
