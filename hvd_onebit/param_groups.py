"""Param groups as the library reads them: which group each parameter belongs to."""
from __future__ import annotations

import torch


def groups_by_param(param_groups: list[dict]) -> dict[torch.Tensor, dict]:
    """Each parameter's param group (the dict itself: options read from it are current)."""
    return {p: g for g in param_groups for p in g["params"]}
