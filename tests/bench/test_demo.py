"""`make demo`'s parts that need no cluster: how Horovod's optimizer waits (hvd_onebit_tools.bench.waits),
train_lm.py's --wait, and the demo's table rows and speed-up breakdown from train_lm summaries."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from hvd_onebit_tools.bench import demo
from hvd_onebit_tools.bench.waits import WAITS, WaitTimer, set_horovod_wait, sleeping_horovod_waits

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def horovod_synchronize():
    """Horovod's optimizer module and its own synchronize, put back afterwards."""
    import horovod.torch.mpi_ops as mpi_ops
    import horovod.torch.optimizer as horovod_optimizer

    yield horovod_optimizer, mpi_ops.synchronize
    horovod_optimizer.synchronize = mpi_ops.synchronize


def test_spin_restores_horovods_own_synchronize(horovod_synchronize):
    module, own = horovod_synchronize
    set_horovod_wait("sleep")
    assert module.synchronize is not own
    set_horovod_wait("spin")
    assert module.synchronize is own
    sleeping_horovod_waits(True)  # bench train's and the zoo's spelling
    assert module.synchronize is not own
    sleeping_horovod_waits(False)
    assert module.synchronize is own


@pytest.mark.parametrize("wait", WAITS)
def test_a_timer_counts_every_wait(horovod_synchronize, wait):
    module, own = horovod_synchronize
    timer = WaitTimer()
    set_horovod_wait(wait, timer)
    assert module.synchronize is not own
    # A callable handle (Horovod's own for a gradient that needs no allreduce) is not polled,
    # and Horovod's synchronize returns at once for a handle it does not know.
    for _ in range(3):
        assert module.synchronize(lambda: None) is None
    assert timer.calls == 3 and timer.seconds >= 0.0, \
        f"the timer counted {timer.calls} calls (expected 3) and {timer.seconds} s"
    seconds = timer.seconds
    taken = timer.take()
    assert (taken, timer.seconds) == (seconds, 0.0), \
        f"take() gave {taken} s of {seconds} and left {timer.seconds} s, expected all and 0.0"


def test_an_unknown_wait_is_refused(horovod_synchronize):
    with pytest.raises(ValueError, match="wait must be one of"):
        set_horovod_wait("busy")


def test_train_lm_waits_by_sleeping_unless_told_to_spin():
    spec = importlib.util.spec_from_file_location("train_lm", REPO / "examples" / "train_lm.py")
    train_lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_lm)
    assert train_lm.parse_args([]).wait == "sleep"
    assert train_lm.parse_args(["--wait", "spin"]).wait == "spin"
    with pytest.raises(SystemExit):
        train_lm.parse_args(["--wait", "busy"])


def test_the_demo_passes_each_baseline_its_wait():
    assert demo.RUNS["adam"][:2] == ("adam", ["--wait", "sleep"])
    assert demo.RUNS["adam_spin"][:2] == ("adam", ["--wait", "spin"])
    assert demo.RUNS["onebit"][0] == "onebit"


def phase(steps, s_per_step, comm_per_step, mb, first_step=0, batch=64):
    seconds, comm = steps * s_per_step, steps * comm_per_step
    return {"steps": steps, "seconds": seconds, "bytes": int(steps * mb * 1e6),
            "comm_seconds": comm, "first_step": first_step,
            "samples_per_sec": steps * batch / seconds, "bytes_per_step": mb * 1e6,
            "seconds_per_step": s_per_step, "comm_seconds_per_step": comm_per_step,
            "comm_share": comm / seconds}


def summary(optimizer, wait, phases, wall):
    return {"optimizer": optimizer, "wait": wait, "phases": phases, "final_val_loss": 2.4,
            "wall_seconds": wall, "measured_tx_bytes_per_rank": None}


def test_rows_and_breakdown_say_where_the_time_went():
    steps = 100
    runs = {"adam": summary("adam", "sleep",
                            {"full_precision": phase(100, 0.40, 0.20, 2.6)}, 45.0),
            "adam_spin": summary("adam", "spin",
                                 {"full_precision": phase(100, 0.60, 0.30, 2.6)}, 65.0),
            "onebit": summary("onebit", None,
                              {"warmup": phase(20, 0.41, 0.21, 2.6),
                               "refresh": phase(10, 0.42, 0.22, 2.6, first_step=20),
                               "compression": phase(70, 0.15, 0.02, 0.08, first_step=21)},
                              25.0)}
    rows = {tag: demo._row(tag, s, steps) for tag, s in runs.items()}
    adam, onebit = rows["adam"], rows["onebit"]
    got = {k: adam[k] for k in ("warmup_steps", "compression_steps", "compression_sps",
                                "warmup_s_per_step", "warmup_comm_share", "train_s", "comm_s")}
    assert got == {"warmup_steps": 100, "compression_steps": 0, "compression_sps": None,
                   "warmup_s_per_step": 0.40, "warmup_comm_share": pytest.approx(0.5),
                   "train_s": pytest.approx(40.0), "comm_s": pytest.approx(20.0)}, \
        f"adam's row: {got}"
    assert onebit["train_s"] == pytest.approx(20 * 0.41 + 10 * 0.42 + 70 * 0.15)
    assert onebit["compression_mb"] == pytest.approx(0.08)
    got = (rows["adam_spin"]["wait"], adam["wait"])
    assert got == ("spin", "sleep"), f"waits of adam_spin and adam {got}, expected spin and sleep"

    b = demo.breakdown(rows)
    assert b["speedup"] == pytest.approx(40.0 / 22.9)
    got = (b["warmup_steps"], b["refresh_steps"], b["compression_steps"])
    assert got == (20, 10, 70), f"warmup, refresh and compression steps {got}"
    assert b["warmup_s"] == pytest.approx(20 * (0.40 - 0.41))
    assert b["refresh_s"] == pytest.approx(10 * (0.40 - 0.42))
    assert b["compression_s"] == pytest.approx(70 * (0.40 - 0.15))
    assert b["compression_comm_s"] == pytest.approx(70 * (0.20 - 0.02))
    # the parts add up to the whole difference in step time, refresh steps included
    parts = b["warmup_s"] + b["refresh_s"] + b["compression_s"]
    whole = b["adam_train_s"] - b["onebit_train_s"]
    assert parts == pytest.approx(whole), f"the phases' savings {parts} s, the whole {whole} s"
    assert b["compression_comm_s"] + b["compression_other_s"] == pytest.approx(b["compression_s"])
    assert b["spin_wait_s"] == pytest.approx(60.0 - 40.0)
    text = demo.headline(b, rows)
    for part in ("same sleeping wait", "Warmup (20 steps", "Variance refresh (10 full-precision",
                 "Compression phase (70 steps",
                 "less waiting on communication", "spinning wait", "+20 s against"):
        assert part in text, text
    del rows["adam_spin"]
    assert "spin_wait_s" not in demo.breakdown(rows)
