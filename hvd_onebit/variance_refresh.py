"""When the variance is refreshed in the compression phase: ``variance_refresh``'s schedule.

A frozen variance goes stale: where the gradients keep fading, every later step is shorter than
Adam's, and elements with no gradient before the freeze stay held. A refresh step is a
full-precision step inside the compression phase (the gradients allreduced as in the warmup,
then ``m`` and ``v`` updated from the exact average); the steps between refreshes stay 1-bit.

The schedule is 0/1 Adam's (Lu et al., 2022, arXiv 2202.06009): the variance is updated at steps
``s_0 = 0, s_1, s_2, ...`` counted from the start of training, whose gaps start at
``first_interval`` and are multiplied by ``growth`` after every ``updates_per_interval``
updates, until ``last_step``, after which the variance stays frozen. The warmup (the steps
before ``freeze_step``) is full precision anyway; from the freeze on, a step is a refresh step
when it falls on the schedule. With the defaults of ``"doubling"`` (1, 2, 16, never) that is 96
of the first 1,000 steps, 148 of the first 10,000 and 201 of the first 100,000.

It is a pure function of the step count, which every rank keeps alike (param group 0, moved by
checkpoints and elastic commits), so every rank decides alike without a collective, and a
resumed run continues the same schedule.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterator, Optional

from .values import check_positive_int, is_int, is_number

DOUBLING = "doubling"
ERROR_FEEDBACK_MODES = ("rescale", "fold")  # how the error feedback crosses a refresh
VARIANCE_UPDATES = ("gap", "single")  # how a refresh updates the variance
# Options a schedule no longer takes, each with what to do instead.
RETIRED = {"accept": "its gates ('lowering', 'hypergradient') were measured and retired (the "
                     "fading table of the results page); every refresh updates every "
                     "parameter's variance, as accept='always' did: drop 'accept'"}


@dataclass(frozen=True)
class RefreshSchedule:
    """The steps at which the variance is updated (steps counted from 0, before the step).

    Attributes:
        first_interval: steps between the first updates (>= 1).
        growth: the gap is multiplied by this after every ``updates_per_interval`` updates
            (>= 1; 1 keeps a fixed gap). Gaps are rounded down to whole steps.
        updates_per_interval: updates at one gap before it grows (>= 1).
        last_step: no refresh at this step count or later: the variance then stays frozen for
            the rest of the run (None: refresh forever).
        variance_update: "gap" (default): a refresh ``k`` steps after the variance's last update
            weighs its squared gradient as Adam's running average would weigh ``k`` steps of it,
            ``v = beta2^k * v + (1 - beta2^k) * g^2``, and the bias correction counts steps
            (``1 - beta2^t``, Adam's): the refreshed variance estimates Adam's own, however far
            apart the refreshes are. "single": one update of Adam's average per refresh,
            ``v = beta2 * v + (1 - beta2) * g^2``, with the bias correction counting updates
            (0/1 Adam's): sparse refreshes then move the variance slowly, and the warmup's
            steps keep most of its weight.
        error_feedback: with ``precondition=True`` the errors are in units of the old
            denominator. "rescale" (default) multiplies each by old / new denominator (0 where
            either is infinite): no bytes. "fold" folds every rank's errors into the momentum
            first (one more full-precision allreduce) and they restart from 0.
    Trade-off: each refresh costs a full-precision allreduce (about 30x a compressed step's
    bytes with the default block scales, 32x with one scale per chunk);
    a faster ``growth`` or an earlier ``last_step`` saves bytes and lets the variance age.
    """

    first_interval: int = 1
    growth: float = 2
    updates_per_interval: int = 16
    last_step: Optional[int] = None
    variance_update: str = "gap"
    error_feedback: str = "rescale"

    def __post_init__(self) -> None:
        for name in ("first_interval", "updates_per_interval"):
            check_positive_int(f"refresh_schedule {name}", getattr(self, name))
        g = self.growth
        if not is_number(g) or g < 1:
            raise ValueError(f"refresh_schedule growth must be a number >= 1, got {g!r}")
        if self.last_step is not None and (not is_int(self.last_step) or self.last_step < 1):
            raise ValueError(f"refresh_schedule last_step must be a positive int or None, got "
                             f"{self.last_step!r}")
        if self.variance_update not in VARIANCE_UPDATES:
            raise ValueError(f"refresh_schedule variance_update must be one of "
                             f"{VARIANCE_UPDATES}, got {self.variance_update!r}")
        if self.error_feedback not in ERROR_FEEDBACK_MODES:
            raise ValueError(f"refresh_schedule error_feedback must be one of "
                             f"{ERROR_FEEDBACK_MODES}, got {self.error_feedback!r}")

    @classmethod
    def from_option(cls, option) -> Optional["RefreshSchedule"]:
        """``variance_refresh``: None (no refresh: 1-bit Adam as the paper has it),
        ``"doubling"`` (0/1 Adam's defaults), a dict of some of the fields, or a schedule."""
        if option is None or isinstance(option, cls):
            return option
        if option == DOUBLING:
            return cls()
        if isinstance(option, str):
            raise ValueError(f"variance_refresh must be None, {DOUBLING!r} or a dict of "
                             f"{[f.name for f in fields(cls)]}, got {option!r}")
        if not isinstance(option, dict):
            raise TypeError(f"variance_refresh must be None, {DOUBLING!r} or a dict, got "
                            f"{type(option).__name__}")
        known = [f.name for f in fields(cls)]
        retired = sorted(set(option) & set(RETIRED))
        if retired:
            name = retired[0]
            raise ValueError(f"refresh_schedule {name}={option[name]!r} is no longer an "
                             f"option: {RETIRED[name]}")
        unknown = sorted(set(option) - set(known))
        if unknown:
            raise ValueError(f"refresh_schedule: unknown field(s) {unknown}; known: {known}")
        return cls(**option)

    def gap(self, group: int) -> int:
        """Steps between the updates of the ``group``-th run of ``updates_per_interval``."""
        return max(1, int(self.first_interval * self.growth ** group))

    def updates(self) -> Iterator[int]:
        """The step counts at which the variance is updated, in order (before ``last_step``)."""
        step, group = 0, 0
        while self.last_step is None or step < self.last_step:
            gap = self.gap(group)
            for _ in range(self.updates_per_interval):
                if self.last_step is not None and step >= self.last_step:
                    return
                yield step
                step += gap
            if self.growth == 1:  # the same gap forever: no need to walk group by group
                group = 0
            else:
                group += 1

    def is_update(self, step: int) -> bool:
        """Whether the variance is updated at the step taken with ``step`` steps behind it."""
        if step < 0 or (self.last_step is not None and step >= self.last_step):
            return False
        if self.growth == 1:
            return step % self.first_interval == 0
        start, group = 0, 0
        while True:
            gap = self.gap(group)
            end = start + gap * self.updates_per_interval
            if step < end:
                return (step - start) % gap == 0
            start, group = end, group + 1

    def is_refresh(self, step: int, freeze_step: Optional[int]) -> bool:
        """Whether the step taken after ``step`` steps is a refresh step: in the compression
        phase (``step >= freeze_step``) and on the schedule."""
        return freeze_step is not None and step >= freeze_step and self.is_update(step)

    def count(self, run_steps: int, freeze_step: int) -> int:
        """Refresh steps in a run of ``run_steps`` steps frozen at ``freeze_step``."""
        total = 0
        for s in self.updates():
            if s >= run_steps:
                break
            total += s >= freeze_step
        return total

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
