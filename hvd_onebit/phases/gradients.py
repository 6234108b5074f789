"""What every face's phases do with gradients and Adam's own step, framework-free: the gradient
as Adam takes it in, the finiteness check of a full-precision step, the closure, and the
wrapped Adam's step on averaged gradients (float32 for low-precision parameters)."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..dtypes import check_converted
from ..low_precision import adam_step_float32, is_low_precision
from ..optimizer_view import OptimizerView
from ..state.schedule import Schedule


def as_adam_takes_it(view: OptimizerView, p: torch.Tensor, group: dict,
                     g: torch.Tensor) -> torch.Tensor:
    """The gradient ``g`` of ``p`` as Adam takes it in: negated for ``maximize``, plus Adam's
    L2 weight decay (not AdamW's decoupled one) in ``g``'s dtype."""
    if group.get("maximize"):
        g = -g
    wd = group["weight_decay"]
    if wd != 0 and not view.adam.decoupled(group):
        g = g.add(p.detach().to(g.dtype), alpha=wd)
    return g


def closure_loss(closure: Optional[Callable[[], float]]):
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def sparse_gradient_error(view: OptimizerView, p: torch.Tensor) -> TypeError:
    return TypeError(f"parameter {view.name_of(p)} has a sparse gradient; "
                     f"Adam needs dense gradients: {view.sparse_advice}")


def nonfinite_flag(tensors: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """A 0-dim bool tensor, set where some tensor holds inf or NaN, not read (on a GPU a read is
    a sync; a full-precision step reads it with the ranks' agreement); None without tensors.
    Each tensor's sum of absolute values in float32, in one foreach call (on a GPU a few
    kernels for all of them, not one per tensor), stacked into one flag.

    The sum of absolute values is inf/NaN when an element is; it also overflows where the
    values' magnitudes sum past float32's limit (where a plain sum would too, and sooner), and
    such gradients are as good as non-finite anyway (Adam's squares overflowed long before: the
    step is skipped). Float32, not the tensors' own dtype: a float16 sum overflows at 65504
    where the values are finite.
    """
    if not tensors:
        return None
    dense = [t.coalesce().values() if t.is_sparse else t for t in tensors]
    try:
        norms = torch._foreach_norm(dense, 1, dtype=torch.float32)
    except RuntimeError:  # float64 does not narrow to float32 here: say what it is
        check_converted(dense)
        raise
    return ~torch.isfinite(torch.stack(norms)).all()


def adam_step(view: OptimizerView, schedule: Schedule) -> None:
    """The wrapped Adam's step on the averaged gradients, counted; float16 and bfloat16
    parameters step in float32 with their float32 state (:mod:`hvd_onebit.low_precision`)."""
    low = []
    for group in view.adam.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise sparse_gradient_error(view, p)
            if is_low_precision(p):
                low.append((p, group))
    stashed = [p.grad for p, _ in low]
    for p, _ in low:
        p.grad = None  # torch's Adam skips parameters without a gradient
    try:
        view.adam.adam_step()
    finally:
        for (p, _), g in zip(low, stashed):
            p.grad = g
    for p, group in low:
        adam_step_float32(p, view.adam.state[p], group, view.adam.decoupled(group))
    schedule.count_step()
    schedule.observe_variance()
