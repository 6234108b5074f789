"""freeze_step="auto": end the warmup once Adam's variance has settled.

1-bit Adam freezes Adam's variance ``v`` as a fixed preconditioner; what it freezes is the
bias-corrected ``v_hat = v / (1 - beta2^t)`` (the denominator is ``sqrt(v_hat) + eps``). The
monitor measures how much ``v_hat`` still moves: every ``window`` steps it compares ``v_hat`` with
the copy it kept ``window`` steps earlier,

    change = sum |v_hat_t - v_hat_{t-window}| / sum v_hat_t        (over every element)

and freezes at the first check, at or after ``min_steps``, where ``change`` has been under
``tolerance`` at ``patience`` checks in a row, and at ``max_steps`` at the latest.

Cost: nothing on the steps between checks (a counter); at a check one pass that reads ``v`` and
the copy and rewrites the copy. Memory: one float32 copy of the variance, during the warmup only.

The same decision on every rank without a collective: in the warmup the gradients are allreduced,
so ``v`` is bit-identical on every rank, and the figure is reduced in an order that depends on
nothing rank-local: each parameter's elements are summed in fixed rows of ``ROW`` elements (one
thread per row, whatever the thread count), in float64, and the row sums are added with
``math.fsum`` (correctly rounded, so their order does not matter either).
"""
from __future__ import annotations

import logging
import math
from dataclasses import asdict
from typing import Iterable, Optional

import torch

from .config import AutoFreeze

log = logging.getLogger("hvd_onebit")

ROW = 4096  # elements per partial sum
CHUNK = 1 << 20  # elements per piece of a check pass (bounds its temporaries)


def _partial_sums(x: torch.Tensor, out: list[float]) -> None:
    """Append the float64 sums of ``x`` (1-D) in rows of ROW elements: each row is reduced by
    one thread, so the bits do not depend on the thread count."""
    whole = x.numel() // ROW * ROW
    if whole:
        out.extend(x[:whole].view(-1, ROW).sum(dim=1, dtype=torch.float64).tolist())
    if whole < x.numel():
        out.append(float(x[whole:].sum(dtype=torch.float64)))


class VarianceMonitor:
    """Decides ``freeze_step="auto"``: see the module docstring.

    The copy of the variance and the figures so far are part of the optimizer's checkpoint
    (:meth:`state_dict`), so a run resumed in the warmup decides at the same step.
    """

    def __init__(self, options: AutoFreeze):
        self.options = options
        self.snapshot: Optional[list[torch.Tensor]] = None  # v_hat at snapshot_step, per param
        self.snapshot_step = -1
        self.history: list[tuple[int, float]] = []  # (step, change) at each check
        self.decision: Optional[dict] = None

    def restart(self) -> None:
        """Forget the copy and the figures (every rank at the same point, e.g. an elastic sync):
        the next check takes a new copy."""
        self.snapshot = None
        self.snapshot_step = -1
        self.history = []

    def observe(self, step: int, variances: Iterable[tuple[torch.Tensor, int, float]]
                ) -> Optional[int]:
        """After warmup step ``step`` (steps taken so far): the step to freeze at (``step``), or
        None to go on. ``variances`` yields (exp_avg_sq, the parameter's Adam step, beta2); it
        is only read at a check."""
        opt = self.options
        if step >= opt.max_steps:
            return self._decide(step, f"max_steps={opt.max_steps} reached", None)
        if step % opt.window:
            return None
        change = self._check(step, list(variances))
        if change is None:
            return None
        self.history.append((step, change))
        recent = [c for _, c in self.history[-opt.patience:]]
        if step >= opt.min_steps and len(recent) == opt.patience \
                and all(c < opt.tolerance for c in recent):
            return self._decide(step, f"relative change of the variance over {opt.window} steps "
                                f"{change:.4g} < tolerance {opt.tolerance:g} at "
                                f"{opt.patience} check(s) in a row", change)
        return None

    def _check(self, step: int, variances: list) -> Optional[float]:
        """One pass: the relative change since the copy (None if there was none), and a new copy."""
        fresh = self.snapshot is None or len(self.snapshot) != len(variances)
        if fresh:
            self.snapshot = [torch.zeros(v.numel(), dtype=torch.float32, device=v.device)
                             for v, _, _ in variances]
        diffs: list[float] = []
        totals: list[float] = []
        for i, (v, t, beta2) in enumerate(variances):
            flat = v.detach().reshape(-1)
            snap = self.snapshot[i]
            if snap.device != flat.device or snap.numel() != flat.numel():
                fresh = True  # e.g. a checkpoint loaded elsewhere: start a new record
                snap = self.snapshot[i] = torch.zeros(flat.numel(), dtype=torch.float32,
                                                      device=flat.device)
            inv_bc = 1.0 / (1.0 - beta2 ** t) if t > 0 else 0.0
            for lo in range(0, flat.numel(), CHUNK):
                hi = min(lo + CHUNK, flat.numel())
                v_hat = flat[lo:hi].float() * inv_bc
                if not fresh:
                    _partial_sums((v_hat - snap[lo:hi]).abs_(), diffs)
                    _partial_sums(v_hat, totals)
                snap[lo:hi].copy_(v_hat)
        previous, self.snapshot_step = self.snapshot_step, step
        if fresh:
            return None
        total = math.fsum(totals)
        change = math.fsum(diffs) / total if total > 0 else math.inf
        log.debug("hvd_onebit auto freeze: step %d, change over steps %d..%d = %.4g",
                  step, previous, step, change)
        return change

    def _decide(self, step: int, reason: str, change: Optional[float]) -> int:
        self.decision = {"freeze_step": step, "reason": reason, "change": change,
                         "history": list(self.history)}
        log.info("hvd_onebit: freeze_step='auto' freezes the variance after step %d: %s",
                 step, reason)
        self.snapshot = None  # the copy is no longer needed
        return step

    # ---- checkpoints --------------------------------------------------------------------------

    def figures(self) -> dict:
        """The record less its copy of the variance: options, the copy's step, the checks."""
        return {"options": asdict(self.options), "snapshot_step": self.snapshot_step,
                "history": list(self.history)}

    def state_dict(self) -> dict:
        """The record as it is now: a copy of the variance's copy, which the next check
        rewrites in place, so that the dict's copy stays that of its ``snapshot_step``."""
        snapshot = None if self.snapshot is None else [t.clone() for t in self.snapshot]
        return dict(self.figures(), snapshot=snapshot, decision=self.decision)

    def load_state_dict(self, state: dict) -> None:
        """Adopt a saved monitor; one saved with other options restarts (with its decision)."""
        self.decision = state.get("decision")
        if state.get("options") != asdict(self.options) or state.get("snapshot") is None:
            self.restart()
            return
        self.adopt(state, [t.detach().clone() for t in state["snapshot"]])

    def adopt(self, figures: dict, snapshot: Optional[list[torch.Tensor]]) -> None:
        """Take another monitor's :meth:`figures` (of these options) and its copy of the
        variance (None where it had taken none yet)."""
        self.snapshot = snapshot
        self.snapshot_step = int(figures["snapshot_step"]) if snapshot is not None else -1
        self.history = [(int(s), float(c)) for s, c in figures["history"]]
