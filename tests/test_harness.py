"""The multi-rank harness itself: results come back, failures and hangs fail fast and clean."""
import os
import site
from pathlib import Path

import psutil
import pytest

from hvd_onebit_tools.cluster import jobs as testing
from hvd_onebit_tools.cluster.jobs import RankFailure, run_ranks
from tests.worlds import Scratch, Suite, World, earlier_worlds, shared_suite

pytestmark = pytest.mark.multirank


# in the shared jobs (tests/worlds.py), which come back through the same run_job
allreduce_rank = shared_suite("tests.workers_harness:allreduce_rank", np=[2, 4],
                              controller=["gloo", "mpi"], timeout=120)


def test_results_come_back_in_rank_order(allreduce_rank):
    (controller, np_), results = allreduce_rank
    total = float(sum(range(np_)))
    assert results == [(r, np_, total) for r in range(np_)]


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_a_rank_that_raises_fails_the_test(controller):
    """The job ends because rank 1 raised, not because the other rank, stuck in a collective that
    can never complete, ran into the timeout."""
    with pytest.raises(RankFailure) as info:
        run_ranks("tests.workers_harness:raise_on_rank", np=2, controller=controller,
                  kwargs={"bad_rank": 1}, timeout=90)
    message = str(info.value)
    assert "deliberate failure on rank 1" in message and "rank 1 raised" in message, message
    assert "timed out" not in message, f"the job ran into its timeout instead:\n{message}"


def test_a_hung_rank_is_killed_at_the_timeout(tmp_path):
    """run_ranks reports the timeout and returns only once every process of the job is gone:
    the launcher and the ranks, the hung one and the one that finished. (Every process of the job
    carries HANG_PID_FILE in its environment; the ranks that got going also wrote their pids.)"""
    pid_file = tmp_path / "hung.pid"
    with pytest.raises(RankFailure) as info:
        run_ranks("tests.workers_harness:hang_on_rank", np=2, timeout=10,
                  env={"HANG_PID_FILE": str(pid_file)})
    assert "timed out after 10s" in str(info.value), str(info.value)
    left = {}
    for proc in psutil.process_iter(["pid", "name"]):
        try:
            if (proc.environ().get("HANG_PID_FILE") == str(pid_file)
                    and proc.status() != psutil.STATUS_ZOMBIE):
                left[proc.pid] = proc.info["name"]
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    assert not left, f"processes of the job left alive after the timeout: {left}"
    for rank in range(2):
        f = Path(f"{pid_file}.rank{rank}")
        if f.exists():  # that rank got going before the timeout (on a loaded machine it may not)
            pid = int(f.read_text())
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie", \
                f"rank {rank} (pid {pid}) is still alive after the timeout"


def test_unknown_controller_is_a_clear_error():
    with pytest.raises(ValueError, match="controller must be one of"):
        run_ranks("tests.workers_harness:allreduce_rank", np=2, controller="tcp")


def test_ranks_import_the_callers_modules_wherever_they_are(tmp_path, monkeypatch):
    """Nothing depends on the checkout: a worker module outside it, run from another folder, is
    found by the ranks (through where the caller imports it from), and they run in the caller's
    folder."""
    elsewhere, run_dir = tmp_path / "elsewhere", tmp_path / "run_here"
    elsewhere.mkdir()
    run_dir.mkdir()
    (elsewhere / "outside_workers.py").write_text(
        "import os\n\nimport horovod.torch as hvd\n\n\n"
        "def where():\n    return hvd.rank(), os.getcwd()\n")
    monkeypatch.syspath_prepend(str(elsewhere))
    monkeypatch.chdir(run_dir)
    assert run_ranks("outside_workers:where", np=2, timeout=120) == [
        (0, str(run_dir)), (1, str(run_dir))]


def test_an_installed_package_puts_no_site_packages_on_pythonpath(monkeypatch):
    """Installed (not editable), the package's folder is site-packages, which the ranks' Python
    has anyway: only the folders of the caller's own modules go on PYTHONPATH."""
    site_dir = Path(site.getsitepackages()[0])
    monkeypatch.setattr(testing, "REPO_ROOT", site_dir)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    env = testing.job_environment("token", import_roots=[testing.import_root("tests.workers_harness")])
    assert env["PYTHONPATH"].split(os.pathsep) == [str(Path(__file__).resolve().parents[1])]


def test_a_later_stage_waits_only_for_the_worlds_it_reads_from():
    """A stage-1 world runs after the stage-0 worlds whose suites write a folder it reads, not
    after every other world: those launch when their own modules ask, and their time is theirs."""
    def suite(key, world, **kwargs):
        return Suite(key=key, target="m:f", world=world, kwargs=tuple(kwargs.items()),
                     timeout=1.0, module="m", fixture=key)

    writer, other, plain = World(2, "torchrun"), World(4, hosts="h:4"), World(2, "mpi")
    reader = World(4, "torchrun", stage=1)
    selected = [suite("save", writer, scratch=Scratch("ckpt"), stage="save"),
                suite("other", other, runs=[{"dir": Scratch("elsewhere")}]),
                suite("plain", plain, n=3),
                suite("load", reader, scratch=Scratch("ckpt"), stage="load")]
    assert earlier_worlds(selected, reader) == [writer], \
        f"the stage-1 world waits for {earlier_worlds(selected, reader)}"
    # a stage-1 world that names no folder cannot say what it reads: every earlier world first
    blind = World(2, "gloo", stage=1)
    found = earlier_worlds(selected + [suite("blind", blind, n=1)], blind)
    assert found == [writer, other, plain], f"the stage-1 world without a folder waits for {found}"
