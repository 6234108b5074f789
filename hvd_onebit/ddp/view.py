"""The DDP face's :class:`~hvd_onebit.optimizer_view.OptimizerView`: the wrapped Adam and the
model's parameter names."""
from __future__ import annotations

import torch

from ..optimizer_view import WrappedAdam


class DDPView:
    """The wrapped Adam of one DDP-face optimizer, and what DDP settles for the phases.

    Args:
        optimizer: the built optimizer (its class derives from the wrapped Adam class).
        optimizer_class: that built class (super() of it is the wrapped Adam).
        names: each parameter's name in the DDP model.
    """

    sparse_as_dense = False  # DDP hands Adam dense gradients or refuses them itself
    sums_gradients = False  # DDP averages

    def __init__(self, optimizer, optimizer_class: type, names: dict):
        self.adam = WrappedAdam(optimizer, optimizer_class)
        self.names = names
        self.synchronized = False

    def name_of(self, p: torch.Tensor) -> str:
        return self.names.get(p, "?")

    def reset_backward_passes(self) -> None:
        """DDP counts no backward passes: ``model.no_sync()`` says which ones accumulate."""
