"""What the phases and the state modules may read and do on the optimizer a face built.

Each face hands them an object of this shape: :class:`~hvd_onebit.horovod_view.HorovodView` for
the Horovod face, :class:`~hvd_onebit.ddp.view.DDPView` for the DDP face. Nothing here imports a
framework, so a module typed against it runs under either.
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch


STATE_REPLACED = (
    "hvd_onebit: the optimizer's state was replaced by another mapping (opt.state = ...). The "
    "optimizer keeps Adam's moments and frozen variance in the mapping it was built with, and "
    "would step on that one while state_dict() saved the new one. Put the mapping back "
    "(opt.state = the old one), restore a saved state with load_state_dict(), change entries "
    "in place, or build the optimizer again to start Adam afresh")


class WrappedAdam:
    """The containers and the own actions of the Adam a face wraps, read through: torch's
    ``load_state_dict`` replaces the containers, so each read is current after every load.
    Both faces' views hold one as ``adam``.

    Args:
        optimizer: the built optimizer (its class derives from the wrapped Adam class).
        optimizer_class: that built class (super() of it is the wrapped Adam).
        load_state_dict: the load the face's framework runs (default: the wrapped Adam's own).
    """

    def __init__(self, optimizer, optimizer_class: type,
                 load_state_dict: Optional[Callable[[dict], None]] = None):
        self._opt = optimizer
        self._cls = optimizer_class
        self._load = load_state_dict or super(optimizer_class, optimizer).load_state_dict

    @property
    def param_groups(self) -> list[dict]:
        return self._opt.param_groups

    @property
    def state(self) -> dict:
        return self._opt.state

    def check_state(self, kept: dict) -> None:
        """Raise where the optimizer's state container is no longer ``kept``, the one the
        engine and the phases hold (``opt.state = defaultdict(dict)``, a way to reset torch's
        Adam): its steps and its ``state_dict()`` would part from theirs."""
        if self._opt.state is not kept:
            raise RuntimeError(STATE_REPLACED)

    @property
    def optimizer_id(self) -> int:
        """The key GradScaler files its record of this optimizer under."""
        return id(self._opt)

    def parameters(self) -> list[torch.Tensor]:
        return [p for g in self._opt.param_groups for p in g["params"]]

    def attribute(self, name: str):
        """What another library set on the optimizer under ``name`` (GradScaler's
        ``grad_scale``), or None."""
        return getattr(self._opt, name, None)

    def drop_attribute(self, name: str) -> None:
        """Remove what :meth:`attribute` reads, if it is there."""
        self._opt.__dict__.pop(name, None)

    def active_parameters(self) -> list[torch.Tensor]:
        """The parameters that take gradients now (requires_grad may change during a run)."""
        return [p for p in self.parameters() if p.requires_grad]

    def decoupled(self, group: dict) -> bool:
        """Whether ``group`` decays weights as AdamW does (decoupled) rather than through L2."""
        return bool(group.get("decoupled_weight_decay", isinstance(self._opt, torch.optim.AdamW)))

    def adam_step(self) -> None:
        """The wrapped Adam's own step on the gradients as they are."""
        super(self._cls, self._opt).step()

    def zero_grad(self, set_to_none: bool) -> None:
        """The wrapped Adam's own zero_grad. (The face's methods run on objects of a subclass
        too, such as Lightning's optimizer wrapper, which reads the optimizer's attributes:
        ``super(self.__class__, self)`` there would find the face's method again.)"""
        super(self._cls, self._opt).zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        """The wrapped Adam's own add_param_group."""
        super(self._cls, self._opt).add_param_group(param_group)

    def torch_state_dict(self) -> dict:
        """The wrapped Adam's own state_dict (torch's)."""
        return super(self._cls, self._opt).state_dict()

    def load_torch_state_dict(self, state_dict: dict) -> None:
        """The framework's load_state_dict, keeping the identity of the state container and of
        the param groups' list and dicts (torch replaces them; the engine and the phases hold
        the state, and the Adam that was wrapped, with any scheduler built on it, holds the
        groups: a scheduler on it would otherwise set an lr no step reads)."""
        kept, groups, dicts = self._opt.state, self._opt.param_groups, list(self._opt.param_groups)
        self._load(state_dict)
        loaded = self._opt.state
        if loaded is not kept:
            kept.clear()
            kept.update(loaded)
            self._opt.state = kept
        for old, new in zip(dicts, self._opt.param_groups):
            if new is not old:
                old.clear()
                old.update(new)
        groups[:] = dicts
        self._opt.param_groups = groups


class OptimizerView(Protocol):
    """The wrapped Adam (:class:`WrappedAdam`) and the few things of the face's framework the
    phases need."""

    adam: WrappedAdam

    @property
    def sparse_as_dense(self) -> bool:
        """Whether sparse gradients are taken as dense ones (else refused)."""

    @property
    def sparse_advice(self) -> str:
        """What the error refusing a sparse gradient tells the user to do."""

    @property
    def sums_gradients(self) -> bool:
        """Whether the update sees the sum of the ranks' gradients rather than their mean."""

    @property
    def names(self) -> dict: ...

    synchronized: bool  # the script called synchronize() before step() (Horovod's flag)

    def name_of(self, p: torch.Tensor) -> str: ...

    def reset_backward_passes(self) -> None: ...
