"""Elastic Horovod: a worker lost in the compression phase, the others go on."""
import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_onebit.testing import job_environment, kill_job

pytestmark = pytest.mark.multirank
SCRIPT = Path(__file__).parent / "elastic" / "train_elastic.py"


def test_worker_killed_in_compression_phase(tmp_path):
    host = socket.gethostname()
    if host == "localhost":
        pytest.skip("needs a hostname other than localhost to act as a second host")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\necho localhost:2\necho {host}:1\n")
    discover.chmod(discover.stat().st_mode | stat.S_IEXEC)
    token = f"elastic-{os.getpid()}"
    env = job_environment(token, extra={"OUT_DIR": str(tmp_path), "VICTIM_HOST": host})
    cmd = ["horovodrun", "-np", "3", "--min-np", "2", "--max-np", "3", "--gloo",
           "--host-discovery-script", str(discover), sys.executable, str(SCRIPT)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        kill_job(proc, token)
        out, _ = proc.communicate()
        pytest.fail("elastic job hung:\n" + out.decode(errors="replace")[-4000:])
    finally:
        kill_job(proc, token)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    lines = [json.loads(l) for f in tmp_path.glob("*.jsonl") for l in f.read_text().splitlines()]
    steps = [l for l in lines if "step" in l]
    done = [l for l in lines if l.get("done")]
    # Three ranks reached the compression phase, then one was lost.
    assert {l["size"] for l in steps if l["step"] <= 12} == {3}
    assert any(l["phase"] == "compression" and l["size"] == 3 for l in steps)
    # Two survivors finished every step in a world of two, with identical parameters.
    assert len(done) == 2 and all(d["size"] == 2 and d["steps"] == 24 for d in done)
    assert done[0]["hash"] == done[1]["hash"]
    after = [l for l in steps if l["size"] == 2]
    assert after and all(l["phase"] == "compression" for l in after)
    for step in {l["step"] for l in after}:
        assert len({l["hash"] for l in after if l["step"] == step}) == 1
