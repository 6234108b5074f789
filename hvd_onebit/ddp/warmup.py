"""The DDP face's full-precision steps: DDP's reducer averaged the gradients during backward
(through :class:`~hvd_onebit.ddp.hook.CommHook`, as DDP's own allreduce), so the step is the
wrapped Adam's on them, as DDP + Adam takes it."""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

from ..engine import CompressedStep
from ..layout import ring_allreduce_bytes
from ..phases.gradients import adam_step
from ..state.schedule import Schedule
from ..state.telemetry import Telemetry
from .view import DDPView


class DDPWarmup:
    """The allreduce of a full-precision step (already done by DDP when step() runs) and the
    warmup's own kind of step (a :class:`~hvd_onebit.phases.full_precision.FullPrecisionStep`).

    Args:
        engine: the compression phase's (its buckets are fused before the warmup's last step).
        average_if_local: averages the given parameters' gradients if DDP did not (their
            backward was a compressed step's):
            :meth:`~hvd_onebit.ddp.hook.CommHook.average_if_local`.
    """

    what = "step"

    def __init__(self, view: DDPView, schedule: Schedule, telemetry: Telemetry,
                 engine: CompressedStep, average_if_local: Callable[[Iterable], None]):
        self._view = view
        self._average_if_local = average_if_local
        self._schedule = schedule
        self._telemetry = telemetry
        self._engine = engine
        # DDP waits for its allreduces inside backward: step() never blocks on them
        self.wait_seconds = 0.0

    def synchronize_for_step(self, make_hook: Optional[Callable], scaler=None) -> None:
        """Nothing to wait for: DDP's reducer finished its allreduces when backward returned.
        Before the warmup's last step the compression phase's buckets are fused, so that the
        first compressed step's buckets can start from the gradient hooks. Gradients a
        compressed step's backward left local (a second step() with no backward) are averaged
        here first."""
        self._view.synchronized = False
        names = self._view.names
        self._average_if_local(p for p in self._view.adam.parameters() if p in names)
        active, engine = self._view.adam.active_parameters(), self._engine
        if (self._schedule.last_warmup_step_next() and engine.world > 1
                and not engine.up_to_date(active)):
            engine.fuse(active)

    def race(self) -> None:
        """Nothing was in flight when the script could touch the gradients: DDP's reducer wrote
        its averages into them before backward returned."""
        return None

    def averaged_gradients(self) -> list[torch.Tensor]:
        return [p.grad for p in self._view.adam.parameters() if p.grad is not None]

    def step_bytes(self) -> int:
        """Bytes a bandwidth-optimal ring allreduce sends per rank for the gradients."""
        total = sum(p.numel() * p.element_size() for p in self._view.adam.active_parameters())
        return ring_allreduce_bytes(total, self._engine.world)

    def begin(self) -> None:
        pass

    def apply(self) -> None:
        adam_step(self._view, self._schedule)

    def account(self) -> None:
        self._telemetry.account(self.step_bytes(), self.wait_seconds)
