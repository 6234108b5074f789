"""`hvd-onebit bench dev tensors`: the sweep's rows from a small run in the DDP face's torchrun
world, and the summary's slopes and ratios from rows of known figures."""
import math

import pytest
from click.testing import CliRunner

from hvd_onebit_tools.bench.tensors import METHODS, summarize
from hvd_onebit_tools.cli import main
from tests.bench.workers_tensors import COUNTS
from tests.worlds import shared_suite

small = shared_suite("tests.bench.workers_tensors:suite", np=2, controller="torchrun",
                     timeout=180)


def test_the_sweep_times_both_methods_at_every_count_alike_on_every_rank(small):
    rows = small[0]
    assert small[1] == rows, "the ranks hand back different rows"
    got = sorted((r["tensors"], r["method"]) for r in rows)
    want = sorted((n, m) for n in COUNTS for m in METHODS)
    assert got == want, f"rows for {got}, want {want}"
    bad = [r for r in rows if not all(math.isfinite(r[k]) and r[k] > 0
                                      for k in ("whole_ms", "step_ms", "backward_ms"))]
    assert bad == [], f"rows without positive finite times: {bad}"
    assert all(r["step_ms"] + r["backward_ms"] <= r["whole_ms"] for r in rows), \
        f"a step and backward longer than the whole step: {rows}"


def _rows(adam_us: float, onebit_us: float, reps: int = 3) -> list[dict]:
    """Rows whose whole step is 5 ms plus so many us per tensor, plus a rep's own offset."""
    return [{"rep": k, "tensors": n, "method": m, "step_ms": 1.0, "backward_ms": 1.0,
             "whole_ms": 5.0 + 0.1 * k + n * (adam_us if m == "ddp_adam" else onebit_us) / 1e3}
            for k in range(reps) for n in (10, 100, 1000) for m in METHODS]


def test_the_summary_gives_each_methods_cost_per_tensor_and_the_one_bit_excess():
    s = summarize(_rows(adam_us=2.0, onebit_us=7.0))
    per = {m: s["us_per_tensor"][m]["median"] for m in METHODS}
    assert per == pytest.approx({"ddp_adam": 2.0, "ddp_onebit": 7.0}), f"slopes {per}"
    assert s["extra_us_per_tensor"]["median"] == pytest.approx(5.0), s["extra_us_per_tensor"]
    at_1000 = s["counts"][-1]
    assert at_1000["ratio"] == pytest.approx((5.1 + 7.0) / (5.1 + 2.0)), at_1000
    assert at_1000["ratio_range"][0] < at_1000["ratio"] < at_1000["ratio_range"][1], at_1000


def test_one_tensor_count_is_refused_before_anything_runs():
    result = CliRunner().invoke(main, ["bench", "dev", "tensors", "--counts", "100,100"])
    assert result.exit_code == 2 and "two or more distinct tensor counts" in result.output, \
        result.output
