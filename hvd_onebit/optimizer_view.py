"""What the phases and the state modules may read and do on the optimizer a face built.

Each face hands them an object of this shape: :class:`~hvd_onebit.horovod_view.HorovodView` for
the Horovod face, :class:`~hvd_onebit.ddp.view.DDPView` for the DDP face. Nothing here imports a
framework, so a module typed against it runs under either.
"""
from __future__ import annotations

from typing import Protocol

import torch


class OptimizerView(Protocol):
    """The optimizer's containers, read through (current after every load), and the few
    actions of the face's framework the phases need."""

    @property
    def param_groups(self) -> list[dict]: ...

    @property
    def state(self) -> dict: ...

    @property
    def optimizer_id(self) -> int:
        """The key GradScaler files its record of this optimizer under."""

    @property
    def sparse_as_dense(self) -> bool:
        """Whether sparse gradients are taken as dense ones (else refused)."""

    @property
    def sums_gradients(self) -> bool:
        """Whether the update sees the sum of the ranks' gradients rather than their mean."""

    @property
    def names(self) -> dict: ...

    synchronized: bool  # the script called synchronize() before step() (Horovod's flag)

    def parameters(self) -> list[torch.Tensor]: ...

    def active_parameters(self) -> list[torch.Tensor]: ...

    def decoupled(self, group: dict) -> bool: ...

    def name_of(self, p: torch.Tensor) -> str: ...

    def reset_backward_passes(self) -> None: ...

    def adam_step(self) -> None:
        """The wrapped Adam's own step on the gradients as they are."""

    def torch_state_dict(self) -> dict: ...

    def load_torch_state_dict(self, state_dict: dict) -> None: ...
