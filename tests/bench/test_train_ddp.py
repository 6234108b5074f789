"""`bench train`'s DDP methods without a job: the DDP face's arguments and what the summary sets
against what. The methods themselves run in tests/bench/test_bench_cli.py's launched jobs."""
import math
from types import SimpleNamespace

import pytest

from hvd_onebit import Experimental
from hvd_onebit_tools.bench.cli.train import refresh_share_note
from hvd_onebit_tools.bench.refresh import run_steps
from hvd_onebit_tools.bench.train import DEFAULT_METHODS, METHODS, summarize
from hvd_onebit_tools.bench.train_ddp import DDP_METHODS, ddp_onebit_arguments, onebit_phase
from hvd_onebit_tools.bench.world import HOROVOD_FREE


def test_ddp_onebit_takes_onebits_freeze_and_only_the_options_the_ddp_face_has():
    assert set(DDP_METHODS) <= set(METHODS), f"{DDP_METHODS} not all in {METHODS}"
    assert {"ddp_adam", "ddp_onebit"} <= set(DEFAULT_METHODS), DEFAULT_METHODS
    # the library's defaults (the refresh schedule) are measured without being asked for
    assert "onebit_refresh" in DEFAULT_METHODS, DEFAULT_METHODS
    bench_options = {"transport": "auto", "intra_node": "auto", "bucket_size_mb": 8.0}
    got = ddp_onebit_arguments(600, 0.15, bench_options)
    assert got == {"bucket_size_mb": 8.0, "freeze_step": 90, "variance_refresh": None}, \
        f"ddp_onebit's arguments from {bench_options}: {got}"


def test_ddp_onebit_refresh_takes_onebit_refreshs_schedule_and_freeze():
    """The library's defaults through the DDP face, measured by default and without Horovod:
    onebit_refresh's variance_refresh (a schedule's dict as Experimental's refresh_schedule)
    and its freeze at refresh_freeze_frac, not ddp_onebit's."""
    assert "ddp_onebit_refresh" in DEFAULT_METHODS and "ddp_onebit_refresh" in HOROVOD_FREE, \
        f"default methods {DEFAULT_METHODS}, without Horovod {HOROVOD_FREE}"
    bench_options = {"transport": "auto", "intra_node": "auto", "bucket_size_mb": 8.0}
    got = ddp_onebit_arguments(600, 0.15, bench_options, "ddp_onebit_refresh", "doubling", 0.05)
    assert got == {"bucket_size_mb": 8.0, "freeze_step": 30, "variance_refresh": "doubling"}, \
        f"ddp_onebit_refresh's arguments: {got}"
    schedule = {"first_interval": 4}
    got = ddp_onebit_arguments(600, 0.15, bench_options, "ddp_onebit_refresh", schedule, 0.1)
    want = {"bucket_size_mb": 8.0, "freeze_step": 60, "variance_refresh": "doubling",
            "experimental": Experimental(refresh_schedule=schedule)}
    assert got == want, f"ddp_onebit_refresh's arguments for {schedule}: {got}"
    frozen = ddp_onebit_arguments(600, 0.15, bench_options, "ddp_onebit_refresh", None, 0.05)
    assert frozen["variance_refresh"] is None, f"--variance-refresh none reached it as {frozen}"
    plain = ddp_onebit_arguments(600, 0.15, bench_options, "ddp_onebit", "doubling", 0.05)
    assert plain["variance_refresh"] is None and plain["freeze_step"] == 90, plain
    with pytest.raises(ValueError, match="not a method of the DDP face"):
        ddp_onebit_arguments(600, 0.15, bench_options, "ddp_adam")


def test_a_refresh_step_is_its_own_phase_in_either_face():
    """phase() before each step: the optimizer's phase, "refresh" where the schedule refreshes
    inside the compression phase; the counts match the schedule's whole-run figures."""
    opt = SimpleNamespace(phase="warmup", freeze_step=3)
    counter = {"it": 0}
    refreshed = onebit_phase(opt, {"first_interval": 2}, counter)
    fixed = onebit_phase(opt, None, counter)
    phases, plain = [], []
    for it in range(10):
        counter["it"] = it
        opt.phase = "warmup" if it < opt.freeze_step else "compression"
        phases.append(refreshed())
        plain.append(fixed())
    assert phases == 3 * ["warmup"] + ["compression", "refresh"] * 3 + ["compression"], phases
    assert plain == 3 * ["warmup"] + 7 * ["compression"], plain
    kinds = run_steps(10, 3, {"first_interval": 2})
    assert phases.count("refresh") == kinds["refresh_steps"], (phases, kinds)
    note = refresh_share_note(kinds, {"first_interval": 2}, 0.3, method="ddp_onebit_refresh")
    assert note.startswith("ddp_onebit_refresh: 6 of 10 steps in full precision (warmup 3, "
                           "refreshes 3)"), note


def rows(fp32_step, onebit_step, adam_step, face_step):
    """Rows as train_worker makes them, with the figures the summary reads."""
    return [
        {"method": "horovod_fp32", "all_step_s": fp32_step, "run_seconds": 40 * fp32_step},
        {"method": "onebit", "compression_step_s": onebit_step, "warmup_step_s": fp32_step,
         "run_seconds": 30.0, "freeze_step": 8, "steps": 40},
        {"method": "ddp_adam", "all_step_s": adam_step, "run_seconds": 40.0,
         "all_measured_tx_bytes_per_step": 4_000_000, "bytes_per_step": 3_750_000},
        {"method": "ddp_onebit", "compression_step_s": face_step, "warmup_step_s": adam_step,
         "run_seconds": 25.0, "compression_measured_tx_bytes_per_step": 140_000,
         "compression_bytes_per_step": 120_000},
        {"method": "ddp_powersgd", "run_seconds": 30.0}]


def refresh_rows():
    """ddp_adam, ddp_onebit and ddp_onebit_refresh rows as train_worker makes them."""
    return [
        {"method": "ddp_adam", "all_step_s": 1.0, "run_seconds": 40.0, "bytes_per_step": 4e6},
        {"method": "ddp_onebit", "warmup_step_s": 1.0, "compression_step_s": 0.2,
         "run_seconds": 16.0, "run_bytes_per_rank": 1000.0, "run_measured_tx_bytes": 1100.0},
        {"method": "ddp_onebit_refresh", "warmup_step_s": 1.0, "compression_step_s": 0.2,
         "refresh_step_s": 1.1, "run_seconds": 10.0, "run_bytes_per_rank": 450.0,
         "run_measured_tx_bytes": 550.0,
         "steps_by_kind": {"run_steps": 40, "freeze_step": 2, "refresh_steps": 5,
                           "full_precision_steps": 7, "compressed_steps": 33}}]


def test_the_summary_sets_the_ddp_faces_defaults_against_ddp_adam_and_ddp_onebit():
    """ddp_onebit_refresh's whole run, as the summary sets onebit_refresh's: against DDP Adam,
    against the paper's setting (time and bytes), and the ceilings of its speed-up."""
    got = summarize(refresh_rows())
    want = {"ddp_onebit_refresh_run_speedup_vs_ddp_adam": 4.0,
            "ddp_onebit_refresh_run_speedup_vs_ddp_onebit": 1.6,
            "ddp_onebit_refresh_bytes_vs_ddp_onebit": 0.45,
            "ddp_onebit_refresh_measured_bytes_vs_ddp_onebit": 0.5,
            # ddp_onebit's 16 s over 7 full-precision steps at 1 s and 33 compressed at 0.2 s
            "ddp_onebit_refresh_speedup_at_warmup_cost": 16 / (7 + 33 * 0.2),
            "ddp_onebit_refresh_speedup_no_refreshes": 16 / (2 + 38 * 0.2),
            "ddp_onebit_refresh_speedup_any_schedule": 16 / (40 * 0.2),
            "ddp_refresh_over_warmup_step": 1.1, "ddp_warmup_over_compressed_step": 5.0}
    wrong = {k: (got.get(k), v) for k, v in want.items() if got.get(k) != pytest.approx(v)}
    assert not wrong, f"summary figures (got, expected): {wrong}"
    clash = {k for k in got if k.startswith("onebit_refresh") or k in
             ("refresh_over_warmup_step", "warmup_over_compressed_step")}
    assert not clash, f"the DDP face's figures took the Horovod face's keys: {clash}"
    assert all(math.isfinite(v) for v in got.values()), got
    alone = summarize([r for r in refresh_rows() if r["method"] != "ddp_onebit"])
    assert set(alone) == {"ddp_onebit_refresh_run_speedup_vs_ddp_adam"}, \
        f"without ddp_onebit: {alone}"


def test_the_summary_sets_the_ddp_faces_gain_against_the_horovod_faces():
    got = summarize(rows(fp32_step=1.0, onebit_step=0.25, adam_step=0.9, face_step=0.3))
    want = {"ddp_onebit_compression_step_speedup_vs_ddp_adam": 3.0,
            "onebit_compression_step_speedup_vs_fp32": 4.0,
            "ddp_face_speedup_vs_horovod_face": 0.75,
            "ddp_onebit_compression_step_vs_onebit": 1.2,
            "ddp_adam_step_vs_horovod_fp32": 0.9,
            "ddp_onebit_run_speedup_vs_ddp_adam": 1.6,
            "ddp_onebit_run_speedup_vs_ddp_powersgd": 1.2,
            "ddp_onebit_measured_bytes_vs_ddp_adam": 0.035,
            "ddp_onebit_bytes_vs_ddp_adam": 0.032}
    wrong = {k: (got.get(k), v) for k, v in want.items() if got.get(k) != pytest.approx(v)}
    assert not wrong, f"summary figures (got, expected): {wrong}"


def test_the_summary_leaves_out_what_a_run_did_not_measure():
    runs = rows(fp32_step=1.0, onebit_step=0.25, adam_step=0.9, face_step=0.3)
    for r in runs:  # off the emulator nothing is measured on a link
        r.pop("all_measured_tx_bytes_per_step", None)
        r.pop("compression_measured_tx_bytes_per_step", None)
    got = summarize([r for r in runs if r["method"] != "onebit"])
    assert "ddp_onebit_measured_bytes_vs_ddp_adam" not in got, got
    assert "ddp_face_speedup_vs_horovod_face" not in got, got
    assert got["ddp_onebit_bytes_vs_ddp_adam"] == pytest.approx(0.032), got
