"""CompressedStep on its own: n virtual ranks on the in-process transport (no job launched),
checked against the NumPy reference, for all-or-nothing skips, and bit for bit against the same
engine inside a Horovod job."""
import numpy as np
import pytest

from hvd_onebit.transport.inprocess import run_threads
from tests.workers_compressed_step import reference, run_engine
from tests.worlds import shared_suite


def run_inprocess(n, **kwargs):
    return run_threads(n, lambda t: run_engine(t.rank, transport=t, **kwargs), timeout=120)


@pytest.mark.parametrize("n", range(1, 9))
def test_engine_matches_the_reference_on_every_virtual_rank(n):
    results = run_inprocess(n)
    want = reference(n)
    for rank, r in enumerate(results):
        assert r["buckets"] > 1, "the model must span several buckets"
        assert r["skipped"] == [False] * 6, r["errors"]
        for step, (got, exp) in enumerate(zip(r["params"], want)):
            for i, (a, b) in enumerate(zip(got, exp)):
                np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6,
                                           err_msg=f"n={n} rank {rank} step {step} param {i}")
            for i, (a, b) in enumerate(zip(got, results[0]["params"][step])):
                assert a.tobytes() == b.tobytes(), \
                    f"n={n}: rank {rank} differs from rank 0 at step {step}, param {i}"


@pytest.mark.parametrize("n", [2, 3])
def test_lean_and_fast_memory_give_the_same_bits(n):
    """memory="lean" (one error buffer, the passes repeated at the commit) and "fast" (spare
    buffers adopted at the commit) store the same errors, so every step is bit-identical; a
    skipped step included."""
    runs = {mode: run_inprocess(n, memory=mode, bad=(2, n - 1, 3)) for mode in ("lean", "fast")}
    for rank in range(n):
        lean, fast = runs["lean"][rank], runs["fast"][rank]
        assert lean["skipped"] == fast["skipped"] == [s == 2 for s in range(6)], lean["skipped"]
        for key in ("params", "momenta"):
            for step, (a_step, b_step) in enumerate(zip(lean[key], fast[key])):
                for i, (a, b) in enumerate(zip(a_step, b_step)):
                    assert a.tobytes() == b.tobytes(), \
                        f"n={n} rank {rank} step {step} {key}[{i}]: lean and fast differ"


@pytest.mark.parametrize("memory", ["lean", "fast"])
@pytest.mark.parametrize("n", [1, 2, 5])
@pytest.mark.parametrize("param", [0, 3, 5], ids=["first_bucket", "middle_bucket", "last_bucket"])
def test_a_nonfinite_gradient_changes_nothing_anywhere(n, param, memory):
    bad_rank = n - 1
    results = run_inprocess(n, bad=(2, bad_rank, param), memory=memory)
    clean = run_inprocess(n)
    for rank, r in enumerate(results):
        assert r["skipped"] == [s == 2 for s in range(6)], f"rank {rank}: {r['skipped']}"
        assert f"[{bad_rank}]" in r["errors"][0], r["errors"]
        for key in ("params", "momenta"):
            for i, (a, b) in enumerate(zip(r[key][2], r[key][1])):
                assert a.tobytes() == b.tobytes(), f"rank {rank}: {key}[{i}] changed when skipped"
            # the steps after the skip go on (not the same as the clean run: its step 2 counted)
            assert not np.array_equal(r[key][3][0], r[key][2][0]), f"rank {rank}: {key} stuck"
    # the step before the bad one is the clean run's, bit for bit
    for a, b in zip(results[0]["params"][1], clean[0]["params"][1]):
        assert a.tobytes() == b.tobytes()


horovod_job = shared_suite("tests.workers_compressed_step:horovod_job", np=[2, 4], timeout=200)


@pytest.mark.multirank
def test_inprocess_engine_gives_the_bits_of_a_horovod_job(horovod_job):
    n, job = horovod_job
    threads = run_inprocess(n)
    for rank in range(n):
        for step, (a_step, b_step) in enumerate(zip(job[rank]["params"], threads[rank]["params"])):
            for i, (a, b) in enumerate(zip(a_step, b_step)):
                assert a.tobytes() == b.tobytes(), \
                    f"n={n} rank {rank} step {step} param {i}: Horovod and in-process differ"


def test_step_counts_move_by_one_each_and_the_host_copies_follow():
    """count_step adds one to every parameter's step (tensors together, Python numbers too, a
    step tensor two parameters share once per parameter, as Adam's loop would) and its host
    copies read what the tensors hold, with no read of the tensors needed."""
    import torch

    from hvd_onebit.engine.variance import FrozenVariance

    params = [torch.zeros(3) for _ in range(5)]
    shared = torch.tensor(7.0)
    state = {params[0]: {"step": torch.tensor(3.0)}, params[1]: {"step": torch.tensor(5.0)},
             params[2]: {"step": 4}, params[3]: {"step": shared}, params[4]: {"step": shared}}
    variance = FrozenVariance(state, "hold", refreshing=False, names={})
    for _ in range(2):
        variance.count_step(params)
    held = [float(state[p]["step"]) for p in params]
    host = [variance.host_step(p) for p in params]
    assert held == [5.0, 7.0, 6.0, 11.0, 11.0] and host == held, \
        f"steps held {held}, host copies {host}, want [5, 7, 6, 11, 11] in both"


def test_the_update_terms_follow_each_groups_options_from_step_to_step():
    """Parameters of one group share their host numbers; another group's, or those after a
    scheduler changed lr, are their own."""
    import torch

    from hvd_onebit.engine.adam_terms import AdamTerms
    from hvd_onebit.engine.variance import FrozenVariance

    params = [torch.zeros(4) for _ in range(3)]
    state = {p: {"step": torch.tensor(9.0), "exp_avg_sq": torch.ones(4),
                 "frozen_variance_step": 9} for p in params}
    groups = [{"params": params[:2], "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
               "weight_decay": 0.0},
              {"params": params[2:], "lr": 2e-3, "betas": (0.9, 0.999), "eps": 1e-8,
               "weight_decay": 0.0}]
    terms = AdamTerms(state, FrozenVariance(state, "hold", refreshing=False, names={}),
                      decoupled=lambda group: False, bound="adam", preconditioned=True,
                      backend="torch")
    steps = []
    for lr in (1e-3, 5e-4):
        groups[0]["lr"] = lr
        steps.append([terms.update(p, g).numbers.step for g in groups for p in g["params"]])
    bc1 = 1 - 0.9 ** 10
    want = [[-1e-3 / bc1, -1e-3 / bc1, -2e-3 / bc1], [-5e-4 / bc1, -5e-4 / bc1, -2e-3 / bc1]]
    assert steps == want, f"update steps per parameter, by step: {steps}, want {want}"


def _early_or_not(t, early: bool, steps: int = 3) -> dict:
    """Compressed steps of the engine on virtual rank ``t``, every bucket started before
    step() (as the gradient hooks start them) or none; the passes over every parameter's
    input terms per step."""
    from hvd_onebit.config import OneBitConfig
    from hvd_onebit.engine import CompressedStep
    from tests.workers_compressed_step import BETAS, EPS, LR, gradient, initial_state

    params, state = initial_state()
    engine = CompressedStep(OneBitConfig.from_options(freeze_step=4, bucket_size_mb=0.001), state,
                            decoupled=lambda group: True, transport=t)
    groups = [{"params": params, "lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": 0.0}]
    passes, inputs = [], engine.terms.inputs

    def counted(*args):
        passes.append(1)
        return inputs(*args)

    engine.terms.inputs = counted  # the engine's own terms object, counted
    per_step = []
    for step in range(steps):
        engine.ensure_ready(params)
        grads = {p: gradient(step, t.rank, p.shape) for p in params}
        before = len(passes)
        if early:
            engine.begin_step()
            for _ in engine.buckets:
                engine.start_bucket(groups, grads)
        engine.step(groups, grads)
        per_step.append(len(passes) - before)
    return {"passes": per_step, "buckets": len(engine.buckets), "early": engine.early_starts,
            "params": [p.clone() for p in params]}


def test_a_step_whose_buckets_all_started_early_reads_the_input_terms_once():
    """The input terms (every parameter's numbers at this step) are computed at the first
    early start; step() computes them again only for a bucket it starts itself. The bits are
    those of the steps started in step()."""
    early = run_threads(2, lambda t: _early_or_not(t, early=True), timeout=120)
    late = run_threads(2, lambda t: _early_or_not(t, early=False), timeout=120)
    for rank, (e, s) in enumerate(zip(early, late)):
        assert e["buckets"] > 1 and e["early"] == 3 * e["buckets"], \
            f"rank {rank}: {e['early']} early starts of {e['buckets']} buckets in 3 steps"
        assert e["passes"] == [1, 1, 1] and s["passes"] == [1, 1, 1], \
            f"rank {rank}: passes over the terms per step, early {e['passes']}, in step() " \
            f"{s['passes']}; want one each"
        differ = [i for i, (a, b) in enumerate(zip(e["params"], s["params"]))
                  if not a.equal(b)]
        assert differ == [], f"rank {rank}: parameters {differ} differ from the late starts'"


def _replacing(t, how: str, steps: int = 3) -> list:
    """Compressed steps of the engine on virtual rank ``t``; before the second, parameters 0
    (cut across buckets) and 3 (whole in one) get new data equal to the old ("data"), or their
    variance times 4 as a new tensor ("variance"), in a new state entry ("entry") or in place
    ("variance_in_place"); "same": nothing. The parameters after the last step."""
    from hvd_onebit.config import OneBitConfig
    from hvd_onebit.engine import CompressedStep
    from tests.workers_compressed_step import BETAS, EPS, LR, gradient, initial_state

    params, state = initial_state()
    engine = CompressedStep(OneBitConfig.from_options(freeze_step=4, bucket_size_mb=0.001), state,
                            decoupled=lambda group: True, transport=t)
    groups = [{"params": params, "lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": 0.0}]
    for step in range(steps):
        for p in (params[0], params[3]) if step == 1 else ():
            if how == "data":
                p.data = p.data.clone()
            elif how == "variance":
                state[p]["exp_avg_sq"] = state[p]["exp_avg_sq"] * 4
            elif how == "entry":
                state[p] = {**state[p], "exp_avg_sq": state[p]["exp_avg_sq"] * 4}
            elif how == "variance_in_place":
                state[p]["exp_avg_sq"].mul_(4)
        engine.ensure_ready(params)
        engine.step(groups, {p: gradient(step, t.rank, p.shape) for p in params})
    return [p.clone() for p in params]


def test_new_parameter_data_or_a_new_variance_tensor_is_the_one_a_step_uses():
    """The engine keeps each bucket's views of the weights and variances from step to step; a
    parameter given new data (``p.data = ...``) is updated in its new storage, and a variance
    replaced in the state is read, bit for bit as the same values in place."""
    runs = {how: run_threads(2, lambda t, how=how: _replacing(t, how), timeout=120)
            for how in ("same", "data", "variance", "entry", "variance_in_place")}
    for rank in range(2):
        differ = {how: [i for i, (a, b) in enumerate(zip(runs[how][rank], runs[base][rank]))
                        if not a.equal(b)]
                  for how, base in (("data", "same"), ("variance", "variance_in_place"),
                                    ("entry", "variance_in_place"), ("variance_in_place", "same"))}
        assert differ["data"] == [], \
            f"rank {rank}: parameters {differ['data']} moved otherwise after new data"
        for how in ("variance", "entry"):
            assert differ[how] == [], \
                f"rank {rank}: parameters {differ[how]} differ between a variance replaced " \
                f"({how}) and the same variance written in place"
        assert 0 in differ["variance_in_place"] and 3 in differ["variance_in_place"], \
            f"rank {rank}: a 4x variance changed only parameters {differ['variance_in_place']}"


def test_a_steps_update_plan_makes_no_tensor_per_parameter_once_its_views_are_made():
    """The update plan's weight and variance views are made at the first step of a bucket
    layout and kept: a later step's plan makes no tensor per parameter (each one more object
    for the garbage collector to go over, on a model of thousands of tensors)."""
    import gc
    import operator

    import torch

    from hvd_onebit.engine.adam_terms import AdamTerms
    from hvd_onebit.engine.fusion import FusedBuckets
    from hvd_onebit.engine.variance import FrozenVariance

    params = [torch.nn.Parameter(torch.randn(40 + i % 7)) for i in range(300)]
    state = {p: {"step": torch.tensor(9.0), "exp_avg": torch.zeros_like(p),
                 "exp_avg_sq": torch.rand_like(p) + 0.1, "frozen_variance_step": 9}
             for p in params}
    groups = [{"params": params, "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
               "weight_decay": 0.0}]
    terms = AdamTerms(state, FrozenVariance(state, "hold", refreshing=False, names={}),
                      decoupled=lambda group: False, bound="adam", preconditioned=True,
                      backend="torch")
    fused = FusedBuckets(state, 500)
    fused.fuse(params)

    def tensors() -> int:
        return sum(type(o) is torch.Tensor for o in gc.get_objects())

    first = terms.plan(groups, fused.buckets, set(params))[0]
    before = tensors()
    second = terms.plan(groups, fused.buckets, set(params))[0]
    made = tensors() - before
    assert len(fused.buckets) > 3 and made <= len(fused.buckets), \
        f"a second step's plan made {made} tensors for {len(params)} parameters in " \
        f"{len(fused.buckets)} buckets"
    kept = [all(map(operator.is_, getattr(a, what), getattr(b, what)))
            for what in ("weights", "variances") for a, b in zip(first, second)]
    assert all(kept), f"the second step's plan reads other views than the first's: {kept}"
