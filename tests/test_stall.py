"""The stall watch (hvd_onebit.stall): a call that does not return is told once, then, if asked,
ends the process; the decision on a clock the test moves, and once in a real job whose rank 0
takes a step the other rank never joins."""
import pytest

from hvd_onebit.stall import (EXIT_STATUS, SHUTDOWN_VARIABLE, WARNING_VARIABLE, StallSettings,
                              StallWatch)
from tests.torchrun_jobs import REPO, run_torchrun_script


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def watched(settings: StallSettings) -> tuple[StallWatch, Clock]:
    clock = Clock()
    watch = StallWatch(settings, clock)
    watch._start = lambda: None  # the test asks due() itself; no thread
    return watch, clock


def test_a_call_is_warned_about_once_past_the_limit_and_ended_past_the_shutdown():
    watch, clock = watched(StallSettings(warning_s=60, shutdown_s=300))
    with watch.watching(lambda: "rank 1: optimizer.step() (step count 22)"):
        clock.now += 59.5
        assert watch.due(clock.now) is None, "warned before 60 s in the call"
        clock.now += 1
        due = watch.due(clock.now)
        assert due is not None and not due.shutdown, f"at 60.5 s: {due}"
        for part in ("rank 1: optimizer.step() (step count 22) has not returned after 60 s",
                     f"{WARNING_VARIABLE}=60", "a checkpoint loaded on some ranks only",
                     "requires_grad changed on some ranks only",
                     "a checkpoint written or an evaluation run on rank 0 only"):
            assert part in due.message, f"the warning lacks {part!r}: {due.message}"
        assert SHUTDOWN_VARIABLE not in due.message, \
            f"the warning offers the shutdown that is set: {due.message}"
        clock.now += 100
        assert watch.due(clock.now) is None, "warned twice in one call"
        clock.now += 200
        due = watch.due(clock.now)
        assert due is not None and due.shutdown, f"at 360.5 s: {due}"
        assert f"exit status {EXIT_STATUS}, {SHUTDOWN_VARIABLE}=300" in due.message, due.message
    assert watch.due(clock.now + 1000) is None, "a call that returned is still watched"


def test_without_a_shutdown_the_warning_says_how_to_end_a_stalled_process():
    watch, clock = watched(StallSettings(warning_s=60))
    with watch.watching(lambda: "rank 0: optimizer.step()"):
        clock.now += 61
        due = watch.due(clock.now)
    assert due is not None and due.message.endswith(
        f"This rank waits on; {SHUTDOWN_VARIABLE}=SECONDS ends a stalled process instead, so "
        "that the launcher ends or restarts the job"), f"at 61 s: {due}"


def test_each_call_is_timed_from_its_own_start_and_an_inner_call_is_part_of_the_outer():
    watch, clock = watched(StallSettings(warning_s=10))
    for _ in range(3):  # short calls add nothing up
        with watch.watching(lambda: "step"):
            clock.now += 0.5
    with watch.watching(lambda: "outer"):
        clock.now += 6
        with watch.watching(lambda: "inner"):
            clock.now += 6
        due = watch.due(clock.now)
    assert due is not None and due.message.startswith("hvd_onebit: outer has not returned after "
                                                      "12 s"), f"the outer call at 12 s: {due}"


def test_slow_calls_raise_the_warning_limit_to_ten_times_the_slowest_but_not_the_shutdown():
    """Steps that are slow by nature (a large model on a slow link) are not stalls: a call
    is warned about once it has waited ten times the slowest call before it, if that is past
    the limit; the shutdown keeps its own limit."""
    watch, clock = watched(StallSettings(warning_s=60, shutdown_s=3000))
    with watch.watching(lambda: "first step"):
        clock.now += 90
        assert watch.due(clock.now) is not None, "the first 90 s step was not warned about"
    with watch.watching(lambda: "slow step"):
        clock.now += 899
        assert watch.due(clock.now) is None, "a step under 10 x 90 s was warned about"
        clock.now += 2
        due = watch.due(clock.now)
        assert due is not None and not due.shutdown and \
            "10 times the slowest call before it: 900 s" in due.message, f"at 901 s: {due}"
        clock.now += 2100
        due = watch.due(clock.now)
        assert due is not None and due.shutdown, f"the shutdown at 3001 s: {due}"


def test_a_call_whose_name_cannot_be_told_is_still_warned_about():
    watch, clock = watched(StallSettings(warning_s=1))
    with watch.watching(lambda: 1 / 0):
        clock.now += 2
        due = watch.due(clock.now)
    assert due is not None and "a watched call (naming it raised ZeroDivisionError) has not " \
        "returned after 2 s" in due.message, f"at 2 s: {due}"


def test_no_watch_when_both_limits_are_zero():
    watch, clock = watched(StallSettings(warning_s=0, shutdown_s=0))
    with watch.watching(lambda: "step"):
        clock.now += 1e6
        assert watch.due(clock.now) is None


@pytest.mark.parametrize("value", ["-1", "soon", "nan", "inf"])
def test_a_bad_setting_is_refused_naming_the_variable(value):
    with pytest.raises(ValueError, match=f"{SHUTDOWN_VARIABLE}='{value}' is not a number of "
                                         "seconds >= 0"):
        StallSettings.from_environment({SHUTDOWN_VARIABLE: value})
    got = StallSettings.from_environment({WARNING_VARIABLE: "5", SHUTDOWN_VARIABLE: " "})
    assert got == StallSettings(5.0, 0.0), f"settings from the environment: {got}"


@pytest.mark.multirank
def test_an_optimizer_built_on_one_rank_only_is_told_then_ended():
    """Rank 1 never builds the optimizer: rank 0 waits in the building's collective check, and
    the watch says so and ends it, as it does for a step."""
    rc, text = run_torchrun_script(2, REPO / "tests" / "scripts" / "stalled_rank.py",
                                   ["--unbuilt", "--sleep", "120"], timeout=100,
                                   env={WARNING_VARIABLE: "1", SHUTDOWN_VARIABLE: "4"})
    tail = text[-3000:]
    warned = [line for line in text.splitlines()
              if line.startswith("hvd_onebit: building hvd_onebit.ddp.DistributedOptimizer")]
    assert rc not in (None, 0) and len(warned) == 2 and f"exit status {EXIT_STATUS}" in \
        warned[1], f"exit status {rc}; rank 0's warning, then its shutdown, expected; got " \
                   f"{warned}: {tail}"


@pytest.mark.multirank
@pytest.mark.parametrize("freeze_step, where", [
    (2, "optimizer.step() (after 5 step() calls since the optimizer was built (2 since its "
        "collectives were last reset), step count 5: a compressed step"),
    (100, "DDP's gradient allreduce in backward (after 5 step() calls since the optimizer was "
          "built, step count 5: a warmup step")], ids=["compressed", "warmup"])
def test_a_step_no_other_rank_joins_is_told_then_ended(freeze_step, where):
    """Rank 0 takes a sixth step while rank 1 sleeps outside any collective: without the watch
    the job waits out the test's timeout; with it rank 0 says where it waits (in step(), or in
    backward for DDP's own allreduce), then ends with the watch's exit status, and torchrun
    ends the job. In the compression phase every rank resets its collectives after step 3:
    the calls are counted from the optimizer's building, and from the reset beside them."""
    reset = ["--reset-after", "3"] if freeze_step < 5 else []
    rc, text = run_torchrun_script(2, REPO / "tests" / "scripts" / "stalled_rank.py",
                                   ["--steps", "5", "--sleep", "120",
                                    "--freeze-step", str(freeze_step)] + reset, timeout=100,
                                   env={WARNING_VARIABLE: "1", SHUTDOWN_VARIABLE: "4"})
    tail = text[-3000:]
    assert rc not in (None, 0), f"the job's exit status {rc} (None: killed at the timeout): {tail}"
    where = (f"hvd_onebit: rank 0: {where}, 2 trainable parameters of 36 elements, the first "
             "weight) has not returned after ")
    warned = [line for line in text.splitlines() if line.startswith(where)]
    assert len(warned) == 2 and f"{WARNING_VARIABLE}=1" in warned[0] and \
        f"exit status {EXIT_STATUS}" in warned[1], \
        f"rank 0's warning, then its shutdown, expected; got {warned}: {tail}"
    assert f"exitcode  : {EXIT_STATUS}" in text, f"rank 0 did not end with {EXIT_STATUS}: {tail}"
