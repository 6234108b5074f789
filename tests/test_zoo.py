"""The convergence zoo's fixed subset, in a real 4-rank job: Horovod's MNIST Net at
Horovod's learning rate (1e-3 x 4) frozen at 20%, and the GRU LM, each against Horovod Adam on
the same seed; plus the report on made-up records (single process).

What the job asserts: every loss finite and the final held-out loss within 1.2x Adam's with the
step bound; a 1-bit run's warmup is Adam bit for bit (the comparison is fair); and on the MNIST
Net the unbounded frozen-variance step diverges (what the bound prevents: without it this test
would fail).
"""
from __future__ import annotations

import json
import math

import pytest

from hvd_onebit_tools.bench.zoo.grid import ADAM, optimizer_options, plan_family
from tests.checks import first_difference
from tests.worlds import Scratch, scratch_path, shared_suite

MAX_RATIO = 1.2
STEPS = 60


CELLS = (plan_family("mnist_cnn", [0], ["bounded", "unbounded", "null_lr_up_1ppm"],
                     freezes=["20%"],
                     lr_rules=["scaled"], steps=STEPS)
         + plan_family("gru_lm", [0], ["bounded"], freezes=["20%"], lr_rules=["scaled"],
                       steps=STEPS))
RESULTS = Scratch("zoo", "cells.jsonl")
zoo_ranks = shared_suite("hvd_onebit_tools.bench.zoo.worker:zoo_worker", np=4, timeout=240,
                         kwargs={"cells": CELLS, "results": RESULTS})


@pytest.fixture(scope="module")
def zoo_cells(zoo_ranks, tmp_path_factory):
    results = scratch_path(tmp_path_factory, RESULTS)
    records = zoo_ranks[0]
    # what rank 0 wrote as it went is what it returned
    written, returned = ([json.loads(line) for line in results.read_text().splitlines()],
                         json.loads(json.dumps(records)))
    assert written == returned, \
        f"rank 0 wrote {len(written)} cells and returned {len(returned)}; they part at cell " \
        f"{first_difference(written, returned)}"
    return {(r["family"], r["scheme"]): r for r in records}


def _name(r: dict) -> str:
    return f"{r['family']} {r['lr_rule']} lr {r['lr']:g} seed {r['seed']} " + \
        ("adam" if r["method"] == ADAM else f"{r['scheme']} freeze {r['freeze']}")


@pytest.mark.multirank
@pytest.mark.parametrize("family", ["mnist_cnn", "gru_lm"])
def test_bounded_1bit_adam_converges_like_horovod_adam(zoo_cells, family):
    adam, ours = zoo_cells[(family, None)], zoo_cells[(family, "bounded")]
    for r in (adam, ours):
        assert not r["diverged"] and r["final_loss"] is not None, \
            f"{_name(r)} diverged: held-out curve {r['curve']}"
        assert all(v is not None and math.isfinite(v) for _, v in r["curve"]), \
            f"{_name(r)}: non-finite held-out loss in {r['curve']}"
    assert ours["compressed_steps"] == STEPS - ours["freeze_step"] > 0, \
        f"{_name(ours)}: {ours['compressed_steps']} compressed steps, expected {STEPS} - " \
        f"freeze_step {ours['freeze_step']} > 0: {ours}"
    ratio = ours["final_loss"] / adam["final_loss"]
    assert ratio <= MAX_RATIO, \
        (f"{_name(ours)}: final held-out loss {ours['final_loss']:.4f} is {ratio:.3f}x Horovod "
         f"Adam's {adam['final_loss']:.4f} (bound {MAX_RATIO})")
    assert ours["clamped_fraction"] is not None and 0.0 <= ours["clamped_fraction"] < 1.0, \
        f"{_name(ours)}: clamped fraction {ours['clamped_fraction']}, expected in [0, 1)"


@pytest.mark.multirank
def test_the_warmup_is_horovod_adam_bit_for_bit(zoo_cells):
    """Before the freeze a 1-bit run is Horovod Adam: same data, dropout masks and reduction
    order, so every held-out evaluation before the freeze is the same number."""
    adam, ours = zoo_cells[("mnist_cnn", None)], zoo_cells[("mnist_cnn", "bounded")]
    before = [(s, v) for s, v in ours["curve"] if s <= ours["freeze_step"]]
    assert len(before) >= 2, \
        f"{len(before)} held-out evaluations up to the freeze at {ours['freeze_step']}, " \
        f"expected 2 or more: {ours['curve']}"
    assert before == adam["curve"][:len(before)], \
        f"warmup curve {before} differs from Horovod Adam's {adam['curve'][:len(before)]}"


@pytest.mark.multirank
def test_without_the_bound_horovods_mnist_net_diverges(zoo_cells):
    """The same cell with step_bound=None (the paper's unbounded frozen-variance step): the loss
    goes non-finite soon after the freeze, so the bound is what the test above
    measures."""
    r = zoo_cells[("mnist_cnn", "unbounded")]
    assert r["diverged"] and r["nonfinite_at"] is not None, \
        f"{_name(r)} did not diverge: final held-out loss {r['final_loss']}, curve {r['curve']}"
    assert r["nonfinite_at"] > r["freeze_step"], \
        f"{_name(r)}: non-finite at step {r['nonfinite_at']}, before the freeze at " \
        f"{r['freeze_step']}: {r}"


@pytest.mark.multirank
def test_the_null_change_moves_the_compression_phase_alone(zoo_cells):
    """The zoo's null change (the compression phase's lr times 1 + 1e-6) leaves the warmup's bits
    alone and changes the compression phase's, so its cells against "bounded" measure how far a
    change of trajectory alone moves a final loss."""
    bounded = zoo_cells[("mnist_cnn", "bounded")]
    null = zoo_cells[("mnist_cnn", "null_lr_up_1ppm")]
    before = [(s, v) for s, v in null["curve"] if s <= null["freeze_step"]]
    assert before == bounded["curve"][:len(before)], \
        f"null change's warmup curve {before} differs from bounded's {bounded['curve']}"
    after = [(a, b) for (s, a), (_, b) in zip(null["curve"], bounded["curve"])
             if s > null["freeze_step"]]
    assert after and all(a != b for a, b in after), \
        f"null change's held-out losses after the freeze at {null['freeze_step']} are " \
        f"bounded's in some evaluations (null, bounded): {after}"
    assert abs(null["final_loss"] / bounded["final_loss"] - 1) < 0.2, \
        f"null change ends at {null['final_loss']:.4f}, bounded at {bounded['final_loss']:.4f}"


def _record(family, seed, method, loss, scheme=None, freeze=None, diverged=False, **extra):
    return {"family": family, "lr_rule": "scaled", "lr": 4e-3, "seed": seed, "steps": 100,
            "batch": 32, "method": method, "scheme": scheme, "freeze": freeze,
            "final_loss": loss, "tail_loss": loss, "diverged": diverged, "seconds": 1.0,
            "initial_loss": 2.3, **extra}


def test_schemes_on_the_defaults_keep_the_default_refresh_and_the_others_freeze():
    def options(scheme):
        [cell] = [c for c in plan_family("mlp", [0], [scheme], freezes=["10%"],
                                         lr_rules=["scaled"], steps=100)
                  if c["method"] != ADAM]
        return optimizer_options(cell)

    # the default and its finer-scale variants leave variance_refresh to the library
    assert options("default") == {"freeze_step": 10}, options("default")
    assert options("default_blocks512") == {"freeze_step": 10, "block_size": 512}, \
        options("default_blocks512")
    # a research scheme that names no refresh runs with the variance frozen
    frozen = options("bounded_blocks512")
    assert (frozen["variance_refresh"], frozen["block_size"]) == (None, 512), frozen


def test_report_ratios_divergences_and_heat_map(tmp_path):
    from hvd_onebit_tools.bench.zoo.report import write_report

    records = [_record("mlp", s, ADAM, 1.0) for s in (0, 1)] + [
        _record("mlp", 0, "onebit", 1.02, "bounded", "20%", freeze_step=20,
                clamped_fraction=0.1, held_fraction=0.0),
        _record("mlp", 1, "onebit", 0.99, "bounded", "20%", freeze_step=20,
                clamped_fraction=0.3, held_fraction=0.01),
        _record("mlp", 0, "onebit", None, "unbounded", "20%", diverged=True, freeze_step=20),
        _record("mlp", 1, "onebit", 1.10, "unbounded", "20%", freeze_step=20)]
    (tmp_path / "cells.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records)
                                          + '{"torn line')
    summary = write_report(tmp_path, show=False)
    bounded, unbounded = summary["schemes"]["bounded"], summary["schemes"]["unbounded"]
    figures = ("divergences", "median_ratio", "max_ratio", "over_1_05")
    got = {k: bounded[k] for k in figures}
    assert got == {"divergences": 0, "median_ratio": pytest.approx(1.005),
                   "max_ratio": pytest.approx(1.02), "over_1_05": 0}, \
        f"bounded: {got}, expected 0 divergences, median ratio 1.005, max 1.02, none over 1.05"
    missed = [t for t, met in bounded["targets"].items() if not met]
    assert not missed, f"bounded: targets missed {missed}: {bounded['targets']}"
    got = {k: unbounded[k] for k in ("divergences", "over_1_05")}
    assert got == {"divergences": 1, "over_1_05": 2}, \
        f"unbounded: {got}, expected 1 divergence and 2 cells over 1.05"
    assert not unbounded["targets"]["no_divergence"], \
        f"unbounded: the no_divergence target is met despite a divergence: {unbounded['targets']}"
    mean = summary["families"]["bounded"]["mlp"]["clamped_fraction_mean"]
    assert mean == pytest.approx(0.2), f"bounded mlp: clamped fraction mean {mean}, expected 0.2"
    size = (tmp_path / "heat_map.png").stat().st_size
    assert size > 0, f"heat_map.png is {size} bytes"
    written = json.loads((tmp_path / "summary.json").read_text())["schemes"]["unbounded"]
    assert written["max_ratio"] == "inf", \
        f"summary.json: unbounded max_ratio {written['max_ratio']!r}, expected 'inf' (a diverged cell)"


def test_a_scheme_against_a_base_scheme_cell_by_cell(tmp_path):
    from hvd_onebit_tools.bench.zoo.report import write_report

    records = [_record("mlp", s, ADAM, 1.0) for s in (0, 1, 2, 3)] + [
        _record("mlp", 0, "onebit", 1.02, "bounded", "20%"),
        _record("mlp", 1, "onebit", 0.99, "bounded", "20%"),
        _record("mlp", 2, "onebit", None, "bounded", "20%", diverged=True),
        _record("mlp", 3, "onebit", 1.04, "bounded", "20%"),
        _record("mlp", 0, "onebit", 1.00, "refreshed", "20%"),   # better
        _record("mlp", 1, "onebit", 1.005, "refreshed", "20%"),  # worse by 0.015 (1.5%)
        _record("mlp", 2, "onebit", 1.01, "refreshed", "20%"),   # converges where base diverged
        _record("mlp", 3, "onebit", 1.06, "refreshed", "20%")]   # worse by 0.02, over 1.05
    (tmp_path / "cells.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    got = write_report(tmp_path, show=False, plot=False, against="bounded")["against"]
    s = got["schemes"]["refreshed"]
    figures = {k: s[k] for k in ("pairs", "worse", "worse_by_over_1pct", "max_excess",
                                 "better_by_over_1pct", "newly_over_1_05", "no_longer_over_1_05")}
    assert figures == {"pairs": 4, "worse": 2, "worse_by_over_1pct": 2,
                       "max_excess": pytest.approx(0.02), "better_by_over_1pct": 2,
                       "newly_over_1_05": 1, "no_longer_over_1_05": 1}, \
        f"refreshed vs bounded: {figures}"
    cells = [w["cell"] for w in s["worst"]]
    assert cells == ["mlp scaled seed 3 20%", "mlp scaled seed 1 20%"], f"worse cells {cells}"
    with pytest.raises(ValueError, match="no cells of base scheme 'nope'"):
        write_report(tmp_path, show=False, plot=False, against="nope")


def test_against_over_seeds_counts_only_losses_consistent_across_seeds(tmp_path):
    from hvd_onebit_tools.bench.zoo.report import write_report

    seeds = (0, 1, 2)
    base = {"mlp": (1.0, 0.9, 1.1), "gru_lm": (1.0, 1.0, 1.0), "resnet_bn": (1.0, 1.0, 1.0)}
    schemes = {  # per family, the three seeds' losses
        "consistent": {"mlp": (1.03, 0.9315, 1.1275), "gru_lm": (1.0, 1.0, 1.0),
                       "resnet_bn": (1.0, None, 1.0)},  # resnet_bn seed 1 diverges
        "noisy": {"mlp": (1.06, 0.855, 1.111), "gru_lm": (1.005, 1.004, 1.006),
                  "resnet_bn": (1.0, 1.0, 1.0)}}
    records = [_record(f, s, ADAM, 1.0) for f in base for s in seeds]
    records += [_record(f, s, "onebit", base[f][s], "bounded", "20%") for f in base for s in seeds]
    records += [_record(f, s, "onebit", losses[f][s], name, "20%", diverged=losses[f][s] is None)
                for name, losses in schemes.items() for f in base for s in seeds]
    (tmp_path / "cells.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    got = write_report(tmp_path, show=False, plot=False, against="bounded")["against"]["schemes"]
    consistent = got["consistent"]
    groups = [(g["group"], g["geo_mean_ratio_of_ratios"]) for g in consistent["worst_groups"]]
    assert groups == [("resnet_bn scaled 20%", math.inf),
                      ("mlp scaled 20%", pytest.approx(1.030, abs=1e-3))], \
        f"consistent: worse groups {groups}, want the diverged resnet_bn, then mlp (+3%, +3.5%, " \
        f"+2.5% over its seeds)"
    noisy = got["noisy"]
    figures = (noisy["seed_groups"], noisy["groups_worse_beyond_seed_noise"], noisy["worse"])
    assert figures == (3, 0, 5), \
        f"noisy: (groups, worse beyond seed noise, worse cells) {figures}, want (3, 0, 5): mlp " \
        f"+6%/-5%/+1% is within its seeds' noise and gru_lm's +0.5% is under 1%, though 5 " \
        f"cells are worse one by one"


@pytest.mark.parametrize("steps", [10, 19, 20, 150])
def test_an_automatic_freeze_in_the_zoo_fits_a_short_run(steps):
    """--steps takes 10 or more: "auto" waits at most half the run, and its least wait gives
    way to that where it is longer (the optimizer refuses min_steps past max_steps)."""
    from hvd_onebit.config import AutoFreeze
    from hvd_onebit_tools.bench.zoo.grid import freeze_options

    auto = freeze_options("auto", steps)["auto_freeze"]
    AutoFreeze(**auto)  # raises if the optimizer would refuse them
    assert auto["max_steps"] == steps // 2 and auto["min_steps"] <= auto["max_steps"], \
        f"{steps} steps: {auto}"


def test_a_resumed_zoo_with_other_steps_is_refused_before_any_run(tmp_path):
    """--resume keeps the cells already in OUT: with another --steps, its runs and theirs would
    be counted as seeds of the same cells."""
    from hvd_onebit_tools.bench.zoo.runner import RESULTS, run_zoo

    kept = dict(plan_family("mlp", [0], ["bounded"], steps=10)[0], final_val_loss=1.0)
    (tmp_path / RESULTS).write_text(json.dumps(kept) + "\n")
    with pytest.raises(ValueError, match=r"holds mlp runs of \(steps, batch\) \[\(10, "):
        run_zoo(["mlp"], tmp_path, seeds=[0], schemes=["bounded"], steps=12, resume=True,
                progress=lambda s: pytest.fail(f"a run started: {s}"))
