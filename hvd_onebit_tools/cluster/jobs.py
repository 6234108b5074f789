"""Launch real multi-rank jobs and collect each rank's result: the test harness.

``run_ranks("tests.workers:fn", np=4, controller="gloo", kwargs={...})`` starts ``np`` processes under
``horovodrun --gloo`` (or ``mpirun`` with Horovod's MPI controller), each of which calls
``hvd.init()`` and then ``fn(**kwargs)``; each rank's return value is pickled back and the list, in
rank order, is returned. A rank that raises, exits early, or runs past ``timeout`` makes
:func:`run_ranks` raise :class:`RankFailure` with that rank's traceback and the job's output; every
process of the job is killed first (found by a token in their environment, so launcher
grandchildren in other process groups are not missed). A hung job is never left behind.

Lives in the package (not under tests/) so benchmarks and the CLI can reuse it. Nothing here
depends on a checkout: the ranks run in the caller's working directory, with the folders that
hold ``target``'s module and this package on PYTHONPATH.
"""
from __future__ import annotations

import importlib.util
import os
import pickle
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Optional, Sequence

import psutil

CONTROLLERS = ("gloo", "mpi")
# The folder holding the hvd_onebit package the caller runs: the checkout in development (ranks
# then import this very copy), site-packages when installed.
REPO_ROOT = Path(__file__).resolve().parents[2]  # hvd_onebit_tools/cluster/jobs.py -> the checkout
_TOKEN_VAR = "HVD_ONEBIT_JOB_TOKEN"


class RankFailure(AssertionError):
    """A multi-rank job failed: a rank raised, died or timed out. The message has the details."""


class LaunchError(RuntimeError):
    """A Horovod job that cannot start here: Horovod, or the launcher it needs, is missing, or
    the launcher failed before any rank started (a host it cannot reach)."""


# touched by every rank as its first act: a job without it never started a rank
STARTED = "rank_started"


NO_HOROVOD = ("this command runs its ranks as a Horovod job, and Horovod does not import in this "
              "Python ({python}): install Horovod built against the installed torch "
              "(docs/install.md, Horovod). Without Horovod: `hvd-onebit check`, `bench train` "
              "(DDP's methods, under torchrun), `bench predict`, `bench dev kernel`, `bench dev "
              "memory --world inprocess`, `bench dev zoo --face ddp` and `cluster run "
              "--torchrun`")


def horovod_installed() -> bool:
    """Whether Horovod imports in this Python (a DDP user's environment may have none)."""
    return importlib.util.find_spec("horovod") is not None


def launcher(name: str) -> str:
    """The launcher ``name`` (horovodrun, mpirun) of this Python's environment (beside its
    interpreter, where a virtual environment's scripts are, activated or not), else from PATH;
    a :class:`LaunchError` naming it when neither has it."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        what = ("Horovod's launcher (installed with Horovod)" if name == "horovodrun" else
                "Open MPI's launcher (--controller mpi, --transport mpi)")
        raise LaunchError(f"{name} is not beside {sys.executable} nor on PATH: it is {what}")
    return found


def _job_processes(token: str) -> list[psutil.Process]:
    procs = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.pid != os.getpid() and proc.environ().get(_TOKEN_VAR) == token:
                procs.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return procs


def kill_job(root: subprocess.Popen, token: str) -> None:
    """Kill the launcher, everything below it, and anything else carrying the job token."""
    victims: dict[int, psutil.Process] = {}
    try:
        parent = psutil.Process(root.pid)
        victims[parent.pid] = parent
        for child in parent.children(recursive=True):
            victims[child.pid] = child
    except psutil.NoSuchProcess:
        pass
    for proc in _job_processes(token):
        victims[proc.pid] = proc
    for proc in victims.values():
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(list(victims.values()), timeout=10)
    try:
        root.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover
        pass


def launch_command(np: int, controller: str, argv: list[str], hosts: Optional[str] = None) -> list[str]:
    """The command line that starts ``argv`` on ``np`` ranks with ``controller``.

    ``hosts`` ("h1:4,h2:4") runs on a real cluster through horovodrun; default: this machine.
    """
    if controller == "gloo":
        return [launcher("horovodrun"), "-np", str(np), "-H", hosts or f"localhost:{np}",
                "--gloo"] + argv
    if controller == "mpi":
        if hosts:
            return [launcher("horovodrun"), "-np", str(np), "-H", hosts, "--mpi"] + argv
        return [launcher("mpirun"), "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
                "-np", str(np), "-x", "PYTHONPATH", "-x", _TOKEN_VAR, "-x", "HOROVOD_CONTROLLER",
                "-x", "HOROVOD_CPU_OPERATIONS", "-x", "OMP_NUM_THREADS"] + argv
    raise ValueError(f"controller must be one of {CONTROLLERS}, got {controller!r}")


def import_root(module: str) -> Optional[Path]:
    """The sys.path folder from which this process imports ``module`` ("tests.workers" -> the
    folder holding tests/), or None if it cannot be found."""
    try:
        spec = importlib.util.find_spec(module.split(".")[0])
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0]).resolve().parent
    return Path(spec.origin).resolve().parent if spec.origin else None


def _python_path(extra_roots: Sequence[Path]) -> list[str]:
    """Folders the ranks need on PYTHONPATH: ``extra_roots`` and this package's own folder,
    except site-packages folders, which every Python of this installation has anyway."""
    sites = {Path(p).resolve() for p in site.getsitepackages() + [site.getusersitepackages()]}
    paths = []
    for root in [*extra_roots, REPO_ROOT]:
        if root.resolve() not in sites and str(root) not in paths:
            paths.append(str(root))
    return paths


def job_environment(token: str, controller: str = "gloo", extra: Optional[dict] = None,
                    import_roots: Sequence[Path] = ()) -> dict:
    """Environment for a job's ranks: this process's, plus ``extra``, the job token (so
    :func:`kill_job` finds every process), this Python's bin folder on PATH (horovodrun,
    mpirun's python), ``import_roots`` and this package's folder on PYTHONPATH (unless
    installed in site-packages), one torch thread per rank, and Horovod's controller settings."""
    env = dict(os.environ)
    env.update(extra or {})
    env[_TOKEN_VAR] = token
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = os.pathsep.join(_python_path(import_roots)
                                        + [p for p in [env.get("PYTHONPATH", "")] if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("HOROVOD_CPU_OPERATIONS", controller)
    if controller == "mpi":
        env["HOROVOD_CONTROLLER"] = "mpi"
    return env


def run_command(argv: list[str], np: int = 2, controller: str = "gloo",
                timeout: Optional[float] = None, log: Optional[IO] = None,
                env: Optional[dict] = None, hosts: Optional[str] = None,
                cwd: Optional[str] = None, import_roots: Sequence[Path] = ()) -> Optional[int]:
    """Run the command ``argv`` on ``np`` ranks (horovodrun or mpirun) and wait for it.

    Output goes to ``log`` (a binary file; default: this process's stdout and stderr). Returns
    the launcher's exit status, or None if it ran past ``timeout`` seconds. Every process of the
    job is killed before this returns, so nothing outlives it.
    """
    token = uuid.uuid4().hex
    return wait_for_job(launch_command(np, controller, argv, hosts), token,
                        job_environment(token, controller, env, import_roots), timeout, log, cwd)


def wait_for_job(cmd: list[str], token: str, env: dict, timeout: Optional[float],
                 log: Optional[IO] = None, cwd: Optional[str] = None) -> Optional[int]:
    """Start the launcher ``cmd`` in a session of its own (``env`` carries ``token``) and wait
    for it: its exit status, or None past ``timeout`` seconds. Output goes to ``log`` (default:
    this process's). Every process carrying the token is killed before this returns."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=None if log is None else subprocess.STDOUT,
                            env=env, cwd=cwd, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        kill_job(proc, token)


@dataclass
class JobResult:
    """Each rank's return value in rank order, the job's wall time and, on an emulated cluster,
    the emulator's record of the run (per-rank bytes on the wire)."""

    results: list
    wall_seconds: float
    cluster_run: Any = None


def run_ranks(target: str, np: int = 2, controller: str = "gloo", kwargs: Optional[dict] = None,
              timeout: float = 180.0, env: Optional[dict] = None) -> list[Any]:
    """Run ``target`` ("module:function") on ``np`` ranks; return the results in rank order.

    Args:
        target: importable "module:function"; called as ``function(**kwargs)`` after hvd.init().
        np: number of ranks.
        controller: "gloo" (horovodrun --gloo) or "mpi" (mpirun, Horovod's MPI controller).
        kwargs: picklable keyword arguments for the function.
        timeout: seconds for the whole job, launch included; past it every process is killed.
        env: extra environment variables for the ranks.
    Raises:
        RankFailure: a rank raised, exited without a result, or the job timed out.
    """
    return run_job(target, np, controller, kwargs, timeout, env).results


def run_job(target: str, np: int = 2, controller: str = "gloo", kwargs: Optional[dict] = None,
            timeout: float = 180.0, env: Optional[dict] = None, cluster=None,
            hosts: Optional[str] = None, shared_dir: Optional[str] = None) -> JobResult:
    """:func:`run_ranks` with a choice of where the ranks run.

    Args:
        cluster: a started :class:`hvd_onebit_tools.cluster.EmulatedCluster` to run on (gloo only).
        hosts: "h1:4,h2:4": a real cluster through horovodrun; the ranks exchange results through
            files, so ``shared_dir`` must then be a folder every host sees at the same path.
        shared_dir: where the job's scratch folder is made (default: the system temp folder).
    """
    if cluster is not None and (hosts or controller != "gloo"):
        raise ValueError("an emulated cluster runs Horovod over gloo on its own hosts")
    if not horovod_installed():
        raise LaunchError(NO_HOROVOD.format(python=sys.executable))
    workdir = Path(tempfile.mkdtemp(prefix="hvd_onebit_job_", dir=shared_dir))
    roots = [r for r in [import_root(target.split(":")[0])] if r is not None]
    try:
        (workdir / "kwargs.pkl").write_bytes(pickle.dumps(kwargs or {}))
        argv = [sys.executable, "-m", "hvd_onebit_tools.cluster.jobs", target, str(workdir)]
        log_path = workdir / "output.log"
        start = time.monotonic()
        cluster_run = None
        if cluster is not None:
            job_env = job_environment(uuid.uuid4().hex, controller, env, roots)
            cluster_run = cluster.run(argv, env=job_env, timeout=timeout, cwd=os.getcwd())
            rc, timed_out = cluster_run.returncode, cluster_run.timed_out
            log_path.write_text("\n".join(f"--- rank {r.rank} output:\n{r.output}"
                                          for r in cluster_run.ranks))
        else:
            with open(log_path, "wb") as log:
                rc = run_command(argv, np, controller, timeout, log, env, hosts,
                                 import_roots=roots)
            timed_out = rc is None
        wall = time.monotonic() - start
        results = _collect(workdir, np, rc, timed_out, timeout, target, controller)
        return JobResult(results=results, wall_seconds=wall, cluster_run=cluster_run)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def launcher_error(output: str) -> str:
    """The lines of a launcher's output that say why it failed: what it printed before its
    traceback (e.g. ssh's complaint) and the traceback's last line (the error), or its last
    line."""
    lines = [line.rstrip() for line in output.splitlines() if line.strip()]
    if "Traceback (most recent call last):" not in lines:
        return "\n".join(lines[-3:]) or "(no output)"
    before = lines[:lines.index("Traceback (most recent call last):")]
    return "\n".join(before[-3:] + lines[-1:])


def _collect(workdir: Path, np: int, rc, timed_out: bool, timeout: float, target: str,
             controller: str) -> list[Any]:
    if rc not in (0, None) and not timed_out and not (workdir / STARTED).exists():
        output = (workdir / "output.log").read_text(errors="replace")
        raise LaunchError(f"{target} on {np} ranks ({controller}): the launch failed before any "
                          f"rank started (the launcher exited with {rc}):\n"
                          + launcher_error(output))
    results, problems = [], []
    for rank in range(np):
        err = workdir / f"rank{rank}.err"
        res = workdir / f"rank{rank}.pkl"
        if err.exists():
            problems.append(f"--- rank {rank} raised:\n{err.read_text()}")
        elif res.exists():
            results.append(pickle.loads(res.read_bytes()))
            continue
        else:
            problems.append(f"--- rank {rank} returned no result")
    if timed_out:
        problems.insert(0, f"job timed out after {timeout:.0f}s; every process was killed")
    elif rc != 0 and not problems:
        problems.append(f"launcher exited with {rc}")
    if problems:
        output = (workdir / "output.log").read_text(errors="replace")
        raise RankFailure(f"{target} on {np} ranks ({controller}) failed:\n" + "\n".join(problems)
                          + f"\n--- job output (last 6000 chars):\n{output[-6000:]}")
    return results


def _rank_main(target: str, workdir: str) -> int:
    """Entry point inside each rank (``python -m hvd_onebit_tools.cluster.jobs target workdir``)."""
    import importlib

    out = Path(workdir)
    (out / STARTED).touch()
    import horovod.torch as hvd
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    hvd.init()
    rank = hvd.rank()
    try:
        module_name, func_name = target.split(":")
        func = getattr(importlib.import_module(module_name), func_name)
        kwargs = pickle.loads((out / "kwargs.pkl").read_bytes())
        result = func(**kwargs)
        tmp = out / f"rank{rank}.pkl.tmp"
        tmp.write_bytes(pickle.dumps(result))
        tmp.rename(out / f"rank{rank}.pkl")
        return 0
    except BaseException:  # noqa: BLE001 - every failure must reach the parent test
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        sys.stderr.write(f"[rank {rank}] " + traceback.format_exc())
        sys.stderr.flush()
        # Exit hard: a rank stuck in Horovod's shutdown would turn one failure into a hang.
        os._exit(1)


if __name__ == "__main__":
    code = _rank_main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.exit(code)
