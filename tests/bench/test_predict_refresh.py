"""`bench predict` with a ``variance_refresh`` schedule: a run's steps counted by kind (warmup,
refreshes, compressed), the whole-run formula, the run-length sweep and the command line. The
arithmetic runs on test_predict's hand-made calibration; nothing here trains."""
import json

import pytest

from hvd_onebit_tools.bench.calibrate.files import save
from hvd_onebit_tools.bench.predict.job import Cluster, Job
from hvd_onebit_tools.bench.predict.model import Model
from hvd_onebit_tools.bench.predict.runs import (RunSetting, add_run_figures, fp32_step_bytes,
                                           run_length_sweep, whole_run)
from hvd_onebit_tools.bench.refresh import (freeze_step_for, option_text, parse_variance_refresh,
                                      run_steps)
from hvd_onebit.layout import ring_allreduce_bytes
from hvd_onebit.variance_refresh import RefreshSchedule
from tests.bench.test_predict import fake_calibration
from tests.cli import hvd_onebit


def test_a_run_counts_its_warmup_refreshes_and_compressed_steps():
    got = run_steps(1000, freeze_step_for(0.05, 1000), "doubling")
    # doubling: updates at 0..15 (gap 1), 16..46 (gap 2), 48..108 (4), ...; from step 50 on:
    # 52..108 (15), 112..232 (16), 240..480 (16), 496..976 (16) = 63
    assert got == {"run_steps": 1000, "freeze_step": 50, "refresh_steps": 63,
                   "full_precision_steps": 113, "compressed_steps": 887}, \
        f"1,000 steps frozen at 5% with doubling: {got}"
    s = RefreshSchedule()
    marked = sum(s.is_refresh(t, 50) for t in range(1000))
    assert got["refresh_steps"] == marked, \
        f"{got['refresh_steps']} refreshes counted, {marked} steps marked by is_refresh"
    fixed = run_steps(1000, freeze_step_for(0.15, 1000))
    assert (fixed["full_precision_steps"], fixed["compressed_steps"]) == (150, 850), \
        f"no refresh at 15%: {fixed}"
    bounded = run_steps(1000, 50, {"last_step": 200})
    assert bounded["refresh_steps"] == sum(s.is_refresh(t, 50) for t in range(200)), \
        f"last_step=200 still counts refreshes after it: {bounded}"
    assert run_steps(100, 500, "doubling")["compressed_steps"] == 0, \
        "a freeze after the run's end leaves compressed steps"


def test_the_whole_run_prices_full_precision_steps_at_the_fp32_step():
    steps = run_steps(1000, 50, "doubling")  # 113 full precision, 887 compressed
    r = whole_run(steps, fp32_step_s=2.0, compressed_step_s=0.5, fp32_bytes=1000,
                  compressed_bytes=30)
    assert r["run_s"] == pytest.approx(113 * 2.0 + 887 * 0.5), f"run seconds {r['run_s']}"
    assert r["run_speedup_vs_fp32"] == pytest.approx(1000 * 2.0 / (113 * 2.0 + 887 * 0.5)), \
        f"speed-up {r['run_speedup_vs_fp32']}: not S * t_fp32 / run_s"
    assert r["bytes_per_rank_run"] == 113 * 1000 + 887 * 30, \
        f"bytes over the run {r['bytes_per_rank_run']}"


def test_each_onebit_row_gets_the_fixed_and_the_refresh_run():
    model, job = Model(fake_calibration()), Job(params=1_000_000, model="mlp", warmup_frac=0.15)
    cl = Cluster(nodes=4, inter_bps=1e9)
    methods = model.predict_all(job, cl, ("horovod_fp32", "onebit"))
    setting = RunSetting(run_steps=2000, warmup_frac=0.15, variance_refresh="doubling",
                         refresh_freeze_frac=0.05)
    add_run_figures(methods, setting, fp32_step_bytes(job, cl))
    fp32, ob = methods["horovod_fp32"], methods["onebit"]
    assert "run_refresh" not in fp32, "the fp32 row got refresh figures"
    F, R = 100, RefreshSchedule().count(2000, 100)
    rf, fx = ob["run_refresh"], ob["run_fixed"]
    assert (rf["freeze_step"], rf["refresh_steps"]) == (F, R), f"refresh run's steps: {rf}"
    t32, t1 = fp32["step_s"], ob["step_s"]
    want = (F + R) * t32 + (2000 - F - R) * t1
    assert rf["run_s"] == pytest.approx(want), \
        f"refresh run {rf['run_s']:.4f} s, (F + R) t_fp32 + rest t_1bit = {want:.4f} s"
    # at a whole number of warmup steps, the fixed run is the fraction-based figure
    assert fx["full_precision_steps"] == 300 and fx["run_speedup_vs_fp32"] == pytest.approx(
        ob["run_speedup_vs_fp32"]), (f"fixed run {fx['run_speedup_vs_fp32']:.4f}x vs "
                                     f"warmup_frac's {ob['run_speedup_vs_fp32']:.4f}x")
    b32 = ring_allreduce_bytes(4 * job.params, 4)
    assert b32 == fp32["bytes_per_rank"], f"fp32 bytes {b32} vs the row's {fp32['bytes_per_rank']}"
    assert rf["bytes_per_rank_run"] == (F + R) * b32 + (2000 - F - R) * ob["bytes_per_rank"]
    assert ob["refresh_vs_fixed_bytes"] == pytest.approx(
        rf["bytes_per_rank_run"] / fx["bytes_per_rank_run"])
    assert ob["refresh_vs_fixed_run_speedup"] == pytest.approx(fx["run_s"] / rf["run_s"])


def test_the_refresh_pays_more_the_longer_the_run():
    model, job = Model(fake_calibration()), Job(params=1_000_000, model="mlp")
    clusters = [Cluster(nodes=n, inter_bps=1e9) for n in (2, 4)]
    rows = run_length_sweep(model, job, clusters, [1000, 10000, 100000],
                            RunSetting(variance_refresh="doubling", refresh_freeze_frac=0.05))
    assert len(rows) == 6, f"{len(rows)} rows for 2 clusters x 3 run lengths"
    for n in (2, 4):
        mine = [r for r in rows if r["np"] == n]
        fixed = [r["fixed_run_speedup_vs_fp32"] for r in mine]
        refresh = [r["refresh_run_speedup_vs_fp32"] for r in mine]
        assert max(fixed) == pytest.approx(min(fixed)), f"np={n}: fixed warmup varies {fixed}"
        assert refresh == sorted(refresh) and refresh[0] < refresh[-1], \
            f"np={n}: refresh speed-ups against run length {refresh}"
        fp = [r["refresh_full_precision_steps"] for r in mine]
        assert fp == [50 + 63, 500 + 67, 5000 + 69], f"np={n}: full-precision steps {fp}"


def test_variance_refresh_option_parsing():
    parsed = {text: parse_variance_refresh(text) for text in ("none", None, "")}
    assert parsed == {"none": None, None: None, "": None}, f"no schedule should parse to None: {parsed}"
    assert parse_variance_refresh("doubling") == "doubling"
    assert parse_variance_refresh('{"first_interval": 8, "last_step": 5000}') == \
        {"first_interval": 8, "last_step": 5000}
    assert option_text(parse_variance_refresh('{"first_interval": 8}')) == '{"first_interval":8}'
    for bad, error in (("weekly", "must be none, doubling or a JSON object"),
                       ("{nope", "not valid JSON"), ('{"interval": 4}', "unknown field"),
                       ('{"growth": 0.5}', "growth must be a number >= 1")):
        with pytest.raises(ValueError, match=error):
            parse_variance_refresh(bad)


def test_predict_cli_prints_the_refresh_columns_and_the_run_length_sweep(tmp_path):
    path = save(fake_calibration(), tmp_path / "cal.json")
    base = ["bench", "predict", "--calibration", str(path), "--model", "mlp", "--bandwidth",
            "1gbit"]
    proc = hvd_onebit(base + ["--np", "4", "--run-steps", "1000", "--methods",
                              "horovod_fp32,onebit", "--json"])
    assert proc.exit_code == 0, proc.stderr
    report = json.loads(proc.stdout)
    ob = report["rows"][0]["methods"]["onebit"]
    assert ob["run_refresh"]["full_precision_steps"] == 113, ob["run_refresh"]
    assert report["inputs"]["variance_refresh"] == "doubling"
    proc = hvd_onebit(base + ["--np", "4", "--run-steps", "1000", "--methods",
                              "horovod_fp32,onebit"])
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("np "))
    columns = lines[header].split("  ")
    columns = [c.strip() for c in columns if c.strip()]
    row = lines[header + 3].split()  # np, link (2 words), method, step ms, MB, step x, run x, ...
    default = ob["run_refresh"]["run_speedup_vs_fp32"]
    fixed = ob["run_speedup_vs_fp32"]
    assert columns[5:8] == ["step x", "run x", "fp steps"] and \
        row[6:9] == [f"{ob['step_speedup_vs_fp32']:.2f}", f"{default:.2f}", "113/1,000"], \
        (f"the run's speed-up first should be the library default's ({default:.2f}, 113 "
         f"full-precision steps), then the fixed warmup's ({fixed:.2f}): {lines[header]!r} "
         f"{lines[header + 3]!r}")
    assert "with variance_refresh=doubling frozen at step 50 (5%) (the library's default" in \
        proc.stdout, proc.stdout
    proc = hvd_onebit(base + ["--np", "2,4", "--run-lengths", "1000,10000", "--methods",
                              "horovod_fp32,onebit"])
    assert proc.exit_code == 0, proc.stderr
    assert "refresh: run x fp32" in proc.stdout and "113 (50 + 63)" in proc.stdout, proc.stdout
    proc = hvd_onebit(base + ["--variance-refresh", '{"every": 3}'])
    assert proc.exit_code != 0 and "unknown field" in proc.stderr, proc.stderr


def test_bench_train_reports_what_bounds_the_refresh_runs_speed_up():
    from hvd_onebit_tools.bench.refresh import run_steps, whole_run_ceilings

    steps = 600
    fixed = {"run_seconds": 90 * 0.6 + 510 * 0.15, "steps_by_kind": run_steps(steps, 90)}
    kinds = run_steps(steps, 18, "doubling")
    refreshed = {"warmup_step_s": 0.6, "compression_step_s": 0.15, "refresh_step_s": 0.9,
                 "steps_by_kind": kinds}
    got = whole_run_ceilings(fixed, refreshed)
    fp = kinds["full_precision_steps"]
    expect = {"warmup_over_compressed_step": 4.0, "refresh_over_warmup_step": 1.5,
              "onebit_refresh_speedup_at_warmup_cost":
                  fixed["run_seconds"] / (fp * 0.6 + (steps - fp) * 0.15),
              "onebit_refresh_speedup_no_refreshes":
                  fixed["run_seconds"] / (18 * 0.6 + 582 * 0.15),
              "onebit_refresh_speedup_any_schedule": (0.15 * 4 + 0.85)}
    assert got == pytest.approx(expect), f"ceilings {got}, expected {expect}"
    assert whole_run_ceilings(fixed, {"steps_by_kind": kinds}) == {}, "a missing figure"
