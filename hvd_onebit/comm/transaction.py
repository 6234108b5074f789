"""Several calls of the stage protocol as one transaction: every call commits, or none does."""
from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from .protocol import (Epilogue, NonFiniteInputError, StagedCollective, StaleInputError, Status,
                       read_statuses)


class TransactionalCollective:
    """What a collective shares with every other one :func:`synchronize_all` drives: finishing one
    call alone, and claiming a handle once. Subclasses implement the rest of
    :class:`~hvd_onebit.comm.protocol.StagedCollective`."""

    def synchronize(self, handle, epilogue: Optional[Epilogue] = None) -> torch.Tensor:
        """Finish an allreduce: the remaining stages and the decode. Returns the output tensor.

        ``epilogue`` is applied to the output once the call has succeeded on every rank, fused
        into the decode pass where it can; a failed call applies nothing. Passing it here, not
        at the start, lets the caller prepare it while stage 1 is on the wire.

        Raises:
            NonFiniteInputError: on every rank, if any rank's input (or a server's average) held
                inf or NaN; the output, the error feedback and ``epilogue``'s tensors are
                untouched.
        """
        return synchronize_all([(self, handle)], [epilogue])[0]

    def claim(self, handle) -> None:
        if handle.done:
            raise RuntimeError("this allreduce handle was already synchronized")
        handle.done = True


def synchronize_all(calls: Sequence[tuple[StagedCollective, object]],
                    epilogues: Optional[Sequence[Optional[Epilogue]]] = None,
                    clock: Optional[dict] = None) -> list[torch.Tensor]:
    """Finish several started allreduces as one transaction: every call commits, or none does.

    A training step spans several buckets, each its own call; a step must never be half applied.
    Stage 1 of every call is waited for before any output is written, and the statuses in the
    rows (every rank's, in every row) tell every rank the same thing, so the decision to commit
    or abandon is the same on every rank without another collective. Stage 2 of a call starts
    as soon as its stage 1 is in, whatever it said (a bad input only makes bad server rows);
    stage 2 can only fail if a server's average (or an input it averaged) was not finite, and is
    agreed the same way. Every status stays on the device until all stages of all calls are
    in, and is then read at once: one device-to-host sync per step, whatever the number of
    calls. On failure nothing is written (outputs, error feedback, ``epilogues``' tensors),
    every started collective has been waited out, and the calls are ready for the next step.

    Args:
        calls: (collective, handle) pairs, in the same order on every rank.
        epilogues: per call, an optional ``Epilogue`` applied to its output in the decode
            pass, only once every call has succeeded.
        clock: if given, seconds spent here are added to its "wait" (blocked on the
            transport), "server" (server steps) and "decode" (decode and commit) entries.
    Returns:
        The outputs, in the order of ``calls``.
    Raises:
        NonFiniteInputError: on every rank, naming the ranks whose values were not finite.
        StaleInputError: on every rank, when a rank marked its call ``stale`` (and no input
            was non-finite); nothing was changed.
    """
    clock = clock if clock is not None else {}
    tick = time.perf_counter

    def timed(key: str, fn, *args):
        start = tick()
        try:
            return fn(*args)
        finally:
            clock[key] = clock.get(key, 0.0) + tick() - start

    epilogues = list(epilogues) if epilogues is not None else [None] * len(calls)
    if len(epilogues) != len(calls):
        raise ValueError(f"{len(epilogues)} epilogues for {len(calls)} calls")
    for comm, handle in calls:
        comm.claim(handle)
    try:
        inputs: list[Status] = []
        for comm, handle in calls:
            inputs.append(timed("wait", comm.wait_stage1, handle))
            timed("server", comm.start_stage2, handle)
        servers = [timed("wait", comm.wait_stage2, handle) for comm, handle in calls]
        stale = [getattr(handle, "stale_from", None) or Status.none() for _, handle in calls]
        bad_inputs, bad_servers, stale_ranks = read_statuses([inputs, servers, stale])
        if bad_inputs:
            raise NonFiniteInputError(bad_inputs, "in the input")
        if stale_ranks:
            raise StaleInputError(stale_ranks)
        if bad_servers:
            raise NonFiniteInputError(bad_servers, "in the server average")
        for (comm, handle), epilogue in zip(calls, epilogues):
            timed("decode", comm.commit, handle, epilogue)
    except BaseException:
        for comm, handle in calls:
            try:
                comm.drain(handle)
            except Exception:  # the transport itself failed (a lost rank): nothing to wait for
                pass
        raise
    finally:
        for comm, _ in calls:
            comm.release()
    return [handle.out for _, handle in calls]

