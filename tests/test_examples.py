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

from hvd_onebit_tools.cluster.jobs import job_environment, kill_job, launch_command

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


def differing_keys(a: dict, b: dict) -> list:
    """The keys whose values differ between two dicts (or that only one has)."""
    return sorted(k for k in set(a) | set(b) if a.get(k, KeyError) != b.get(k, KeyError))


def not_finite(points: list[dict], *keys: str) -> list:
    """The (step, key, value) of the curve points whose ``keys`` are not finite numbers."""
    return [(p.get("step"), k, p[k]) for p in points for k in keys if not finite(p[k])]


@pytest.fixture(scope="module")
def quick_benchmark(tmp_path_factory):
    """benchmarks/convergence.py --quick: train_lm.py on 2 ranks, 8 steps, freeze_step 4, once with
    each optimizer (``horovodrun -np 2 --gloo python examples/train_lm.py --optimizer ...``).
    The variance stays frozen (``--variance-refresh none``): a run this short would take every
    step after the freeze as a refresh on the default schedule, and these tests check the
    compressed steps."""
    out = tmp_path_factory.mktemp("convergence")
    stdout = run([sys.executable, "benchmarks/convergence.py", "--quick", "--steps", "8",
                  "--warmup-frac", "0.5", "--eval-every", "4", "--out-dir", str(out),
                  "--", "--variance-refresh", "none"], timeout=300)
    result, _ = json.JSONDecoder().raw_decode(stdout[stdout.index("{\n"):])
    runs = {opt: (json.loads((out / f"{opt}.json").read_text()),
                  (out / f"{opt}.log").read_text(errors="replace")) for opt in ("adam", "onebit")}
    return out, result, runs


@pytest.fixture(scope="module")
def lm_runs(quick_benchmark):
    return quick_benchmark[2]


def test_train_lm_summary_is_valid_and_finite(lm_runs):
    for opt, (s, stdout) in lm_runs.items():
        assert (s["optimizer"], s["world_size"]) == (opt, 2), \
            f"{opt}: the summary says optimizer {s['optimizer']!r} on {s['world_size']} ranks"
        steps = [p["step"] for p in s["val_curve"]]
        assert steps == [0, 4, 8], f"{opt}: held-out evaluations at steps {steps}"
        bad = not_finite(s["val_curve"], "val_loss")
        assert not bad, f"{opt}: non-finite held-out losses (step, key, value) {bad}"
        bad = not_finite(s["train_curve"], "train_loss")
        assert not bad, f"{opt}: non-finite training losses (step, key, value) {bad}"
        first = s["val_curve"][0]["val_loss"]
        assert finite(s["final_val_loss"]) and s["final_val_loss"] < first, \
            f"{opt}: final held-out loss {s['final_val_loss']}, at step 0 {first}"
        assert s["total_bytes_per_rank"] > 0 and finite(s["samples_per_sec"]), \
            f"{opt}: {s['total_bytes_per_rank']} bytes per rank, {s['samples_per_sec']} samples/s"
        assert s["config"]["steps"] == 8, f"{opt}: config steps {s['config']['steps']}, not 8"
        # the default: Horovod's optimizer sleeps, as hvd_onebit's
        assert s["wait"] == "sleep", f"{opt}: wait {s['wait']!r} by default, expected 'sleep'"
        for name, ph in s["phases"].items():  # seconds blocked on communication, CPU seconds
            assert 0 <= ph["comm_seconds"] <= ph["seconds"] and ph["cpu_seconds"] >= 0, \
                f"{opt} {name}: {ph['comm_seconds']} s on communication of {ph['seconds']} s, " \
                f"{ph['cpu_seconds']} CPU s"
            assert ph["comm_share"] == pytest.approx(ph["comm_seconds"] / ph["seconds"]), \
                f"{opt} {name}: comm share {ph['comm_share']}, {ph['comm_seconds']} / {ph['seconds']} s"
            assert ph["seconds_per_step"] == pytest.approx(ph["seconds"] / ph["steps"]), \
                f"{opt} {name}: {ph['seconds_per_step']} s per step, {ph['seconds']} s / " \
                f"{ph['steps']} steps"
        total = sum(p["seconds"] for p in s["phases"].values())
        assert s["train_seconds"] == pytest.approx(total), \
            f"{opt}: train_seconds {s['train_seconds']}, the phases' sum {total}"
        assert "done: final val loss" in stdout, \
            f"{opt}: rank 0's progress lines are missing from the output:\n{stdout[-2000:]}"
        assert "[1]<stdout>:step" not in stdout, \
            f"{opt}: rank 1 printed progress lines too:\n{stdout[-2000:]}"


def test_train_lm_onebit_switches_phase_at_freeze_step(lm_runs):
    s, _ = lm_runs["onebit"]
    assert (s["freeze_step"], s["phase_switch_step"]) == (4, 4), \
        f"freeze_step {s['freeze_step']}, phase switched at {s['phase_switch_step']}, expected 4"
    warm, comp = s["phases"]["warmup"], s["phases"]["compression"]
    assert (warm["steps"], warm["first_step"]) == (4, 0), f"warmup (steps, first step): {warm}"
    assert (comp["steps"], comp["first_step"]) == (4, 4), f"compression (steps, first step): {comp}"
    assert comp["bytes_per_step"] < warm["bytes_per_step"] / 4, \
        f"{comp['bytes_per_step']} bytes per compressed step, {warm['bytes_per_step']} per " \
        f"warmup step: not under a quarter (1-bit momentum vs fp32 gradients)"
    phases = [p["phase"] for p in s["val_curve"]]
    assert phases == ["warmup", "compression", "compression"], \
        f"phase at each held-out evaluation {phases}"
    t = s["telemetry"]
    assert (t["steps"], t["skipped_steps"]) == (8, 0), \
        f"telemetry: {t['steps']} steps, {t['skipped_steps']} skipped, expected 8 and 0"
    assert s["total_bytes_per_rank"] == t["total_bytes"], \
        f"the summary's {s['total_bytes_per_rank']} bytes per rank, telemetry's {t['total_bytes']}"


def test_train_lm_adam_and_onebit_share_init_and_data(lm_runs):
    adam, _ = lm_runs["adam"]
    onebit, _ = lm_runs["onebit"]
    assert adam["phase_switch_step"] is None and list(adam["phases"]) == ["full_precision"], \
        f"adam: phase switch at {adam['phase_switch_step']}, phases {list(adam['phases'])}"
    # Same seed, same initial model; same data order, same first batch. Not bit-identical: on the
    # Horovod path hvd.broadcast_optimizer_state creates AdamW's state with a zero-gradient step,
    # which applies the weight decay once (lr * wd = 2e-4) and offsets Adam's step count by one.
    va, vo = adam["val_curve"][0]["val_loss"], onebit["val_curve"][0]["val_loss"]
    assert va == pytest.approx(vo, rel=1e-4), f"held-out loss at step 0: adam {va}, onebit {vo}"
    a, o = adam["train_loss_per_step_rank0"], onebit["train_loss_per_step_rank0"]
    assert len(a) == len(o) == 8, f"{len(a)} adam and {len(o)} onebit training losses, not 8"
    assert a[0] == pytest.approx(o[0], rel=1e-4), f"first training loss: adam {a[0]}, onebit {o[0]}"
    ba = adam["phases"]["full_precision"]["bytes_per_step"]
    bo = onebit["phases"]["warmup"]["bytes_per_step"]
    assert ba == bo, f"bytes per step: adam {ba}, onebit's warmup {bo}"


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
    assert (spin["wait"], spin["config"]["wait"]) == ("spin", "spin"), \
        f"--wait spin ran with wait {spin['wait']!r} (config {spin['config']['wait']!r})"
    assert spin["train_loss_per_step_rank0"] == pytest.approx(adam["train_loss_per_step_rank0"],
                                                              rel=1e-4), \
        f"training losses per step: spin {spin['train_loss_per_step_rank0']}, " \
        f"sleep {adam['train_loss_per_step_rank0']}"
    assert spin["final_val_loss"] == pytest.approx(adam["final_val_loss"], rel=1e-4), \
        f"final held-out loss: spin {spin['final_val_loss']}, sleep {adam['final_val_loss']}"
    ph = spin["phases"]["full_precision"]
    assert 0 <= ph["comm_seconds"] <= ph["seconds"], \
        f"spin: {ph['comm_seconds']} s on communication of {ph['seconds']} s"


def test_train_digits_runs_with_onebit(tmp_path):
    pytest.importorskip("sklearn")
    path = tmp_path / "digits.json"
    horovodrun("examples/train_digits.py",
               ["--optimizer", "onebit", "--steps", "20", "--warmup-frac", "0.25",
                "--eval-every", "10", "--batch-size", "16", "--json-out", str(path)])
    s = json.loads(path.read_text())
    got = (s["world_size"], s["freeze_step"], s["phase_switch_step"])
    assert got == (2, 5, 5), f"(world size, freeze_step, phase switch step) {got}, expected (2, 5, 5)"
    bad = [(p.get("step"), p["val_loss"], p["val_acc"]) for p in s["val_curve"]
           if not (finite(p["val_loss"]) and 0 <= p["val_acc"] <= 1)]
    assert not bad, f"held-out (step, loss, accuracy) not finite or out of [0, 1]: {bad}"
    t = s["telemetry"]
    assert (t["phase"], t["skipped_steps"]) == ("compression", 0), \
        f"telemetry: phase {t['phase']!r}, {t['skipped_steps']} skipped steps"
    assert s["final_val_acc"] > 0.2, \
        f"final held-out accuracy {s['final_val_acc']}: not better than chance (0.1) after 20 steps"


def test_convergence_benchmark_quick(quick_benchmark):
    out, result, _ = quick_benchmark
    for key in ("final_val_loss_adam", "final_val_loss_onebit", "ratio_onebit_over_adam",
                "loss_threshold", "total_bytes_per_rank_adam", "total_bytes_per_rank_onebit",
                "wall_seconds_adam", "wall_seconds_onebit", "wall_seconds_total"):
        assert finite(result[key]), f"{key} is {result[key]!r}, not a finite number"
    got = (result["world_size"], result["steps"], result["freeze_step"])
    assert got == (2, 8, 4), f"(world size, steps, freeze_step) {got}, expected (2, 8, 4)"
    assert result["ratio_onebit_over_adam"] == pytest.approx(
        result["final_val_loss_onebit"] / result["final_val_loss_adam"]), \
        f"ratio {result['ratio_onebit_over_adam']} for final losses " \
        f"{result['final_val_loss_onebit']} / {result['final_val_loss_adam']}"
    # The threshold is chosen so that both runs reach it.
    for opt in ("adam", "onebit"):
        assert result[f"steps_to_threshold_{opt}"] is not None, \
            f"{opt} never reached the loss threshold {result['loss_threshold']}"
    assert result["total_bytes_per_rank_onebit"] < result["total_bytes_per_rank_adam"], \
        f"bytes per rank: onebit {result['total_bytes_per_rank_onebit']}, " \
        f"adam {result['total_bytes_per_rank_adam']}"
    size = Path(result["plot"]).stat().st_size
    assert size > 1000, f"the plot {result['plot']} is {size} bytes"
    written = json.loads((out / "summary.json").read_text())
    assert written == result, \
        f"summary.json differs from the printed result in {differing_keys(written, result)}"


def test_auto_freeze_benchmark_across_seeds_with_the_batch_order_alone_changed(tmp_path):
    """benchmarks/auto_freeze.py --seeds: per seed, Adam and Adam on another batch order (the
    example's --data-seed); the summary holds each seed's ratio to that seed's Adam."""
    pytest.importorskip("sklearn")
    # one rank: the runs are Adam's, and what is checked is the seeds' plumbing, not the ranks
    stdout = run([sys.executable, "benchmarks/auto_freeze.py", "--example", "digits", "--np", "1",
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
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written == result, \
        f"summary.json differs from the printed result in {differing_keys(written, result)}"


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
        assert r["variance_vs_first"] == pytest.approx(r["variance_sum"] / rows[0]["variance_sum"]), \
            f"step {r['step']}: variance_vs_first {r['variance_vs_first']}, variance " \
            f"{r['variance_sum']} / first {rows[0]['variance_sum']}"
        assert 0 < r["recent_over_variance"] < 50 and 0 < r["change_10"] < 2, r
    assert summary["variance_drop_first_to_last"] == pytest.approx(
        rows[0]["variance_sum"] / rows[-1]["variance_sum"]), summary
    proc = subprocess.run([sys.executable, "benchmarks/variance_trend.py", "--every", "5"],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 2 and "--every must be at least 10" in proc.stderr, proc.stderr
