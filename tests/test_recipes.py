"""Horovod's recipes on Horovod's own MNIST network (2 ranks, 40 steps, freeze at 10): mixed
precision and clipping train like Horovod's Adam with the defaults (bounded,
preconditioned), the unbounded step loses the loss scale, and a checkpoint written without the
bound resumes."""
import pytest

from tests.worlds import shared_suite

pytestmark = pytest.mark.multirank

INITIAL_SCALE = 65536.0  # GradScaler's default


ranks = shared_suite("tests.workers_recipes:suite", np=2, timeout=400)


@pytest.fixture(scope="module")
def results(ranks):
    return ranks[0]


def scenario(results, name):
    r = results[name]
    assert "error" not in r, f"{name} failed: {r.get('error')}"
    return r


@pytest.mark.parametrize("how", ["amp", "clip"])
def test_horovods_recipes_train_like_horovod_adam_with_the_bound(results, how):
    adam, ours = scenario(results, f"adam_{how}"), scenario(results, f"bounded_{how}")
    assert ours["phase"] == "compression", f"{how}: the run never compressed ({ours['phase']})"
    assert ours["finite"], f"{how}: parameters went non-finite"
    assert ours["held_loss"] <= adam["held_loss"] * 1.05, \
        f"{how}: held-out loss {ours['held_loss']:.4f} vs Horovod Adam {adam['held_loss']:.4f}"
    if how == "amp":
        assert min(ours["scales"]) == INITIAL_SCALE, \
            f"amp: the loss scale fell to {min(ours['scales'])} (an overflowed step)"


def test_with_the_unbounded_momentum_scheme_the_loss_scale_falls(results):
    """What the defaults prevent, on the same steps: the unbounded compression of the momentum
    itself overflows float16 and GradScaler halves its scale (over a longer run, to tiny
    scales)."""
    bounded = scenario(results, "bounded_amp")
    unbounded = scenario(results, "unbounded_momentum_amp")
    assert min(unbounded["scales"]) < min(bounded["scales"]), \
        f"unbounded scale {min(unbounded['scales'])}, bounded {min(bounded['scales'])}"


@pytest.mark.parametrize("how", ["compiled", "compiled_step"])
def test_a_compiled_model_trains_as_the_eager_one(results, how):
    """``torch.compile`` of the model (its parameters handed to the optimizer as usual), or of
    a whole training step with ``opt.step()`` inside it (the optimizer's step runs eagerly
    there): the same steps through both phases as the model run eagerly."""
    eager, compiled = scenario(results, "eager"), scenario(results, how)
    assert compiled["phase"] == "compression", f"{how}: the run never compressed " \
                                               f"({compiled['phase']})"
    for i, (a, b) in enumerate(zip(eager["params"], compiled["params"])):
        assert a.tobytes() == b.tobytes(), \
            f"{how}: param {i}: {int((a != b).sum())} of {a.size} elements differ, " \
            f"max |diff| {float(abs(a - b).max()):.3g}"


def test_grad_scaler_through_step_alone(results):
    r = scenario(results, "bounded_scaler_step")
    assert r["finite"] and r["phase"] == "compression", r
    assert min(r["scales"]) == INITIAL_SCALE, f"the loss scale fell to {min(r['scales'])}"


def test_an_unbounded_checkpoint_resumes_with_its_error_feedback_reset(results):
    """Written unbounded, with the momentum compressed as such: the momentum loads bit for
    bit, the error feedback (in the momentum's units, not the preconditioned ones) is reset,
    and both changes are named in warnings."""
    r = scenario(results, "resume")
    assert any("step_bound=None" in w and "carry over unchanged" in w
               for w in r["load_warnings"]), f"no warning naming the bound: {r['load_warnings']}"
    assert any("units of the momentum" in w and "reset to zero" in w
               for w in r["load_warnings"]), f"no warning of the reset: {r['load_warnings']}"
    assert r["phase_after_load"] == "compression"
    assert r["momenta_equal"], "the momentum did not come back bit for bit"
    assert r["errors_saved_nonzero"], "the checkpoint held no error feedback to reset"
    assert not r["errors_after_load_nonzero"], "error feedback in the old units was kept"
    assert r["steps"] == 24 and r["finite"], f"resumed run: {r['steps']} steps, finite={r['finite']}"
