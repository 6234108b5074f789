"""The step bound: Adam's own largest step (hvd_onebit.step_bound), checked against torch's Adam,
and its option validated like every other."""
import math
import warnings

import pytest
import torch

from hvd_onebit.config import OneBitConfig
from hvd_onebit.step_bound import adam_ratio_bound, clamped_fraction, ratio_bound
from hvd_onebit import Experimental


def adam_ratios(grads: torch.Tensor, betas=(0.9, 0.999)) -> list[float]:
    """torch.optim.Adam (eps=0) on one parameter fed ``grads`` in turn: |m_hat| / sqrt(v_hat)
    after each step, read back from its own update (lr=1: the update is the ratio)."""
    w = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([w], lr=1.0, betas=betas, eps=0.0)
    out = []
    for g in grads:
        before = w.detach().clone()
        w.grad = g.reshape(1).double()
        opt.step()
        out.append(float((w.detach() - before).abs()))
    return out


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.8, 0.99), (0.95, 0.98)])
def test_no_gradient_sequence_takes_adam_past_the_bound_and_the_worst_one_reaches_it(betas):
    """Random and adversarial gradient sequences never give a step above B(t); the sequence that
    makes Cauchy-Schwarz an equality (g_k proportional to (b1/b2)^(t-k)) reaches it at t."""
    b1, b2 = betas
    g = torch.Generator().manual_seed(0)
    for t in (1, 2, 5, 30, 200):
        bound = adam_ratio_bound(b1, b2, t)
        for trial in range(8):
            grads = torch.randn(t, generator=g, dtype=torch.float64) * torch.rand(
                t, generator=g, dtype=torch.float64).pow(8)
            worst = max(adam_ratios(grads, betas))
            assert worst <= bound * (1 + 1e-9), f"t={t}: Adam stepped {worst} past B={bound}"
        k = torch.arange(t, dtype=torch.float64)
        equality = (b1 / b2) ** (t - 1 - k)
        reached = adam_ratios(equality, betas)[-1]
        assert math.isclose(reached, bound, rel_tol=1e-9), \
            f"t={t}: the equality case reached {reached}, B(t)={bound}"


def test_the_bound_starts_at_a_sign_step_and_rises_to_its_limit():
    assert adam_ratio_bound(0.9, 0.999, 1) == pytest.approx(1.0, rel=1e-12)
    values = [adam_ratio_bound(0.9, 0.999, t) for t in (1, 10, 100, 1000, 10_000, 100_000)]
    assert values == sorted(values), f"B(t) is not increasing: {values}"
    limit = 0.1 / math.sqrt(0.001 * (1 - 0.81 / 0.999))
    assert values[-1] == pytest.approx(limit, rel=1e-9), f"B(1e5)={values[-1]}, limit {limit}"
    assert limit == pytest.approx(7.27, abs=0.005)
    assert ratio_bound(None, 0.9, 0.999, 5) == math.inf
    assert ratio_bound(2.5, 0.9, 0.999, 5) == 2.5


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "Adam", [1.0]])
def test_a_bad_step_bound_is_refused_at_construction(bad):
    with pytest.raises(ValueError, match="step_bound must be 'adam', None or a positive"):
        OneBitConfig.from_options(freeze_step=3, experimental=Experimental(step_bound=bad))


def test_the_default_is_adams_bound_and_none_or_a_number_are_kept():
    assert OneBitConfig.from_options(freeze_step=3).step_bound == "adam"
    assert OneBitConfig.from_options(freeze_step=3,
                                     experimental=Experimental(step_bound=None)).step_bound is None
    assert OneBitConfig.from_options(freeze_step=3,
                                     experimental=Experimental(step_bound=3)).step_bound == 3.0


def test_clamped_fraction_counts_the_elements_at_the_bound():
    """After a compressed step, elements whose |m| / bc1 / denom reaches B(t) are counted;
    held elements (variance 0) and unfrozen parameters are not."""
    p, q = torch.zeros(4), torch.zeros(3)
    t, frozen = 10, 5
    bc1, sbc2 = 1 - 0.9 ** t, math.sqrt(1 - 0.999 ** frozen)
    v = torch.tensor([1e-4, 1e-4, 1e-4, 0.0])
    denom = 1e-2 / sbc2
    limit = adam_ratio_bound(0.9, 0.999, t)
    m = torch.tensor([2.0 * limit, 0.5 * limit, -3.0 * limit, 1.0]) * bc1 * denom
    state = {p: {"step": torch.tensor(float(t)), "exp_avg": m, "exp_avg_sq": v,
                 "frozen_variance_step": frozen},
             q: {"step": torch.tensor(3.0), "exp_avg": torch.ones(3), "exp_avg_sq": torch.ones(3),
                 "frozen_variance_step": -1}}
    groups = [{"params": [p, q], "betas": (0.9, 0.999), "eps": 0.0}]
    assert clamped_fraction(groups, state) == pytest.approx(2 / 3)
    assert clamped_fraction(groups, state, None) is None


def _engine_steps(rank_transport, zero_variance: str, step_bound="adam", steps: int = 3,
                  lr: float = 1e-2):
    """Three compressed steps of one parameter whose first 10 variances are 0, on a virtual
    rank: the parameter before and after, and the variance the engine trained with. (Warnings
    are recorded by the caller: catch_warnings is process-wide, not per thread.)"""
    from hvd_onebit.engine import NOT_FROZEN, CompressedStep

    g = torch.Generator().manual_seed(0)
    p = torch.randn(100, generator=g)
    v = torch.rand(100, generator=g) * 1e-4 + 1e-6
    v[:10] = 0.0
    state = {p: {"step": torch.tensor(4.0), "exp_avg": torch.zeros(100), "exp_avg_sq": v,
                 "frozen_variance_step": NOT_FROZEN}}
    config = OneBitConfig.from_options(freeze_step=4,
                                       experimental=Experimental(zero_variance=zero_variance, step_bound=step_bound))
    engine = CompressedStep(config, state, decoupled=lambda group: False,
                            transport=rank_transport)
    groups = [{"params": [p], "lr": lr, "betas": (0.9, 0.999), "eps": 1e-8,
               "weight_decay": 0.0}]
    start = p.clone()
    for step in range(steps):
        engine.ensure_ready([p])
        grad = torch.randn(100, generator=torch.Generator().manual_seed(
            step * 7 + rank_transport.rank))
        engine.step(groups, {p: grad})
    return start, p.clone(), state[p]["exp_avg_sq"].clone()


@pytest.mark.parametrize("mode", ["hold", "eps", "floor"])
def test_elements_with_zero_variance_are_held_or_trained_as_asked(mode):
    from hvd_onebit.transport.inprocess import run_threads

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = run_threads(2, lambda t: _engine_steps(t, mode), timeout=60)
    messages = [str(w.message) for w in caught]
    start, end, v = results[0]
    assert torch.equal(end, results[1][1]), "the two ranks' parameters differ"
    moved = (end - start).abs()
    if mode == "hold":
        assert torch.equal(moved[:10], torch.zeros(10)), f"held elements moved by {moved[:10]}"
        assert any("phase holds them" in m for m in messages), messages
        assert torch.equal(v[:10], torch.zeros(10)), f"held elements' variance {v[:10]}, not 0"
    else:
        assert bool((moved[:10] > 0).all()), f"{mode}: zero-variance elements did not move"
        assert not any("phase holds them" in m for m in messages), messages
        floor = torch.finfo(torch.float32).tiny if mode == "eps" else float(v[10:].min())
        assert torch.equal(v[:10], torch.full((10,), floor)), f"{mode}: variance {v[:10]}"
    # every step is bounded: three steps of at most lr * B(t), t = 5, 6, 7 (the weights round
    # to float32 after each: a few ulps of |w| ~ 1 beyond it)
    limit = 1e-2 * sum(adam_ratio_bound(0.9, 0.999, t) for t in (5, 6, 7))
    assert float(moved.max()) <= limit + 1e-6, \
        f"{mode}: an element moved {float(moved.max()):.4f}, more than {limit:.4f}"



def test_without_a_bound_the_same_steps_run_away():
    """The same three steps with step_bound=None and zero_variance="eps" move elements by
    lr * m / eps: the bound is what keeps them in check."""
    from hvd_onebit.transport.inprocess import run_threads

    start, end, _ = run_threads(2, lambda t: _engine_steps(t, "eps", None), timeout=60)[0]
    moved = float((end - start).abs()[:10].min())
    assert moved > 1e3, f"unbounded eps-divided steps moved only {moved}"


@pytest.mark.parametrize("bound", [None, "adam", 2.0])
def test_a_group_at_lr_0_takes_its_steps_unmoved_with_or_without_a_bound(bound):
    """lr 0 (a scheduler's eta_min=0, a group frozen by its lr): the bound lr * B(t) is 0, or
    no bound at all without one (0 * inf was nan, refused as a bound in the first step)."""
    from hvd_onebit.transport.inprocess import run_threads

    start, end, _ = run_threads(2, lambda t: _engine_steps(t, "hold", bound, lr=0.0),
                                timeout=60)[0]
    assert torch.equal(start, end), \
        f"step_bound={bound!r}: lr 0 moved elements by up to {float((end - start).abs().max())}"


def test_input_clamped_fraction_counts_this_ranks_momenta_past_the_input_bound():
    """Before a compressed step: |beta1 * m + (1 - beta1) * g| / denom against bc1 * B(t + 1),
    held elements left out."""
    from hvd_onebit.step_bound import input_clamped_fraction

    p = torch.zeros(4)
    t, frozen = 9, 5
    denom = 1e-2 / math.sqrt(1 - 0.999 ** frozen)
    limit = (1 - 0.9 ** (t + 1)) * adam_ratio_bound(0.9, 0.999, t + 1)
    # with a zero momentum, x = 0.1 * g: gradients 3x, 0.5x and 20x the limit (in x / denom)
    p.grad = torch.tensor([3.0, 0.5, -20.0, 5.0]) * limit * denom / 0.1
    state = {p: {"step": torch.tensor(float(t)), "exp_avg": torch.zeros(4),
                 "exp_avg_sq": torch.tensor([1e-4, 1e-4, 1e-4, 0.0]),
                 "frozen_variance_step": frozen}}
    groups = [{"params": [p], "betas": (0.9, 0.999), "eps": 0.0}]
    assert input_clamped_fraction(groups, state) == pytest.approx(2 / 3)
    assert input_clamped_fraction(groups, state, None) is None
