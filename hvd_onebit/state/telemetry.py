"""What an optimizer tells training scripts and the CLI about its communication."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Optional


@dataclass
class Telemetry:
    """Counters of one optimizer (bytes and seconds are this rank's)."""

    last_step_bytes: int = 0  # bytes sent in the last step (warmup: the ring allreduce estimate)
    total_bytes: int = 0
    # seconds step() waited on communication in the last step (the DDP face's full-precision
    # steps: 0, DDP waits for its own allreduce inside backward)
    last_step_comm_seconds: float = 0.0
    total_comm_seconds: float = 0.0
    skipped_steps: int = 0  # steps skipped on every rank for non-finite values
    # seconds of the last compressed step by part (CompressedStep.BREAKDOWN); {} in the warmup
    last_step_breakdown: dict = field(default_factory=dict)
    refreshes: int = 0  # variance refresh steps taken (variance_refresh), over the run
    last_refresh_step: Optional[int] = None  # the step count before the last of them

    def count_refresh(self, steps: int) -> None:
        """A refresh step was taken with ``steps`` steps behind it."""
        self.refreshes += 1
        self.last_refresh_step = steps

    def account(self, nbytes: int, seconds: float) -> None:
        """Record one step's communication."""
        self.last_step_bytes = nbytes
        self.total_bytes += nbytes
        self.last_step_comm_seconds = seconds
        self.total_comm_seconds += seconds

    def add(self, nbytes: int, seconds: float) -> None:
        """Count communication outside a step (an error-feedback flush) in the totals only."""
        self.total_bytes += nbytes
        self.total_comm_seconds += seconds

    def as_dict(self, phase: str, steps: int) -> dict:
        """``telemetry()``: the phase, the step count and every counter."""
        return {"phase": phase, "steps": steps, **asdict(self)}


COUNTERS = tuple(f.name for f in fields(Telemetry))  # each one an attribute of the optimizer too
