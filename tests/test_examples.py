"""examples/train_lm.py, examples/train_digits.py, examples/ddp_train.py and
benchmarks/convergence.py: their argument checks, and the scripts run for real.

The argument checks run in this process (each script's ``parse_args`` and ``main``, no rank
started): a bad value is an argument error naming the option, before any rank starts.

The runs launch each script the way a user launches it (``horovodrun -np 2 --gloo python
SCRIPT``) at a tiny size, with a timeout; a job that overruns is killed whole (every process
carrying its token). train_lm.py runs inside ``benchmarks/convergence.py --quick`` (once per
optimizer), which saves three launches of horovodrun; the tests read both its printed JSON and
each run's summary.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hvd_onebit_tools.cluster.jobs import job_environment, kill_job, launch_command

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "examples") not in sys.path:
    sys.path.insert(0, str(REPO / "examples"))

import ddp_train  # noqa: E402  (examples/)
import train_digits  # noqa: E402
import train_lm  # noqa: E402

multirank = pytest.mark.multirank


def launch(cmd: list[str], timeout: float) -> tuple[int, str]:
    """Run ``cmd`` in the repository: its exit status and output; fail on a timeout."""
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
    return proc.returncode, out.decode(errors="replace")


def run(cmd: list[str], timeout: float) -> str:
    """Run ``cmd`` in the repository; return its output; fail with the output on error or timeout."""
    rc, text = launch(cmd, timeout)
    assert rc == 0, f"{' '.join(cmd)} exited with {rc}:\n{text[-4000:]}"
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


@multirank
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


@multirank
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


@multirank
def test_train_lm_adam_and_onebit_share_init_and_data(lm_runs):
    adam, _ = lm_runs["adam"]
    onebit, _ = lm_runs["onebit"]
    assert adam["phase_switch_step"] is None and list(adam["phases"]) == ["full_precision"], \
        f"adam: phase switch at {adam['phase_switch_step']}, phases {list(adam['phases'])}"
    # Same seed, same initial model, same data order, and the same Adam steps through the
    # warmup: the example broadcasts no fresh optimizer state (Horovod's broadcast would take a
    # zero-gradient step, starting Adam one step ahead), so the losses are the same bits.
    va, vo = adam["val_curve"][0]["val_loss"], onebit["val_curve"][0]["val_loss"]
    assert va == vo, f"held-out loss at step 0: adam {va}, onebit {vo}"
    a, o = adam["train_loss_per_step_rank0"], onebit["train_loss_per_step_rank0"]
    assert len(a) == len(o) == 8, f"{len(a)} adam and {len(o)} onebit training losses, not 8"
    warm = onebit["freeze_step"] + 1  # the losses of the warmup's parameters
    assert a[:warm] == o[:warm], \
        f"training losses through the warmup ({warm}): adam {a[:warm]}, onebit {o[:warm]}"
    ba = adam["phases"]["full_precision"]["bytes_per_step"]
    bo = onebit["phases"]["warmup"]["bytes_per_step"]
    assert ba == bo, f"bytes per step: adam {ba}, onebit's warmup {bo}"


@multirank
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
                                        "--out", str(path)])
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


@multirank
def test_train_lm_counts_refresh_steps_apart_from_the_compressed_ones(tmp_path):
    """On the default refresh schedule the summary's phases are the warmup, the refresh steps
    (full precision) and the compressed steps, as many of each as its steps_by_kind says."""
    path = tmp_path / "refresh.json"
    horovodrun("examples/train_lm.py",
               ["--steps", "24", "--warmup-frac", "0.25", "--eval-every", "24", "--d-model", "32",
                "--n-head", "2", "--n-layer", "1", "--context", "16", "--batch-size", "2",
                "--eval-batches", "1", "--out", str(path)])
    s = json.loads(path.read_text())
    kinds = s["steps_by_kind"]
    got = {name: ph["steps"] for name, ph in s["phases"].items()}
    want = {"warmup": kinds["freeze_step"], "refresh": kinds["refresh_steps"],
            "compression": kinds["compressed_steps"]}
    assert got == want, f"steps per phase {got}, steps by kind {kinds}"
    assert s["telemetry"]["refreshes"] == kinds["refresh_steps"], \
        f"telemetry counts {s['telemetry']['refreshes']} refreshes, steps by kind {kinds}"
    refresh, comp = s["phases"]["refresh"], s["phases"]["compression"]
    assert comp["bytes_per_step"] < refresh["bytes_per_step"] / 4, \
        f"{comp['bytes_per_step']} bytes per compressed step, {refresh['bytes_per_step']} per " \
        f"refresh step: not under a quarter (1-bit momentum vs fp32 gradients)"


TINY_LM = ["--steps", "8", "--warmup-frac", "0.25", "--eval-every", "8", "--d-model", "32",
           "--n-head", "2", "--n-layer", "1", "--context", "16", "--batch-size", "2",
           "--eval-batches", "1", "--variance-refresh", "none"]


def train_lm_job(face: str, args: list[str]) -> tuple[int, str]:
    """train_lm.py on 2 ranks as a user launches it for ``face``: its exit status and output."""
    if face == "ddp":
        from tests.torchrun_jobs import run_torchrun_script

        rc, text = run_torchrun_script(2, REPO / "examples" / "train_lm.py",
                                       ["--face", "ddp", *args], timeout=180)
        return (-1 if rc is None else rc), text
    return launch(launch_command(2, "gloo", [sys.executable, str(REPO / "examples" / "train_lm.py"),
                                             *args]), timeout=180)


@pytest.mark.parametrize("content, says", [
    (None, "No such file"),
    (bytes(range(256)) * 8, "not a checkpoint this script wrote whole (torch.load raised "
                            "UnpicklingError)"),
    (b"", "not a checkpoint this script wrote whole")], ids=["missing", "corrupt", "empty"])
def test_train_lm_refuses_a_checkpoint_it_cannot_read_naming_it(tmp_path, content, says):
    """--resume of a file that is not there, or not a whole checkpoint: the script ends with a
    message naming the file (every rank reads it under torchrun), not torch's traceback."""
    path = tmp_path / "step10.pt"
    if content is not None:
        path.write_bytes(content)
    args = SimpleNamespace(resume=str(path), steps=20)
    with pytest.raises(SystemExit) as ended:
        train_lm.load_checkpoint(args, None, None, SimpleNamespace(hvd=None, rank=0))
    message = str(ended.value)
    assert message.startswith(f"cannot resume from {path}: ") and says in message, message


@multirank
@pytest.mark.parametrize("face", ["horovod", "ddp"])
def test_train_lm_resumes_from_its_checkpoint_as_if_never_stopped(tmp_path, face):
    """A run that saved at step 4, and a run resumed from that file: the same losses at every
    step after it (the error feedback folded into the saved momentum, the same batches drawn),
    each face by its own recipe."""
    ckpt = tmp_path / "ckpt"
    whole, resumed = tmp_path / "whole.json", tmp_path / "resumed.json"
    rc, text = train_lm_job(face, [*TINY_LM, "--checkpoint-every", "4", "--checkpoint-dir",
                                   str(ckpt), "--out", str(whole)])
    assert rc == 0, f"{face}: the run that saves exited with {rc}:\n{text[-3000:]}"
    saved = sorted(p.name for p in ckpt.iterdir())
    assert saved == ["step4.pt", "step8.pt"], f"{face}: checkpoints {saved}"
    # a later --warmup-frac: the checkpoint's freeze step (2) holds, and the start-up line says so
    rc, text = train_lm_job(face, [*TINY_LM, "--warmup-frac", "0.5", "--resume",
                                   str(ckpt / "step4.pt"), "--out", str(resumed)])
    assert rc == 0, f"{face}: the resumed run exited with {rc}:\n{text[-3000:]}"
    started = [line for line in text.splitlines() if "resumed at step 4" in line]
    assert started and all("freeze_step=2 " in line for line in started), \
        f"{face}: the start-up line of the resumed run: {started}"
    a, b = json.loads(whole.read_text()), json.loads(resumed.read_text())
    assert b["resumed_at_step"] == 4 and list(b["phases"]) == ["compression"], \
        f"{face}: resumed at {b['resumed_at_step']} with phases {list(b['phases'])}"
    after = a["train_loss_per_step_rank0"][4:]
    assert b["train_loss_per_step_rank0"] == after and \
        b["final_val_loss"] == a["final_val_loss"], \
        f"{face}: losses after step 4 {b['train_loss_per_step_rank0']} (final val " \
        f"{b['final_val_loss']}) resumed, {after} (final val {a['final_val_loss']}) in one run"
    if face == "horovod":  # rank 0 reads the file: a refusal must still reach every rank
        rc, text = train_lm_job(face, [*TINY_LM, "--steps", "9", "--resume",
                                       str(ckpt / "step4.pt")])
        refusals = [line for line in text.splitlines()
                    if "is from a run of --steps 8, this one has --steps 9" in line]
        assert rc != 0 and len(refusals) == 2, \
            f"--resume into another --steps: exit {rc}, refusal lines {refusals}:\n{text[-3000:]}"
        # Adam takes the 1-bit run on: rank 0 reads it, Horovod's broadcast sends it
        adam = tmp_path / "adam.json"
        rc, text = train_lm_job(face, [*TINY_LM, "--optimizer", "adam", "--resume",
                                       str(ckpt / "step4.pt"), "--out", str(adam)])
        assert rc == 0 and json.loads(adam.read_text())["resumed_at_step"] == 4, \
            f"--optimizer adam --resume of a 1-bit checkpoint: exit {rc}:\n{text[-3000:]}"


@multirank
def test_train_digits_runs_with_onebit(tmp_path):
    """The 1-bit run, and the Adam baseline the benchmarks compare it with: the same held-out
    losses through the warmup (the same start and Adam steps, none taken ahead)."""
    pytest.importorskip("sklearn")
    runs = {}
    for opt in ("onebit", "adam"):
        path = tmp_path / f"digits_{opt}.json"
        horovodrun("examples/train_digits.py",
                   ["--optimizer", opt, "--steps", "20", "--warmup-frac", "0.25",
                    "--eval-every", "1", "--batch-size", "16", "--out", str(path)])
        runs[opt] = json.loads(path.read_text())
    s = runs["onebit"]
    warmup = [(p["step"], p["val_loss"]) for p in s["val_curve"] if p["step"] <= 5]
    adam = [(p["step"], p["val_loss"]) for p in runs["adam"]["val_curve"] if p["step"] <= 5]
    assert len(warmup) == 5 and warmup == adam, \
        f"held-out (step, loss) through the warmup: onebit {warmup}, adam {adam}"
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


@multirank
def test_convergence_benchmark_quick(quick_benchmark):
    out, result, _ = quick_benchmark
    for key in ("final_val_loss_adam", "final_val_loss_onebit", "ratio_onebit_over_adam",
                "loss_threshold", "total_bytes_per_rank_adam", "total_bytes_per_rank_onebit",
                "wall_seconds_adam", "wall_seconds_onebit", "wall_seconds_total"):
        assert finite(result[key]), f"{key} is {result[key]!r}, not a finite number"
    got = (result["world_size"], result["steps"], result["freeze_step"])
    assert got == (2, 8, 4), f"(world size, steps, freeze_step) {got}, expected (2, 8, 4)"
    got = tuple(result[f"steps_onebit_{k}"] for k in ("warmup", "refresh", "compression"))
    assert got == (4, 0, 4), f"1-bit steps (warmup, refresh, compression) {got}, expected (4, 0, 4)"
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


@multirank
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


@multirank
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


# ---- argument checks, in this process --------------------------------------------------------

def refusal(parse, argv: list[str], capsys) -> tuple[object, str]:
    """The exit code and the stderr of ``parse(argv)``, which must refuse it."""
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    return exc.value.code, capsys.readouterr().err


MUST_BE_POSITIVE = "must be a positive integer, got 0"
WARMUP_RANGE = "must be 'auto' or a fraction of --steps from 0 to 1"
HELD_OUT_RANGE = "must be a fraction strictly between 0 and 1 (the share of the data held out)"
NO_COMPRESSED_STEP = "leaving no compressed step"

REFUSED = [  # (script, argv, what its error must say)
    (train_lm, ["--val-frac", "0"], f"argument --val-frac: {HELD_OUT_RANGE}, got 0"),
    (train_lm, ["--val-frac", "1.5"], f"argument --val-frac: {HELD_OUT_RANGE}, got 1.5"),
    (train_lm, ["--warmup-frac", "1.5", "--steps", "10"],
     f"argument --warmup-frac: {WARMUP_RANGE}, got 1.5"),
    (train_lm, ["--warmup-frac", "-0.1"], f"argument --warmup-frac: {WARMUP_RANGE}, got -0.1"),
    (train_lm, ["--warmup-frac", "0.96", "--steps", "10"],
     f"argument --warmup-frac: 0.96 x --steps 10 freezes at step 10, {NO_COMPRESSED_STEP}"),
    (train_lm, ["--steps", "1"], "argument --steps: 1 step(s) with the default --warmup-frac"),
    (train_lm, ["--lr-warmup-frac", "2"],
     "argument --lr-warmup-frac: must be a fraction of --steps from 0 to 1, got 2"),
    (train_lm, ["--eval-every", "0"], f"argument --eval-every: {MUST_BE_POSITIVE}"),
    (train_lm, ["--n-head", "3"], "argument --n-head: 3 does not divide --d-model 128"),
    (train_lm, ["--context", "0"], f"argument --context: {MUST_BE_POSITIVE}"),
    (train_lm, ["--batch-size", "0"], f"argument --batch-size: {MUST_BE_POSITIVE}"),
    (train_lm, ["--steps", "ten"], "argument --steps: must be a positive integer, got ten"),
    (train_lm, ["--threads", "0"], f"argument --threads: {MUST_BE_POSITIVE}"),
    (train_lm, ["--eval-batches", "-1"],
     "argument --eval-batches: must be an integer >= 0, got -1"),
    (train_lm, ["--lr", "nan"], "argument --lr: must be a positive number, got nan"),
    (train_lm, ["--weight-decay", "-1"], "argument --weight-decay: must be a number >= 0, got -1"),
    (train_lm, ["--block-size", "12"], "argument --block-size: must be a positive multiple of 8, "
                                       "got 12"),
    (train_lm, ["--auto-freeze-min-steps", "0"],
     f"argument --auto-freeze-min-steps: {MUST_BE_POSITIVE}"),
    (train_lm, ["--warmup-frac", "auto", "--steps", "30", "--auto-freeze-min-steps", "40"],
     "argument --warmup-frac: auto over --steps 30 may freeze at step 40, leaving no compressed"),
    (train_digits, ["--warmup-frac", "auto", "--steps", "1"],
     "argument --warmup-frac: auto over --steps 1 may freeze at step 1, leaving no compressed"),
    (train_lm, ["--checkpoint-every", "2", "--checkpoint-dir", __file__],
     f"argument --checkpoint-dir: {__file__} is a file, not a folder"),
    (train_lm, ["--checkpoint-every", "9", "--steps", "8"],
     "argument --checkpoint-every: 9 is past the run's --steps 8"),
    (train_digits, ["--val-frac", "0"], f"argument --val-frac: {HELD_OUT_RANGE}, got 0"),
    (train_digits, ["--warmup-frac", "2", "--steps", "10"],
     f"argument --warmup-frac: {WARMUP_RANGE}, got 2"),
    (train_digits, ["--warmup-frac", "1", "--steps", "10"],
     f"argument --warmup-frac: 1.0 x --steps 10 freezes at step 10, {NO_COMPRESSED_STEP}"),
    (train_digits, ["--steps", "0"], f"argument --steps: {MUST_BE_POSITIVE}"),
    (train_digits, ["--width", "0"], f"argument --width: {MUST_BE_POSITIVE}"),
    (train_digits, ["--eval-every", "0"], f"argument --eval-every: {MUST_BE_POSITIVE}"),
    (train_digits, ["--batch-size", "0"], f"argument --batch-size: {MUST_BE_POSITIVE}"),
    (train_digits, ["--lr", "0"], "argument --lr: must be a positive number, got 0"),
    (ddp_train, ["--steps", "0"], f"argument --steps: {MUST_BE_POSITIVE}"),
    (ddp_train, ["--batch-size", "0"], f"argument --batch-size: {MUST_BE_POSITIVE}"),
    (ddp_train, ["--lr", "-1"], "argument --lr: must be a positive number, got -1"),
    (ddp_train, ["--warmup-frac", "1.5"], "argument --warmup-frac: must be a fraction of --steps "
                                          "from 0 to 1, got 1.5"),
    (ddp_train, ["--warmup-frac", "1", "--steps", "10"],
     f"argument --warmup-frac: 1.0 x --steps 10 freezes at step 10, {NO_COMPRESSED_STEP}"),
]


@pytest.mark.parametrize("script, argv, says", REFUSED,
                         ids=[f"{m.__name__}{' '.join(a)}" for m, a, _ in REFUSED])
def test_the_examples_refuse_a_bad_value_with_an_error_naming_the_option(script, argv, says,
                                                                          capsys):
    code, err = refusal(script.parse_args, argv, capsys)
    assert code == 2 and says in err, \
        f"{script.__name__} {argv}: exit code {code} (argparse's is 2), stderr {err!r}, " \
        f"expected it to say {says!r}"


@pytest.mark.parametrize("steps, min_steps, bounds", [
    (8, None, (4, 4)), (60, None, (30, 30)), (1000, None, (50, 500)), (30, 10, (10, 15))])
def test_an_automatic_freeze_decides_by_half_the_run_however_short(steps, min_steps, bounds):
    """--warmup-frac auto: the freeze comes at half the steps at the latest, so a short run
    reaches the compression phase; the default min_steps gives way where it is past that."""
    argv = ["--warmup-frac", "auto", "--steps", str(steps)]
    args = train_lm.parse_args(argv + ([] if min_steps is None else
                                       ["--auto-freeze-min-steps", str(min_steps)]))
    auto = train_lm.onebit_options(args)["experimental"].auto_freeze
    assert (auto["min_steps"], auto["max_steps"]) == bounds, \
        f"{argv}: auto_freeze {auto}, expected min_steps and max_steps {bounds}"


def test_the_examples_take_the_edges_of_each_range():
    lm = train_lm.parse_args(["--warmup-frac", "0", "--eval-batches", "0", "--steps", "10"])
    assert train_lm.onebit_options(lm)["freeze_step"] == 1, \
        f"--warmup-frac 0 froze at {train_lm.onebit_options(lm)['freeze_step']}, not after one step"
    # with Adam the freeze is unused, so a fraction that leaves no compressed step is no error
    adam = train_lm.parse_args(["--optimizer", "adam", "--warmup-frac", "1", "--steps", "10"])
    assert adam.warmup_frac == 1.0, f"--optimizer adam --warmup-frac 1 parsed as {adam.warmup_frac}"
    auto = train_digits.parse_args(["--warmup-frac", "auto", "--steps", "2"])
    assert auto.warmup_frac == "auto", f"--warmup-frac auto parsed as {auto.warmup_frac!r}"
    ddp = ddp_train.parse_args(["--warmup-frac", "0.9", "--steps", "10"])
    assert ddp.freeze_step == 9, \
        f"ddp_train --warmup-frac 0.9 --steps 10 froze at {ddp.freeze_step}"


def test_train_lm_split_needs_a_window_in_each_part():
    text = torch.zeros(100, dtype=torch.long)
    train, val = train_lm.split_text(text, 0.5, 4, 4)
    assert (len(train), len(val)) == (50, 50), f"a half split: {len(train)} and {len(val)} bytes"
    with pytest.raises(ValueError, match=r"holds out 1 of the text's 100 bytes.*needs \(5\)"):
        train_lm.split_text(text, 0.01, 4, 1)
    with pytest.raises(ValueError, match=r"leaves 10 of .* 5 per rank on 2 ranks.*needs \(6\)"):
        train_lm.split_text(text, 0.9, 4, 2)


def test_train_lm_refuses_a_split_before_any_rank_starts(monkeypatch, capsys):
    def start(face):
        raise AssertionError(f"a {face} rank started")

    monkeypatch.setattr(train_lm, "Ranks", start)
    code, err = refusal(train_lm.main, ["--val-frac", "0.000001"], capsys)
    says = "--val-frac 1e-06 holds out 0 of the text's"
    assert code == 2 and says in err, f"exit code {code}, stderr {err!r}, expected {says!r}"


def test_train_digits_refuses_a_split_before_any_rank_starts(monkeypatch, capsys):
    pytest.importorskip("sklearn")

    def start():
        raise AssertionError("hvd.init() was called")

    monkeypatch.setattr(train_digits, "hvd", SimpleNamespace(init=start))
    code, err = refusal(train_digits.main, ["--val-frac", "0.0001"], capsys)
    says = "--val-frac 0.0001 holds out none of the"
    assert code == 2 and says in err, f"exit code {code}, stderr {err!r}, expected {says!r}"


def test_train_lm_as_a_script_refuses_before_starting_a_rank():
    """The script itself, one process and no launcher: the argument error, not a rank's."""
    proc = subprocess.run([sys.executable, "examples/train_lm.py", "--val-frac", "0"],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    says = f"train_lm.py: error: argument --val-frac: {HELD_OUT_RANGE}, got 0"
    assert proc.returncode == 2 and says in proc.stderr, \
        f"exit code {proc.returncode}, stderr {proc.stderr!r}, expected {says!r}"


@pytest.mark.parametrize("script, argv", [("ddp_train.py", []),
                                          ("train_lm.py", ["--face", "ddp", "--steps", "8"])])
def test_a_ddp_example_started_without_torchrun_says_how_to_start_it(script, argv):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, str(REPO / "examples" / script), *argv],
                          capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert proc.returncode == 1 and "runs under torchrun" in proc.stderr \
        and "Traceback" not in proc.stderr, f"{script}: exit {proc.returncode}:\n{proc.stderr}"
