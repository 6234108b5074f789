"""Checkpoints, non-finite gradients, GradScaler, bad input and the divergence guard, multi-rank."""
import pytest
import torch

from tests.checks import assert_same_params
from tests.scenarios import scenario
from tests.worlds import Scratch, shared_suite

pytestmark = pytest.mark.multirank
W = "tests.workers_resilience:"


results = shared_suite(W + "suite", np=2, timeout=400)


# One job runs the whole run and the run interrupted in the compression phase (saved at 20);
# new processes (a job of the next stage) resume from the files: with the error feedback,
# without it, and built with a larger freeze_step or "auto" (the checkpoint was frozen at 8 and
# stays so).
KW = {"ckpt_dir": Scratch("resilience_compression"), "total": 30, "freeze_step": 8}
saved = shared_suite(W + "checkpoint_runs", np=2, timeout=300,
                     kwargs={"runs": [KW, {**KW, "stop_at": 20}]})
resumes = shared_suite(W + "checkpoint_runs", np=2, stage=1, timeout=300, kwargs={"runs": [
    {**KW, "resume": True}, {**KW, "resume": True, "error_feedback": False},
    {**KW, "resume": True, "freeze_step": 25}, {**KW, "resume": True, "freeze_step": "auto"}]})
# Saved in the warmup at step 3; resumed by new processes with freeze_step=8, and with
# freeze_step=2 (already past: the variance freezes at the checkpoint's step).
WARMUP_CKPT = Scratch("resilience_warmup")
warmup_saved = shared_suite(W + "checkpoint_run", np=2, timeout=300,
                            kwargs={"ckpt_dir": WARMUP_CKPT, "stop_at": 3, "freeze_step": 5})
warmup_resumed = shared_suite(W + "checkpoint_runs", np=2, stage=1, timeout=300, kwargs={"runs": [
    {"ckpt_dir": WARMUP_CKPT, "resume": True, "freeze_step": 8, "total": 12},
    {"ckpt_dir": WARMUP_CKPT, "resume": True, "freeze_step": 2, "total": 6}]})


def test_checkpoint_resume_is_bit_identical_with_error_feedback(saved, resumes):
    full = [r[0] for r in saved]
    resumed, reset, later, auto = ([r[i] for r in resumes] for i in range(4))
    for rank in range(2):
        assert (resumed[rank]["start"], resumed[rank]["steps"]) == (20, 30), \
            f"rank {rank}: resumed at step {resumed[rank]['start']} and ended at " \
            f"{resumed[rank]['steps']}, expected 20 and 30"
        assert resumed[rank]["phases"] == ["compression"] * 10, \
            f"rank {rank}: phases after resuming at 20: {resumed[rank]['phases']}"
        assert_same_params(resumed[rank]["params"], full[rank]["params"],
                           f"rank {rank}: resumed at 20 vs the uninterrupted run")
        assert later[rank]["phases"] == ["compression"] * 10, \
            f"rank {rank}: phases after resuming with freeze_step=25: {later[rank]['phases']}"
        assert later[rank]["freeze_step"] == 8, \
            f"rank {rank}: resumed with freeze_step=25, kept {later[rank]['freeze_step']}, " \
            f"expected the checkpoint's 8"
        assert_same_params(later[rank]["params"], full[rank]["params"],
                           f"rank {rank}: resumed with a larger freeze_step vs the uninterrupted run")
        assert any("keeps its frozen variance and freeze_step=8, not 25" in w
                   for w in later[rank]["warnings"]), \
            f"rank {rank}: no warning that freeze_step=8 is kept: {later[rank]['warnings']}"
        assert (auto[rank]["phases"], auto[rank]["freeze_step"]) == (["compression"] * 10, 8), \
            f"rank {rank}: resumed with freeze_step='auto': phases {auto[rank]['phases']}, " \
            f"freeze_step {auto[rank]['freeze_step']}, expected compression and 8"
        assert_same_params(auto[rank]["params"], full[rank]["params"],
                           f"rank {rank}: resumed with freeze_step='auto' vs the uninterrupted run")
        assert any("freeze_step='auto' has nothing left to decide" in w
                   for w in auto[rank]["warnings"]), \
            f"rank {rank}: no warning that 'auto' has nothing to decide: {auto[rank]['warnings']}"
        assert resumed[rank]["warnings"] == [], \
            f"rank {rank}: warnings resuming as saved: {resumed[rank]['warnings']}"
        # Without the saved error feedback the trajectory differs (the compression noise is
        # not the same), but the model is as good: held-out loss within 2%.
        assert reset[rank]["params"] != full[rank]["params"], \
            f"rank {rank}: resumed without the error feedback, the parameters are bit-identical " \
            f"to the uninterrupted run's (the error feedback was not dropped)"
        assert reset[rank]["val_loss"] == pytest.approx(full[rank]["val_loss"], rel=0.02), \
            f"rank {rank}: held-out loss {reset[rank]['val_loss']:.6g} without the error " \
            f"feedback, {full[rank]['val_loss']:.6g} uninterrupted (allowed 2% apart)"


def test_warmup_checkpoint_resumes_with_a_new_freeze_step(warmup_saved, warmup_resumed):
    resumed = [r[0] for r in warmup_resumed]
    for rank, r in enumerate(resumed):
        assert r["start"] == 3, f"rank {rank}: resumed at step {r['start']}, expected 3"
        assert r["phases"] == ["warmup"] * 5 + ["compression"] * 4, \
            f"rank {rank}: phases from step 3 on {r['phases']}, expected steps 3..7 in the " \
            f"warmup, 8..11 in compression (freeze_step=8)"
        assert r["warnings"] == [], f"rank {rank}: warnings resuming a warmup checkpoint " \
            f"with its (empty) error feedback: {r['warnings']}"
    assert_same_params(resumed[1]["params"], resumed[0]["params"], "rank 1 vs rank 0 at step 12")


def test_warmup_checkpoint_past_the_new_freeze_step_freezes_at_its_own_step(warmup_saved,
                                                                             warmup_resumed):
    past = [r[1] for r in warmup_resumed]
    for rank, r in enumerate(past):
        assert (r["start"], r["phases"]) == (3, ["compression"] * 3), \
            f"rank {rank}: resumed at {r['start']} with phases {r['phases']}, expected 3 and " \
            "three compressed steps (freeze_step=2 is past)"
        assert r["freeze_step"] == 3, \
            f"rank {rank}: opt.freeze_step {r['freeze_step']}, the variance froze at step 3"
        assert [w for w in r["warnings"] if "past freeze_step=2" in w
                and "freezes now, at freeze_step=3" in w], \
            f"rank {rank}: no warning naming both freeze steps: {r['warnings']}"
    assert_same_params(past[1]["params"], past[0]["params"], "rank 1 vs rank 0 at step 6")


def test_error_feedback_from_another_world_size_is_reset_with_a_warning(results):
    for rank, ef in enumerate(scenario(results, "ef_other_world")):
        assert any("does not fit" in w and "reset to zero" in w for w in ef["warnings"]), \
            f"rank {rank}: {ef['warnings']}"
        assert ef["norms_before"][0] > 0, f"rank {rank}: no error feedback to reset"
        assert ef["norms_after"] == (0.0, 0.0), f"rank {rank}: error feedback {ef['norms_after']}"


def test_error_feedback_from_another_step_is_reset_with_a_warning(results):
    """Errors saved at step 4 and loaded mid-run at step 6, or into a fresh optimizer that then
    trains to its freeze at step 2 (its buckets fused by the warmup's last step, at step 1), are
    not the errors of that step: each warns, at the step that would apply it, naming both step
    counts, and the errors restart from zero (at the freeze: zero after it), not silently
    folded into the next average."""
    for rank, r in enumerate(scenario(results, "ef_other_step")):
        assert max(r["saved_norms"]) > 0, f"rank {rank}: nothing saved to drop: {r}"
        for case, at in (("mid_run", 6), ("into_warmup", 1)):
            said = [w for w in r[case]["warnings"]
                    if f"error feedback saved at step 4 does not fit this optimizer at step {at}"
                    in w and "reset to zero" in w]
            assert len(said) == 1, f"rank {rank} {case}: warnings {r[case]['warnings']}"
        assert r["mid_run"]["as_dropped"], \
            f"rank {rank}: the step after the mid-run load is not that of a run whose errors " \
            "were dropped at the same point"
        assert list(r["into_warmup"]["norms"]) == [0.0, 0.0], \
            f"rank {rank}: errors {r['into_warmup']['norms']} after a dropped load at the freeze"


@pytest.mark.parametrize("key", ["nonfinite", "nonfinite_averaged"])
def test_nonfinite_gradient_on_one_rank_skips_the_step_everywhere(results, key):
    """An inf in rank 1's gradient, or (``_averaged``) written into its averaged gradient after
    synchronize() in a warmup step and a variance refresh step: every rank skips alike."""
    a, b = scenario(results, key)
    for rank, r in enumerate((a, b)):
        # steps 2 (warmup) and 8 (compression) skipped: the count rises exactly there
        assert r["skipped_count_after_step"] == [0, 0] + [1] * 6 + [2] * 4, \
            f"rank {rank}: skipped steps after each step {r['skipped_count_after_step']}"
        for s in (2, 8):
            assert r["changed_params"][s] == [], \
                f"rank {rank}: parameters {r['changed_params'][s]} changed in skipped step {s}"
        assert r["steps"] == 10 and r["nonfinite_params"] == [], \
            f"rank {rank}: {r['steps']} steps taken (expected 10 of 12), non-finite " \
            f"parameters {r['nonfinite_params']}"
    refreshes = a["refreshes_after_step"]
    if key == "nonfinite_averaged":  # the later bad step is a refresh step, after one
        assert refreshes[7] > 0 and refreshes[9] > refreshes[8] == refreshes[7], \
            f"refresh steps taken after each step: {refreshes}"
    assert_same_params(b["final"], a["final"], "rank 1 vs rank 0 after the skips")


@pytest.mark.parametrize("key", ["scaler", "scaler_horovod_recipe"])
def test_grad_scaler_overflow_on_one_rank_is_agreed(results, key):
    a, b = scenario(results, key)
    assert a["skipped"] == b["skipped"], f"ranks disagree on skips: {a['skipped']} {b['skipped']}"
    skipped_at = [s for s, skipped in enumerate(a["skipped"]) if skipped]
    assert skipped_at == [2, 8], f"{key}: steps {skipped_at} skipped, expected [2, 8]"
    assert a["steps"] == b["steps"] == 10, \
        f"{key}: steps taken {a['steps']} on rank 0, {b['steps']} on rank 1, expected 10 of 12"
    assert_same_params(b["final"], a["final"], f"{key}: rank 1 vs rank 0 after the skips")
    assert a["nonfinite_params"] == [], f"{key}, rank 0: non-finite parameters {a['nonfinite_params']}"


@pytest.mark.parametrize("key, what, ranks", [
    ("unscale_in_flight", "scaler.unscale_(optimizer) before optimizer.synchronize()", 2),
    ("unscale_before_synchronize", "scaler.unscale_(optimizer) before optimizer.synchronize()", 2),
    ("clip_alone_in_flight", "changed in place (clipped?)", 1)])
def test_gradients_changed_in_flight_in_the_warmup_are_refused_on_every_rank(results, key,
                                                                              what, ranks):
    """Without synchronize() first, an unscale or a clip races Horovod's in-place allreduce."""
    a, b = scenario(results, key)
    for rank, r in enumerate((a, b)):
        assert r["error_step"] == 2, f"{key}, rank {rank}: error at step {r['error_step']}: {r['error']}"
        here = what if key != "clip_alone_in_flight" or rank == 1 else "another rank's script"
        assert here in r["error"] and f"on {ranks} rank(s)" in r["error"] \
            and "optimizer.synchronize() first" in r["error"], \
            f"{key}, rank {rank}: expected {here!r} on {ranks} rank(s) in {r['error']!r}"
        assert r["after"]["steps"] == r["before"]["steps"] == 2, \
            f"{key}, rank {rank}: steps {r['before']['steps']} -> {r['after']['steps']}"
        assert r["after"]["params"] == r["before"]["params"], \
            f"{key}, rank {rank}: the refused step moved parameters"
        moved = [i for i, (x, y) in enumerate(zip(r["before"]["exp_avg"], r["after"]["exp_avg"]))
                 if not torch.equal(x, y)]
        assert moved == [], f"{key}, rank {rank}: the refused step changed momenta {moved}"
    assert a["steps"] == b["steps"] == 4, f"{key}: steps {a['steps']}, {b['steps']}, expected 4"
    assert_same_params(b["final"], a["final"], f"{key}: rank 1 vs rank 0 after the error")


def test_a_parameter_added_in_the_warmup_is_named_by_its_group_and_shape(results):
    """A parameter add_param_group brought in has no name from named_parameters: the messages
    name it by its param group and shape, not by an internal allreduce name. Its group takes
    the optimizer's learning rate (Horovod's constructor left Adam's 1e-3 as the default)."""
    for rank, r in enumerate(scenario(results, "added_in_the_warmup")):
        caught = r["warnings"]
        assert len(caught) == 1 and "3 of 3 elements of parameter param group 1, shape (3,)" \
            in caught[0], f"rank {rank}: the warnings about the added parameter: {caught}"
        assert r["lrs"] == [1e-2, 1e-2], \
            f"rank {rank}: lr of the first group and of the added one: {r['lrs']}"


@pytest.mark.parametrize("phase", ["compression", "warmup", "compression_mid_step"])
def test_rank_0_loading_and_broadcasting_mid_run_resumes_every_rank(results, phase):
    """Horovod's recipe mid-run: rank 0 loads an earlier state, then sends it to the others.
    Every rank goes on from it as if the run had not gone past it; also where the rollback
    comes between a backward (whose hooks started buckets) and step(), after synchronize()."""
    key = f"rollback_broadcast_{phase}"
    reference = scenario(results, f"no_rollback_{phase.split('_')[0]}")
    for rank, (r, ref) in enumerate(zip(scenario(results, key), reference)):
        assert (r["error"], r["steps"], r["phase"]) == (None, 14, "compression"), \
            f"{key}, rank {rank}: error {r['error']!r}, {r['steps']} steps, {r['phase']}; " \
            "expected no error, 14 steps, compression"
        assert_same_params(r["params"], ref["params"],
                           f"{key}, rank {rank}: after the rollback vs the run without it")


@pytest.mark.parametrize("order", ["state_first", "errors_first"])
def test_a_rollback_with_each_ranks_errors_resumes_bit_identically_in_either_order(results,
                                                                                    order):
    """Back from step 10 to the model, state and error feedback saved at step 7 (compression
    phase, no flush), loaded on every rank with the errors before or after the state: the run
    goes on with the bits of one that never went back, and nothing warns."""
    for rank, r in enumerate(scenario(results, f"rollback_errors_{order}")):
        assert r["same"] and not r["warnings"], \
            f"rank {rank} ({order}): the same bits as never going back: {r['same']}; " \
            f"warnings {r['warnings']}"


def test_a_state_broadcast_at_the_same_step_count_is_noticed(results):
    """Rank 0 loads another run's state at the step count every rank is at, then broadcasts it:
    every rank goes on as a fresh optimizer that loaded it does (not from its own error
    feedback and fused momenta)."""
    for rank, r in enumerate(scenario(results, "broadcast_same_step")):
        assert (r["steps"], r["phase"]) == (14, "compression"), \
            f"rank {rank}: {r['steps']} steps, {r['phase']}; expected 14 steps, compression"
        assert_same_params(r["params"], r["reference"],
                           f"rank {rank}: after the broadcast at step 10 vs loading it")


def test_torch_optimizer_states_load_at_their_adam_step_count(results):
    """A plain Adam's state after 6 steps, and one of the optimizer's (step 8, frozen at 4)
    that a plain Adam trained 3 more steps on: each is a warmup state at its Adam step count,
    past freeze_step=4, so the variance freezes there and the next step is compressed."""
    ranks = scenario(results, "torch_states")
    for name, steps in (("plain", 6), ("through_plain", 11)):
        for rank, r in enumerate(x[name] for x in ranks):
            what = f"rank {rank}, {name}"
            assert (r["steps"], r["freeze_step"]) == (steps, steps), \
                f"{what}: loaded at step {r['steps']}, freeze_step {r['freeze_step']}; " \
                f"expected Adam's step count {steps} for both"
            assert set(r["frozen_at"]) == {-1}, \
                f"{what}: variance already marked frozen at {r['frozen_at']} after the load"
            assert (r["phase_after"], r["steps_after"]) == ("compression", steps + 1), \
                f"{what}: after one step {r['phase_after']} at {r['steps_after']}"
            past = f"in the warmup at step {steps}, past freeze_step=4"
            assert any(past in w for w in r["warnings"]), f"{what}: {r['warnings']}"
            stale = [w for w in r["warnings"] if "holds 1-bit Adam's entries (step 8)" in w]
            assert len(stale) == (name == "through_plain"), \
                f"{what}: the stale 1-bit entries warned {len(stale)} times: {r['warnings']}"
        assert_same_params(ranks[1][name]["params"], ranks[0][name]["params"],
                           f"{name}: rank 1 against rank 0 after the step")


def test_a_state_exported_for_torch_adam_gives_adam_the_frozen_denominator(results):
    """torch_adam_state_dict of a state at step 8 frozen at 4: no 1-bit entries, and each
    exp_avg_sq scaled so that Adam's bias correction by step 8 gives the optimizer's own
    denominator (bias-corrected by 4)."""
    for rank, r in enumerate(scenario(results, "torch_states")):
        e = r["exported"]
        assert (e["frozen_at"], e["steps"]) == ([4], [8.0]), \
            f"rank {rank}: the state must be frozen at 4, at step 8: {e['frozen_at']}, {e['steps']}"
        assert e["max_relative_difference"] < 1e-6, \
            f"rank {rank}: Adam's denominator from the export differs from the optimizer's by " \
            f"{e['max_relative_difference']:.3g} (relative)"
        assert e["state_keys"] == ["exp_avg", "exp_avg_sq", "step"] and e["group_keys"] == [] \
            and not e["record"] and e["whole_unchanged"], f"rank {rank}: {e}"


def test_the_optimizers_own_state_without_its_record_loads_as_it_is(results):
    """The optimizer's state at step 8 (frozen at 4) without its "onebit" record (as
    torch.distributed.checkpoint keeps it) is still its own: frozen at 4, no warning, and the
    step after it has the bits of the step after loading the whole state."""
    for rank, r in enumerate(scenario(results, "torch_states")):
        dropped, whole = r["record_dropped"], r["with_record"]
        assert (dropped["steps"], dropped["freeze_step"], set(dropped["frozen_at"])) == \
            (8, 4, {4}), f"rank {rank}: loaded at step {dropped['steps']}, freeze_step " \
            f"{dropped['freeze_step']}, variance frozen at {dropped['frozen_at']}; expected 8, 4, 4"
        assert dropped["warnings"] == [], f"rank {rank}: {dropped['warnings']}"
        assert_same_params(dropped["params"], whole["params"],
                           f"rank {rank}: the step after loading without the record vs whole")


def test_a_checkpoint_loaded_on_one_rank_only_is_named_by_the_check(results):
    for rank, r in enumerate(scenario(results, "rollback_one_rank")):
        assert r["error"] is not None and "different step counts ([11, 8]" in r["error"], \
            f"rank {rank}: rank 1 alone went back to step 7 (check_every=1); expected an error " \
            f"naming the step counts [11, 8], got {r['error']!r} after {r['steps']} steps"


def test_checks_every_few_steps_name_a_checkpoint_loaded_on_one_rank_only(results):
    """check_every=3, rank 1 alone goes back two steps: the ranks' step counts no longer fall on
    the same multiples of 3, yet every rank checks at the same step() and names them."""
    for rank, r in enumerate(scenario(results, "rollback_one_rank_every_3")):
        assert r["error"] is not None and "different step counts ([12, 10]" in r["error"], \
            f"rank {rank}: rank 1 alone went back from step 10 to 8 (check_every=3); expected " \
            f"an error naming the step counts [12, 10], got {r['error']!r} after {r['steps']} steps"


def test_bad_input_is_a_clear_error_on_every_rank(results):
    expected = {"shapes_differ": "optimizers differ in their parameters (rank 0: 6 (1377 "
                                  "elements), rank 1: 6 (433",
                "trainable_differs": "optimizers differ in which of their parameters are "
                                     "trainable (requires_grad differs on rank(s) [1] from "
                                     "rank 0",
                "duplicate_names": "must be unique",
                "missing_names": "named_parameters names 2 of the optimizer's 6 parameters",
                "mixed_devices": "one device",
                "added_after_freeze": "after the variance was frozen",
                "sparse_gradients": "sparse_as_dense=True",
                "another_models_state": "the optimizer state loaded is another model's: its "
                                        "exp_avg for 0.weight has shape (32, 8), the parameter "
                                        "(16, 8); nothing was loaded"}
    for rank, bad in enumerate(scenario(results, "bad")):
        for case, text in expected.items():
            assert text in bad[case], f"rank {rank}, {case}: expected {text!r} in {bad[case]!r}"
        assert list(bad["another_models_state_then"]) == [1, True], \
            f"rank {rank}: after the refused load, (steps, parameters moved) " \
            f"{bad['another_models_state_then']}: the optimizer should train as before"


def test_divergence_guard_raises_on_every_rank(results):
    for rank, g in enumerate(scenario(results, "guard")):
        # corrupted after step 6, caught at the next check (step 9)
        assert g["raised_at"] == 9, \
            f"rank {rank}: the guard raised at step {g['raised_at']}, expected 9: {g['message']!r}"
        for text in ("diverged", "[1]", "a clip on one rank"):
            assert text in g["message"], f"rank {rank}: {text!r} not in {g['message']!r}"


def test_elements_without_warmup_gradient_are_held_fixed(results):
    for rank, z in enumerate(scenario(results, "zero_variance")):
        assert torch.equal(z["unseen_at_freeze"], z["unseen_end"]), \
            f"rank {rank}: rows without a warmup gradient moved: {z['unseen_end'] - z['unseen_at_freeze']}"
        stopped = [row for row, moved in
                   enumerate((z["seen_end"] != z["seen_at_freeze"]).any(1).tolist()) if not moved]
        assert not stopped, f"rank {rank}: rows {stopped} trained in the warmup stopped training"
        assert not z["unseen_momentum"].any(), f"rank {rank}: held momentum {z['unseen_momentum']}"
        nonfinite = {i: int((~torch.isfinite(p)).sum()) for i, p in enumerate(z["params"])
                     if not bool(torch.isfinite(p).all())}
        assert not nonfinite, f"rank {rank}: non-finite elements per parameter {nonfinite}"
        parts = ("26 elements of 2 parameter(s) received no gradient in the warmup",
                 "20 of 40 elements of parameter emb (", "6 of 12 elements of parameter side (")
        assert len(z["warnings"]) == 1 and all(part in z["warnings"][0] for part in parts), \
            f"rank {rank}: expected one warning naming {parts}, got {z['warnings']}"
