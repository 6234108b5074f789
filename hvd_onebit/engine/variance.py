"""The frozen variance: frozen once per parameter, its zeros treated as configured, and the
host copies of the step counts that keep the step free of device syncs.
"""
from __future__ import annotations

import warnings

import torch


NOT_FROZEN = -1  # state["frozen_variance_step"] before the freeze


class FrozenVariance:
    """The frozen-variance half of :class:`~hvd_onebit.engine.step.CompressedStep` (a mixin)."""

    def _freeze_variances(self, params: list[torch.Tensor]) -> None:
        """Record the step count each parameter's variance was frozen at (once per parameter),
        reading every such step count and zero-variance count in one device-to-host read (a
        read per parameter would be a sync each on a GPU); the step counts also prime
        :meth:`_host_step`.

        Elements whose frozen variance is exactly zero never saw a gradient in the warmup (a
        dead ReLU unit, an unused embedding row). Adam would divide their momentum by eps, and
        every element receives about its block's scale, so they would jump by
        lr * scale / eps. With ``zero_variance="hold"`` (default) they are held fixed, with a
        warning: their denominator is +inf (see :class:`~hvd_onebit.kernels.fused_adam.AdamUpdate`), so
        the update leaves them alone and zeroes their momentum. ``"eps"`` gives them Adam's own
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
        for i, p in enumerate(todo):
            state, step, unseen = self.state[p], values[2 * i], int(values[2 * i + 1])
            state["frozen_variance_step"] = int(step)
            self._remember_step(p, step)
            if unseen and self.config.zero_variance == "hold":
                warnings.warn(
                    f"hvd_onebit: {unseen} of {p.numel()} elements of parameter "
                    f"{self.names.get(p, '?')} received no gradient during the "
                    f"{state['frozen_variance_step']}-step warmup (variance 0); they are held "
                    "fixed in the compression phase" + (
                        "" if self.config.refresh is None else
                        " until a variance refresh sees their gradient"))
            elif unseen:
                _fill_zero_variances(state["exp_avg_sq"], self.config.zero_variance)

    def _host_step(self, p: torch.Tensor) -> float:
        """Adam's step count of ``p`` as a host number. A step tensor on a GPU (fused or
        capturable Adam) would cost a device-to-host sync per parameter and step to read, so the
        value is read once and then followed on the host: :meth:`step` increments both. A
        replaced or externally changed tensor (a loaded state dict) is read again."""
        t = self.state[p]["step"]
        if not isinstance(t, torch.Tensor):
            return float(t)
        cached = self._host_steps.get(p)
        if cached is not None and cached[0] is t and cached[1] == t._version:
            return cached[2]
        value = float(t)
        self._remember_step(p, value)
        return value

    def _remember_step(self, p: torch.Tensor, value: float) -> None:
        """Record ``value`` as the host copy of ``p``'s step tensor as it is now (nothing for a
        step held as a Python number)."""
        t = self.state[p]["step"]
        if isinstance(t, torch.Tensor):
            self._host_steps[p] = (t, t._version, value)


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


