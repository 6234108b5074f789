"""The compression engine when what it built on changes between steps: the trainable set, a
parameter's layout or dtype, Adam's state entries. Two virtual ranks on the in-process
transport."""
from __future__ import annotations

import pytest
import torch

from hvd_onebit.config import OneBitConfig
from hvd_onebit.engine import CompressedStep
from hvd_onebit.transport.inprocess import run_threads
from tests.workers_compressed_step import BETAS, EPS, LR, gradient, initial_state

NAMES = ("big", "big_bias", "mid", "mid_bias", "column", "one")  # SHAPES' order


def _engine(t, params, state, bucket_mb: float = 0.004) -> tuple[CompressedStep, list[dict]]:
    engine = CompressedStep(OneBitConfig.from_options(freeze_step=4, bucket_size_mb=bucket_mb),
                            state, decoupled=lambda group: True, transport=t,
                            names=dict(zip(params, NAMES)))
    return engine, [{"params": params, "lr": LR, "betas": BETAS, "eps": EPS,
                     "weight_decay": 0.0}]


def _step(engine, groups, active, step, rank) -> None:
    engine.ensure_ready(active)
    engine.step(groups, {p: gradient(step, rank, p.shape) for p in active})


def _errors(engine) -> dict:
    """Each bucket's layout (parameter names, start, count) -> its worker error (a copy)."""
    names = engine.variance.names
    return {tuple((names[s.param], s.start, s.numel) for s in b.segments):
            engine.collectives.of(b).state_dict()["worker_error"].clone()
            for b in engine.buckets}


def _recut(t, frozen: int) -> dict:
    params, state = initial_state()
    engine, groups = _engine(t, params, state, bucket_mb=0.001)  # buckets of 262 elements
    for step in range(2):
        _step(engine, groups, params, step, t.rank)
    before, sizes = _errors(engine), [b.numel for b in engine.buckets]
    engine.ensure_ready([p for i, p in enumerate(params) if i != frozen])
    return {"before": before, "after": _errors(engine), "sizes": sizes,
            "sizes_after": [b.numel for b in engine.buckets]}


@pytest.mark.parametrize("frozen", [0, 5])
def test_a_new_trainable_set_keeps_the_error_feedback_of_unchanged_buckets_only(frozen):
    """Error feedback belongs to the elements a bucket holds. After a parameter leaves the
    trainable set, a bucket holding the same elements as before keeps its errors, and one that
    now holds others starts from zero (its old errors were other elements' residue), also where
    it has the same place and size as before: the buckets are planned from the last parameter,
    so freezing the last one (5) moves every element by one, and freezing the first (0) leaves
    the buckets before its pieces as they were."""
    for rank, r in enumerate(run_threads(2, lambda t: _recut(t, frozen), timeout=120)):
        before, after = r["before"], r["after"]
        kept = [k for k in after if k in before]
        new = [k for k in after if k not in before]
        assert new and (kept if frozen == 0 else r["sizes_after"][0] == r["sizes"][0]), \
            f"rank {rank}: buckets kept {kept}, new {new}, sizes {r['sizes']} then " \
            f"{r['sizes_after']}: the case needs both, or a new bucket of an old size"
        for k in kept:
            assert after[k].equal(before[k]) and before[k].abs().sum() > 0, \
                f"rank {rank}: bucket {k} kept its elements but not its errors"
        for k in new:
            assert after[k].abs().sum() == 0, \
                f"rank {rank}: bucket {k} holds other elements than before and carries errors " \
                f"of norm {float(after[k].norm()):.3g}"


def _non_contiguous(t, steps: int = 4) -> dict:
    params, state = initial_state()
    engine, groups = _engine(t, params, state)
    big = params[0]
    _step(engine, groups, params, 0, t.rank)
    cut = len(engine.positions[big])
    big.data = big.data.t().contiguous().t()  # same values, column-major (as channels_last)
    before = big.detach().clone()
    moved = []
    for step in range(1, steps):
        last = big.detach().clone()
        _step(engine, groups, params, step, t.rank)
        moved.append(int((big != last).sum()))
    return {"cut": cut, "moved": moved, "contiguous": big.is_contiguous(),
            "params": [p.detach().clone() for p in params], "unchanged": int((big == before).sum())}


def test_a_parameter_cut_across_buckets_trains_on_after_it_turns_non_contiguous():
    """A parameter split between two buckets whose memory turns non-contiguous (a model moved to
    channels_last after the freeze): its pieces are no views of it any more, so the buckets are
    cut anew and it keeps training, on every rank alike."""
    runs = run_threads(2, _non_contiguous, timeout=120)
    for rank, r in enumerate(runs):
        assert r["cut"] == 2 and not r["contiguous"], \
            f"rank {rank}: the case needs a parameter in 2 buckets turned non-contiguous: {r}"
        assert all(m == 1200 for m in r["moved"]), \
            f"rank {rank}: elements of the 1200 that moved at each step: {r['moved']}"
    same = [i for i, (a, b) in enumerate(zip(runs[0]["params"], runs[1]["params"]))
            if a.equal(b)]
    assert same == list(range(6)), f"the ranks agree on parameters {same} only"


def _removed(t, how: str) -> str:
    params, state = initial_state()
    engine, groups = _engine(t, params, state)
    _step(engine, groups, params, 0, t.rank)
    if how == "pop":
        state.pop(params[2])
    elif how == "empty":
        state[params[2]] = {}
    else:
        state[params[2]] = {k: v for k, v in state[params[2]].items() if k != "exp_avg_sq"}
    try:
        _step(engine, groups, params, 1, t.rank)
    except RuntimeError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.parametrize("how", ["pop", "empty", "no_variance"])
def test_adam_state_removed_in_the_compression_phase_is_refused_naming_the_parameter(how):
    """torch's Adam starts a removed state entry from zeros; here it held the momentum and the
    frozen variance: every rank refuses the step, naming the parameter and what it lacks."""
    for rank, said in enumerate(run_threads(2, lambda t: _removed(t, how), timeout=120)):
        lacks = "exp_avg_sq" if how == "no_variance" else "step, exp_avg, exp_avg_sq"
        assert "parameter mid lacks " + lacks in said and "load_state_dict()" in said, \
            f"rank {rank}: {how}: {said}"


def _converted(t, convert: bool, steps: int = 4) -> dict:
    params, state = initial_state()
    engine, groups = _engine(t, params, state)
    refused = None
    for step in range(steps):
        if convert and step == 2:
            params[3].data = params[3].data.double()
            momenta = [state[p]["exp_avg"].clone() for p in params]
            try:
                _step(engine, groups, params, step, t.rank)
            except TypeError as exc:
                refused = str(exc)
            kept = all(state[p]["exp_avg"].equal(m) for p, m in zip(params, momenta))
            params[3].data = params[3].data.float()
            continue
        _step(engine, groups, params, step if not convert or step < 2 else step - 1, t.rank)
    out = {"params": [p.detach().clone() for p in params]}
    if convert:
        out.update(refused=refused, momenta_kept=kept)
    return out


def test_a_parameter_converted_to_float64_is_refused_and_its_step_changes_nothing():
    """model.double() after the optimizer was built: every rank refuses the step, naming the
    dtype, with the momenta unchanged and the buckets' exchanges waited out; converted back, the
    run goes on as if the refused step had not been tried."""
    converted = run_threads(2, lambda t: _converted(t, True), timeout=120)
    plain = run_threads(2, lambda t: _converted(t, False, steps=3), timeout=120)
    for rank, (c, p) in enumerate(zip(converted, plain)):
        assert c["refused"] and "torch.float64" in c["refused"] and c["momenta_kept"], \
            f"rank {rank}: refused {c['refused']!r}, momenta kept {c['momenta_kept']}"
        differ = [i for i, (a, b) in enumerate(zip(c["params"], p["params"])) if not a.equal(b)]
        assert differ == [], f"rank {rank}: parameters {differ} differ from the run without it"


def _resumed_errors(t) -> dict:
    """Error feedback saved with parameter "mid_bias" (20,) frozen, loaded with the optimizer
    state it was saved with into engines whose trainable sets leave out "mid_bias" again, or
    "column" (20, 1) instead: the same bucket places and sizes, other elements in bucket 0."""
    import copy

    params, state = initial_state()
    saving = [p for i, p in enumerate(params) if i != 3]
    engine, groups = _engine(t, params, state)
    for step in range(2):
        _step(engine, groups, saving, step, t.rank)
    saved, out = copy.deepcopy(engine.error_feedback_state_dict()), {}
    legacy = {**saved, "buckets": {k.rsplit(":", 1)[0]: v for k, v in saved["buckets"].items()}}
    for name, frozen, errors in (("same", 3, saved), ("other", 4, saved),
                                 ("legacy_same", 3, legacy)):
        copied = copy.deepcopy(state)
        again = list(copied)  # the parameters, in the order of the saved state
        resumed, _ = _engine(t, again, copied)
        resumed.load_error_feedback_state_dict(copy.deepcopy(errors))
        resumed.ensure_ready([p for i, p in enumerate(again) if i != frozen])
        out[name] = {"keys": sorted(k.split(":")[1] for k in resumed.saved_comms()),
                     "errors": [resumed.collectives.of(b).state_dict()["worker_error"].clone()
                                for b in resumed.buckets]}
    out["saved"] = [c.state_dict()["worker_error"].clone() for c in engine.saved_comms().values()]
    out["sizes"] = sorted(k.split(":")[1] for k in engine.saved_comms())
    return out


def test_error_feedback_resumed_into_another_layout_of_the_same_sizes_is_dropped():
    """Saved error feedback belongs to the elements each bucket held: resumed where the buckets
    hold the same elements it is restored, and where they have the same places and sizes but
    hold other parameters' elements it is dropped with a warning, as for another layout
    (errors saved without the buckets' signatures are restored by place and size). The
    warnings are caught around both virtual ranks (catch_warnings is not per thread)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = run_threads(2, _resumed_errors, timeout=120)
    said = [str(w.message) for w in caught if "error feedback" in str(w.message)]
    assert len(said) == 2 and all("another bucket layout" in w for w in said), \
        f"the warnings about error feedback, expected one per rank for the other layout: {said}"
    for rank, r in enumerate(runs):
        assert r["same"]["keys"] == r["other"]["keys"] == r["sizes"], \
            f"rank {rank}: the case needs the same bucket sizes: {r['sizes']}, {r['other']}"
        for name in ("same", "legacy_same"):
            restored = [a.equal(b) for a, b in zip(r[name]["errors"], r["saved"])]
            assert all(restored), f"rank {rank}: {name}: restored {restored}"
        other = r["other"]
        assert all(e.abs().sum() == 0 for e in other["errors"]), \
            f"rank {rank}: into another layout: error sums " \
            f"{[float(e.abs().sum()) for e in other['errors']]}"
