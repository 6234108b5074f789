"""Jobs under torchrun (``python -m torch.distributed.run``), the DDP face's launcher: a
target function on every rank through the library's
:func:`hvd_onebit_tools.cluster.torchrun.run_torchrun_job` (Gloo set up, the result pickled
back); ``python -m tests.torchrun_jobs --script SCRIPT ARGS`` runs a user's script in each rank
instead, with :mod:`hvd_onebit_tools.cluster.jobs`'s process clean-up (every process carrying
the job's token is killed). Horovod is blocked in the ranks, so whatever runs there runs
without it.
"""
from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from typing import Optional

from hvd_onebit_tools.cluster.torchrun import block_horovod, rank_main, torchrun_command

REPO = Path(__file__).resolve().parent.parent


def run_torchrun_job(target: str, np: int = 2, kwargs: Optional[dict] = None,
                     timeout: float = 180.0, env: Optional[dict] = None):
    """Run ``target`` ("module:function", called as ``function(**kwargs)`` once Gloo is set up)
    on ``np`` ranks of this machine under torchrun, Horovod blocked in them (the library's
    :func:`hvd_onebit_tools.cluster.torchrun.run_torchrun_job`); a
    :class:`~hvd_onebit_tools.cluster.jobs.JobResult` with the results in rank order. Raises
    RankFailure when a rank raised, died or ran past ``timeout``."""
    from hvd_onebit_tools.cluster import torchrun

    return torchrun.run_torchrun_job(target, None, kwargs=kwargs, timeout=timeout, env=env,
                                     np=np)


def run_torchrun_script(np: int, script: Path, args: list[str], max_restarts: int = 0,
                        timeout: float = 300.0,
                        env: Optional[dict] = None) -> tuple[Optional[int], str]:
    """Run a user's ``script`` with ``args`` on ``np`` ranks under torchrun (Horovod blocked in
    the ranks, ``env`` added to their environment); its exit status (None: killed at
    ``timeout``) and its output."""
    from hvd_onebit_tools.cluster.jobs import job_environment, kill_job

    token = uuid.uuid4().hex
    cmd = torchrun_command(np, ["-m", "tests.torchrun_jobs", "--script", str(script), *args],
                           max_restarts=max_restarts)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO,
                            env=job_environment(token, extra=env, import_roots=[REPO]),
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc: Optional[int] = proc.returncode
    except subprocess.TimeoutExpired:
        out, rc = b"", None
    finally:
        kill_job(proc, token)
    return rc, out.decode(errors="replace")


def _script_main(script: str, args: list[str]) -> None:
    """Run ``script`` as ``python script args`` would, with Horovod blocked."""
    import runpy

    block_horovod()
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    if sys.argv[1] == "--script":  # python -m tests.torchrun_jobs --script SCRIPT ARGS...
        _script_main(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(rank_main(sys.argv[1], sys.argv[2], without_horovod=True))
