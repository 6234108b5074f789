"""`bench train`'s DDP methods without a job: the DDP face's arguments and what the summary sets
against what. The methods themselves run in tests/bench/test_bench_cli.py's launched jobs."""
import pytest

from hvd_onebit_tools.bench.train import DEFAULT_METHODS, METHODS, summarize
from hvd_onebit_tools.bench.train_ddp import DDP_METHODS, ddp_onebit_arguments


def test_ddp_onebit_takes_onebits_freeze_and_only_the_options_the_ddp_face_has():
    assert set(DDP_METHODS) <= set(METHODS), f"{DDP_METHODS} not all in {METHODS}"
    assert {"ddp_adam", "ddp_onebit"} <= set(DEFAULT_METHODS), DEFAULT_METHODS
    # the library's defaults (the refresh schedule) are measured without being asked for
    assert "onebit_refresh" in DEFAULT_METHODS, DEFAULT_METHODS
    bench_options = {"transport": "auto", "intra_node": "auto", "bucket_size_mb": 8.0}
    got = ddp_onebit_arguments(600, 0.15, bench_options)
    assert got == {"bucket_size_mb": 8.0, "freeze_step": 90, "variance_refresh": None}, \
        f"ddp_onebit's arguments from {bench_options}: {got}"


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
