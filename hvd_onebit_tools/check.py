"""`hvd-onebit check`: what this environment will use, each part OK or the fix, in the spirit of
`horovodrun --check-build`. Every probe returns a :class:`Finding`; :func:`findings` runs them
all, :func:`report` prints them."""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from typing import Callable, List

OK, FIX, INFO = "OK", "FIX", "--"
SHM_ADVISED = 1 << 30  # bytes free in /dev/shm below which hierarchical's segments may not fit


@dataclasses.dataclass(frozen=True)
class Finding:
    """One part of the environment: its name, OK / FIX / -- (not needed here), what was found,
    the fix when there is one, and whether a job cannot run without it (``required``)."""

    part: str
    status: str
    found: str
    fix: str = ""
    required: bool = False


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return ""


def check_torch() -> Finding:
    import torch

    if torch.cuda.is_available():
        device = f"cuda ({torch.cuda.device_count()} x {torch.cuda.get_device_name(0)})"
    else:
        device = "cpu (no CUDA device)"
    return Finding("torch", OK, f"{torch.__version__}, device {device}", required=True)


def check_distributed() -> Finding:
    """Horovod and its controllers, else torch.distributed's backends."""
    if importlib.util.find_spec("horovod") is not None:
        try:
            import horovod.torch as hvd
        except Exception as exc:  # noqa: BLE001 - any import failure is a broken build
            return Finding("horovod", FIX, f"{_version('horovod')} does not import with torch: "
                           f"{exc}", "rebuild Horovod against this torch: HOROVOD_WITH_PYTORCH=1 "
                           "pip install --no-cache-dir --no-build-isolation horovod",
                           required=True)
        controllers = [name for name, built in (("mpi", hvd.mpi_built()),
                                                ("gloo", hvd.gloo_built())) if built]
        ops = [name for name, built in (("nccl", hvd.nccl_built()),) if built]
        found = f"{_version('horovod')}: controllers {', '.join(controllers) or 'none'}"
        found += f"; GPU ops {', '.join(ops)}" if ops else ""
        if not controllers:
            return Finding("horovod", FIX, found, "rebuild Horovod with HOROVOD_WITH_GLOO=1 or "
                           "HOROVOD_WITH_MPI=1", required=True)
        return Finding("horovod", OK, found, required=True)
    import torch.distributed as dist

    if not dist.is_available():
        return Finding("distributed", FIX, "no Horovod, and this torch has no torch.distributed",
                       "a torch with distributed support, or Horovod built against this torch: "
                       "HOROVOD_WITH_PYTORCH=1 pip install --no-build-isolation horovod",
                       required=True)
    backends = [b for b, ok in (("gloo", dist.is_gloo_available()),
                                ("nccl", dist.is_nccl_available()),
                                ("mpi", dist.is_mpi_available())) if ok]
    return Finding("distributed", OK, "no Horovod (the DDP face needs none); torch.distributed "
                   f"with {', '.join(backends) or 'no backend'}", required=True)


def check_native() -> Finding:
    from hvd_onebit.kernels.native_loader import FIX as NATIVE_FIX, load_native

    native = load_native()
    if native.module is not None:
        return Finding("native kernels", OK, f"{native.origin} (CPU sign compression fused in "
                       "C++)", required=False)
    return Finding("native kernels", FIX, f"none: CPU runs use the slower torch kernels "
                   f"({native.reason})", NATIVE_FIX)


def check_triton() -> Finding:
    import torch

    version = _version("triton")
    cuda = torch.cuda.is_available()
    if version:
        return Finding("triton", OK, f"{version} (the CUDA kernels)")
    if cuda:
        return Finding("triton", FIX, "not installed: CUDA runs use the slower torch kernels",
                       "pip install triton")
    return Finding("triton", INFO, "not installed (needed for CUDA tensors only)")


def check_shm() -> Finding:
    """Where the hierarchical collective's segments go (``HVD_ONEBIT_SHM_DIR``, else
    /dev/shm), as the library resolves it."""
    from hvd_onebit.transport.shared_memory import shm_dir

    where = shm_dir()
    network = "experimental=hvd_onebit.Experimental(intra_node='network')"
    try:
        st = os.statvfs(where)
    except OSError as exc:
        return Finding(where, FIX, f"not usable ({exc}): hierarchical's shared memory inside a "
                       "node is off", f"mount a tmpfs there, set HVD_ONEBIT_SHM_DIR to one, or "
                       f"pass {network}")
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    found = f"{size / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free (hierarchical, inside a node)"
    if free < SHM_ADVISED:
        return Finding(where, FIX, found, "enlarge it (docker run --shm-size=2g), set "
                       f"HVD_ONEBIT_SHM_DIR to a larger tmpfs, or pass {network}")
    return Finding(where, OK, found)


def check_mpi_thread_level(timeout: float = 60.0) -> Finding:
    """The thread level MPI grants when asked for MPI_THREAD_MULTIPLE, read in a child process
    (initialising MPI here would tie this process to it)."""
    if importlib.util.find_spec("mpi4py") is None:
        return Finding("MPI thread level", INFO, "mpi4py not installed (needed for "
                       "transport='mpi' only: pip install mpi4py)")
    code = ("import mpi4py; mpi4py.rc.thread_level = 'multiple'; from mpi4py import MPI; "
            "print(MPI.Query_thread() == MPI.THREAD_MULTIPLE, MPI.Query_thread())")
    # A child of a rank must not join the rank's MPI job: without the launcher's variables it
    # initialises MPI alone (a singleton).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return Finding("MPI thread level", FIX, f"MPI did not initialise in {timeout:.0f} s",
                       "check the MPI installation (mpirun -np 1 hostname)")
    words = out.stdout.split()
    if out.returncode != 0 or len(words) != 2:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return Finding("MPI thread level", FIX, f"MPI does not initialise: {tail}",
                       "install an MPI and rebuild mpi4py against it")
    if words[0] == "True":
        return Finding("MPI thread level", OK, "MPI_THREAD_MULTIPLE")
    return Finding("MPI thread level", FIX, f"level {words[1]}, below MPI_THREAD_MULTIPLE",
                   "use an MPI built with thread support, or transport='horovod'")


PROBES: List[Callable[[], Finding]] = [check_torch, check_distributed, check_native,
                                       check_triton, check_shm, check_mpi_thread_level]


def findings() -> List[Finding]:
    return [probe() for probe in PROBES]


def blocking(found: List[Finding]) -> List[str]:
    """The parts without which a job cannot run here."""
    return [f.part for f in found if f.required and f.status == FIX]


def report(found: List[Finding]) -> str:
    """One line per finding, the fix under it; the last line says whether a job can run."""
    width = max(len(f.part) for f in found)
    lines = []
    for f in found:
        lines.append(f"{f.part:<{width}}  {f.status:<3}  {f.found}")
        if f.fix:
            lines.append(f"{'':<{width}}       fix: {f.fix}")
    blocked = blocking(found)
    lines.append(f"not ready: {', '.join(blocked)}" if blocked else "ready")
    return "\n".join(lines)


def report_dict(found: List[Finding]) -> dict:
    """The report as `check --json` prints it: whether a job can run, what blocks it, and each
    finding's fields."""
    blocked = blocking(found)
    return {"ready": not blocked, "blocking": blocked,
            "parts": [dataclasses.asdict(f) for f in found]}
