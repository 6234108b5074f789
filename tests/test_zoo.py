"""The convergence zoo's fixed subset (issue 25), in a real 4-rank job: Horovod's MNIST Net at
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

from hvd_onebit.bench.zoo.grid import ADAM, plan_family
from hvd_onebit.cluster.jobs import run_ranks

MAX_RATIO = 1.2
STEPS = 60


@pytest.fixture(scope="module")
def zoo_cells(tmp_path_factory):
    cells = (plan_family("mnist_cnn", [0], ["bounded", "unbounded"], freezes=["20%"],
                         lr_rules=["scaled"], steps=STEPS)
             + plan_family("gru_lm", [0], ["bounded"], freezes=["20%"], lr_rules=["scaled"],
                           steps=STEPS))
    results = tmp_path_factory.mktemp("zoo") / "cells.jsonl"
    records = run_ranks("hvd_onebit.bench.zoo.worker:zoo_worker", np=4,
                        kwargs={"cells": cells, "results": str(results)}, timeout=240)[0]
    # what rank 0 wrote as it went is what it returned
    assert [json.loads(line) for line in results.read_text().splitlines()] == \
        json.loads(json.dumps(records))
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
    assert ours["compressed_steps"] == STEPS - ours["freeze_step"] > 0, ours
    ratio = ours["final_loss"] / adam["final_loss"]
    assert ratio <= MAX_RATIO, \
        (f"{_name(ours)}: final held-out loss {ours['final_loss']:.4f} is {ratio:.3f}x Horovod "
         f"Adam's {adam['final_loss']:.4f} (bound {MAX_RATIO})")
    assert ours["clamped_fraction"] is not None and 0.0 <= ours["clamped_fraction"] < 1.0


@pytest.mark.multirank
def test_the_warmup_is_horovod_adam_bit_for_bit(zoo_cells):
    """Before the freeze a 1-bit run is Horovod Adam: same data, dropout masks and reduction
    order, so every held-out evaluation before the freeze is the same number."""
    adam, ours = zoo_cells[("mnist_cnn", None)], zoo_cells[("mnist_cnn", "bounded")]
    before = [(s, v) for s, v in ours["curve"] if s <= ours["freeze_step"]]
    assert len(before) >= 2, ours["curve"]
    assert before == adam["curve"][:len(before)], \
        f"warmup curve {before} differs from Horovod Adam's {adam['curve'][:len(before)]}"


@pytest.mark.multirank
def test_without_the_bound_horovods_mnist_net_diverges(zoo_cells):
    """The same cell with step_bound=None (the paper's unbounded frozen-variance step): the loss
    goes non-finite soon after the freeze (issue 25's NaN), so the bound is what the test above
    measures."""
    r = zoo_cells[("mnist_cnn", "unbounded")]
    assert r["diverged"] and r["nonfinite_at"] is not None, \
        f"{_name(r)} did not diverge: final held-out loss {r['final_loss']}, curve {r['curve']}"
    assert r["nonfinite_at"] > r["freeze_step"], r


def _record(family, seed, method, loss, scheme=None, freeze=None, diverged=False, **extra):
    return {"family": family, "lr_rule": "scaled", "lr": 4e-3, "seed": seed, "steps": 100,
            "batch": 32, "method": method, "scheme": scheme, "freeze": freeze,
            "final_loss": loss, "tail_loss": loss, "diverged": diverged, "seconds": 1.0,
            "initial_loss": 2.3, **extra}


def test_report_ratios_divergences_and_heat_map(tmp_path):
    from hvd_onebit.bench.zoo.report import write_report

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
    assert bounded["divergences"] == 0 and bounded["median_ratio"] == pytest.approx(1.005)
    assert bounded["max_ratio"] == pytest.approx(1.02) and bounded["over_1_05"] == 0
    assert all(bounded["targets"].values()), bounded["targets"]
    assert unbounded["divergences"] == 1 and unbounded["over_1_05"] == 2
    assert not unbounded["targets"]["no_divergence"]
    assert summary["families"]["bounded"]["mlp"]["clamped_fraction_mean"] == pytest.approx(0.2)
    assert (tmp_path / "heat_map.png").stat().st_size > 0
    assert json.loads((tmp_path / "summary.json").read_text())["schemes"]["unbounded"][
        "max_ratio"] == "inf"
