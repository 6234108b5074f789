"""--variance-refresh through the examples, benchmarks/auto_freeze.py and `bench train`: the
arguments each builds for hvd_onebit.DistributedOptimizer and the figures each derives. Nothing
here trains or starts a rank, so none of it needs the optimizer to have the option yet: the
option reaches the optimizer only when it is set."""
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hvd_onebit import Experimental
from hvd_onebit_tools.bench.studies import auto_freeze
from hvd_onebit_tools.bench.studies import variance_refresh as refresh_benchmark
from hvd_onebit_tools.bench.train import METHODS, onebit_arguments, summarize
from tests.cli import hvd_onebit

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "examples") not in sys.path:
    sys.path.insert(0, str(REPO / "examples"))

import train_digits  # noqa: E402  (examples/)
import train_lm  # noqa: E402


@pytest.mark.parametrize("example", [train_lm, train_digits])
def test_examples_pass_variance_refresh_and_its_recommended_freeze(example):
    plain = train_lm.onebit_options(example.parse_args(["--steps", "1000"]))
    assert plain == {"freeze_step": 50, "variance_refresh": "doubling"}, \
        f"{example.__name__} with the defaults: {plain}"
    frozen = train_lm.onebit_options(example.parse_args(["--variance-refresh", "none",
                                                         "--steps", "1000"]))
    assert frozen == {"freeze_step": 200, "variance_refresh": None}, \
        f"{example.__name__} with --variance-refresh none: {frozen}"
    args = example.parse_args(["--variance-refresh", "doubling", "--warmup-frac", "0.05",
                               "--steps", "1000"])
    got = train_lm.onebit_options(args)
    assert got == {"freeze_step": 50, "variance_refresh": "doubling"}, \
        f"{example.__name__}'s optimizer arguments: {got}"
    args = example.parse_args(["--variance-refresh", '{"first_interval": 4}', "--warmup-frac",
                               "auto", "--auto-freeze-min-steps", "20", "--steps", "300"])
    got = train_lm.onebit_options(args)
    assert got == {"freeze_step": "auto", "variance_refresh": "doubling",
                   "experimental": Experimental(auto_freeze={"min_steps": 20, "max_steps": 150},
                                                refresh_schedule={"first_interval": 4})}, \
        f"auto + a dict: {got}"
    with pytest.raises(SystemExit):
        example.parse_args(["--variance-refresh", '{"interval": 4}'])


def test_the_example_summary_records_the_setting_and_the_steps_by_kind():
    args = train_lm.parse_args(["--variance-refresh", "doubling", "--steps", "1000"])
    got = train_lm.refresh_summary(args, SimpleNamespace(freeze_step=50))
    assert got == {"variance_refresh": "doubling", "steps_by_kind": {
        "run_steps": 1000, "freeze_step": 50, "refresh_steps": 63, "full_precision_steps": 113,
        "compressed_steps": 887}}, f"summary of a doubling run frozen at 50: {got}"
    adam = train_lm.parse_args(["--optimizer", "adam"])
    assert train_lm.refresh_summary(adam, None) == {"variance_refresh": "none"}


def test_auto_freeze_builds_the_refresh_runs():
    args = SimpleNamespace(example="digits", variance_refresh="doubling", auto_min_steps=20)
    assert auto_freeze.train_args_for("refresh_5pct", args, ["--seed", "3"]) == [
        "--seed", "3", "--warmup-frac", "0.05", "--variance-refresh", "doubling"]
    assert auto_freeze.train_args_for("refresh_auto", args, []) == [
        "--warmup-frac", "auto", "--variance-refresh", "doubling", "--auto-freeze-min-steps", "20"]
    # the other 1-bit runs keep the variance frozen, though the examples refresh by default
    assert auto_freeze.train_args_for("auto", args, []) == [
        "--warmup-frac", "auto", "--variance-refresh", "none"], \
        f"the plain auto run got {auto_freeze.train_args_for('auto', args, [])}"
    assert auto_freeze.train_args_for("frozen_20pct", args, []) == [
        "--warmup-frac", "0.2", "--variance-refresh", "none"]
    assert auto_freeze.train_args_for("adam", args, []) == [], "Adam got 1-bit arguments"


def test_auto_freeze_averages_each_seeds_ratio_and_bytes():
    def seed(adam, auto, refresh, auto_bytes, refresh_bytes):
        return {"runs": {"adam": {"final_val_loss": adam},
                         "auto": {"ratio_to_adam": auto / adam, "freeze_fraction": 0.2,
                                  "total_bytes_per_rank": auto_bytes},
                         "refresh_auto": {"ratio_to_adam": refresh / adam, "freeze_fraction": 0.1,
                                          "bytes_vs_auto": refresh_bytes / auto_bytes}}}
    summary = auto_freeze.across_seeds({"0": seed(1.0, 1.06, 1.00, 100, 50),
                                        "1": seed(2.0, 2.10, 2.02, 100, 70)})
    r = summary["refresh_auto"]
    assert r["ratio_to_adam"] == {"0": 1.0, "1": 1.01} and r["mean_ratio_to_adam"] == \
        pytest.approx(1.005), f"refresh_auto across seeds: {r}"
    assert r["mean_bytes_vs_auto"] == pytest.approx(0.6) and r["freeze_fraction"] == \
        {"0": 0.1, "1": 0.1}, f"refresh_auto bytes / freeze across seeds: {r}"


def test_bench_train_builds_onebit_refresh_like_the_other_onebit_methods():
    assert "onebit_refresh" in METHODS
    base = {"transport": "auto", "intra_node": "auto"}
    moved = {"transport": "auto", "experimental": Experimental(intra_node="auto")}
    fixed = onebit_arguments("onebit", 600, 0.15, base, "doubling", 0.05)
    assert fixed == {**moved, "freeze_step": 90, "variance_refresh": None}, f"onebit got {fixed}"
    refresh = onebit_arguments("onebit_refresh", 600, 0.15, base, "doubling", 0.05)
    assert refresh == {**moved, "freeze_step": 30, "variance_refresh": "doubling"}, \
        f"onebit_refresh got {refresh}"
    frozen = onebit_arguments("onebit_refresh", 600, 0.15, base, None, 0.05)
    assert frozen["variance_refresh"] is None, f"--variance-refresh none reached it as {frozen}"
    # onebit_blocks is onebit at another granularity (0: one scale per chunk); the other
    # methods keep the default's
    blocks = onebit_arguments("onebit_blocks", 600, 0.15, base, "doubling", 0.05, 256)
    assert blocks == {**fixed, "block_size": 256}, f"onebit_blocks got {blocks}"
    chunk = onebit_arguments("onebit_blocks", 600, 0.15, base, "doubling", 0.05, 0)
    assert chunk == {**fixed, "block_size": None}, f"onebit_blocks at 0 got {chunk}"
    assert "block_size" not in onebit_arguments("onebit", 600, 0.15, base, None, 0.05, 256)


def test_bench_train_summary_compares_the_whole_runs():
    rows = [{"method": "onebit", "run_seconds": 80.0, "run_bytes_per_rank": 1000.0,
             "run_measured_tx_bytes": 1100.0, "compression_step_s": 0.07, "warmup_step_s": 0.5,
             "freeze_step": 90, "steps": 600},
            {"method": "onebit_refresh", "run_seconds": 50.0, "run_bytes_per_rank": 450.0,
             "run_measured_tx_bytes": 550.0}]
    got = summarize(rows)
    assert got["onebit_refresh_run_speedup_vs_onebit"] == pytest.approx(1.6), got
    assert got["onebit_refresh_bytes_vs_onebit"] == pytest.approx(0.45), got
    assert got["onebit_refresh_measured_bytes_vs_onebit"] == pytest.approx(0.5), got


def test_bench_train_summary_sets_finer_scales_against_the_default_in_the_same_run():
    rows = [{"method": "onebit", "compression_step_s": 0.080,
             "compression_measured_tx_bytes_per_step": 1600.0},
            {"method": "onebit_blocks", "compression_step_s": 0.082,
             "compression_measured_tx_bytes_per_step": 1700.0}]
    got = summarize(rows)
    assert got["onebit_blocks_compression_step_vs_onebit"] == pytest.approx(1.025), got
    assert got["onebit_blocks_compression_bytes_vs_onebit"] == pytest.approx(1.0625), got


def test_bench_train_rejects_a_bad_schedule_before_starting_ranks():
    proc = hvd_onebit(["bench", "train", "--bandwidth", "local", "--methods",
                       "onebit,onebit_refresh", "--variance-refresh", '{"every": 2}'])
    assert proc.exit_code != 0 and "unknown field" in proc.stderr, proc.stderr[-2000:]
    assert "training" not in proc.stderr, "ranks were started"


def test_the_targets_benchmark_builds_its_commands():
    args = refresh_benchmark.parse_args(["--variance-refresh", '{"first_interval": 16}',
                                         "--train-repeats", "3", "--out-dir", "/tmp/vr"])
    cmds = refresh_benchmark.commands(args)
    assert list(cmds) == ["digits", "lm", "train"] and len(cmds["train"]) == 3, cmds
    digits = cmds["digits"][0]
    assert digits[digits.index("--seeds") + 1] == "0,1,2,3,4,5", digits
    assert digits[digits.index("--runs") + 1] == "adam,auto,refresh_5pct,refresh_auto", digits
    assert digits[digits.index("--variance-refresh") + 1] == '{"first_interval": 16}', digits
    lm = cmds["lm"][0]
    assert lm[-3:] == ["--", "--steps", "1000"], f"the LM's steps go to the example: {lm}"
    train = cmds["train"][0]
    for flag, value in (("--steps", "600"), ("--model", "embedding"), ("--warmup-frac", "0.15"),
                        ("--methods", "onebit,onebit_refresh"), ("--bandwidth", "1gbit"),
                        ("--np", "4"), ("--refresh-freeze-frac", "0.05")):
        assert train[train.index(flag) + 1] == value, f"bench train {flag}: {train}"
    assert "--json" in train
    with pytest.raises(SystemExit):
        refresh_benchmark.parse_args(["--parts", "zoo"])
    with pytest.raises(SystemExit):
        refresh_benchmark.parse_args(["--variance-refresh", "weekly"])


def test_the_targets_benchmark_reads_each_parts_figures():
    train = refresh_benchmark.train_figures([
        {"rows": [{"method": "onebit", "run_seconds": 84.0, "run_bytes_per_rank": 9e8},
                  {"method": "onebit_refresh", "run_seconds": 56.0, "run_bytes_per_rank": 4e8}],
         "summary": {}} for _ in range(3)])
    assert train["median_run_speedup_vs_onebit"] == pytest.approx(1.5) and train["met"], train
    lm = refresh_benchmark.lm_figures({"runs": {
        "adam": {"final_val_loss": 2.0, "ratio_to_adam": 1.0},
        "refresh_auto": {"final_val_loss": 2.01, "ratio_to_adam": 1.005, "bytes_vs_auto": 0.7}}})
    assert lm["met"] == {"refresh_auto": False}, f"bytes 0.7 > 0.6 passed: {lm}"
    digits = refresh_benchmark.digits_figures({"summary": {
        "refresh_5pct": {"ratio_to_adam": {"0": 1.0, "1": 1.03}, "mean_ratio_to_adam": 1.015}}})
    assert digits["met"] == {"refresh_5pct": False}, digits
    text = 'progress\n{\n "a": {\n  "b": 1\n }\n}\n'
    assert refresh_benchmark.last_json(text) == {"a": {"b": 1}}


def test_auto_freeze_run_all_reports_the_refresh_runs_against_auto(tmp_path, monkeypatch):
    """run_all on canned summaries (no training): ratios to Adam, bytes vs auto, the targets."""
    def summary(optimizer, loss, freeze, total, refresh="none", kinds=None):
        return {"config": {"steps": 300}, "world_size": 4, "optimizer": optimizer,
                "params": 1000, "final_val_loss": loss, "freeze_step": freeze,
                "total_bytes_per_rank": total, "freeze_decision": {"step": freeze},
                "val_curve": [{"step": 300, "val_loss": loss}], "variance_refresh": refresh,
                "steps_by_kind": kinds}
    canned = {"adam": summary("adam", 1.0, None, None),
              "auto": summary("onebit", 1.06, 60, 1000),
              "refresh_5pct": summary("onebit", 1.005, 15, 500, "doubling", {"run_steps": 300}),
              "refresh_auto": summary("onebit", 1.02, None, 700, "doubling")}
    seen = []

    def fake_train_lm(optimizer, np, train_args, run_dir, timeout, script=None):
        seen.append((run_dir.name, list(train_args)))
        return SimpleNamespace(summary=canned[run_dir.name], wall_seconds=1.0)
    monkeypatch.setattr(auto_freeze, "train_lm", fake_train_lm)
    args = SimpleNamespace(example="digits", np=4, timeout=10, variance_refresh="doubling",
                           auto_min_steps=20)
    result = auto_freeze.run_all(args, list(canned), [], tmp_path, "cmd")
    assert dict(seen)["refresh_auto"] == ["--warmup-frac", "auto", "--variance-refresh",
                                          "doubling", "--auto-freeze-min-steps", "20"], seen
    runs = result["runs"]
    assert runs["refresh_5pct"]["bytes_vs_auto"] == pytest.approx(0.5), runs["refresh_5pct"]
    assert runs["refresh_5pct"]["steps_by_kind"] == {"run_steps": 300}, runs["refresh_5pct"]
    assert result["refresh_5pct_within_1_01_of_adam"] and \
        result["refresh_5pct_bytes_within_0_6_of_auto"], result
    assert not result["refresh_auto_within_1_01_of_adam"] and \
        not result["refresh_auto_bytes_within_0_6_of_auto"], result
    assert runs["refresh_auto"]["freeze_decision"] == {"step": None}, runs["refresh_auto"]
    assert result["auto_in_10_30_percent"] is True, f"auto froze at 60 of 300 steps: {result}"
    canned["auto"] = summary("onebit", 1.06, None, 1000)  # a run too short for auto to freeze
    result = auto_freeze.run_all(args, ["adam", "auto"], [], tmp_path, "cmd")
    assert result["auto_in_10_30_percent"] is False, f"auto never froze: {result}"


def test_auto_freeze_over_seeds_writes_its_provenance(tmp_path, monkeypatch):
    """--seeds: the summary across seeds carries the commit, date and machine as the single
    run's does (the results page prints them under its table)."""
    def fake_train_lm(optimizer, np, train_args, run_dir, timeout, script=None):
        loss = 1.0 if optimizer == "adam" else 1.1
        return SimpleNamespace(wall_seconds=1.0, summary={
            "config": {"steps": 300}, "world_size": 2, "optimizer": optimizer, "params": 10,
            "final_val_loss": loss, "freeze_step": 15 if optimizer == "onebit" else None,
            "total_bytes_per_rank": 100, "val_curve": [{"step": 300, "val_loss": loss}]})
    monkeypatch.setattr(auto_freeze, "train_lm", fake_train_lm)
    auto_freeze.main(["--example", "digits", "--np", "2", "--seeds", "0,1", "--runs",
                      "adam,early_2pct", "--out-dir", str(tmp_path)])
    written = json.loads((tmp_path / "summary.json").read_text())
    missing = [k for k in ("commit", "date", "machine", "versions") if k not in written]
    assert not missing and written["summary"]["early_2pct"]["mean_ratio_to_adam"] == \
        pytest.approx(1.1), f"missing {missing}; summary {written['summary']}"
