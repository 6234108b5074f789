"""The narrow view of the optimizer Horovod built that the phases receive.

:func:`hvd_onebit.DistributedOptimizer` builds one class out of the wrapped Adam class, Horovod's
``_DistributedOptimizer`` and the face (:mod:`hvd_onebit.optimizer`). The phases never hold
that object: they get this view, which reads the param groups and the state as they are now
(torch's ``load_state_dict`` replaces both containers) and offers the few things of Horovod's
they use, so what a phase may touch is written down here and nowhere else.
"""
from __future__ import annotations

import horovod.torch as hvd
import torch
from horovod.torch.optimizer import _DistributedOptimizer

from .optimizer_view import WrappedAdam


class HorovodView:
    """The wrapped Adam (``adam``) and Horovod's machinery of one optimizer, read through."""

    def __init__(self, optimizer, optimizer_class: type):
        self._opt = optimizer
        # the parameters whose gradient accumulator carries a hook (Horovod's, at construction,
        # then refresh_hooks'): a hook stays on its accumulator when its parameter is frozen
        self._hooked = set(optimizer._requires_update)
        self.adam = WrappedAdam(  # Horovod's load also forgets its pending handles
            optimizer, optimizer_class,
            lambda state_dict: _DistributedOptimizer.load_state_dict(optimizer, state_dict))

    # ---- Horovod's options and bookkeeping --------------------------------------------------------

    @property
    def process_set(self) -> hvd.ProcessSet:
        return self._opt.process_set

    @property
    def op(self):
        return self._opt.op

    sparse_advice = "pass sparse_as_dense=True"

    @property
    def sums_gradients(self) -> bool:
        """op=hvd.Sum: the update sees the sum over ranks."""
        return self._opt.op == hvd.Sum

    @property
    def sparse_as_dense(self) -> bool:
        return self._opt.sparse_as_dense

    @property
    def compression(self):
        return self._opt._compression

    @property
    def requires_update(self) -> set:
        return self._opt._requires_update

    @property
    def handles(self) -> dict:
        return self._opt._handles

    def name_of(self, p: torch.Tensor) -> str:
        return self._opt._parameter_names.get(p, "?")

    @property
    def names(self) -> dict:
        return self._opt._parameter_names

    @property
    def should_synchronize(self) -> bool:
        return self._opt._should_synchronize

    @property
    def synchronized(self) -> bool:
        return self._opt._synchronized

    @synchronized.setter
    def synchronized(self, value: bool) -> None:
        self._opt._synchronized = value

    def reset_backward_passes(self) -> None:
        """Every parameter expects ``backward_passes_per_step`` backward passes again."""
        delay = self._opt._allreduce_delay
        for p in delay:
            delay[p] = self._opt.backward_passes_per_step

    def count_backward_pass(self, p: torch.Tensor) -> bool:
        """Count one backward pass of ``p``'s gradient; True on the step's last one."""
        delay = self._opt._allreduce_delay
        if delay[p] <= 0:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call "
                "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
        delay[p] -= 1
        return delay[p] == 0

    # ---- Horovod's actions ---------------------------------------------------------------

    def start_remaining_allreduces(self) -> None:
        """Start the gradient allreduces that Horovod's synchronize() would start before it
        waits: those of the parameters whose hook did not fire on this rank (unused in this
        backward; a zero gradient, which Horovod fills in) and those whose handle is still a
        placeholder. One rank's hook-started allreduce of a parameter that only it used completes
        only when the others start theirs, so they must all be started before any is waited
        for."""
        opt = self._opt
        if not opt.process_set.included():
            return
        started = set()
        for key in opt._handles:
            started.update(key) if isinstance(key, tuple) else started.add(key)
        for p in opt._requires_update - started:
            opt._handles[p] = opt._allreduce_grad_async(p)
        for p, (handle, _) in list(opt._handles.items()):
            if handle is None:
                opt._handles[p] = opt._allreduce_grad_async(p)

    def _added_name(self, p: torch.Tensor, number: int) -> str:
        """The name of a parameter added to the optimizer since it was built (add_param_group),
        which has none from named_parameters: one that says so, the same on every rank, for
        Horovod's allreduce and for the messages that name it."""
        group = next((g for g, group in enumerate(self.adam.param_groups)
                      if any(q is p for q in group["params"])), "?")
        return f"param group {group}, shape {tuple(p.shape)}, added #{number}"

    def synchronize(self) -> None:
        """Horovod's synchronize: wait for the gradient allreduces the hooks started."""
        _DistributedOptimizer.synchronize(self._opt)

    def refresh_hooks(self, make_hook) -> None:
        """Follow requires_grad changes: hook newly trainable parameters (``make_hook(p)``),
        forget frozen ones. A parameter frozen and trainable again keeps the hook it had (its
        accumulator, which Horovod holds, is the same): a second one would count each of its
        backward passes twice."""
        opt = self._opt
        if not (opt.process_set.included() and hvd.size() > 1):
            return
        for p in self.adam.parameters():
            if p.requires_grad and p not in opt._requires_update:
                if p not in self._hooked:
                    grad_acc = p.expand_as(p).grad_fn.next_functions[0][0]
                    grad_acc.register_hook(make_hook(p))
                    opt._grad_accs.append(grad_acc)
                    self._hooked.add(p)
                opt._requires_update.add(p)
                opt._allreduce_delay.setdefault(p, opt.backward_passes_per_step)
                if p not in opt._parameter_names:
                    opt._parameter_names[p] = self._added_name(p, len(opt._grad_accs))
        for p in [p for p in opt._requires_update if not p.requires_grad]:
            opt._requires_update.discard(p)
