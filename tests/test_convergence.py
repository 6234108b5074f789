"""1-bit Adam ends where Adam ends: 4 virtual ranks, 300 steps of a teacher-student regression,
the final held-out loss within 2% of Adam's."""
import pytest

from tests.workers_convergence import adam, onebit

STEPS, LR = 300, 3e-3


@pytest.mark.parametrize("noise, freeze_step", [(0.1, 60), (0.0, 75)], ids=["noisy", "clean"])
def test_onebit_adam_converges_like_adam(noise, freeze_step):
    per_rank = onebit(STEPS, freeze_step, LR, noise)
    losses = [r["loss"] for r in per_rank]
    assert len(set(losses)) == 1, f"final held-out losses differ between ranks: {losses}"
    assert all(r["bytes"] > 0 for r in per_rank), \
        f"the compression phase sent nothing: {[r['bytes'] for r in per_rank]} bytes per rank"
    reference = adam(STEPS, LR, noise)
    assert losses[0] <= reference * 1.02, \
        f"1-bit held-out loss {losses[0]:.4g} vs Adam {reference:.4g} " \
        f"(ratio {losses[0] / reference:.4f}, limit 1.02; freeze at step {freeze_step})"
