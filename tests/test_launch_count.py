"""tests/conftest.py's count of the processes the session launches: what each is counted as."""
import subprocess
import sys

import pytest

from tests import conftest


@pytest.mark.parametrize("argv, kind", [
    (["/venv/bin/horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", "python", "x.py"],
     "horovodrun"),
    (["mpirun", "--allow-run-as-root", "-np", "4", "python", "-m", "x"], "mpirun"),
    (["torchrun", "--nproc-per-node", "2", "x.py"], "torchrun"),
    (["python3", "-m", "torch.distributed.run", "x.py"], "torchrun"),
    ([sys.executable, "-m", "hvd_onebit_tools.cli", "bench", "train"], "cli"),
    ([sys.executable, "benchmarks/variance_trend.py"], "other python"),
    (["env", "A=1", "nice", "-n", "5", "timeout", "60", "horovodrun", "-np", "2"], "horovodrun"),
    (["/bin/sh", "-c", "mpirun -np 2 true"], "mpirun"),
    (["ip", "netns", "list"], "other"),
    ([], "other"),
])
def test_a_launch_is_counted_as_what_it_starts(argv, kind):
    assert conftest.classify(argv) == kind, f"{argv} counted as {conftest.classify(argv)!r}"


def test_each_process_started_is_counted_once():
    before = dict(conftest._launches)
    subprocess.run(["true"], check=True)
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    added = {k: v - before.get(k, 0) for k, v in conftest._launches.items()
             if v != before.get(k, 0)}
    assert added == {"other": 1, "other python": 1}, f"launches counted: {added}"
    assert conftest.launch_summary().startswith("launches: "), conftest.launch_summary()
