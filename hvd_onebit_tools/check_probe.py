"""`hvd-onebit check --probe` (or ``--np N``, which also checks the job's size), run on every
rank of a job (``horovodrun -np N hvd-onebit check --probe ...``, or ``torchrun
--nproc_per_node N -m hvd_onebit_tools.cli check --probe ...``): a
short allreduce probe measures the link between the ranks, through Horovod under horovodrun and
through torch.distributed under torchrun (NCCL on a GPU, Gloo otherwise), and rank 0 prices 1-bit
Adam on it with the scale model (:mod:`hvd_onebit_tools.bench.predict`) for the given
parameters and compute per step."""
from __future__ import annotations

import dataclasses
import os
import time
from typing import List, Optional

PROBE_ELEMENTS = 4 << 20  # float32 elements per probe allreduce: large enough to be bandwidth-bound
PROBE_REPEATS = 5
HOROVOD_LAUNCHED = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
TORCHRUN_LAUNCHED = "TORCHELASTIC_RUN_ID"  # set by torchrun on every rank it starts
# the job's size, as each launcher says it: torchrun, horovodrun (Gloo), Open MPI, MPICH
LAUNCHED_SIZES = ("WORLD_SIZE", "HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
# a rank's place on its node, as each launcher says it (torchrun's LOCAL_RANK first under
# torchrun: srun's SLURM_LOCALID is then the torchrun agent's, which every rank inherits)
LOCAL_RANKS = ("HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
               "MV2_COMM_WORLD_LOCAL_RANK", "PMIX_LOCAL_RANK", "SLURM_LOCALID")


@dataclasses.dataclass(frozen=True)
class LinkProbe:
    """What the probe measured: ranks, the median time of an fp32 allreduce of ``elements``, and
    the bus rate it implies (a ring allreduce moves ``2 (n-1)/n`` of the buffer per rank);
    ``rank`` is this process's, ``via`` what carried the allreduce, ``per_node`` the ranks on
    each node (the launcher's local size; None: the nodes have different numbers of ranks),
    ``device`` where the probed buffer lived ("cuda": GPU memory, as the job's gradients),
    ``transport`` what the Horovod face's ``transport="auto"`` takes in this job, in words
    (None under torchrun)."""

    ranks: int
    elements: int
    seconds: float
    rank: int = 0
    via: str = "Horovod"
    per_node: Optional[int] = 1
    device: str = "cpu"
    transport: Optional[str] = None

    @property
    def bus_bps(self) -> float:
        moved = 2 * (self.ranks - 1) / self.ranks * 4 * self.elements
        return 8 * moved / self.seconds

    @property
    def ranks_per_node(self) -> int:
        """The ranks that share a node's link in the prediction: the local size when the job
        spans several nodes of that many ranks, else 1 (on one node, every rank is priced with
        a link of its own: the probe crossed no link between nodes)."""
        L = self.per_node
        return L if L is not None and 1 < L < self.ranks and self.ranks % L == 0 else 1

    def layout(self) -> str:
        """The job's ranks as the prediction takes them."""
        if self.ranks_per_node > 1:
            return f"{self.ranks} ranks ({self.ranks // self.ranks_per_node} nodes of " \
                   f"{self.ranks_per_node})"
        if self.per_node == self.ranks:
            return f"{self.ranks} ranks (one node; priced as ranks with links of their own)"
        if self.per_node is None:
            return (f"{self.ranks} ranks (nodes of different sizes; priced as ranks with links "
                    "of their own)")
        return f"{self.ranks} ranks"


def launcher() -> Optional[str]:
    """"horovod" or "torchrun", whichever started this process, or None outside a job."""
    if any(k in os.environ for k in HOROVOD_LAUNCHED):
        return "horovod"
    return "torchrun" if TORCHRUN_LAUNCHED in os.environ else None


def launched() -> bool:
    return launcher() is not None


def reports_for_its_node() -> bool:
    """Whether this process prints the environment's report: outside a job, or as its node's
    first rank under a launcher (one report per node, where a job's ranks would print one
    each)."""
    if not launched():
        return True
    keys = ("LOCAL_RANK",) if TORCHRUN_LAUNCHED in os.environ else LOCAL_RANKS
    local = next((os.environ[key] for key in keys if key in os.environ), "0")
    return local.strip() == "0"


def _median_time(allreduce, repeats: int) -> float:
    allreduce("warmup")
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        allreduce(str(i))
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


# How long a rank that stops on an error before the job's first collective stays, its error
# printed: the launcher ends every rank once one exits with an error, and a rank still starting
# (importing torch) would be ended before it printed its own.
ERROR_LINGER_S = 5.0


def stop_together(exc) -> None:
    """Print ``exc`` (a :class:`click.ClickException`) now, wait :data:`ERROR_LINGER_S` where
    the launcher started other ranks, then exit with its code."""
    import sys

    exc.show()
    sys.stderr.flush()
    if launched_size() > 1:
        time.sleep(ERROR_LINGER_S)
    raise SystemExit(exc.exit_code)


def launched_size() -> int:
    """The ranks of the job, as the launcher that started it says (1 where none does): a
    variable another launcher sets, left in the environment, is not read."""
    names = {"torchrun": LAUNCHED_SIZES[:1], "horovod": LAUNCHED_SIZES[1:]}.get(launcher(),
                                                                            LAUNCHED_SIZES)
    for name in names:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 1


class JobSizeError(ValueError):
    """``--np`` is not the size of the job it runs in."""


def _check_size(np_: Optional[int], size: int) -> None:
    if np_ is not None and size != np_:
        raise JobSizeError(f"--np {np_} but this job has {size} ranks (horovodrun -np {size} "
                           f"hvd-onebit check --probe ...: the ranks are the job's)")


def _probe_torch(np_: Optional[int], elements: int, repeats: int) -> LinkProbe:
    """Under torchrun: torch.distributed's allreduce (NCCL on a GPU, Gloo otherwise)."""
    import torch
    import torch.distributed as dist

    # a GPU of its own for each local rank (NCCL takes no two ranks on one device)
    cuda = (torch.cuda.is_available()
            and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= torch.cuda.device_count())
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    ours = not dist.is_initialized()
    if ours:
        dist.init_process_group("nccl" if cuda else "gloo")
    size, rank = dist.get_world_size(), dist.get_rank()
    _check_size(np_, size)
    x = torch.ones(elements, device="cuda" if cuda else "cpu")

    def allreduce(_name):
        dist.all_reduce(x)
        if cuda:
            torch.cuda.synchronize()
    seconds, via = _median_time(allreduce, repeats), f"torch.distributed ({dist.get_backend()})"
    sizes = [None] * size  # every node's ranks, as each rank's launcher counts them
    dist.all_gather_object(sizes, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if ours:  # a process that exits with its group alive can abort in Gloo's threads
        dist.destroy_process_group()
    return LinkProbe(size, elements, seconds, rank, via, one_size(sizes),
                     "cuda" if cuda else "cpu")


def _probe_horovod(np_: Optional[int], elements: int, repeats: int) -> LinkProbe:
    import horovod.torch as hvd
    import torch

    hvd.init()
    _check_size(np_, hvd.size())
    # GPU memory, as the job's gradients, where Horovod was built for it and each local rank
    # has a GPU of its own; else host memory
    cuda = (torch.cuda.is_available() and (hvd.cuda_built() or hvd.rocm_built())
            and hvd.local_size() <= torch.cuda.device_count())
    if cuda:
        torch.cuda.set_device(hvd.local_rank())
    x = torch.ones(elements, device="cuda" if cuda else "cpu")

    def allreduce(name):
        hvd.allreduce(x, name=f"hvd_onebit_check.{name}")
        if cuda:
            torch.cuda.synchronize()
    seconds = _median_time(allreduce, repeats)
    sizes = hvd.allgather(torch.tensor([hvd.local_size()]), name="hvd_onebit_check.local_sizes")
    return LinkProbe(hvd.size(), elements, seconds, hvd.rank(), "Horovod",
                     one_size(sizes.tolist()), "cuda" if cuda else "cpu",
                     _auto_transport("cuda" if cuda else "cpu"))


def _auto_transport(device: str) -> str:
    """Every rank: what ``transport="auto"`` takes in this job, as the optimizer decides it
    (:func:`~hvd_onebit.transport.registry.resolve_transport`, then torch.distributed's
    rendezvous and connections: :func:`~hvd_onebit.transport.rendezvous.init_torch_distributed`,
    agreed on every rank, each within ``HVD_ONEBIT_RENDEZVOUS_S``). A group it set up is taken
    down again (a process that exits with its group alive can abort in Gloo's threads)."""
    import horovod.torch as hvd
    import torch.distributed as dist

    from hvd_onebit.transport.registry import resolve_transport
    from hvd_onebit.transport.rendezvous import (TorchConnectError, TorchRendezvousError,
                                                 init_torch_distributed)

    if hvd.size() < 2 or resolve_transport("auto", hvd.global_process_set, device) != "torch":
        return "Horovod's alltoall and allgather (torch.distributed does not serve this job)"
    ours = not dist.is_initialized()
    try:
        init_torch_distributed(device)
    except (TorchRendezvousError, TorchConnectError) as exc:
        return f"Horovod's alltoall and allgather, with a warning: {exc}"
    gloo = os.environ.get("GLOO_SOCKET_IFNAME")
    if ours:
        dist.destroy_process_group()
    return ("torch.distributed's collectives (its rendezvous reached by every rank"
            + (f"; Gloo on interface {gloo}" if gloo and device == "cpu" else "") + ")")


def one_size(local_sizes: list) -> Optional[int]:
    """The ranks per node when every rank's node has as many (the ranks' local sizes), else
    None."""
    return local_sizes[0] if len(set(local_sizes)) == 1 else None


def load_calibration(calibration: Optional[str] = None) -> dict:
    """The calibration the prediction prices the link with (``calibration``; None: the cached or
    the shipped one), checked, or a one-line error (:class:`click.ClickException`) naming what
    is wrong with it and how to make one."""
    import click

    from .bench.calibrate.files import load_or_shipped

    try:
        return load_or_shipped(calibration, note=lambda s: None)
    except (FileNotFoundError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None


def probe(np_: Optional[int], elements: int = PROBE_ELEMENTS,
          repeats: int = PROBE_REPEATS, calibration: Optional[str] = None) -> LinkProbe:
    """Every rank: a warm-up allreduce, then the median of ``repeats`` timed ones, through
    whatever launched the job; ``np_`` (None: the job's) must be the job's size.

    First, before any collective, every rank loads and checks the calibration that rank 0
    will price the link with (``calibration``, else the cached or shipped one): a missing or
    bad file stops every rank with the same one-line error, and no rank waits in a collective
    for one that stopped."""
    load_calibration(calibration)
    if launcher() == "torchrun":
        return _probe_torch(np_, elements, repeats)
    return _probe_horovod(np_, elements, repeats)


def model_rate(model, link: LinkProbe) -> Optional[float]:
    """The link rate (bit/s) at which the scale model's fp32 allreduce of the probe's buffer
    takes the probed time: the probe's time less the hosts' own costs, as the model prices them.
    None when even an unlimited link is slower in the model (the hosts, not the link, bound it)."""
    from .bench.predict.job import Job
    from .bench.predict.sweep import sweep

    job = Job(params=link.elements, compute_s=0.0, adam_s=0.0, warmup_frac=0.0)

    def seconds(bps: float) -> float:
        return sweep(model, job, [link.ranks], [bps], link.ranks_per_node,
                     methods=("horovod_fp32",))[0]["methods"]["horovod_fp32"]["step_s"]

    low, high = 1e6, 1e13
    if seconds(high) >= link.seconds:
        return None
    if seconds(low) <= link.seconds:
        return low
    for _ in range(60):  # bisection in log space: the model's time falls as the rate rises
        mid = (low * high) ** 0.5
        low, high = (mid, high) if seconds(mid) > link.seconds else (low, mid)
    return high


def predict(link: LinkProbe, params: str, compute_ms: float,
            calibration: Optional[str] = None) -> List[str]:
    """The scale model's fp32 and 1-bit steps at the probed rate, as lines to print."""
    from .bench.predict.job import Job, parse_params
    from .bench.predict.model import Model
    from .bench.predict.sweep import sweep
    from .docs_tables import freeze_guidance

    from .bench.calibrate.files import check_calibration, chosen_path

    cal = load_calibration(calibration)
    check_calibration(cal, chosen_path(calibration), [link.ranks], colocated=False,
                      per_peer=False)
    model = Model(cal, None)
    rate = model_rate(model, link)
    job = Job(params=parse_params(params), model=None, compute_s=compute_ms / 1e3, adam_s=None,
              warmup_frac=0.0, kernel_speedup=1.0, host_speedup=1.0)
    # the methods as `bench predict` and `bench train` name them, for the face the probe ran
    names = ("horovod_fp32", "onebit") if link.via == "Horovod" else ("ddp_adam", "ddp_onebit")
    row = sweep(model, job, [link.ranks], [rate or 1e13], link.ranks_per_node,
                methods=names)[0]["methods"]
    fp32, onebit = (row[n] for n in names)
    speedup = onebit["step_speedup_vs_fp32"]
    if rate is None:  # the model cannot explain the probe: it prices slower hosts than these
        verdict = ("no verdict: these hosts are faster than the calibrated ones, so the model "
                   "overprices their share; run `hvd-onebit bench calibrate` here and pass "
                   "--calibration, then measure with `hvd-onebit bench train`")
    else:
        verdict = ("1-bit Adam should help here" if speedup > 1.1 else
                   "little to gain here: the link is not the bottleneck")
        if link.per_node == link.ranks:  # the network between nodes was never measured
            verdict += (" (at this rate; but every rank is on one node, so the probe crossed no "
                        "network: probe with ranks on two or more nodes for your network's "
                        "verdict)")
    modelled = ("faster than the calibrated hosts manage on any link: the prediction below "
                "takes an unlimited link" if rate is None
                else f"the scale model's link rate for it, once the hosts' own costs (copies, "
                f"sums) are taken out of that time: {rate / 1e9:.2f} Gbit/s"
                + (" per node" if link.ranks_per_node > 1 else ""))
    memory = "GPU" if link.device == "cuda" else "host"
    # the same prediction for a whole run, as `bench predict` prices it
    whole_run = (f"hvd-onebit bench predict --methods {','.join(names)} --params {params} "
                 f"--compute-ms {compute_ms:g} --np {link.ranks}"
                 + (f" --ranks-per-node {link.ranks_per_node}" if link.ranks_per_node > 1 else "")
                 + f" --bandwidth {'unlimited' if rate is None else f'{rate / 1e6:.0f}mbit'}"
                 + " --run-steps N")
    return [f"link: {link.layout()}, fp32 allreduce of {4 * link.elements / 2**20:.0f} MiB of "
            f"{memory} memory through {link.via} in {link.seconds * 1e3:.1f} ms, "
            f"{link.bus_bps / 1e9:.2f} Gbit/s bus rate; {modelled}",
            f"predicted step ({params} parameters, {compute_ms:g} ms compute): "
            f"{'Horovod fp32' if link.via == 'Horovod' else 'DDP + Adam'} ({names[0]}) "
            f"{fp32['step_s'] * 1e3:.1f} ms, 1-bit Adam ({names[1]}) "
            f"{onebit['step_s'] * 1e3:.1f} ms "
            f"({speedup:.2f}x per compressed step, where no method's exchange overlaps "
            f"backward; a run's warmup and refresh steps are fp32's: `{whole_run}` prices the "
            f"whole run): "
            f"{verdict}" + ("; priced at the calibration's CPU speeds, which overstate a GPU's "
                            "kernels and hosts: `bench predict --kernel-speedup --host-speedup` "
                            "prices them (docs/predicting.md, GPU nodes)"
                            if link.device == "cuda" else ""),
            f"freeze point: {freeze_guidance(ddp=link.via != 'Horovod').replace('``', '`')}",
            f"calibration: {calibration_text(calibration, cal)}"] + (
        [] if link.transport is None else [f"transport='auto' takes {link.transport}"])


def calibration_text(calibration: Optional[str], cal: dict) -> str:
    """Which calibration priced the prediction, and whose machine it measured."""
    from .bench.calibrate.files import SHIPPED_PATH, chosen_path

    path = chosen_path(calibration)
    measured = f"{cal.get('cores', '?')} cores, {cal.get('machine', {}).get('date', 'undated')}"
    if path == SHIPPED_PATH and calibration is None:
        return (f"the one shipped with the tools ({measured}); `hvd-onebit bench calibrate` "
                "measures this machine's")
    return f"{path} ({measured})"
