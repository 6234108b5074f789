"""The DDP face's :class:`~hvd_onebit.optimizer_view.OptimizerView`: the wrapped Adam and the
model's parameter names."""
from __future__ import annotations

import operator

import torch

from ..optimizer_view import WrappedAdam


class DDPView:
    """The wrapped Adam of one DDP-face optimizer, and what DDP settles for the phases.

    Args:
        optimizer: the built optimizer (its class derives from the wrapped Adam class).
        optimizer_class: that built class (super() of it is the wrapped Adam).
        names: each parameter's name in the DDP model, for those DDP averages.
        every_name: every parameter's name in the wrapped module.
    """

    sparse_as_dense = False  # DDP hands Adam dense gradients or refuses them itself
    sums_gradients = False  # DDP averages
    sparse_advice = ("the DDP face takes dense gradients only (DDP would average them sparse); "
                     "build the embedding with sparse=False")

    def __init__(self, optimizer, optimizer_class: type, names: dict, every_name: dict):
        self.adam = WrappedAdam(optimizer, optimizer_class)
        self.names = names
        self._every_name = every_name
        self.synchronized = False
        self._averaged: list = []  # the last trainable parameters found all averaged by DDP

    def name_of(self, p: torch.Tensor) -> str:
        return self.names.get(p, "?")

    def refuse_unaveraged(self) -> None:
        """Raise a ValueError naming the parameters that take a gradient now but that DDP does
        not average: DDP chose the parameters it averages when it was built, from
        ``requires_grad`` then, so a parameter unfrozen since, or one added to the optimizer
        that is not the DDP model's (``add_param_group``), would be trained on each rank's own
        gradient (the ranks would part)."""
        active = self.adam.active_parameters()
        if len(active) == len(self._averaged) and all(map(operator.is_, active, self._averaged)):
            return  # the same as last time (a step of thousands of tensors asks every time)
        stray = [p for p in active if p not in self.names]
        unfrozen = [self._every_name[p] for p in stray if p in self._every_name]
        strangers = [tuple(p.shape) for p in stray if p not in self._every_name]
        if strangers:
            raise ValueError(
                f"hvd_onebit.ddp.DistributedOptimizer: {len(strangers)} parameter(s) added to "
                f"the optimizer are not the DDP model's (shapes {strangers[:4]}"
                f"{' ...' if len(strangers) > 4 else ''}): DDP averages only its model's "
                "parameters, so these would be trained on each rank's own gradient. Make them "
                "part of the model before wrapping it in DDP, or set requires_grad=False on "
                "them. Nothing was changed by this step")
        if unfrozen:
            raise ValueError(
                f"hvd_onebit.ddp.DistributedOptimizer: {len(unfrozen)} parameter(s) take a "
                f"gradient now that the DDP model does not average ({', '.join(unfrozen[:4])}"
                f"{' ...' if len(unfrozen) > 4 else ''}): DDP averages the parameters that "
                "required a gradient when it was built, so one unfrozen since would be trained "
                "on each rank's own gradient. Set requires_grad before wrapping the model in "
                "DDP: to unfreeze during training, save a checkpoint and build the DDP model "
                "and the optimizer again. Nothing was changed by this step")
        self._averaged = active

    def reset_backward_passes(self) -> None:
        """DDP counts no backward passes: ``model.no_sync()`` says which ones accumulate."""
