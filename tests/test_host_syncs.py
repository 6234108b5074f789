"""At most one host read of device values per compressed step, whatever the number of buckets.

On a GPU every read of a tensor's value by Python (``.tolist()``, ``bool()``, ``float()``, ...) is
a device-to-host sync. The step's one read is its agreed success or skip: every bucket's status
words, read together at the end (:func:`hvd_onebit.comm.protocol.read_statuses`). Counted here on
CPU tensors by wrapping those methods (:mod:`tests.sync_counter`); the GPU count, with
``torch.cuda.set_sync_debug_mode``, is in ``benchmarks/gpu_check.py``.
"""
import threading

import pytest

from hvd_onebit.comm.protocol import NonFiniteInputError
from hvd_onebit.engine import CompressedStep
from hvd_onebit.config import OneBitConfig
from hvd_onebit.transport.inprocess import run_threads
from tests.sync_counter import HostReads
from tests.workers_compressed_step import BETAS, EPS, LR, gradient, initial_state


def _engine_steps(t, reads: HostReads, steps: int, bad_step: int = -1) -> dict:
    params, state = initial_state()
    engine = CompressedStep(OneBitConfig.from_options(freeze_step=4, bucket_size_mb=0.001), state,
                            decoupled=lambda group: False, transport=t)
    groups = [{"params": params, "lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": 0.0}]
    me = threading.get_ident()
    counts, skipped = [], []
    for step in range(steps):
        before = reads.count(me)
        engine.ensure_ready(params)
        grads = {p: gradient(step, t.rank, p.shape) for p in params}
        if step == bad_step and t.rank == 0:
            grads[params[-1]][0] = float("inf")  # in the last bucket
        try:
            engine.step(groups, grads)
            skipped.append(False)
        except NonFiniteInputError:
            skipped.append(True)
        counts.append(reads.count(me) - before)
    return {"buckets": len(engine.buckets), "counts": counts, "skipped": skipped,
            "where": reads.calls[me]}


@pytest.mark.parametrize("n", [2, 3])
def test_one_host_read_per_compressed_step_whatever_the_buckets(n):
    with HostReads() as reads:
        results = run_threads(n, lambda t: _engine_steps(t, reads, steps=4, bad_step=2),
                              timeout=120)
    for r in results:
        assert r["buckets"] >= 4, "the model must span several buckets"
        assert r["skipped"] == [False, False, True, False]
        # the first step also reads every parameter's frozen step count and zero-variance
        # count, all in one read (then the step counts are followed on the host)
        assert r["counts"] == [2, 1, 1, 1], r["where"]
