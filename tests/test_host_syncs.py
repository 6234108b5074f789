"""At most one host read of device values per compressed step, whatever the number of buckets.

On a GPU every read of a tensor's value by Python (``.tolist()``, ``bool()``, ``float()``, ...) is
a device-to-host sync. The step's one read is its agreed success or skip: every bucket's status
words, read together at the end (:func:`hvd_onebit.comm.protocol.read_statuses`). Counted here on
CPU tensors by wrapping those methods (:mod:`tests.sync_counter`); the GPU count, with
``torch.cuda.set_sync_debug_mode``, is in ``benchmarks/gpu_check.py``.
"""
import threading

import pytest
import torch

from hvd_onebit.comm.protocol import NonFiniteInputError
from hvd_onebit.engine import CompressedStep
from hvd_onebit.config import OneBitConfig
from hvd_onebit.transport.inprocess import run_threads
from tests.sync_counter import HostReads
from tests.workers_compressed_step import BETAS, EPS, LR, gradient, initial_state


def _engine_steps(t, reads: HostReads, steps: int, bad_step: int = -1, options=None,
                  weight_decay: float = 0.0) -> dict:
    params, state = initial_state()
    engine = CompressedStep(OneBitConfig.from_options(freeze_step=4, bucket_size_mb=0.001), state,
                            decoupled=lambda group: True, transport=t)
    lr, betas = options(t.rank) if options else (LR, BETAS)
    groups = [{"params": params, "lr": lr, "betas": betas, "eps": EPS,
               "weight_decay": weight_decay}]
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
            "where": reads.calls[me], "params": [p.clone() for p in params]}


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


def _as_tensors(rank: int) -> tuple:
    """LR and BETAS as torch's Adam also takes them: tensors (each rank its own objects)."""
    return torch.tensor(LR), (torch.tensor(BETAS[0]), torch.tensor(BETAS[1]))


def _their_floats(rank: int) -> tuple:
    lr, (b1, b2) = _as_tensors(rank)
    return float(lr), (float(b1), b2.item())


def test_tensor_lr_and_betas_are_read_once_and_step_as_their_floats():
    with HostReads() as reads:
        tensors = run_threads(2, lambda t: _engine_steps(t, reads, steps=4, options=_as_tensors,
                                                         weight_decay=0.1), timeout=120)
    floats = run_threads(2, lambda t: _engine_steps(t, HostReads(), steps=4,
                                                    options=_their_floats, weight_decay=0.1),
                         timeout=120)
    for r, f in zip(tensors, floats):
        # the options' one read joins the first step's two; then they are known (same objects,
        # same in-place versions) and each step reads only its statuses
        assert r["counts"] == [3, 1, 1, 1], r["where"]
        for i, (a, b) in enumerate(zip(r["params"], f["params"])):
            assert torch.equal(a, b), (f"parameter {i}: tensor options stepped otherwise than "
                                       f"their floats, max diff {(a - b).abs().max().item():.3g}")


def test_a_tensor_option_changed_in_place_is_read_again():
    def run(t):
        params, state = initial_state()
        engine = CompressedStep(OneBitConfig.from_options(freeze_step=4), state,
                                decoupled=lambda group: True, transport=t)
        lr = torch.tensor(LR)
        groups = [{"params": params, "lr": lr, "betas": BETAS, "eps": EPS, "weight_decay": 0.0}]
        moved = []
        for step in range(3):
            if step == 2:
                lr.fill_(0.0)  # as a scheduler of a tensor lr does
            before = [p.clone() for p in params]
            engine.ensure_ready(params)
            engine.step(groups, {p: gradient(step, t.rank, p.shape) for p in params})
            moved.append(max((a - b).abs().max().item() for a, b in zip(params, before)))
        return moved
    for moved in run_threads(2, run, timeout=120):
        assert moved[0] > 0 and moved[1] > 0 and moved[2] == 0, (
            f"largest change per step {moved}: with lr set to 0 in place, the last must be 0")
