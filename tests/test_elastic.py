"""Elastic Horovod in the compression phase: a worker lost, a worker replaced, the job grown,
the job left with one rank and grown again.

Real horovodrun --gloo jobs whose "hosts" are names of this machine's loopback address."""
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_onebit_tools.cluster.jobs import job_environment, kill_job

pytestmark = pytest.mark.multirank
SCRIPT = Path(__file__).parent / "elastic" / "train_elastic.py"
TOTAL, KILL_STEP, GROW_STEP = 24, 12, 10

SCENARIOS = {
    # np, min, max, initial hosts
    "lost": (3, 2, 3, "localhost:2\n127.0.0.1:1\n"),
    "replace": (2, 2, 2, "localhost:1\n127.0.0.1:1\n127.1:1\n127.0.1:1\n"),
    "grow": (2, 2, 3, "localhost:1\n127.0.0.1:1\n"),
    "to_one": (2, 1, 2, "localhost:1\n127.0.0.1:1\n"),
}


def run_scenario(tmp_path, scenario, refresh=None, flush_on_commit=False):
    np_, min_np, max_np, hosts = SCENARIOS[scenario]
    (tmp_path / "hosts.txt").write_text(hosts)
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {tmp_path / 'hosts.txt'}\n")
    discover.chmod(discover.stat().st_mode | stat.S_IEXEC)
    token = f"elastic-{os.getpid()}-{scenario}"
    extra = {"OUT_DIR": str(tmp_path), "SCENARIO": scenario}
    if refresh is not None:
        extra["VARIANCE_REFRESH"] = json.dumps(refresh)
    if flush_on_commit:
        extra["FLUSH_ON_COMMIT"] = "1"
    env = job_environment(token, extra=extra)
    cmd = ["horovodrun", "-np", str(np_), "--min-np", str(min_np), "--max-np", str(max_np),
           "--gloo", "--host-discovery-script", str(discover), sys.executable, str(SCRIPT)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        kill_job(proc, token)
        out, _ = proc.communicate()
        pytest.fail(f"elastic job ({scenario}) hung:\n" + out.decode(errors="replace")[-4000:])
    finally:
        kill_job(proc, token)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    per_process = {}
    for f in tmp_path.glob("*.jsonl"):
        per_process[f.stem] = [json.loads(line) for line in f.read_text().splitlines()]
    return per_process, text


def steps_of(per_process):
    return [line for lines in per_process.values() for line in lines if "step" in line]


def assert_identical_at_every_step(steps, text):
    for step in sorted({s["step"] for s in steps}):
        hashes = {(s["size"], s["hash"]) for s in steps if s["step"] == step}
        sizes = {size for size, _ in hashes}
        for size in sizes:
            assert len({h for sz, h in hashes if sz == size}) == 1, \
                f"ranks differ at step {step} (world size {size})\n{text[-3000:]}"


def assert_each_step_from_the_last(steps, text):
    """Every step started from parameters a step before it ended with: a restore that took a
    step twice starts it from its own result."""
    ended = {(s["step"], s["hash"]) for s in steps}
    twice = [(s["step"], s["size"]) for s in steps
             if s["step"] > 0 and (s["step"] - 1, s["before"]) not in ended]
    assert not twice, f"(step, world size) that did not start from the step before: {twice}" \
                      f"\n{text[-3000:]}"


def assert_finished_together(per_process, size, text):
    done = [line for lines in per_process.values() for line in lines if line.get("done")]
    assert len(done) == size, f"{len(done)} processes finished, expected {size}\n{text[-3000:]}"
    assert all(d["size"] == size and d["steps"] == TOTAL for d in done), done
    assert len({d["hash"] for d in done}) == 1, "final parameters differ across ranks"


def joiners(per_process):
    """Processes that started after step 0: the workers that joined a running job."""
    return {pid: lines for pid, lines in per_process.items()
            if lines and "step" in lines[0] and lines[0]["step"] > 0}


def test_worker_lost_in_compression_phase(tmp_path):
    """With flush_on_commit=True: the survivors meet the loss in the commit's flush."""
    per_process, text = run_scenario(tmp_path, "lost", flush_on_commit=True)
    steps = steps_of(per_process)
    assert {s["size"] for s in steps if s["step"] <= KILL_STEP} == {3}
    assert any(s["phase"] == "compression" and s["size"] == 3 for s in steps), \
        f"no compressed step on 3 ranks before the loss; (step, size, phase): " \
        f"{[(s['step'], s['size'], s['phase']) for s in steps]}"
    after = [s for s in steps if s["size"] == 2]
    assert after and all(s["phase"] == "compression" for s in after), after[:3]
    assert_identical_at_every_step(steps, text)
    assert_each_step_from_the_last(steps, text)
    assert_finished_together(per_process, 2, text)


def assert_one_worker_joined(per_process, text, after_step: int, size: int) -> None:
    """One worker started after ``after_step``, in the compression phase of a world of ``size``
    ranks, with the committed step count; every step's ranks identical; all finished together."""
    new = joiners(per_process)
    assert len(new) == 1, f"expected one new worker, got {list(new)}\n{text[-3000:]}"
    first = next(iter(new.values()))[0]
    assert first["step"] > after_step and first["phase"] == "compression", first
    assert first["size"] == size and first["opt_steps"] == first["step"] + 1, first
    assert_identical_at_every_step(steps_of(per_process), text)
    assert_each_step_from_the_last(steps_of(per_process), text)
    assert_finished_together(per_process, size, text)


# The replaced-worker job runs with variance refreshes (at steps 7, 9, 13, 17 and 21: compressed
# steps between them, the worker replaced after step 12): one elastic job serves both tests.
REFRESH_OPTION = {"first_interval": 1, "growth": 2, "updates_per_interval": 3}


@pytest.fixture(scope="module")
def replaced(tmp_path_factory):
    return run_scenario(tmp_path_factory.mktemp("replace"), "replace", refresh=REFRESH_OPTION)


def test_worker_replaced_in_compression_phase(replaced):
    per_process, text = replaced
    assert_one_worker_joined(per_process, text, after_step=KILL_STEP - 1, size=2)


def test_job_grows_in_compression_phase(tmp_path):
    per_process, text = run_scenario(tmp_path, "grow")
    assert_one_worker_joined(per_process, text, after_step=GROW_STEP, size=3)


def test_one_rank_left_steps_as_adam_and_compresses_again_once_the_job_grows(tmp_path):
    """Left alone, the survivor steps as torch's Adam on the state as torch_adam_state_dict gives
    it (the frozen variance made Adam's at its step count, not divided as it was frozen); grown
    again, the two ranks compress on, identical."""
    per_process, text = run_scenario(tmp_path, "to_one")
    steps = steps_of(per_process)
    alone = [s for s in steps if s["size"] == 1]
    assert alone and min(s["step"] for s in alone) == KILL_STEP + 1, \
        f"steps on one rank: {[s['step'] for s in alone]}\n{text[-3000:]}"
    off = [(s["step"], s["adam_diff"]) for s in alone if s["adam_diff"] != 0.0]
    assert not off, f"(step, max |parameter - torch Adam's|) alone: {off}"
    again = [s for s in steps if s["size"] == 2 and s["step"] > KILL_STEP]
    assert again and all(s["phase"] == "compression" for s in again), \
        f"steps after the job grew again: {[(s['step'], s['phase']) for s in again]}"
    assert_identical_at_every_step(steps, text)
    assert_each_step_from_the_last(steps, text)
    assert_finished_together(per_process, 2, text)


def test_refresh_schedule_survives_a_worker_replaced(replaced):
    """variance_refresh: every process, the new worker too, refreshes at the steps the schedule
    gives from the step count alone (FREEZE of train_elastic.py: 6)."""
    from hvd_onebit.variance_refresh import RefreshSchedule

    per_process, text = replaced
    want = RefreshSchedule(**REFRESH_OPTION)
    for pid, lines in per_process.items():
        steps = [s for s in lines if "step" in s]
        got = [s["step"] for s in steps if s["refreshed"]]
        expected = [s["step"] for s in steps if want.is_refresh(s["step"], 6)]
        assert got == expected and expected, \
            f"process {pid}: refreshed at {got}, the schedule says {expected}"
    assert any(s["refreshed"] and s["step"] > KILL_STEP for s in steps_of(per_process)), \
        "no refresh after the worker was replaced"


def test_sync_takes_the_state_from_a_rank_that_holds_it():
    """Whatever rank a fresh worker gets, even 0, the elastic sync restores from a rank with the
    committed state (the lowest rank among those with the most steps)."""
    from hvd_onebit_tools.cluster.jobs import run_ranks

    r0, r1 = run_ranks("tests.workers_elastic:sync_from_the_rank_that_holds_the_state", np=2,
                       timeout=120)
    assert r0["handler"] == r1["handler"] == ["OneBitModelStateHandler", "OneBitStateHandler"]
    assert r0["before"]["steps"] == 0 and r1["before"]["steps"] == 5, (r0["before"], r1["before"])
    for rank, r in enumerate((r0, r1)):
        assert r["after"]["steps"] == 5 and r["after"]["phase"] == "compression", \
            f"rank {rank} after the sync: {r['after']}"
        assert r["after"]["hash"] == r1["trained"], f"rank {rank}: parameters not rank 1's"
    assert (r0["after"]["v"] == r1["after"]["v"]).all(), "frozen variance not rank 1's"
    assert r0["final"] == r1["final"], "ranks differ after training on from the sync"
    for rank, r in enumerate((r0, r1)):
        f = r["failed_flush"]
        assert len(f["warned"]) == 1 and "commit without folding" in f["warned"][0], \
            f"rank {rank}: a commit past a failed flush warned {f['warned']}"
        assert f["raised"] and "resets the job to that commit" in f["raised"] \
            and f["steps_after"] == f["committed"]["steps"] + 1, \
            f"rank {rank}: the step after it raised {f['raised']!r}; steps after the restore " \
            f"{f['steps_after']}, committed {f['committed']['steps']}"
