"""`hvd-onebit check`: what this environment will use, each part OK or the fix, in the spirit of
`horovodrun --check-build`. Every probe returns a :class:`Finding`; :func:`findings` runs them
all, :func:`report` prints them and which faces can run here: the Horovod face (horovodrun)
needs Horovod, the DDP face (torchrun) torch.distributed, and a part one face needs does not
hold the other back."""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from typing import Callable, Dict, List, Tuple

OK, FIX, INFO = "OK", "FIX", "--"
HOROVOD, DDP = "horovod", "ddp"
FACES = {HOROVOD: "the Horovod face (horovodrun)", DDP: "the DDP face (torchrun)"}
SHM_ADVISED = 1 << 30  # bytes free in /dev/shm below which hierarchical's segments may not fit


@dataclasses.dataclass(frozen=True)
class Finding:
    """One part of the environment: its name, OK / FIX / -- (not needed here), what was found,
    the fix when there is one, and the faces (:data:`FACES`) that cannot run without it."""

    part: str
    status: str
    found: str
    fix: str = ""
    needed_by: Tuple[str, ...] = ()


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
    return Finding("torch", OK, f"{torch.__version__}, device {device}",
                   needed_by=tuple(FACES))


def horovod_install() -> str:
    """How to build Horovod against the installed torch: 0.28.1, its last release, builds
    from PyPI against torch before 2.1, and from its sdist with two fixes from 2.1 on."""
    import torch

    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 1):
        return "HOROVOD_WITH_PYTORCH=1 pip install --no-cache-dir --no-build-isolation horovod"
    return ("build Horovod 0.28.1 from its sdist with the two fixes torch 2.1 and later need "
            "(C++17 in CMakeLists.txt and horovod/torch/CMakeLists.txt; "
            "CMAKE_POLICY_VERSION_MINIMUM=3.5 HOROVOD_WITH_PYTORCH=1 pip install "
            "--no-build-isolation --no-cache-dir .): the commands are in the repository's "
            "docs/install.md, section Horovod")


def check_horovod() -> Finding:
    """Horovod and its controllers: the Horovod face's, which the DDP face does without."""
    install = horovod_install()
    if importlib.util.find_spec("horovod") is None:
        return Finding("horovod", INFO, "not installed (the Horovod face needs it; the DDP face "
                       "does not)", f"for the Horovod face: {install}", needed_by=(HOROVOD,))
    try:
        import horovod.torch as hvd
    except Exception as exc:  # noqa: BLE001 - any import failure is a broken build
        return Finding("horovod", FIX, f"{_version('horovod')} does not import with torch: "
                       f"{exc}", f"rebuild Horovod against this torch: {install}",
                       needed_by=(HOROVOD,))
    controllers = [name for name, built in (("mpi", hvd.mpi_built()),
                                            ("gloo", hvd.gloo_built())) if built]
    ops = [name for name, built in (("nccl", hvd.nccl_built()),) if built]
    found = f"{_version('horovod')}: controllers {', '.join(controllers) or 'none'}"
    found += f"; GPU ops {', '.join(ops)}" if ops else ""
    if not controllers:
        return Finding("horovod", FIX, found, "rebuild Horovod with HOROVOD_WITH_GLOO=1 or "
                       "HOROVOD_WITH_MPI=1", needed_by=(HOROVOD,))
    return Finding("horovod", OK, found, needed_by=(HOROVOD,))


def check_torch_distributed() -> Finding:
    """torch.distributed's backends: the DDP face's (the Horovod face's compressed steps use
    them where they are there, Horovod's own collectives where not)."""
    import torch.distributed as dist

    if not dist.is_available():
        return Finding("torch.distributed", FIX, "not in this torch build",
                       "a torch build with distributed support (PyPI's wheels have it)",
                       needed_by=(DDP,))
    backends = [b for b, ok in (("gloo", dist.is_gloo_available()),
                                ("nccl", dist.is_nccl_available()),
                                ("mpi", dist.is_mpi_available())) if ok]
    if not backends:
        return Finding("torch.distributed", FIX, "no backend (gloo, nccl or mpi)",
                       "a torch build with Gloo (PyPI's wheels have it)", needed_by=(DDP,))
    return Finding("torch.distributed", OK, f"backends {', '.join(backends)}", needed_by=(DDP,))


def check_native() -> Finding:
    from hvd_onebit.kernels.native_loader import FIX as NATIVE_FIX, load_native

    native = load_native()
    if native.module is not None:
        return Finding("native kernels", OK, f"{native.origin} (CPU sign compression fused in "
                       "C++)")
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


PROBES: List[Callable[[], Finding]] = [check_torch, check_horovod, check_torch_distributed,
                                       check_native, check_triton, check_shm,
                                       check_mpi_thread_level]


def findings() -> List[Finding]:
    return [probe() for probe in PROBES]


def face_blocking(found: List[Finding]) -> Dict[str, List[str]]:
    """Each face's parts that are not OK: the face runs here when its list is empty."""
    return {face: [f.part for f in found if face in f.needed_by and f.status != OK]
            for face in FACES}


def blocking(found: List[Finding]) -> List[str]:
    """What keeps every face from running here (empty when one can run)."""
    faces = face_blocking(found)
    if any(not parts for parts in faces.values()):
        return []
    return list(dict.fromkeys(part for parts in faces.values() for part in parts))


def readiness(found: List[Finding]) -> str:
    """The report's last line: which faces can run here, and what the others need."""
    faces = face_blocking(found)
    ready = [FACES[face] for face, parts in faces.items() if not parts]
    others = [f"{FACES[face]} needs {', '.join(parts)}" for face, parts in faces.items()
              if parts]
    if not ready:
        return f"not ready: {'; '.join(others)}"
    return "; ".join([f"ready: {' and '.join(ready)}"] + others)


def report(found: List[Finding]) -> str:
    """One line per finding, the fix under it; the last line says which faces can run."""
    width = max(len(f.part) for f in found)
    lines = []
    for f in found:
        lines.append(f"{f.part:<{width}}  {f.status:<3}  {f.found}")
        if f.fix:
            lines.append(f"{'':<{width}}       fix: {f.fix}")
    lines.append(readiness(found))
    return "\n".join(lines)


def report_dict(found: List[Finding]) -> dict:
    """The report as `check --json` prints it: whether a job can run (on either face), what
    blocks every face, each face's readiness and blocking parts, and each finding's fields."""
    faces = face_blocking(found)
    blocked = blocking(found)
    return {"ready": not blocked, "blocking": blocked,
            "faces": {face: {"ready": not parts, "blocking": parts}
                      for face, parts in faces.items()},
            "parts": [dataclasses.asdict(f) for f in found]}
