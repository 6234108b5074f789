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
    """Whether an optimizer other than the face stepped any of ``params`` since :meth:`watch`.

    Args:
        params: the DDP model's parameters.
        ours: whether an optimizer is the face (its steps are its own).
    """

    def __init__(self, params: Iterable, ours: Callable[[object], bool]):
        self._ids = {id(p) for p in params}  # the model holds them while this matters
        self._ours = ours
        self._watching = False
        self.stepped: Optional[str] = None  # the class name of the optimizer that stepped them
        handle = register_optimizer_step_post_hook(weakly(self._after_step))
        weakref.finalize(self, handle.remove)

    def watch(self) -> None:
        """From now until :meth:`unwatch`, remember a step of another optimizer on them."""
        self._watching, self.stepped = True, None

    def unwatch(self) -> None:
        self._watching, self.stepped = False, None

    def _after_step(self, optimizer, args, kwargs) -> None:
        if not self._watching or self._ours(optimizer):
            return  # (a wrapper's hook runs after its inner optimizer's: the outermost names)
        if any(id(p) in self._ids for g in optimizer.param_groups for p in g["params"]):
            self.stepped = type(optimizer).__name__
