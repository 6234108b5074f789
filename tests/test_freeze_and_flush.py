"""freeze_step="auto" (the warmup ends when Adam's variance has settled) and
flush_error_feedback (every rank's error feedback folded into the momentum)."""
from typing import Callable, Optional

import pytest
import torch

from hvd_onebit.config import AutoFreeze, OneBitConfig
from hvd_onebit.layout import ring_allreduce_bytes
from hvd_onebit.transport.inprocess import run_threads
from hvd_onebit import Experimental
from tests.scenarios import scenario
from tests.checks import assert_same_params, difference
from tests.workers_compressed_step import BETAS
from tests.workers_freeze_and_flush import (AUTO, flush_engine, unflushed_engine,
                                            unflushed_on_one_rank)
from tests.worlds import Scratch, shared_suite

W = "tests.workers_freeze_and_flush:"


# ---- freeze_step="auto" -------------------------------------------------------------------------

# On 2 ranks: the uninterrupted run with a checkpoint after every step, and the runs resumed from
# before and after its decision (tests.workers_freeze_and_flush.auto_freeze_suite).
auto_runs = shared_suite(W + "auto_freeze_suite", np=2, timeout=300, kwargs={"ckpt_dir": Scratch("auto_freeze")})


@pytest.fixture(scope="module")
def auto_full(auto_runs):
    return scenario(auto_runs, "full")


@pytest.mark.multirank
def test_auto_freeze_is_decided_at_the_same_step_on_every_rank_and_logged(auto_full):
    decided = [r["freeze_step"] for r in auto_full]
    assert decided[0] is not None and len(set(decided)) == 1, f"ranks decided {decided}"
    step = decided[0]
    assert AUTO["min_steps"] <= step < AUTO["max_steps"], \
        f"decided at {step}: by the bounds, not by the variance ({auto_full[0]['decision']})"
    for rank, r in enumerate(auto_full):
        assert r["seen"] == [("warmup", None)] * step + [("compression", step)] * (30 - step), \
            f"rank {rank}: (phase, freeze_step) before each step: {r['seen']}"
        change = r["decision"]["change"]
        assert change < AUTO["tolerance"], \
            f"rank {rank}: decided at {step} on a change of {change}, not under the tolerance " \
            f"{AUTO['tolerance']}: {r['decision']}"
        last = r["decision"]["history"][-2:]
        assert [c < AUTO["tolerance"] for _, c in last] == [True] * 2, \
            f"rank {rank}: the last two checks (step, change) {last} are not all under the " \
            f"tolerance {AUTO['tolerance']} (patience 2)"
        assert any(f"after step {step}" in m and f"{change:.4g}" in m for m in r["log"]), \
            f"rank {rank}: the decision and its figure are not in the log: {r['log']}"
    assert auto_full[0]["decision"] == auto_full[1]["decision"], \
        f"the ranks' decisions differ: rank 0 {auto_full[0]['decision']}, " \
        f"rank 1 {auto_full[1]['decision']}"
    assert_same_params(auto_full[1]["params"], auto_full[0]["params"],
                       "rank 1 vs rank 0 after 30 steps")


def test_a_saved_record_of_the_variance_keeps_its_step_while_the_run_goes_on():
    """The monitor's state_dict() is the record at its snapshot_step: the next check, which
    rewrites the monitor's own copy, leaves the saved one as it was."""
    from hvd_onebit.auto_freeze import VarianceMonitor

    monitor = VarianceMonitor(AutoFreeze(window=2, min_steps=100, max_steps=1000))
    v = torch.full((5,), 4.0)
    monitor.observe(2, [(v, 2, 0.999)])
    saved = monitor.state_dict()
    kept = saved["snapshot"][0].clone()
    monitor.observe(4, [(v * 3, 4, 0.999)])
    assert saved["snapshot_step"] == 2 and torch.equal(saved["snapshot"][0], kept), \
        f"saved at step 2: after the check at step 4 it says step {saved['snapshot_step']} " \
        f"with the copy {saved['snapshot'][0].tolist()}, saved as {kept.tolist()}"


@pytest.mark.multirank
def test_auto_checkpoint_before_the_decision_decides_the_same(auto_full, auto_runs):
    step = auto_full[0]["freeze_step"]
    resumed = scenario(auto_runs, "before")
    for rank, r in enumerate(resumed):
        assert r["start"] == step - 1 and r["seen"][0] == ("warmup", None), \
            f"rank {rank}: resumed at step {r['start']} (expected {step - 1}), " \
            f"(phase, freeze_step) before its first steps {r['seen'][:2]} (expected warmup first)"
        assert r["freeze_step"] == step, \
            f"rank {rank}: resumed at {step - 1}, decided {r['freeze_step']}, uninterrupted {step}"
        assert_same_params(r["params"], auto_full[rank]["params"],
                           f"rank {rank}: resumed at {step - 1} vs the uninterrupted run")


@pytest.mark.multirank
def test_auto_checkpoint_after_the_decision_stays_frozen_there(auto_full, auto_runs):
    step = auto_full[0]["freeze_step"]
    resumed = scenario(auto_runs, "after")
    for rank, r in enumerate(resumed):
        assert r["seen"] == [("compression", step)] * (30 - step - 3), \
            f"rank {rank}: {r['seen']}"
        assert r["freeze_step"] == step and r["decision"]["freeze_step"] == step, \
            f"rank {rank}: resumed at {step + 3}, freeze_step {r['freeze_step']} and the " \
            f"decision's {r['decision']['freeze_step']}, the uninterrupted run decided {step}"
        assert_same_params(r["params"], auto_full[rank]["params"],
                           f"rank {rank}: resumed at {step + 3} vs the uninterrupted run")


@pytest.mark.multirank
def test_auto_checkpoint_sent_by_rank_0_decides_as_the_uninterrupted_run(auto_full, auto_runs):
    """Rank 0 loads a checkpoint from before the decision, with its record of the variance, and
    Horovod's broadcast sends the state with the record's figures: every rank takes rank 0's
    record at its first step, so every rank freezes where the uninterrupted run did, with its
    bits, and without a warning."""
    step = auto_full[0]["freeze_step"]
    for rank, r in enumerate(scenario(auto_runs, "broadcast")):
        assert (r["start"], r["freeze_step"]) == (step - 3, step), \
            f"rank {rank}: resumed at {r['start']} from rank 0's broadcast, froze at " \
            f"{r['freeze_step']}; the uninterrupted run froze at {step}"
        assert r["decision"] == auto_full[rank]["decision"] and r["warnings"] == [], \
            f"rank {rank}: decision {r['decision']}, warnings {r['warnings']}; uninterrupted " \
            f"{auto_full[rank]['decision']}"
        assert_same_params(r["params"], auto_full[rank]["params"],
                           f"rank {rank}: resumed at {step - 3} by broadcast vs uninterrupted")


@pytest.mark.multirank
def test_auto_checkpoint_after_the_decision_sent_by_rank_0_keeps_it_on_every_rank(auto_full,
                                                                                 auto_runs):
    """Rank 0 loads a checkpoint from after the decision and Horovod's broadcast sends it: the
    other ranks, which decided nothing themselves, report the decision the state carries, as
    rank 0 does, save it in their own state, and train on with the uninterrupted run's bits."""
    step = auto_full[0]["freeze_step"]
    for rank, r in enumerate(scenario(auto_runs, "broadcast_after")):
        assert (r["start"], r["freeze_step"]) == (step + 3, step) \
            and r["decision"] == r["reloaded"] == auto_full[rank]["decision"], \
            f"rank {rank}: resumed at {r['start']} from rank 0's broadcast, freeze_step " \
            f"{r['freeze_step']}, decision {r['decision']} (its own state saved and loaded: " \
            f"{r['reloaded']}); uninterrupted {step}, " \
            f"{auto_full[rank]['decision']}"
        assert_same_params(r["params"], auto_full[rank]["params"],
                           f"rank {rank}: resumed at {step + 3} by broadcast vs uninterrupted")


@pytest.mark.multirank
def test_auto_checkpoint_sent_by_another_rank_freezes_at_one_step_on_every_rank(auto_full,
                                                                                auto_runs):
    """Rank 1 loads the checkpoint and sends it: rank 0, whose record every rank would take, no
    longer holds the record of its state, so every rank restarts its record together (with a
    warning), freezes at the same step, however late, and none waits on another."""
    step = auto_full[0]["freeze_step"]
    resumed = scenario(auto_runs, "broadcast_from_1")
    decided = [r["freeze_step"] for r in resumed]
    assert decided[0] is not None and decided == [decided[0]] * len(resumed) \
        and decided[0] >= step, f"resumed at {step - 3} on rank 1 and broadcast: the ranks " \
                                f"froze at {decided}, the uninterrupted run at {step}"
    for rank, r in enumerate(resumed):
        assert r["seen"] == resumed[0]["seen"], \
            f"rank {rank}: (phase, freeze_step) before each step {r['seen']}, rank 0's " \
            f"{resumed[0]['seen']}"
        assert len(r["warnings"]) == 1 and f"new record at step {step - 3}" in r["warnings"][0], \
            f"rank {rank}: warnings {r['warnings']}"
        assert_same_params(r["params"], resumed[0]["params"], f"rank {rank} vs rank 0")


# ---- flush_error_feedback: the engine on virtual ranks ----------------------------------------------

def expected_fold(ranks: list[dict]) -> list[torch.Tensor]:
    """m + (mean_i e_w^i + concat_j e_s^j) / beta1, per bucket, from every rank's state before;
    errors of the preconditioned momentum times their denominators first (0 where held)."""
    out = []
    denoms = ranks[0]["before"].get("denominators")
    for k, numel in enumerate(ranks[0]["numel"]):
        e = torch.stack([r["before"]["worker_errors"][k] for r in ranks]).mean(0)
        e = (e + torch.cat([r["before"]["server_errors"][k] for r in ranks]))[:numel]
        if denoms is not None:
            e = torch.where(denoms[k] == float("inf"), 0.0, e * denoms[k])
        out.append(ranks[0]["before"]["momenta"][k] + e / BETAS[0])
    return out


def check_flushed(ranks: list[dict], rtol: float,
                  bytes_of: Optional[Callable[[int], int]]) -> None:
    """The fold on every rank, and (``bytes_of``: a bucket's bytes from its elements) the bytes
    each rank sent."""
    want = expected_fold(ranks)
    for rank, r in enumerate(ranks):
        for k, (got, exp) in enumerate(zip(r["after"]["momenta"], want)):
            torch.testing.assert_close(got, exp, rtol=rtol, atol=1e-7,
                                       msg=f"rank {rank}, bucket {k}: not the folded momentum")
            assert torch.equal(got, ranks[0]["after"]["momenta"][k]), \
                f"rank {rank}, bucket {k}: momentum differs from rank 0's after the flush: " \
                f"{difference(got, ranks[0]['after']['momenta'][k])}"
            left = {kind: int(r["after"][kind][k].count_nonzero())
                    for kind in ("worker_errors", "server_errors")}
            assert left == {"worker_errors": 0, "server_errors": 0}, \
                f"rank {rank}, bucket {k}: nonzero error elements left after the flush: {left}"
        assert bytes_of is None or r["bytes"] == sum(bytes_of(c) for c in r["numel"]), \
            f"rank {rank}: {r['bytes']} bytes sent"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_flush_folds_every_error_into_the_momentum_on_virtual_ranks(n, monkeypatch):
    """Through both ways of the exact sum: one allgather of every rank's errors (small
    buckets), or each rank adding one n-th of them and an allgather of the sums (large ones):
    the same bits, with the bytes each sends; and summed in pieces of a few elements (pieces
    cut across the parameters, as a model larger than a piece is flushed): the same bits."""
    import hvd_onebit.engine.error_feedback as error_feedback
    import hvd_onebit.transport.base as base

    momenta = {}
    for way, small, sent, piece in (  # float32 to n - 1 peers: every element, or twice 1/n
            ("one allgather", 1 << 40, (lambda c: 4 * (n - 1) * c), error_feedback.FLUSH_PIECE),
            ("alltoall and allgather", 0, (lambda c: 2 * 4 * (n - 1) * -(-c // n)),
             error_feedback.FLUSH_PIECE),
            ("pieces of 7 elements", 0, None, 7)):
        monkeypatch.setattr(base, "SMALL_SUM_BYTES", small)
        monkeypatch.setattr(error_feedback, "FLUSH_PIECE", piece)
        ranks = run_threads(n, lambda t: flush_engine(t), timeout=120)
        sums = [float(e.abs().sum()) for e in ranks[0]["before"]["worker_errors"]]
        assert any(s > 0 for s in sums), f"nothing to flush: the test needs error feedback " \
                                         f"(rank 0's sum |e_w| per bucket {sums})"
        check_flushed(ranks, rtol=1e-5, bytes_of=sent)
        momenta[way] = ranks[0]["after"]["momenta"]
    first, *others = momenta
    for way in others:
        for k, (a, b) in enumerate(zip(momenta[first], momenta[way])):
            assert torch.equal(a, b), f"bucket {k}: the flushed momenta of {first} and {way} " \
                                      f"differ: {difference(a, b)}"


def test_flush_on_one_rank_is_a_no_op():
    (r,) = run_threads(1, lambda t: flush_engine(t), timeout=60)
    assert r["bytes"] == 0 and r["error"] is None, \
        f"one rank: the flush sent {r['bytes']} bytes (expected 0) and raised {r['error']!r}"
    changed = [f"bucket {k}: {difference(b, a)}"
               for k, (a, b) in enumerate(zip(r["before"]["momenta"], r["after"]["momenta"]))
               if not torch.equal(a, b)]
    assert not changed, f"one rank: the flush changed the momentum: {changed}"


@pytest.mark.parametrize("n", [2, 3])
def test_flush_with_a_nonfinite_error_changes_nothing_anywhere(n):
    ranks = run_threads(n, lambda t: flush_engine(t, bad_rank=n - 1), timeout=120)
    messages = {r["error"] for r in ranks}
    assert len(messages) == 1 and None not in messages, f"ranks raised {messages}"
    message = messages.pop()
    assert "bucket(s) [1]" in message, message  # the last of two buckets
    for rank, r in enumerate(ranks):
        for key in ("momenta", "worker_errors", "server_errors"):
            for k, (a, b) in enumerate(zip(r["before"][key], r["after"][key])):
                assert torch.allclose(a, b, rtol=0, atol=0, equal_nan=True), \
                    f"rank {rank}: {key}[{k}] changed by a failed flush: {difference(b, a)}"


def test_engine_knows_when_its_errors_are_unflushed_and_warns_when_a_resume_drops_them():
    for rank, r in enumerate(run_threads(2, lambda t: unflushed_engine(t), timeout=120)):
        assert r["seen"] == {"built": False, "stepped": True, "flushed": False,
                             "stepped_again": True, "restarted": False, "expected_False": True,
                             "loaded_False": False, "expected_True": True,
                             "saved_before_fusing": True, "loaded_True": True}, \
            f"rank {rank}: engine.unflushed after each event: {r['seen']}"
        dropped = [w for w in r["warned"][False] if UNSAVED in w]
        assert len(dropped) == 1 and "step 7" in dropped[0], \
            f"rank {rank}: fusing after an unflushed checkpoint without its errors warned " \
            f"{r['warned'][False]}"
        assert not [w for w in r["warned"][True] if UNSAVED in w], \
            f"rank {rank}: fusing with the checkpoint's errors given warned {r['warned'][True]}"


def test_a_resume_on_one_rank_says_at_the_load_that_the_errors_were_dropped():
    """Once, for the optimizer's state and the errors saved beside it on several ranks; errors
    loaded without the optimizer's state warn on their own."""
    (r,) = run_threads(1, lambda t: unflushed_on_one_rank(t), timeout=60)
    dropped = [w for w in r["warned"] if UNSAVED in w]
    assert len(dropped) == 1 and "one rank" in dropped[0] and not r["unflushed"] \
        and "To keep it on another number of ranks" in dropped[0] \
        and "error_feedback_state_dict" not in dropped[0], \
        f"one rank: loading an unflushed checkpoint warned {r['warned']}; a state saved after " \
        f"records unflushed={r['unflushed']} (expected False: nothing is left to drop)"
    assert len(r["warned"]) == 1, f"one rank: the resume warned {len(r['warned'])} times: " \
                                  f"{r['warned']}"
    assert len(r["errors_alone"]) == 1 and "does not fit rank 0 of 1" in r["errors_alone"][0], \
        f"errors of rank 1 of 2 loaded again, alone: {r['errors_alone']}"


# ---- flush_error_feedback in Horovod jobs ------------------------------------------------------------

flush_results = shared_suite(W + "flush_suite", np=2, timeout=300)


@pytest.mark.multirank
def test_flush_in_the_warmup_is_a_no_op(flush_results):
    for rank, r in enumerate(flush_results):
        w = r["warmup"]
        assert w["bytes"] == 0 and w["momentum_changed"] == [], \
            f"rank {rank}: a flush in the warmup sent {w['bytes']} bytes (expected 0) and " \
            f"changed the momentum of (parameter, max |diff|) {w['momentum_changed']}"
        assert_same_params(w["with"]["params"], w["without"]["params"],
                           f"rank {rank}: with a flush in the warmup vs without")


@pytest.mark.multirank
def test_flush_through_horovod_folds_the_errors_and_zeroes_them(flush_results):
    ranks = [r["compression"] for r in flush_results]
    check_flushed(ranks, rtol=1e-5, bytes_of=lambda c: ring_allreduce_bytes(4 * c, 2))
    for rank, r in enumerate(ranks):
        assert r["ef_norms"] and not any(r["ef_norms"]), \
            f"rank {rank}: error feedback left after the flush: {r['ef_norms']}"
        assert r["nonfinite_after"] == {}, \
            f"rank {rank}: non-finite elements per parameter after training on: " \
            f"{r['nonfinite_after']}"


@pytest.mark.multirank
def test_flush_with_a_nonfinite_error_raises_on_every_rank(flush_results):
    got = [r["nonfinite"] for r in flush_results]
    errors = [r["error"] for r in got]
    assert errors[0] is not None and errors[0] == errors[1], f"the ranks raised {errors}"
    for text in ("flush_error_feedback", "nothing was folded"):
        assert text in errors[0], f"{text!r} is not in the error raised: {errors[0]!r}"
    for rank, r in enumerate(got):
        assert r["changed"] == {"momenta": [], "worker_errors": [], "server_errors": []}, \
            f"rank {rank}: a failed flush changed (bucket, max |diff|) {r['changed']}"


@pytest.mark.multirank
def test_elastic_commit_flushes_with_flush_on_commit(flush_results):
    for rank, r in enumerate(flush_results):
        c = r["commit"]
        assert c["norms_before"] > 0 and c["norms_after"] == 0.0, f"rank {rank}: {c}"
        assert c["saved_differs_from_live"] == [], \
            f"rank {rank}: the committed momentum is not the flushed one for (parameter, " \
            f"max |diff|) {c['saved_differs_from_live']}"


@pytest.mark.multirank
def test_elastic_restore_of_unflushed_errors_does_not_warn(flush_results):
    for rank, r in enumerate(flush_results):
        got = r["restore"]
        assert got["committed_unflushed"] is True, \
            f"rank {rank}: the committed state's record says unflushed_error_feedback=" \
            f"{got['committed_unflushed']!r} after compressed steps without a flush"
        about = [w for w in got["warnings"] if UNSAVED in w]
        assert got["steps"] == 8 and not about, \
            f"rank {rank}: after an elastic restore and sync, step {got['steps']} (expected 8), " \
            f"warnings about missing error feedback: {about}"


UNSAVED = "was saved before its error feedback was flushed into it"

# Saved by 4 ranks; resumed by new processes (the next stage's jobs) on 4 ranks and on 2.
FLUSH_CKPT = {"ckpt_dir": Scratch("flush_checkpoint")}
flush_saved = shared_suite(W + "flush_checkpoint_save", np=4, kwargs=FLUSH_CKPT, timeout=300)
flush_resumed_4 = shared_suite(W + "flush_checkpoint_resume", np=4, kwargs=FLUSH_CKPT, stage=1,
                               timeout=300)
flush_resumed_2 = shared_suite(W + "flush_checkpoint_resume", np=2, kwargs=FLUSH_CKPT, stage=1,
                               timeout=300)


@pytest.mark.multirank
def test_flushed_checkpoint_resumes_on_any_world_size_closer_than_a_reset(
        flush_saved, flush_resumed_4, flush_resumed_2):
    full = flush_saved
    for rank, r in enumerate(full):
        differ = [f"parameter {i}: {difference(a, b)}"
                  for i, (a, b) in enumerate(zip(r["flushed_momentum"], full[0]["flushed_momentum"]))
                  if not torch.equal(a, b)]
        assert not differ, f"rank {rank}: the momentum differs from rank 0's after the flush: {differ}"
        assert r["unflushed"] == [True, False], \
            f"rank {rank}: the state's record of unflushed error feedback before and after the " \
            f"flush: {r['unflushed']}, expected [True, False]"
        about = [w for w in r["warnings"] if UNSAVED in w]
        assert not about, f"rank {rank}: resuming with its error feedback loaded warned {about}"
    reference = full[0]["val_loss"]
    gaps, dists = {}, {}
    for np_, resumed in ((4, flush_resumed_4), (2, flush_resumed_2)):
        for rank, r in enumerate(resumed):
            for kind in ("flush", "reset"):
                assert (r[kind]["steps"], r[kind]["phase"]) == (16, "compression"), \
                    f"{np_} ranks, rank {rank}, {kind}: ended at step {r[kind]['steps']} in " \
                    f"{r[kind]['phase']!r}, expected step 16 in 'compression'"
            for kind in ("flush", "reset_flush"):
                about = [w for w in r[kind]["warnings"] if "error feedback" in w]
                assert not about, f"{np_} ranks, rank {rank}, {kind}: resuming a flushed " \
                                  f"checkpoint warned about the error feedback: {about}"
            assert_same_params(r["reset_flush"]["tensors"], r["flush"]["tensors"],
                               f"{np_} ranks, rank {rank}: the flushed checkpoint loaded over "
                               "the other vs alone")
            # the unflushed one, its errors not loaded, says so once, and how to keep them
            about = [w for w in r["reset"]["warnings"] if UNSAVED in w]
            assert len(about) == 1 and all(
                f in about[0] for f in ("step 8", "flush_error_feedback()",
                                        "error_feedback_state_dict()")), \
                f"{np_} ranks, rank {rank}: resuming an unflushed checkpoint without its error " \
                f"feedback warned {r['reset']['warnings']}"
        gaps[np_] = {kind: abs(resumed[0][kind]["val_loss"] - reference)
                     for kind in ("flush", "reset")}
        # how far the parameters end from the uninterrupted run's: the error a reset drops
        # sends them further; the held-out loss of one short run is a noisier witness of it
        dists[np_] = {kind: sum(float((a - b).norm() ** 2) for a, b in zip(
            resumed[0][kind]["tensors"], full[0]["tensors"])) ** 0.5 for kind in ("flush", "reset")}
        # (not a half: the fold can take an element's momentum past the input bound of the
        # preconditioned compression, which clips it at the next step, where the uninterrupted
        # run would have delivered the error unclipped)
        assert dists[np_]["flush"] < 0.6 * dists[np_]["reset"], \
            f"{np_} ranks: parameters end {dists[np_]['flush']:.3g} from the uninterrupted run " \
            f"after a flush, {dists[np_]['reset']:.3g} after a reset"
    assert gaps[4]["flush"] < gaps[4]["reset"], \
        f"4 ranks: held-out loss gap to the uninterrupted run ({reference:.6f}) after a flush " \
        f"{gaps[4]['flush']:.3g}, after a reset {gaps[4]['reset']:.3g}"
    print(f"\nheld-out loss gap to the uninterrupted 4-rank run ({reference:.6f}): {gaps}; "
          f"parameter distance: {dists}")


@pytest.mark.parametrize("options, expected", [
    (dict(window=0), "auto_freeze window must be a positive int, got 0"),
    (dict(patience=1.5), "auto_freeze patience must be a positive int, got 1.5"),
    (dict(tolerance=float("nan")), "auto_freeze tolerance must be a positive number, got nan"),
    (dict(tolerance=0), "auto_freeze tolerance must be a positive number, got 0"),
    (dict(min_steps=20, max_steps=10), "max_steps (10) must be >= min_steps (20)"),
    (dict(windw=5), "auto_freeze: unknown option(s) ['windw']"),
    ("fast", "auto_freeze must be a dict of options, got str"),
])
def test_bad_auto_freeze_options_fail_at_construction(options, expected):
    with pytest.raises((ValueError, TypeError)) as info:
        OneBitConfig.from_options(freeze_step="auto",
                                  experimental=Experimental(auto_freeze=options))
    assert expected in str(info.value), f"expected {expected!r} in the error, got {info.value!s}"


def test_auto_freeze_options_need_freeze_step_auto():
    with pytest.raises(ValueError, match="apply only with freeze_step='auto'"):
        OneBitConfig.from_options(freeze_step=10,
                                  experimental=Experimental(auto_freeze={"window": 5}))
    with pytest.raises(ValueError, match="positive int \\(warmup steps\\) or 'auto', got 'AUTO'"):
        OneBitConfig.from_options(freeze_step="AUTO")
    assert OneBitConfig.from_options(freeze_step="auto").auto_freeze == AutoFreeze()


def test_a_flush_marks_the_states_handed_out_at_its_step_only():
    """HandedStates: a state taken with undelivered errors is marked flushed by a flush at the
    same step (both its records); one taken without, or at another step, or before a load, is
    left alone; a record a script changed does not make the flush raise."""
    import json

    from hvd_onebit.state.checkpoint import KEY, RECORD_KEY, HandedStates

    def state(unflushed: bool) -> dict:
        return {KEY: {"unflushed_error_feedback": unflushed},
                "param_groups": [{RECORD_KEY: json.dumps({"unflushed_error_feedback": unflushed})}]}

    def says(sd: dict) -> tuple:
        return (sd[KEY]["unflushed_error_feedback"],
                json.loads(sd["param_groups"][0][RECORD_KEY])["unflushed_error_feedback"]
                if RECORD_KEY in sd["param_groups"][0] else None)

    handed = HandedStates()
    earlier, taken, changed = state(True), state(True), state(True)
    handed.handed(earlier, 4)
    handed.handed(taken, 5)
    handed.handed(changed, 5)
    del changed["param_groups"][0][RECORD_KEY]
    handed.flushed(5)
    assert (says(earlier), says(taken), says(changed)) == ((True, True), (False, False),
                                                          (False, None)), \
        f"flushed at step 5: the state of step 4 says {says(earlier)}, those of step 5 " \
        f"{says(taken)} and {says(changed)}"
    loaded, later = state(True), state(True)
    handed.handed(loaded, 6)
    handed.clear()  # a state loaded
    handed.flushed(6)
    handed.handed(later, 6)
    handed.flushed(7)
    assert says(loaded) == says(later) == (True, True), \
        f"a state handed before a load says {says(loaded)}; one flushed at another step " \
        f"{says(later)}"
