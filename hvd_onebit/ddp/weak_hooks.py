"""Hooks that hold the DDP face's objects weakly (:func:`weakly`)."""
from __future__ import annotations

import weakref
from typing import Callable


def weakly(method) -> Callable:
    """``method`` (a bound method) called through a weak reference to its object, doing nothing
    once that is gone. For the hooks on the model and its parameters: those hold their hooks for
    as long as they live (a parameter's in C++, where the cycle collector does not look), and a
    strong one would keep the optimizer, its state and its process group alive with them, and
    the hooks acting for an optimizer the script has dropped (taking DDP's sync off for
    another optimizer's steps)."""
    return WeakHook(method)


class WeakHook:
    """A hook calling a bound method through a weak reference (:func:`weakly`). A model pickled
    (``torch.save(model)``) or copied (``copy.deepcopy(model)``, an EMA's copy) takes a hook that
    does nothing in its place: the optimizer trains the model it was built on, not its copies
    (a copy that trains takes an optimizer of its own)."""

    __slots__ = ("_ref",)

    def __init__(self, method) -> None:
        self._ref = weakref.WeakMethod(method)

    def __call__(self, *args):
        bound = self._ref()
        return None if bound is None else bound(*args)

    def __reduce__(self):
        return inert_hook, ()


def inert_hook() -> Callable:
    """What a pickled or copied :class:`WeakHook` becomes: a hook that does nothing."""
    return _nothing


def _nothing(*args) -> None:
    return None
