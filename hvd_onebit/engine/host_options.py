"""Param groups' options as Python numbers, read from tensors when first met or changed.

torch's Adam takes ``lr`` and ``betas`` as tensors too (on the GPU with ``capturable`` or
``fused``). Each read of one by Python is a device-to-host sync; the compressed step's arithmetic
on them is on the host, per parameter and bucket. :class:`HostOptions` hands the engine copies
of the groups with every tensor option read as a float, in one read per device, and reads again
only when an option changed (another object, or the same tensor changed in place).
"""
from __future__ import annotations

from collections import defaultdict

import torch


# the options the engine computes with that torch's Adam lets be tensors (exp_avg_mask, a tensor
# of another kind, stays as it is)
SCALAR_OPTIONS = ("lr", "betas", "eps", "weight_decay")


def _tensor_options(group: dict) -> list[tuple[str, int, torch.Tensor]]:
    """(key, position in ``betas`` or -1, tensor) of each option given as a one-element tensor
    (another tensor, such as both betas in one, is left to be read where it is used)."""
    found = []
    for key in SCALAR_OPTIONS:
        value = group.get(key)
        if _one_element(value):
            found.append((key, -1, value))
        elif isinstance(value, (tuple, list)):
            found.extend((key, i, v) for i, v in enumerate(value) if _one_element(v))
    return found


def _one_element(value) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() == 1


def read_together(tensors: list[torch.Tensor]) -> list[float]:
    """Each one-element tensor's value as a float: one read per device. float64 holds every
    float32, bfloat16 and float16 value exactly, as ``float(t)`` would."""
    by_device = defaultdict(list)
    for i, t in enumerate(tensors):
        by_device[t.device].append(i)
    values = [0.0] * len(tensors)
    for places in by_device.values():
        read = torch.stack([tensors[i].detach().reshape(()).to(torch.float64)
                            for i in places]).tolist()
        for i, v in zip(places, read):
            values[i] = v
    return values


def on_host(param_groups: list[dict], read=read_together) -> list[dict]:
    """The groups with every tensor option as a float (a shallow copy; ``params`` is the same
    list); the groups without one, themselves. ``read``: :func:`read_together` or a stand-in
    that knows the values already."""
    options = [_tensor_options(g) for g in param_groups]
    if not any(options):
        return param_groups
    values = iter(read([t for found in options for _, _, t in found]))
    out = []
    for group, found in zip(param_groups, options):
        if not found:
            out.append(group)
            continue
        copy = dict(group)
        for key, position, _ in found:
            if position < 0:
                copy[key] = next(values)
            else:
                copy[key] = tuple(next(values) if j == position else v
                                  for j, v in enumerate(copy[key]))
        out.append(copy)
    return out


class HostOptions:
    """``of(param_groups)``: :func:`on_host` of the groups, the tensor options read again only
    when one is another tensor or moved in place (its version): one read for a run whose lr
    tensor is never changed, one per step for a scheduler that changes it (torch's schedulers
    ``fill_`` a tensor lr). A new storage (``lr.data = ...``) is seen; a write into the same
    storage through ``.data`` or NumPy moves no version and is not. Inference tensors, which
    have no version, are read at every call. The groups' other entries are current at every
    call."""

    def __init__(self):
        self._key: tuple = ()
        self._held: list = []  # the tensors the key names by id, kept alive while it does
        self._values: list = []

    def of(self, param_groups: list[dict]) -> list[dict]:
        return on_host(param_groups, self._read)

    def _read(self, tensors: list[torch.Tensor]) -> list[float]:
        if any(t.is_inference() for t in tensors):  # no version counter: read every time
            self._key, self._held = (), []
            return read_together(tensors)
        key = tuple((id(t), t._version, t.data_ptr()) for t in tensors)
        if key != self._key:
            self._values = read_together(tensors)
            self._key, self._held = key, list(tensors)
        return self._values
