"""The frozen variance: frozen once per parameter, its zeros treated as configured, and the
host copies of the step counts that keep the step free of device syncs.
"""
from __future__ import annotations

import warnings
from collections import Counter
from typing import Iterable, Mapping

import torch


NOT_FROZEN = -1  # state["frozen_variance_step"] before the freeze


def _takes_tensor_scalar() -> bool:
    """Whether this torch's foreach add takes a 0-dim tensor with ``alpha`` (torch 2.2 on)."""
    try:
        torch._foreach_add_([torch.zeros(1)], torch.tensor(1.0), alpha=1.0)
    except (TypeError, RuntimeError):
        return False
    return True


_TENSOR_SCALAR = _takes_tensor_scalar()


class FrozenVariance:
    """Adam's variance as the compression phase holds it, and each parameter's step count.

    Args:
        state: Adam's per-parameter state, read and written in place.
        zero_variance: what a frozen variance of exactly 0 becomes: "hold", "eps" or "floor".
        refreshing: whether variance refreshes run (said in the "hold" warning).
        names: parameter names for messages.
    """

    def __init__(self, state: Mapping[torch.Tensor, dict], zero_variance: str, refreshing: bool,
                 names: Mapping[torch.Tensor, str]):
        self.state = state
        self.zero_variance = zero_variance
        self.refreshing = refreshing
        self.names = names
        # Each parameter's step count on the host, keyed by the step tensor and its version:
        # reading a device tensor's value every step would be a host sync per parameter.
        self._host_steps: dict[torch.Tensor, HostStep] = {}
        self._scanned_for: object = None  # the bucket layout the last freeze() scanned

    def clear(self) -> None:
        """Forget the host step counts and the scanned layout (they are read again)."""
        self._host_steps.clear()
        self._scanned_for = None

    def freeze_once(self, params: list[torch.Tensor], layout: object) -> None:
        """:meth:`freeze` ``params`` once per bucket ``layout`` (a new one scans again)."""
        if self._scanned_for is not layout:
            self.freeze(params)
            self._scanned_for = layout

    def freeze(self, params: list[torch.Tensor]) -> None:
        """Record the step count each parameter's variance was frozen at (once per parameter),
        reading every such step count and zero-variance count in one device-to-host read (a
        read per parameter would be a sync each on a GPU); the step counts also prime
        :meth:`host_step`.

        Elements whose frozen variance is exactly zero never saw a gradient in the warmup (a
        dead ReLU unit, an unused embedding row). Adam would divide their momentum by eps, and
        every element receives about its block's scale, so they would jump by
        lr * scale / eps. With ``zero_variance="hold"`` (default) they are held, with a warning
        (no update from the momentum; AdamW's decoupled weight decay still shrinks them, as
        AdamW's step shrinks an element whose gradient is zero): their denominator is +inf
        (see :class:`~hvd_onebit.kernels.fused_adam.AdamUpdate`), so the update leaves them
        alone and zeroes their momentum. ``"eps"`` gives them Adam's own
        denominator, eps (their variance becomes the smallest normal float32, whose root is
        far below eps), so they take steps at the step bound; ``"floor"`` gives them the
        smallest non-zero variance of their parameter, so they train like its least active
        elements. Either rewrites ``exp_avg_sq`` once, alike on every rank.
        """
        todo = [p for p in params
                if self.state[p].get("frozen_variance_step", NOT_FROZEN) == NOT_FROZEN]
        if not todo:
            return
        device = self.state[todo[0]]["exp_avg_sq"].device
        f64 = dict(dtype=torch.float64, device=device)
        figures = []  # per parameter: its step count, then its count of zero variances
        for p in todo:
            step = self.state[p]["step"]
            figures.append(step.detach().reshape(()).to(**f64) if isinstance(step, torch.Tensor)
                           else torch.tensor(float(step), **f64))
            figures.append(torch.count_nonzero(self.state[p]["exp_avg_sq"] == 0).to(**f64))
        values = torch.stack(figures).tolist()
        held = []  # (parameter, its elements of variance 0), for one warning
        for i, p in enumerate(todo):
            state, step, unseen = self.state[p], values[2 * i], int(values[2 * i + 1])
            state["frozen_variance_step"] = int(step)
            if isinstance(state["step"], torch.Tensor):
                self._remember(p, state["step"], step)
            if unseen and self.zero_variance == "hold":
                held.append((p, unseen))
            elif unseen:
                _fill_zero_variances(state["exp_avg_sq"], self.zero_variance)
        if held:
            warnings.warn(self._held_warning(held))

    def _held_warning(self, held: list[tuple[torch.Tensor, int]]) -> str:
        """One line for every parameter with elements of variance 0 at the freeze (a dead
        ReLU unit, an unused embedding row), the five with the most named."""
        shown = sorted(held, key=lambda h: -h[1])[:5]
        named = ", ".join(f"{n} of {p.numel()} elements of parameter {self.names.get(p, '?')} "
                          f"(after {self.state[p]['frozen_variance_step']} Adam steps of it)"
                          for p, n in shown)
        more = f", and {len(held) - 5} parameter(s) more" if len(held) > 5 else ""
        total = sum(n for _, n in held)
        return (f"hvd_onebit: {total} elements of {len(held)} parameter(s) received no gradient "
                f"in the warmup (variance 0): {named}{more}; the compression phase holds them "
                "(no update; decoupled weight decay still shrinks them)" + (
                    " until a variance refresh sees their gradient" if self.refreshing else "")
                + ". Usual for dead ReLU units or unused embedding rows.")

    def host_step(self, p: torch.Tensor) -> float:
        """Adam's step count of ``p`` as a host number. A step tensor on a GPU (fused or
        capturable Adam) would cost a device-to-host sync per parameter and step to read, so the
        value is read once and then followed on the host: :meth:`count_step` increments both.
        A replaced or externally changed tensor (a loaded state dict) is read again."""
        return self.host_step_of(p, self.state[p])

    def host_step_of(self, p: torch.Tensor, state: dict) -> float:
        """:meth:`host_step` of ``p``, whose state entry is ``state``."""
        t = state["step"]
        return self._tensor_step(p, t) if isinstance(t, torch.Tensor) else float(t)

    def _tensor_step(self, p: torch.Tensor, t: torch.Tensor) -> float:
        """:meth:`host_step` of ``p``, whose step tensor is ``t``."""
        return self._copy_of(p, t).value

    def _copy_of(self, p: torch.Tensor, t: torch.Tensor) -> "HostStep":
        """The host copy of ``p``'s step tensor ``t``, read again if ``t`` is another tensor
        or was changed since (its version)."""
        copy = self._host_steps.get(p)
        if copy is None or copy.tensor is not t or copy.version != t._version:
            copy = self._host_steps[p] = HostStep(t, t._version, float(t))
        return copy

    def count_step(self, params: Iterable[torch.Tensor]) -> None:
        """One more step for each of ``params``: Adam's step count and its host copy. The step
        tensors take one foreach add per device and dtype, as torch's Adam adds them, not one
        small op (a kernel launch on a GPU) per parameter; the host copies are updated in
        place (no object per parameter and step)."""
        by_kind: dict[tuple, tuple[list, list]] = {}  # (device, dtype) -> tensors, host copies
        for p in params:
            state = self.state[p]
            t = state["step"]
            if isinstance(t, torch.Tensor):
                tensors, copies = by_kind.setdefault((t.device, t.dtype), ([], []))
                tensors.append(t)
                copies.append(self._copy_of(p, t))
            else:
                state["step"] = t + 1
        for (device, dtype), (tensors, copies) in by_kind.items():
            if len(set(map(id, tensors))) == len(tensors):  # one parameter each, as in Adam
                if device.type == "cpu" and dtype.is_floating_point and _TENSOR_SCALAR:
                    # as torch's Adam: a 0-dim tensor, where an int scalar takes a slower path
                    torch._foreach_add_(tensors, torch.tensor(1.0), alpha=1.0)
                else:
                    torch._foreach_add_(tensors, 1)
                for t, copy in zip(tensors, copies):
                    copy.version, copy.value = t._version, copy.value + 1
                continue
            # a step tensor several parameters share takes one add per parameter, as in Adam
            counts = Counter(map(id, tensors))
            distinct = {id(t): t for t in tensors}
            torch._foreach_add_(list(distinct.values()), [counts[k] for k in distinct])
            for t, copy in zip(tensors, copies):
                copy.version, copy.value = t._version, copy.value + counts[id(t)]

    def _remember(self, p: torch.Tensor, t: torch.Tensor, value: float) -> None:
        """Record ``value`` as the host copy of ``p``'s step tensor ``t`` as it is now."""
        self._host_steps[p] = HostStep(t, t._version, value)


class HostStep:
    """The host copy of one step tensor: the tensor, its version when copied, the value."""

    __slots__ = ("tensor", "version", "value")

    def __init__(self, tensor: torch.Tensor, version: int, value: float):
        self.tensor, self.version, self.value = tensor, version, value


def _fill_zero_variances(v: torch.Tensor, mode: str) -> None:
    """Give the zero entries of the frozen variance ``v`` (in place) a denominator to train
    with: "eps", the smallest normal float32 (``sqrt(v) / sqrt_bc2 + eps`` is then eps); "floor",
    the smallest non-zero entry of ``v`` (the same as "eps" where there is none)."""
    zero = v == 0
    tiny = torch.finfo(torch.float32).tiny
    fill = tiny
    if mode == "floor" and bool((~zero).any()):
        fill = float(v[~zero].min())
    v.masked_fill_(zero, fill)
