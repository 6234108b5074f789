"""hvd_onebit: 1-bit Adam for Horovod.

``hvd_onebit.DistributedOptimizer`` wraps ``torch.optim.Adam``/``AdamW`` like
``hvd.DistributedOptimizer``: full-precision Horovod allreduce during a warmup, then Adam's variance
is frozen and only the momentum travels, as 1-bit signs through :class:`OneBitAllreduce`.
"""
__version__ = "0.1.0"

from .collective import AllreduceHandle, NonFiniteInputError, OneBitAllreduce  # noqa: E402
from .layout import Layout  # noqa: E402
from .optimizer import DistributedOptimizer  # noqa: E402

__all__ = ["AllreduceHandle", "DistributedOptimizer", "Layout", "NonFiniteInputError",
           "OneBitAllreduce", "__version__"]
