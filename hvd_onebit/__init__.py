"""hvd_onebit: 1-bit Adam for Horovod.

``hvd_onebit.DistributedOptimizer`` wraps ``torch.optim.Adam``/``AdamW`` like
``hvd.DistributedOptimizer``: full-precision Horovod allreduce during a warmup, then Adam's variance
is frozen and only the momentum travels, as 1-bit signs through :class:`OneBitAllreduce`.

``hvd_onebit.ddp.DistributedOptimizer`` is the same 1-bit Adam for a DDP model under torchrun;
importing it never imports Horovod.

The public names are imported on first use, so that tools which only need the emulator or the CLI
(``hvd-onebit --help``) do not pay for importing Horovod and torch, and the DDP face runs where
Horovod is not installed.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "AllreduceHandle": ".comm.flat",
    "NonFiniteInputError": ".comm.protocol",
    "OneBitAllreduce": ".comm.flat",
    "synchronize_all": ".comm.transaction",
    "Layout": ".layout",
    "DistributedOptimizer": ".optimizer",
    "Experimental": ".config",
    "torch_adam_state_dict": ".state.checkpoint",
}
__all__ = sorted(_PUBLIC) + ["__version__"]


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hvd_onebit' has no attribute {name!r}")
