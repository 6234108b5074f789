"""Another torch optimizer's step on the parameters of a DDP model the DDP face holds.

In a compressed step the face takes DDP's gradient sync off, so the gradients are each rank's
own: another optimizer stepping the model on them parts the ranks. Such a step is told from a
write of the script's own (a weight clip or a renorm under ``torch.no_grad()``, which every
rank makes alike) by torch's global optimizer-step hook, which every ``torch.optim`` optimizer's
``step()`` calls. An update written by hand, outside any torch optimizer, or made on copies of
the parameters that the script then copies in (float32 master weights), is not seen.
"""
from __future__ import annotations

import weakref
from typing import Callable, Iterable, Optional

from torch.optim.optimizer import register_optimizer_step_post_hook

from .weak_hooks import weakly


class ForeignSteps:
    """Whether an optimizer other than the face stepped ``params`` since :meth:`watch`, moving
    them (their in-place versions changed).

    Args:
        params: the DDP model's parameters.
        ours: whether an optimizer is the face (its steps are its own).
    """

    def __init__(self, params: Iterable, ours: Callable[[object], bool]):
        self._params = list(params)
        self._members = set(self._params)
        self._ours = ours
        self._versions: Optional[tuple] = None  # the versions at watch(); None: not watching
        self._stepper: Optional[str] = None  # the class name of the optimizer that stepped them
        handle = register_optimizer_step_post_hook(weakly(self._after_step))
        weakref.finalize(self, handle.remove)

    def _current(self) -> tuple:
        return tuple(p._version for p in self._params)

    def watch(self) -> None:
        """From now until :meth:`unwatch`, remember a step of another optimizer on them."""
        self._versions, self._stepper = self._current(), None

    def unwatch(self) -> None:
        self._versions = self._stepper = None

    def stepped(self) -> Optional[str]:
        """The class name of the optimizer that stepped them since :meth:`watch` and moved them,
        or None."""
        if self._stepper is None or self._current() == self._versions:
            return None
        return self._stepper

    def _after_step(self, optimizer, args, kwargs) -> None:
        if self._versions is None or self._ours(optimizer):
            return  # (a wrapper's hook runs after its inner optimizer's: the outermost names)
        if any(p in self._members for g in optimizer.param_groups for p in g["params"]):
            self._stepper = type(optimizer).__name__
