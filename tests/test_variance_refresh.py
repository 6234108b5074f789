"""variance_refresh: full-precision refresh steps of the variance inside the
compression phase, on 2 real ranks (one job for every scenario, tests/workers_refresh.py)."""
import numpy as np
import pytest
import torch

from hvd_onebit_tools.cluster.jobs import run_job
from hvd_onebit.config import OneBitConfig
from hvd_onebit.layout import ring_allreduce_bytes
from hvd_onebit.variance_refresh import RefreshSchedule
from hvd_onebit import Experimental
from tests.scenarios import scenario
from tests.workers_refresh import FREEZE, SCHEDULE, STEPS
from tests.worlds import shared_suite

W = "tests.workers_refresh:"
EXPECTED = [s for s in range(STEPS) if RefreshSchedule(**SCHEDULE).is_refresh(s, FREEZE)]


results = shared_suite(W + "suite", np=2, timeout=500)


def refreshed_at(r: dict) -> list:
    """Step counts before each iteration whose step was a refresh (the count went up)."""
    counts = [0] + r["refreshes"]
    return [b for b, c0, c1 in zip(r["before"], counts, counts[1:]) if c1 > c0]


def assert_identical(rs, name):
    assert rs[0]["hashes"] == rs[1]["hashes"], \
        f"{name}: ranks differ at iterations " \
        f"{[i for i, (a, b) in enumerate(zip(rs[0]['hashes'], rs[1]['hashes'])) if a != b]}"


def test_option_is_validated_at_construction():
    with pytest.raises(ValueError, match="refresh_schedule growth"):
        OneBitConfig.from_options(freeze_step=3,
                                  variance_refresh="doubling",
                                  experimental=Experimental(refresh_schedule={"growth": 0}))
    with pytest.raises(ValueError, match="refresh_schedule error_feedback"):
        OneBitConfig.from_options(freeze_step=3,
                                  variance_refresh="doubling",
                                  experimental=Experimental(refresh_schedule={"error_feedback": "drop"}))
    with pytest.raises(ValueError, match="refresh_schedule variance_update"):
        OneBitConfig.from_options(freeze_step=3,
                                  variance_refresh="doubling",
                                  experimental=Experimental(refresh_schedule={"variance_update": "often"}))
    c = OneBitConfig.from_options(freeze_step=3,
                                  variance_refresh="doubling",
                                  experimental=Experimental(refresh_schedule={"last_step": 9, "error_feedback": "fold"}))
    assert c.refresh == RefreshSchedule(last_step=9, error_feedback="fold"), f"parsed: {c.refresh}"
    assert OneBitConfig.from_options(freeze_step=3).refresh == RefreshSchedule(), \
        "the default refresh is the doubling schedule"
    assert OneBitConfig.from_options(freeze_step=3, variance_refresh=None).refresh is None


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["overlap", "no_overlap", "memory_lean", "fold", "gated",
                                  "single"])
def test_refreshes_come_on_the_schedule_alike_on_every_rank(results, name):
    rs = scenario(results, name)
    for rank, r in enumerate(rs):
        assert refreshed_at(r) == EXPECTED, \
            f"{name} rank {rank}: refreshed at {refreshed_at(r)}, schedule says {EXPECTED}"
        assert r["telemetry"]["last_refresh_step"] == EXPECTED[-1], r["telemetry"]
        # the count bc2 uses: "gap", the step count of v's last update; "single", v's updates
        # (the warmup's steps and the refreshes). Adam's step count: every step
        n = FREEZE + len(EXPECTED) if name == "single" else EXPECTED[-1] + 1
        assert (r["n"], r["t"]) == (n, STEPS), \
            f"{name} rank {rank}: frozen_variance_step {r['n']} (want {n}), step {r['t']}"
    assert_identical(rs, name)


@pytest.mark.multirank
def test_overlap_on_and_off_give_the_same_bits_around_refreshes(results):
    on, off = scenario(results, "overlap"), scenario(results, "no_overlap")
    for rank in range(2):
        diff = [i for i, (a, b) in enumerate(zip(on[rank]["hashes"], off[rank]["hashes"]))
                if a != b]
        assert not diff, f"rank {rank}: overlap on/off differ at iterations {diff}"
    assert on[0]["buckets"] >= 2, f"expected several buckets, got {on[0]['buckets']}"


@pytest.mark.multirank
def test_a_refresh_step_counts_the_warmup_s_bytes(results):
    for name in ("overlap", "fp16"):
        r = scenario(results, name)[0]
        elem = 2 if name == "fp16" else 4
        ring = ring_allreduce_bytes(r["numel"] * elem, 2)
        at = {b: nbytes for b, nbytes in zip(r["before"], r["bytes"])}
        assert [at[s] for s in EXPECTED] == [ring] * len(EXPECTED), \
            f"{name}: bytes of the refresh steps {[at[s] for s in EXPECTED]} vs ring {ring}"
        compressed = [at[s] for s in range(FREEZE, STEPS) if s not in EXPECTED]
        assert max(compressed) < ring / 8, f"{name}: compressed steps' bytes {compressed}"
    assert_identical(scenario(results, "fp16"), "fp16")


@pytest.mark.multirank
@pytest.mark.parametrize("name, other", [("exact", "single updates"),
                                         ("exact_single", "bc2 from the step count")])
def test_refresh_math_is_adam_s_with_its_bias_corrections(results, name, other):
    """"gap" (default) against the by-hand update weighted by the steps since v's last update;
    "single" against 0/1 Adam's by hand, bc2 from v's updates; each far from the other rule."""
    for rank, r in enumerate(scenario(results, name)):
        worst = max(float(np.abs(a - b).max()) for a, b in zip(r["opt"], r["ref"]))
        wrong = max(float(np.abs(a - b).max()) for a, b in zip(r["opt"], r["wrong"]))
        assert worst < 1e-5, f"{name} rank {rank}: largest |diff| to the update by hand: {worst}"
        assert wrong > 100 * max(worst, 1e-7), \
            f"{name} rank {rank}: {other} differs by only {wrong} (vs {worst})"


def _rescale_figures(probe: dict, rank: int) -> tuple:
    """(largest relative change of e * d where both denominators are finite, largest |e| left
    where one is infinite, largest change of the padding's errors, count of infinite ones)."""
    b, a = probe["before"], probe["after"]
    moved, left, pad, infinite = 0.0, 0.0, 0.0, 0
    for k, (d0, d1) in enumerate(zip(b["denominators"], a["denominators"])):
        numel, chunk = d0.numel(), b["chunks"][k]
        for e0, e1, lo in ((b["worker"][k], a["worker"][k], 0),
                           (b["server"][k], a["server"][k], rank * chunk)):
            n = e0.numel()
            full0 = torch.ones(lo + n)
            full1 = torch.ones(lo + n)
            m = min(numel, lo + n)
            full0[:m], full1[:m] = d0[:m], d1[:m]
            d0s, d1s = full0[lo:lo + n], full1[lo:lo + n]
            finite = torch.isfinite(d0s) & torch.isfinite(d1s)
            u0, u1 = (e0 * d0s)[finite], (e1 * d1s)[finite]
            if u0.numel():
                moved = max(moved, float(((u1 - u0).abs() / u0.abs().clamp_min(1e-30)).max()))
            if (~finite).any():
                left = max(left, float(e1[~finite].abs().max()))
                infinite += int((~finite).sum())
            if lo + n > numel:  # the padding keeps its errors
                tail = slice(max(0, numel - lo), n)
                pad = max(pad, float((e1[tail] - e0[tail]).abs().max()))
    return moved, left, pad, infinite


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["memory_lean", "gated"])
def test_rescaled_errors_stand_for_the_same_momentum(results, name):
    for rank, r in enumerate(scenario(results, name)):
        moved, left, pad, infinite = _rescale_figures(r["probe"], rank)
        assert moved < 1e-5, f"{name} rank {rank}: e * d moved by up to {moved} (relative)"
        assert left == 0.0, f"{name} rank {rank}: |error| up to {left} where d is infinite"
        assert pad == 0.0, f"{name} rank {rank}: the padding's errors changed by {pad}"
        if name == "gated":
            assert infinite > 0, f"rank {rank}: no held element met the refresh"


@pytest.mark.multirank
def test_fold_mode_empties_the_errors_and_pays_an_allreduce(results):
    fold, rescale = scenario(results, "fold"), scenario(results, "overlap")
    for rank, r in enumerate(fold):
        after = max(float(e.abs().max()) for e in r["probe"]["after"]["worker"])
        assert after == 0.0, f"rank {rank}: worker errors up to {after} after a folding refresh"
        at = dict(zip(r["before"], r["bytes"]))
        plain = dict(zip(rescale[rank]["before"], rescale[rank]["bytes"]))
        assert at[6] > plain[6], f"rank {rank}: fold refresh sent {at[6]}, rescale {plain[6]}"


@pytest.mark.multirank
def test_held_elements_train_from_the_first_refresh_that_sees_their_gradient(results):
    gated, frozen = scenario(results, "gated"), scenario(results, "gated_frozen")
    for rank in range(2):
        moved = float(gated[rank]["extra"].abs().max())
        still = float(frozen[rank]["extra"].abs().max())
        assert moved > 1e-4, f"rank {rank}: extra moved {moved} with refreshes"
        assert still == 0.0, f"rank {rank}: extra moved {still} with a frozen variance (held)"
        # the compressed step at step 3 (before any refresh) holds it: identical to no refresh
        assert gated[rank]["hashes"][:4] == frozen[rank]["hashes"][:4], \
            f"rank {rank}: runs differ before the first refresh"
    assert_identical(gated, "gated")


@pytest.mark.multirank
@pytest.mark.parametrize("name, at", [("resumed_before", 6), ("resumed_after", 7)])
def test_checkpoints_around_a_refresh_resume_bit_identically(results, name, at):
    full, resumed = scenario(results, "checkpointed"), scenario(results, name)
    for rank in range(2):
        diff = [at + i for i, (a, b) in enumerate(zip(full[rank]["hashes"][at:],
                                                    resumed[rank]["hashes"])) if a != b]
        assert not diff, f"rank {rank}, resumed at {at}: differs at iterations {diff}"
        assert resumed[rank]["telemetry"]["refreshes"] == full[rank]["telemetry"]["refreshes"], \
            f"rank {rank}: {resumed[rank]['telemetry']} vs {full[rank]['telemetry']}"
        assert (resumed[rank]["n"], resumed[rank]["t"]) == (full[rank]["n"], full[rank]["t"])


@pytest.mark.multirank
def test_flush_after_refreshes_empties_the_errors_on_every_rank(results):
    rs = scenario(results, "flush")
    for rank, r in enumerate(rs):
        assert r["flushed"]["bytes"] > 0 and r["flushed"]["norm"] == 0.0, \
            f"rank {rank}: flush sent {r['flushed']['bytes']} bytes, errors left " \
            f"{r['flushed']['norm']}"
        assert refreshed_at(r) == EXPECTED, f"rank {rank}: {refreshed_at(r)}"
    assert_identical(rs, "flush")


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["inf", "scaler_inf"])
def test_a_non_finite_refresh_step_is_skipped_on_every_rank(results, name):
    rs = scenario(results, name)
    for rank, r in enumerate(rs):
        i = r["before"].index(6)  # iteration 6: a refresh step, inf on rank 1
        assert r["before"][i:i + 2] == [6, 6], f"rank {rank}: step counts {r['before']}"
        assert r["hashes"][i] == r["hashes"][i - 1], f"rank {rank}: the skipped step moved"
        assert r["telemetry"]["skipped_steps"] == 1, f"rank {rank}: {r['telemetry']}"
        assert refreshed_at(r) == EXPECTED, f"rank {rank}: refreshed at {refreshed_at(r)}"
    assert_identical(rs, name)
    if name == "scaler_inf":
        assert rs[0]["scale"] == rs[1]["scale"] < 2.0 ** 8, \
            f"scalers: {rs[0]['scale']} vs {rs[1]['scale']} (backed off alike)"


@pytest.mark.multirank
def test_auto_freeze_with_refreshes(results):
    rs = scenario(results, "auto")
    decided = [r["freeze_step"] for r in rs]
    assert decided[0] is not None and decided[0] == decided[1], f"decided {decided}"
    want = [s for s in range(20) if RefreshSchedule(**SCHEDULE).is_refresh(s, decided[0])]
    for rank, r in enumerate(rs):
        assert refreshed_at(r) == want, f"rank {rank}: refreshed at {refreshed_at(r)}, " \
                                        f"schedule from the freeze at {decided[0]}: {want}"
    assert_identical(rs, "auto")


@pytest.mark.multirank
def test_hierarchical_refreshes_rescale_the_shard_s_errors():
    """2 "nodes" of 1 rank (two names of this machine): the 1-bit stage between them."""
    rs = [r["hier"] for r in run_job(W + "hierarchical_run", np=2,
                                     hosts="127.0.0.1:1,127.1:1", timeout=240).results]
    for rank, r in enumerate(rs):
        if "scenario_error" in r:
            pytest.fail(r["scenario_error"])
        assert refreshed_at(r) == EXPECTED, f"rank {rank}: {refreshed_at(r)}"
        moved, left, _, _ = _rescale_figures(r["probe"], rank)
        assert moved < 1e-5 and left == 0.0, f"rank {rank}: e * d moved {moved}, left {left}"
    assert_identical(rs, "hierarchical")



def test_hierarchical_scale_maps_the_ratio_to_this_rank_s_shard():
    """2 nodes x 2 ranks, 7 elements in shards of 4: local rank 1 holds elements 4..7 (the last
    is padding, factor 1). The collective is built without its transports; its inner 1-bit
    stage is replaced by a recorder of what it is asked to scale (no Horovod involved)."""
    import types

    from hvd_onebit.comm.hierarchical import HierarchicalOneBitAllreduce
    from hvd_onebit.comm.topology import Topology

    comm = object.__new__(HierarchicalOneBitAllreduce)
    comm.topology = Topology.from_layout(3, [(0, 0), (0, 1), (1, 0), (1, 1)])
    comm.numel, comm.shard, comm.device = 7, 4, torch.device("cpu")
    got = []
    comm.inner = types.SimpleNamespace(scale_error_feedback=lambda r: got.append(r.tolist()))
    comm.scale_error_feedback(torch.arange(1.0, 8.0))
    assert got == [[5.0, 6.0, 7.0, 1.0]], f"local rank 1's factors: {got}"
