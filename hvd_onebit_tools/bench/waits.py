"""How ``hvd.DistributedOptimizer`` waits for its allreduces: Horovod's spin or hvd_onebit's sleep.

``hvd.synchronize`` spins on ``sched_yield`` until an op finishes. When ranks share cores (the
emulator puts 4 ranks on this machine's cores), spinning waiters take CPU from the ranks still
computing, so a baseline slows down for a reason a machine with a core per rank would not have.
hvd_onebit's own waits sleep (:func:`hvd_onebit.transports.sleep_until_done`); ``"sleep"`` gives
Horovod's optimizer the same wait, ``"spin"`` restores Horovod's own. The results are the same
either way; only the time differs.

Used by ``bench train`` (every Horovod method), the convergence zoo and ``examples/train_lm.py``
(``--wait``).
"""
from __future__ import annotations

import time
from typing import Optional

WAITS = ("sleep", "spin")


class WaitTimer:
    """Seconds ``hvd.DistributedOptimizer`` spent blocked on its allreduces (summed over
    handles, which it waits for one after the other)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def take(self) -> float:
        """The seconds since the last call (and reset)."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def set_horovod_wait(wait: str, timer: Optional[WaitTimer] = None) -> None:
    """Make ``hvd.DistributedOptimizer`` wait by sleeping (``"sleep"``) or with Horovod's own spin
    (``"spin"``); with ``timer``, also add the seconds each wait blocks to ``timer.seconds``.

    Without a timer, ``"spin"`` puts Horovod's own ``synchronize`` back untouched.
    """
    import horovod.torch.mpi_ops as mpi_ops
    import horovod.torch.optimizer as horovod_optimizer

    from hvd_onebit.transport.horovod import sleep_until_done

    if wait not in WAITS:
        raise ValueError(f"wait must be one of {WAITS}, got {wait!r}")
    sleep = wait == "sleep"

    def synchronize(handle):
        if sleep and not callable(handle):
            sleep_until_done(handle)
        return mpi_ops.synchronize(handle)

    if timer is not None:
        def timed(handle):
            start = time.perf_counter()
            try:
                return synchronize(handle)
            finally:
                timer.seconds += time.perf_counter() - start
                timer.calls += 1

        horovod_optimizer.synchronize = timed
    else:
        horovod_optimizer.synchronize = synchronize if sleep else mpi_ops.synchronize


def sleeping_horovod_waits(enable: bool) -> None:
    """Make ``hvd.DistributedOptimizer`` wait by sleeping (True) or with its own spin (False)."""
    set_horovod_wait("sleep" if enable else "spin")
