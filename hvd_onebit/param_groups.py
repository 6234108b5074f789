"""Param groups as the library reads them: which group each parameter belongs to."""
from __future__ import annotations

from typing import Iterable

import torch


def groups_by_param(param_groups: list[dict]) -> dict[torch.Tensor, dict]:
    """Each parameter's param group (the dict itself: options read from it are current)."""
    return {p: g for g in param_groups for p in g["params"]}


def check_no_amsgrad(param_groups: Iterable[dict], where: str = "") -> None:
    """Raise ValueError if a param group has amsgrad on (``where``: whose groups, for the
    message: a state dict being loaded, a group being added)."""
    on = [i for i, g in enumerate(param_groups) if g.get("amsgrad")]
    if on:
        raise ValueError(f"amsgrad=True is not supported{where}, param group(s) {on}: 1-bit "
                         "Adam freezes the variance, which amsgrad's running maximum would "
                         "contradict")
