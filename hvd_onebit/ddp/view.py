"""The DDP face's :class:`~hvd_onebit.optimizer_view.OptimizerView`: the optimizer's containers
read through, the wrapped Adam's own step and checkpoint, and the model's parameter names."""
from __future__ import annotations

import torch


class DDPView:
    """Param groups, state and the wrapped Adam's actions of one DDP-face optimizer.

    Args:
        optimizer: the built optimizer (its class derives from the wrapped Adam class).
        optimizer_class: that built class (super() of it is the wrapped Adam).
        names: each parameter's name in the DDP model.
    """

    sparse_as_dense = False  # DDP hands Adam dense gradients or refuses them itself
    sums_gradients = False  # DDP averages

    def __init__(self, optimizer, optimizer_class: type, names: dict):
        self._opt = optimizer
        self._cls = optimizer_class
        self.names = names
        self.synchronized = False

    @property
    def param_groups(self) -> list[dict]:
        return self._opt.param_groups

    @property
    def state(self) -> dict:
        return self._opt.state

    @property
    def optimizer_id(self) -> int:
        return id(self._opt)

    def parameters(self) -> list[torch.Tensor]:
        return [p for g in self._opt.param_groups for p in g["params"]]

    def active_parameters(self) -> list[torch.Tensor]:
        return [p for p in self.parameters() if p.requires_grad]

    def decoupled(self, group: dict) -> bool:
        return bool(group.get("decoupled_weight_decay", isinstance(self._opt, torch.optim.AdamW)))

    def name_of(self, p: torch.Tensor) -> str:
        return self.names.get(p, "?")

    def reset_backward_passes(self) -> None:
        """DDP counts no backward passes: ``model.no_sync()`` says which ones accumulate."""

    def adam_step(self) -> None:
        super(self._cls, self._opt).step()

    def torch_state_dict(self) -> dict:
        return super(self._cls, self._opt).state_dict()

    def load_torch_state_dict(self, state_dict: dict) -> None:
        """torch's load_state_dict, keeping the identity of the state container (the engine
        and the phases hold it)."""
        kept = self._opt.state
        super(self._cls, self._opt).load_state_dict(state_dict)
        loaded = self._opt.state
        if loaded is not kept:
            kept.clear()
            kept.update(loaded)
            self._opt.state = kept
