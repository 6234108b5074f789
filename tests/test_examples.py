"""examples/train_lm.py, examples/train_digits.py and benchmarks/convergence.py, run for real.

Each script is launched the way a user launches it (``horovodrun -np 2 --gloo python SCRIPT``) at a
tiny size, with a timeout; a job that overruns is killed whole (every process carrying its token).
train_lm.py runs inside ``benchmarks/convergence.py --quick`` (once per optimizer), which saves
three launches of horovodrun; the tests read both its printed JSON and each run's summary.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from hvd_onebit.cluster.jobs import job_environment, kill_job, launch_command

pytestmark = pytest.mark.multirank

REPO = Path(__file__).resolve().parent.parent


def run(cmd: list[str], timeout: float) -> str:
    """Run ``cmd`` in the repository; return its output; fail with the output on error or timeout."""
    token = uuid.uuid4().hex
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=job_environment(token),
                            cwd=str(REPO), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(proc, token)
        out, _ = proc.communicate()
        text = out.decode(errors="replace")[-4000:]
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout}s:\n{text}")
    finally:
        kill_job(proc, token)  # nothing may outlive the test
    text = out.decode(errors="replace")
    assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}:\n{text[-4000:]}"
    return text


def horovodrun(script: str, args: list[str], np: int = 2, timeout: float = 120) -> str:
    return run(launch_command(np, "gloo", [sys.executable, str(REPO / script)] + args), timeout)


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@pytest.fixture(scope="module")
def quick_benchmark(tmp_path_factory):
    """benchmarks/convergence.py --quick: train_lm.py on 2 ranks, 8 steps, freeze_step 4, once with
    each optimizer (``horovodrun -np 2 --gloo python examples/train_lm.py --optimizer ...``)."""
    out = tmp_path_factory.mktemp("convergence")
    stdout = run([sys.executable, "benchmarks/convergence.py", "--quick", "--steps", "8",
                  "--warmup-frac", "0.5", "--eval-every", "4", "--out-dir", str(out)], timeout=300)
    result, _ = json.JSONDecoder().raw_decode(stdout[stdout.index("{\n"):])
    runs = {opt: (json.loads((out / f"{opt}.json").read_text()),
                  (out / f"{opt}.log").read_text(errors="replace")) for opt in ("adam", "onebit")}
    return out, result, runs


@pytest.fixture(scope="module")
def lm_runs(quick_benchmark):
    return quick_benchmark[2]


def test_train_lm_summary_is_valid_and_finite(lm_runs):
    for opt, (s, stdout) in lm_runs.items():
        assert s["optimizer"] == opt and s["world_size"] == 2
        assert [p["step"] for p in s["val_curve"]] == [0, 4, 8]
        assert all(finite(p["val_loss"]) for p in s["val_curve"])
        assert all(finite(p["train_loss"]) for p in s["train_curve"])
        assert finite(s["final_val_loss"]) and s["final_val_loss"] < s["val_curve"][0]["val_loss"]
        assert s["total_bytes_per_rank"] > 0 and finite(s["samples_per_sec"])
        assert s["config"]["steps"] == 8
        assert s["wait"] == "sleep"  # the default: Horovod's optimizer sleeps, as hvd_onebit's
        for ph in s["phases"].values():  # seconds blocked on communication, CPU seconds
            assert 0 <= ph["comm_seconds"] <= ph["seconds"] and ph["cpu_seconds"] >= 0
            assert ph["comm_share"] == pytest.approx(ph["comm_seconds"] / ph["seconds"])
            assert ph["seconds_per_step"] == pytest.approx(ph["seconds"] / ph["steps"])
        assert s["train_seconds"] == pytest.approx(sum(p["seconds"] for p in s["phases"].values()))
        assert "done: final val loss" in stdout  # rank 0's progress lines
        assert "[1]<stdout>:step" not in stdout  # ... and only rank 0's


def test_train_lm_onebit_switches_phase_at_freeze_step(lm_runs):
    s, _ = lm_runs["onebit"]
    assert s["freeze_step"] == 4 and s["phase_switch_step"] == 4
    warm, comp = s["phases"]["warmup"], s["phases"]["compression"]
    assert (warm["steps"], warm["first_step"]) == (4, 0)
    assert (comp["steps"], comp["first_step"]) == (4, 4)
    assert comp["bytes_per_step"] < warm["bytes_per_step"] / 4  # 1-bit momentum vs fp32 grads
    assert [p["phase"] for p in s["val_curve"]] == ["warmup", "compression", "compression"]
    assert s["telemetry"]["steps"] == 8 and s["telemetry"]["skipped_steps"] == 0
    assert s["total_bytes_per_rank"] == s["telemetry"]["total_bytes"]


def test_train_lm_adam_and_onebit_share_init_and_data(lm_runs):
    adam, _ = lm_runs["adam"]
    onebit, _ = lm_runs["onebit"]
    assert adam["phase_switch_step"] is None and list(adam["phases"]) == ["full_precision"]
    # Same seed, same initial model; same data order, same first batch. Not bit-identical: on the
    # Horovod path hvd.broadcast_optimizer_state creates AdamW's state with a zero-gradient step,
    # which applies the weight decay once (lr * wd = 2e-4) and offsets Adam's step count by one.
    assert adam["val_curve"][0]["val_loss"] == pytest.approx(onebit["val_curve"][0]["val_loss"],
                                                             rel=1e-4)
    a, o = adam["train_loss_per_step_rank0"], onebit["train_loss_per_step_rank0"]
    assert len(a) == len(o) == 8
    assert a[0] == pytest.approx(o[0], rel=1e-4)
    assert adam["phases"]["full_precision"]["bytes_per_step"] == \
        onebit["phases"]["warmup"]["bytes_per_step"]


def test_train_lm_adam_spin_wait_changes_the_time_not_the_numbers(lm_runs, tmp_path):
    """--wait spin (Horovod's own wait) against the quick benchmark's Adam run (--wait sleep,
    the default) with the same arguments: the same losses step by step."""
    adam, _ = lm_runs["adam"]
    c = adam["config"]
    args = [f"--{k.replace('_', '-')}={c[k]}" for k in (
        "steps", "batch_size", "lr", "lr_warmup_frac", "warmup_frac", "weight_decay", "seed",
        "eval_every", "eval_batches", "val_frac", "context", "d_model", "n_layer", "n_head",
        "threads")]
    path = tmp_path / "adam_spin.json"
    horovodrun("examples/train_lm.py", ["--optimizer", "adam", "--wait", "spin", *args,
                                        "--json-out", str(path)])
    spin = json.loads(path.read_text())
    assert spin["wait"] == "spin" and spin["config"]["wait"] == "spin"
    assert spin["train_loss_per_step_rank0"] == pytest.approx(adam["train_loss_per_step_rank0"],
                                                              rel=1e-4)
    assert spin["final_val_loss"] == pytest.approx(adam["final_val_loss"], rel=1e-4)
    ph = spin["phases"]["full_precision"]
    assert 0 <= ph["comm_seconds"] <= ph["seconds"]


def test_train_digits_runs_with_onebit(tmp_path):
    pytest.importorskip("sklearn")
    path = tmp_path / "digits.json"
    horovodrun("examples/train_digits.py",
               ["--optimizer", "onebit", "--steps", "20", "--warmup-frac", "0.25",
                "--eval-every", "10", "--batch-size", "16", "--json-out", str(path)])
    s = json.loads(path.read_text())
    assert s["world_size"] == 2 and s["freeze_step"] == 5 and s["phase_switch_step"] == 5
    assert all(finite(p["val_loss"]) and 0 <= p["val_acc"] <= 1 for p in s["val_curve"])
    assert s["telemetry"]["phase"] == "compression" and s["telemetry"]["skipped_steps"] == 0
    assert s["final_val_acc"] > 0.2  # better than chance (0.1) after 20 steps


def test_convergence_benchmark_quick(quick_benchmark):
    out, result, _ = quick_benchmark
    for key in ("final_val_loss_adam", "final_val_loss_onebit", "ratio_onebit_over_adam",
                "loss_threshold", "total_bytes_per_rank_adam", "total_bytes_per_rank_onebit",
                "wall_seconds_adam", "wall_seconds_onebit", "wall_seconds_total"):
        assert finite(result[key]), key
    assert result["world_size"] == 2 and result["steps"] == 8 and result["freeze_step"] == 4
    assert result["ratio_onebit_over_adam"] == pytest.approx(
        result["final_val_loss_onebit"] / result["final_val_loss_adam"])
    # The threshold is chosen so that both runs reach it.
    assert result["steps_to_threshold_adam"] is not None
    assert result["steps_to_threshold_onebit"] is not None
    assert result["total_bytes_per_rank_onebit"] < result["total_bytes_per_rank_adam"]
    assert Path(result["plot"]).stat().st_size > 1000
    assert json.loads((out / "summary.json").read_text()) == result


def test_auto_freeze_benchmark_across_seeds_with_the_batch_order_alone_changed(tmp_path):
    """benchmarks/auto_freeze.py --seeds: per seed, Adam and Adam on another batch order (the
    example's --data-seed); the summary holds each seed's ratio to that seed's Adam."""
    pytest.importorskip("sklearn")
    stdout = run([sys.executable, "benchmarks/auto_freeze.py", "--example", "digits", "--np", "2",
                  "--seeds", "0,1", "--runs", "adam,adam_reordered", "--out-dir", str(tmp_path),
                  "--", "--steps", "12", "--eval-every", "6", "--batch-size", "8"], timeout=300)
    result, _ = json.JSONDecoder().raw_decode(stdout[stdout.index("{\n"):])
    assert result["seeds"] == ["0", "1"], result["seeds"]
    per_seed = result["per_seed"]
    losses = {s: {name: r["final_val_loss"] for name, r in per_seed[s]["runs"].items()}
              for s in per_seed}
    # the seed reaches the example (another split and init), the data seed only the batch order
    assert losses["0"]["adam"] != losses["1"]["adam"], losses
    for s in ("0", "1"):
        assert losses[s]["adam_reordered"] != losses[s]["adam"], losses
        curve = per_seed[s]["runs"]["adam_reordered"]["val_curve"]
        assert [step for step, _ in curve] == [6, 12], curve
    ratios = result["summary"]["adam_reordered"]["ratio_to_adam"]
    assert ratios == {s: pytest.approx(losses[s]["adam_reordered"] / losses[s]["adam"])
                      for s in ("0", "1")}, ratios
    mean = result["summary"]["adam_reordered"]["mean_ratio_to_adam"]
    assert mean == pytest.approx(sum(ratios.values()) / 2), mean
    assert json.loads((tmp_path / "summary.json").read_text()) == result


def test_variance_trend_reports_the_variance_and_the_recent_gradients(tmp_path):
    """benchmarks/variance_trend.py on the digits model: a row every --every steps with the
    summed variance, its fall since the first row, the recent gradients' mean square over it and
    auto-freeze's own figure; a summary with the drop; a clear error for too short a window."""
    pytest.importorskip("sklearn")
    out = run([sys.executable, "benchmarks/variance_trend.py", "--example", "digits",
               "--steps", "60", "--every", "20"], timeout=120)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    rows, summary = lines[:-1], lines[-1]
    assert [r["step"] for r in rows] == [20, 40, 60], rows
    assert rows[0]["variance_vs_first"] == 1.0 and "recent_over_variance" not in rows[0], rows[0]
    for r in rows[1:]:
        assert r["variance_vs_first"] == pytest.approx(r["variance_sum"] / rows[0]["variance_sum"])
        assert 0 < r["recent_over_variance"] < 50 and 0 < r["change_10"] < 2, r
    assert summary["variance_drop_first_to_last"] == pytest.approx(
        rows[0]["variance_sum"] / rows[-1]["variance_sum"]), summary
    proc = subprocess.run([sys.executable, "benchmarks/variance_trend.py", "--every", "5"],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 2 and "--every must be at least 10" in proc.stderr, proc.stderr
