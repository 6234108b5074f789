"""Checkpoints, non-finite gradients, GradScaler, bad input and the divergence guard, multi-rank."""
import pytest
import torch

from hvd_onebit.cluster.jobs import run_ranks

pytestmark = pytest.mark.multirank
W = "tests.workers_resilience:"


@pytest.fixture(scope="module")
def results():
    return run_ranks(W + "suite", np=2, timeout=400)


def test_checkpoint_resume_is_bit_identical_with_error_feedback(tmp_path):
    kw = {"ckpt_dir": str(tmp_path), "total": 30, "freeze_step": 8}
    full = run_ranks(W + "checkpoint_run", np=2, kwargs=kw, timeout=300)
    run_ranks(W + "checkpoint_run", np=2, kwargs={**kw, "stop_at": 20},
              timeout=300)  # interrupted in the compression phase, in a new job
    resumed = run_ranks(W + "checkpoint_run", np=2, timeout=300, kwargs={**kw, "resume": True})
    reset = run_ranks(W + "checkpoint_run", np=2, timeout=300,
                      kwargs={**kw, "resume": True, "error_feedback": False})
    # built with a larger freeze_step: the checkpoint was frozen at 8 and stays so
    later = run_ranks(W + "checkpoint_run", np=2, timeout=300,
                      kwargs={**kw, "resume": True, "freeze_step": 25})
    for rank in range(2):
        assert resumed[rank]["start"] == 20 and resumed[rank]["steps"] == 30
        assert resumed[rank]["phases"] == ["compression"] * 10
        assert resumed[rank]["params"] == full[rank]["params"], \
            f"rank {rank}: the resumed run is not bit-identical to the uninterrupted one"
        assert later[rank]["phases"] == ["compression"] * 10, \
            f"rank {rank}: phases after resuming with freeze_step=25: {later[rank]['phases']}"
        assert later[rank]["freeze_step"] == 8
        assert later[rank]["params"] == full[rank]["params"], \
            f"rank {rank}: resuming with a larger freeze_step changed the trajectory"
        assert any("keeps its frozen variance and freeze_step=8, not 25" in w
                   for w in later[rank]["warnings"]), later[rank]["warnings"]
        # Without the saved error feedback the trajectory differs (the compression noise is
        # not the same), but the model is as good: held-out loss within 2%.
        assert reset[rank]["params"] != full[rank]["params"]
        assert reset[rank]["val_loss"] == pytest.approx(full[rank]["val_loss"], rel=0.02)


def test_warmup_checkpoint_resumes_with_a_new_freeze_step(tmp_path):
    run_ranks(W + "checkpoint_run", np=2, timeout=300,
              kwargs={"ckpt_dir": str(tmp_path), "stop_at": 3, "freeze_step": 5})
    resumed = run_ranks(W + "checkpoint_run", np=2, timeout=300,
                        kwargs={"ckpt_dir": str(tmp_path), "resume": True, "freeze_step": 8,
                                "total": 12})
    for r in resumed:
        assert r["start"] == 3
        assert r["phases"] == ["warmup"] * 5 + ["compression"] * 4  # steps 3..7 warm, 8..11 not
    assert resumed[0]["params"] == resumed[1]["params"]


def test_error_feedback_from_another_world_size_is_reset_with_a_warning(results):
    for rank, r in enumerate(results):
        ef = r["ef_other_world"]
        assert any("does not fit" in w and "reset to zero" in w for w in ef["warnings"]), \
            f"rank {rank}: {ef['warnings']}"
        assert ef["norms_before"][0] > 0, f"rank {rank}: no error feedback to reset"
        assert ef["norms_after"] == (0.0, 0.0), f"rank {rank}: error feedback {ef['norms_after']}"


def test_nonfinite_gradient_on_one_rank_skips_the_step_everywhere(results):
    a, b = (r["nonfinite"] for r in results)
    for rank, r in enumerate((a, b)):
        # steps 2 (warmup) and 8 (compression) skipped: the count rises exactly there
        assert r["skipped_count_after_step"] == [0, 0] + [1] * 6 + [2] * 4, \
            f"rank {rank}: skipped steps after each step {r['skipped_count_after_step']}"
        for s in (2, 8):
            assert r["changed_params"][s] == [], \
                f"rank {rank}: parameters {r['changed_params'][s]} changed in skipped step {s}"
        assert r["steps"] == 10 and r["nonfinite_params"] == [], r["nonfinite_params"]
    assert a["final"] == b["final"], "ranks differ after the skips"


@pytest.mark.parametrize("key", ["scaler", "scaler_horovod_recipe"])
def test_grad_scaler_overflow_on_one_rank_is_agreed(results, key):
    a, b = (r[key] for r in results)
    assert a["skipped"] == b["skipped"], f"ranks disagree on skips: {a['skipped']} {b['skipped']}"
    assert [s for s, skipped in enumerate(a["skipped"]) if skipped] == [2, 8], a["skipped"]
    assert a["steps"] == b["steps"] == 10 and a["final"] == b["final"]
    assert a["nonfinite_params"] == [], a["nonfinite_params"]


def test_bad_input_is_a_clear_error_on_every_rank(results):
    for r in results:
        bad = r["bad"]
        assert "parameters differ" in bad["shapes_differ"]
        assert "must be unique" in bad["duplicate_names"]
        assert "were not named" in bad["missing_names"]
        assert "one device" in bad["mixed_devices"]
        assert "after the variance was frozen" in bad["added_after_freeze"]
        assert "sparse_as_dense=True" in bad["sparse_gradients"]


def test_divergence_guard_raises_on_every_rank(results):
    for r in results:
        g = r["guard"]
        assert g["raised_at"] == 9  # corrupted after step 6, caught at the next check (step 9)
        assert "diverged" in g["message"] and "[1]" in g["message"]


def test_elements_without_warmup_gradient_are_held_fixed(results):
    for rank, r in enumerate(results):
        z = r["zero_variance"]
        assert torch.equal(z["unseen_at_freeze"], z["unseen_end"]), \
            f"rank {rank}: rows without a warmup gradient moved: {z['unseen_end'] - z['unseen_at_freeze']}"
        assert (z["seen_end"] != z["seen_at_freeze"]).any(1).all(), \
            f"rank {rank}: a row trained in the warmup stopped training"
        assert not z["unseen_momentum"].any(), f"rank {rank}: held momentum {z['unseen_momentum']}"
        assert all(bool(torch.isfinite(p).all()) for p in z["params"])
        assert any("20 of 40 elements of parameter emb" in w for w in z["warnings"]), z["warnings"]
