"""float16 and bfloat16 parameters: float32 optimizer state, and a warmup allreduce that takes them.

Adam's variance is ``(1 - beta2) * g^2`` summed with decay: for ``|g|`` below about 8e-3 that is
below float16's smallest subnormal, so a variance kept in the parameter's dtype freezes at 0 and
1-bit Adam would hold every such element fixed for the rest of the run. bfloat16 keeps the range but
only 8 bits of mantissa, so small contributions vanish when added to a larger running sum. So for
low-precision parameters the momentum and the variance are float32 (as a float32 parameter's are),
the warmup's Adam step runs in float32 and rounds only the parameter, and the compression phase's
fused buckets are float32 like everyone else's.

Horovod's allreduce refuses bfloat16 tensors: :class:`WidenBfloat16` carries them as float32 (or
whatever the user's Horovod compression makes of float32) and hands the average back as bfloat16.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .dtypes import LOW_PRECISION_DTYPES


def is_low_precision(p: torch.Tensor) -> bool:
    return p.dtype in LOW_PRECISION_DTYPES


def state_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype of Adam's momentum and variance for parameter ``p``."""
    return torch.float32 if is_low_precision(p) else p.dtype


class WidenBfloat16:
    """A Horovod compression wrapper: bfloat16 tensors travel as float32, others as before.

    Args:
        inner: the user's Horovod compression (``hvd.Compression.none`` or ``.fp16``), applied to
            the widened tensor.
    """

    def __init__(self, inner: Any):
        self.inner = inner

    def compress(self, tensor: torch.Tensor):
        widened = tensor.dtype == torch.bfloat16
        compressed, ctx = self.inner.compress(tensor.float() if widened else tensor)
        return compressed, (widened, ctx)

    def decompress(self, tensor: torch.Tensor, ctx):
        if ctx is None:  # Horovod's sparse allreduce passes no context of ours
            return self.inner.decompress(tensor, None)
        widened, inner_ctx = ctx
        out = self.inner.decompress(tensor, inner_ctx)
        return out.to(torch.bfloat16) if widened else out


def adam_step_float32(p: torch.Tensor, state: dict, group: dict, decoupled: bool) -> None:
    """One Adam (or AdamW) step of a low-precision parameter, computed in float32.

    The same formulas as ``torch.optim.Adam`` (L2 decay into the gradient, or AdamW's decoupled
    decay; ``maximize``; bias corrections), with ``state["exp_avg"]`` and ``state["exp_avg_sq"]``
    float32 tensors shaped like ``p``; only the new parameter is rounded to ``p``'s dtype.
    """
    beta1, beta2 = group["betas"]
    lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
    g = p.grad.float()  # dense: the optimizer densified or refused sparse gradients before
    if group.get("maximize"):
        g = -g
    w = p.detach().float()
    state["step"] += 1
    step = float(state["step"])
    if wd != 0:
        if decoupled:
            w.mul_(1 - lr * wd)
        else:
            g = g.add(w, alpha=wd)
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1 = 1 - beta1 ** step
    bc2 = 1 - beta2 ** step
    denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
    w.addcdiv_(m, denom, value=-lr / bc1)
    p.detach().copy_(w)


def float32_state_in(state_dict: dict, params: list[torch.Tensor]) -> dict:
    """The float32 momentum/variance tensors a state dict holds for low-precision parameters.

    ``torch.optim.Optimizer.load_state_dict`` casts every state tensor to its parameter's dtype,
    which would round a float32 variance back to float16; the optimizer puts these back after
    loading. ``params`` is the optimizer's parameters in param-group order (the state dict's ids
    are positions in that order). Returns {position: {key: tensor}}.
    """
    ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    kept = {}
    for pid, p in zip(ids, params):
        st = state_dict["state"].get(pid, {})
        if is_low_precision(p):
            kept[pid] = {k: v for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")
                         and torch.is_tensor(v) and v.dtype == torch.float32}
    return kept
