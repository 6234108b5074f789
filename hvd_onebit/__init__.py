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

NEEDS_HOROVOD = (
    "hvd_onebit.{name} is the Horovod face, and Horovod does not import here ({error}). In a "
    "DDP script under torchrun use hvd_onebit.ddp.DistributedOptimizer, which needs no "
    "Horovod; for Horovod jobs install Horovod built against this torch (`hvd-onebit check` "
    "says how)")


def __getattr__(name: str):
    if name in _PUBLIC:
        try:
            module = importlib.import_module(_PUBLIC[name], __name__)
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] != "horovod":
                raise
            raise ModuleNotFoundError(NEEDS_HOROVOD.format(name=name, error=exc),
                                      name=exc.name) from exc
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hvd_onebit' has no attribute {name!r}")
