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


class HorovodView:
    """Param groups, state and Horovod's machinery of one optimizer, read through."""

    def __init__(self, optimizer, optimizer_class: type):
        self._opt = optimizer
        self._cls = optimizer_class  # the built class: super() of it is the wrapped Adam

    # ---- the optimizer's containers (current after every load) ----------------------------------

    @property
    def param_groups(self) -> list[dict]:
        return self._opt.param_groups

    @property
    def state(self) -> dict:
        return self._opt.state

    @property
    def optimizer_id(self) -> int:
        """The key GradScaler files its record of this optimizer under."""
        return id(self._opt)

    def parameters(self) -> list[torch.Tensor]:
        return [p for g in self._opt.param_groups for p in g["params"]]

    def active_parameters(self) -> list[torch.Tensor]:
        """The parameters that take gradients now (requires_grad may change during a run)."""
        return [p for p in self.parameters() if p.requires_grad]

    def decoupled(self, group: dict) -> bool:
        """Whether ``group`` decays weights as AdamW does (decoupled) rather than through L2."""
        return bool(group.get("decoupled_weight_decay", isinstance(self._opt, torch.optim.AdamW)))

    # ---- Horovod's options and bookkeeping --------------------------------------------------------

    @property
    def process_set(self) -> hvd.ProcessSet:
        return self._opt.process_set

    @property
    def op(self):
        return self._opt.op

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

    # ---- Horovod's and Adam's actions ---------------------------------------------------------------

    def synchronize(self) -> None:
        """Horovod's synchronize: wait for the gradient allreduces the hooks started."""
        _DistributedOptimizer.synchronize(self._opt)

    def adam_step(self) -> None:
        """The wrapped Adam's own step on the gradients as they are."""
        super(self._cls, self._opt).step()

    def torch_state_dict(self) -> dict:
        """The wrapped Adam's own state_dict (torch's)."""
        return super(self._cls, self._opt).state_dict()

    def load_torch_state_dict(self, state_dict: dict) -> None:
        """torch's load_state_dict, keeping the identity of the state container (torch
        replaces it; the engine and the phases hold it)."""
        kept = self._opt.state
        _DistributedOptimizer.load_state_dict(self._opt, state_dict)
        loaded = self._opt.state
        if loaded is not kept:
            kept.clear()
            kept.update(loaded)
            self._opt.state = kept

    def refresh_hooks(self, make_hook) -> None:
        """Follow requires_grad changes: hook newly trainable parameters (``make_hook(p)``),
        forget frozen ones."""
        opt = self._opt
        if not (opt.process_set.included() and hvd.size() > 1):
            return
        hooked = {id(p) for p in opt._requires_update}
        for p in self.parameters():
            if p.requires_grad and id(p) not in hooked:
                grad_acc = p.expand_as(p).grad_fn.next_functions[0][0]
                grad_acc.register_hook(make_hook(p))
                opt._grad_accs.append(grad_acc)
                opt._requires_update.add(p)
                opt._allreduce_delay.setdefault(p, opt.backward_passes_per_step)
                opt._parameter_names.setdefault(p, f"allreduce.late.{len(opt._grad_accs)}")
        for p in [p for p in opt._requires_update if not p.requires_grad]:
            opt._requires_update.discard(p)
