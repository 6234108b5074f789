"""Adam's per-parameter state, created at construction with Adam's own initial values.

Created now rather than lazily at the first step: ``hvd.broadcast_optimizer_state`` would
otherwise run a step to create it, and on this optimizer a step communicates and counts. Every
key exists from the start, with the same types on every rank and in every phase:
``hvd.broadcast_optimizer_state`` (an elastic sync) matches entries by name, so a worker joining
in the compression phase must already hold ``frozen_variance_step``.
"""
from __future__ import annotations

import torch

from ..engine import NOT_FROZEN
from ..low_precision import state_dtype


def scalar_step(group: dict, p: torch.Tensor) -> torch.Tensor:
    """A zero ``step`` tensor exactly as torch.optim.Adam creates it lazily."""
    from torch.optim.optimizer import _get_scalar_dtype

    if group.get("capturable") or group.get("fused"):
        return torch.zeros((), dtype=_get_scalar_dtype(is_fused=group.get("fused")), device=p.device)
    return torch.tensor(0.0, dtype=_get_scalar_dtype())


def init_adam_state(param_groups: list[dict], state: dict) -> None:
    """Give every parameter without state Adam's zeros (float32 for float16/bfloat16
    parameters), and every parameter a ``frozen_variance_step`` entry."""
    for group in param_groups:
        for p in group["params"]:
            entry = state[p]
            if len(entry) == 0:
                entry["step"] = scalar_step(group, p)
                like = dict(dtype=state_dtype(p), memory_format=torch.preserve_format)
                entry["exp_avg"] = torch.zeros_like(p, **like)
                entry["exp_avg_sq"] = torch.zeros_like(p, **like)
            entry.setdefault("frozen_variance_step", NOT_FROZEN)
