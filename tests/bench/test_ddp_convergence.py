"""The convergence tools under torchrun: the zoo's worker and examples/train_lm.py run their DDP
face (DDP + Adam against DDP + ``hvd_onebit.ddp``) in the 2-rank torchrun world the DDP face's
own tests launch (Gloo, Horovod blocked in the ranks), so they cost no launch of their own."""
from __future__ import annotations

import math

import pytest

from tests.bench.workers_ddp_convergence import LM_STEPS, ZOO_STEPS
from tests.scenarios import scenario
from tests.worlds import Scratch, shared_suite

pytestmark = pytest.mark.multirank

world = shared_suite("tests.bench.workers_ddp_convergence:suite", np=2, controller="torchrun",
                     timeout=240, kwargs={"scratch": Scratch("ddp_convergence")}, order=1)


@pytest.fixture(scope="module")
def zoo(world):
    """{method: rank 0's record} and the number of lines rank 0 wrote."""
    out = scenario(world, "zoo")
    return {r["method"]: r for r in out[0]["records"]}, out[0]["lines"], out[1]["records"]


def test_the_zoo_runs_adam_and_1bit_cells_under_ddp(zoo):
    records, lines, other_rank = zoo
    assert sorted(records) == ["adam", "onebit"], records
    assert lines == 2 and other_rank == [], (lines, other_rank)
    for r in records.values():
        assert (r["face"], r["world"], r["steps_taken"]) == ("ddp", 2, ZOO_STEPS), r
        assert not r["diverged"] and r["final_loss"] < r["initial_loss"], \
            f"{r['method']}: held-out loss {r['initial_loss']} -> {r['final_loss']}"
    ours = records["onebit"]
    assert (ours["freeze_step"], ours["compressed_steps"], ours["skipped_steps"]) == \
        (4, ZOO_STEPS - 4, 0), ours


def test_the_zoo_ddp_warmup_is_ddp_adam_bit_for_bit(zoo):
    """Before the freeze a 1-bit cell is DDP + Adam: same data, same reduction, so every
    held-out evaluation up to the freeze is the same number; after it, 1-bit Adam's own."""
    records, _, _ = zoo
    adam, ours = records["adam"], records["onebit"]
    before = [(s, v) for s, v in ours["curve"] if s <= ours["freeze_step"]]
    assert len(before) >= 2, f"{len(before)} evaluations up to the freeze: {ours['curve']}"
    assert before == [tuple(p) for p in adam["curve"][:len(before)]], \
        f"warmup curve {before} differs from DDP Adam's {adam['curve'][:len(before)]}"
    assert ours["curve"][-1] != adam["curve"][-1], \
        f"the compression phase left the final loss at DDP Adam's: {ours['curve'][-1]}"


@pytest.fixture(scope="module")
def lm(world):
    return {name: scenario(world, f"lm_{name}")[0] for name in ("adam", "onebit")}


def test_train_lm_ddp_face_trains_with_ddp_adam_and_with_hvd_onebit_ddp(lm):
    adam, ours = lm["adam"], lm["onebit"]
    for s in (adam, ours):
        assert (s["face"], s["world_size"], len(s["train_loss_per_step_rank0"])) == \
            ("ddp", 2, LM_STEPS), {k: s[k] for k in ("face", "world_size", "optimizer")}
        assert math.isfinite(s["final_val_loss"]) and \
            s["final_val_loss"] < s["val_curve"][0]["val_loss"], s["val_curve"]
    assert (ours["freeze_step"], ours["phase_switch_step"]) == (LM_STEPS // 2, LM_STEPS // 2)
    assert ours["telemetry"]["phase"] == "compression", ours["telemetry"]
    adam_bytes = adam["phases"]["full_precision"]["bytes_per_step"]
    compressed = ours["phases"]["compression"]["bytes_per_step"]
    assert 0 < compressed < adam_bytes / 8, \
        f"compression phase sent {compressed} bytes per step, DDP Adam {adam_bytes}"


def test_train_lm_ddp_face_warmup_matches_ddp_adam(lm):
    """Same seed, model, data and schedule as DDP + AdamW: the losses up to the freeze are the
    same numbers, then 1-bit Adam's own."""
    adam, ours = lm["adam"], lm["onebit"]
    freeze = ours["freeze_step"]
    ours_before = ours["train_loss_per_step_rank0"][:freeze + 1]
    adam_before = adam["train_loss_per_step_rank0"][:freeze + 1]
    assert ours_before == adam_before, (ours_before, adam_before)
    assert ours["val_curve"][1]["val_loss"] == adam["val_curve"][1]["val_loss"], \
        (ours["val_curve"], adam["val_curve"])
    assert ours["train_loss_per_step_rank0"] != adam["train_loss_per_step_rank0"], \
        "the compression phase changed nothing"
