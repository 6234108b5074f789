"""DDP jobs on the emulated cluster, launched as torchrun launches them on a multi-node cluster:
one ``python -m torch.distributed.run --nnodes=N --node_rank=k --nproc_per_node=L
--master_addr=<node 0's address> --master_port=P`` per node, inside that node's namespaces
(:meth:`~hvd_onebit_tools.cluster.launcher.EmulatedCluster.run_per_node`). torchrun's own
agents then meet at node 0 (its static rendezvous) and start the node's L ranks with torchrun's
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``); Gloo is kept on the emulated interface, so the traffic
between nodes crosses the shaped links and the traffic inside a node stays on it.

:func:`run_torchrun` runs a script (or ``-m module``) that way; :func:`run_torchrun_job` runs a
target function in every rank (``python -m hvd_onebit_tools.cluster.torchrun TARGET WORKDIR``:
Gloo set up, then the target; its return value pickled back, as
:mod:`~hvd_onebit_tools.cluster.jobs` does for Horovod jobs). Nothing here imports Horovod, and
with ``without_horovod`` the ranks cannot import it either.
"""
from __future__ import annotations

import os
import pickle
import random
import shutil
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from .network import IFACE

#: Where the ports torchrun's rendezvous may use are drawn from (node 0's namespace is the
#: cluster's own, so nothing else listens there).
PORTS = (20000, 40000)
_WITHOUT_HOROVOD = "--without-horovod"


def torchrun_commands(cluster, argv: Sequence[str], port: int) -> list[list[str]]:
    """Each node's torchrun command line for ``argv`` (a script and its arguments, or ``-m
    module ...``): ``cluster.ranks_per_node`` ranks per node, node 0 the rendezvous."""
    return [[sys.executable, "-m", "torch.distributed.run", f"--nnodes={cluster.nodes}",
             f"--node_rank={k}", f"--nproc_per_node={cluster.ranks_per_node}",
             f"--master_addr={cluster.hosts[0].address}", f"--master_port={port}",
             "--max_restarts=0", *argv] for k in range(cluster.nodes)]


def torchrun_command(np: int, argv: Sequence[str], max_restarts: int = 0) -> list[str]:
    """The command line that starts ``argv`` (a script and its arguments, or ``-m module ...``)
    on ``np`` local ranks, as a user starts a DDP job on one machine; torchrun starts the whole
    group again up to ``max_restarts`` times when a worker fails."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={np}", f"--max-restarts={max_restarts}", *argv]


def run_torchrun(cluster, argv: Sequence[str], env: Optional[Mapping[str, str]] = None,
                 timeout: Optional[float] = None, cwd: str | os.PathLike | None = None,
                 port: Optional[int] = None, **options):
    """Run ``argv`` under one torchrun per node of the started ``cluster`` and wait; the
    :class:`~hvd_onebit_tools.cluster.results.RunResult` has one entry per node (its
    torchrun's exit status and output, the node's link bytes). ``env`` is added to this
    process's environment; Gloo is kept on the emulated interface unless ``env`` says
    otherwise. ``options``: ``on_output``, ``kill_grace`` as for
    :meth:`~hvd_onebit_tools.cluster.launcher.EmulatedCluster.run`."""
    port = port if port is not None else random.randint(*PORTS)
    job_env = {"GLOO_SOCKET_IFNAME": IFACE, "PYTHONUNBUFFERED": "1", **(env or {})}
    return cluster.run_per_node(torchrun_commands(cluster, argv, port), env=job_env,
                                timeout=timeout, cwd=cwd, **options)


def run_torchrun_job(target: str, cluster, kwargs: Optional[dict] = None,
                     timeout: float = 300.0, env: Optional[dict] = None,
                     without_horovod: bool = True, np: Optional[int] = None):
    """Run ``target`` ("module:function", called as ``function(**kwargs)`` once Gloo is set up)
    in every rank of a torchrun job on ``cluster``, or, with ``cluster=None``, on ``np`` ranks
    of this machine (one ``torchrun --standalone``); a
    :class:`~hvd_onebit_tools.cluster.jobs.JobResult` with the results in rank order and the
    emulator's record (``cluster_run``, None on this machine). ``without_horovod``:
    ``import horovod`` fails in the ranks, as where Horovod is not installed. Raises
    :class:`~hvd_onebit_tools.cluster.jobs.RankFailure` when a rank raised, died or the job ran
    past ``timeout``."""
    from .jobs import JobResult, _collect, import_root, job_environment, wait_for_job

    workdir = Path(tempfile.mkdtemp(prefix="hvd_onebit_torchrun_"))
    roots = [r for r in [import_root(target.split(":")[0])] if r is not None]
    try:
        (workdir / "kwargs.pkl").write_bytes(pickle.dumps(kwargs or {}))
        argv = ["-m", "hvd_onebit_tools.cluster.torchrun", target, str(workdir)]
        if without_horovod:
            argv.append(_WITHOUT_HOROVOD)
        start = time.monotonic()
        token = uuid.uuid4().hex
        job_env = job_environment(token, extra=env, import_roots=roots)
        if cluster is None:
            with open(workdir / "output.log", "wb") as log:
                rc = wait_for_job(torchrun_command(np, argv), token, job_env, timeout, log,
                                  os.getcwd())
            results = _collect(workdir, np, rc, rc is None, timeout, target, "torchrun")
            return JobResult(results=results, wall_seconds=time.monotonic() - start)
        run = run_torchrun(cluster, argv, timeout=timeout, cwd=os.getcwd(), env=job_env)
        (workdir / "output.log").write_text("\n".join(
            f"--- node {r.rank} (torchrun) output:\n{r.output}" for r in run.ranks))
        results = _collect(workdir, cluster.np, run.returncode, run.timed_out, timeout, target,
                           "torchrun on the emulated cluster")
        return JobResult(results=results, wall_seconds=time.monotonic() - start,
                         cluster_run=run)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def block_horovod() -> None:
    """Make ``import horovod`` fail in this process, as where Horovod is not installed."""
    for name in [n for n in sys.modules if n == "horovod" or n.startswith("horovod.")]:
        del sys.modules[name]
    sys.modules["horovod"] = None  # type: ignore[assignment]


def rank_main(target: str, workdir: str, without_horovod: bool) -> int:
    """One rank, as torchrun started it: Gloo from torchrun's environment, then ``target``."""
    if without_horovod:
        block_horovod()
    import importlib

    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(workdir)
    try:
        module_name, func_name = target.split(":")
        func = getattr(importlib.import_module(module_name), func_name)
        result: Any = func(**pickle.loads((out / "kwargs.pkl").read_bytes()))
        tmp = out / f"rank{rank}.pkl.tmp"
        tmp.write_bytes(pickle.dumps(result))
        tmp.rename(out / f"rank{rank}.pkl")
        # a rank whose target needed no collective must not close its connections while a
        # peer is still making its own in init_process_group ("Connection closed by peer")
        dist.barrier()
        dist.destroy_process_group()
        return 0
    except BaseException:  # noqa: BLE001 - every failure must reach the caller
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        sys.stderr.write(f"[rank {rank}] " + traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)  # a rank stuck in a collective's shutdown would turn a failure into a hang


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1], sys.argv[2], _WITHOUT_HOROVOD in sys.argv[3:]))
