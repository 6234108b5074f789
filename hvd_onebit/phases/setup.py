"""What is decided once, when the optimizer is built: the checks against the job, the
transport the compression phase's two stages travel on, and the parts the face delegates to."""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, replace
from typing import Optional

import horovod.torch as hvd
import torch
from horovod.torch.mpi_ops import is_homogeneous

from ..config import OneBitConfig, validate_masks
from ..consistency import (check_parameters_identical, check_same_parameters,
                           refused_on_every_rank)
from ..engine import CompressedStep, process_set_size
from ..horovod_view import HorovodView
from ..job import check_environment, shared_memory_inside_nodes
from ..state.adam_state import init_adam_state
from ..state.schedule import Schedule
from ..state.telemetry import Telemetry
from .driver import Phases
from .warmup import Warmup, not_contiguous
from ..transport.horovod import HorovodJob
from ..transport.registry import either, resolve_transport, supporting, supports
from ..transport.rendezvous import (TorchConnectError, TorchRendezvousError,
                                    init_torch_distributed)


def refusals_agreed(process_set: hvd.ProcessSet):
    """:func:`~hvd_onebit.consistency.refused_on_every_rank` through Horovod, on the process
    set: what one rank refuses in the block, every rank raises. Elastic workers join running
    jobs, whose ranks would not take part: there each rank raises its own."""
    def gather():
        if os.environ.get("HOROVOD_ELASTIC") == "1" or process_set_size(process_set) < 2:
            return None
        return lambda mine: hvd.allgather(mine, name="hvd_onebit.refusals",
                                          process_set=process_set)
    return refused_on_every_rank(gather, "hvd_onebit.DistributedOptimizer")


def check(config: OneBitConfig, param_groups: list[dict], process_set: hvd.ProcessSet,
          names: Optional[dict]) -> None:
    """Before anything is built: the param groups' masks, the names, the options against the
    parameters and the job (:func:`hvd_onebit.job.check_environment`), and the parameters'
    memory layout against Horovod's allreduce; raises alike on every rank. ``names``:
    parameter -> name, from ``named_parameters`` (None: not given)."""
    in_process_set(config, process_set)
    validate_masks(param_groups)
    if names is not None:
        check_named(param_groups, names)
    params = [p for g in param_groups for p in g["params"]]
    check_environment(config, params, process_set, names)
    check_contiguous(params, names or {})
    if config.flush_on_commit:
        check_foldable(param_groups)


def check_foldable(param_groups: list[dict]) -> None:
    """``flush_on_commit=True`` folds the error feedback into the momentum at every commit,
    which beta1 = 0 leaves nothing to carry: refused now rather than at the first commit."""
    zero = [i for i, g in enumerate(param_groups) if float(g["betas"][0]) == 0]
    if zero:
        raise ValueError(f"flush_on_commit=True folds the error feedback into the momentum at "
                         f"every state.commit(), which needs beta1 > 0; param group(s) {zero} "
                         "have betas[0] = 0. Give beta1 > 0, or leave flush_on_commit off (a "
                         "reset then restarts the error feedback from zero)")


def check_named(param_groups: list[dict], names: dict) -> None:
    """Raise, naming them, unless ``named_parameters`` names every parameter of the optimizer
    (Horovod's own error gives their Python ids)."""
    unnamed = [(i, j, tuple(p.shape)) for i, g in enumerate(param_groups)
               for j, p in enumerate(g["params"]) if p not in names]
    if not unnamed:
        return
    total = sum(len(g["params"]) for g in param_groups)
    empty = (" named_parameters was empty: a generator such as model.named_parameters() can be "
             "read once, so pass a fresh one or a list." if not names else "")
    shown = f"{unnamed[:8]}{' ...' if len(unnamed) > 8 else ''}"
    raise ValueError(
        f"named_parameters names {total - len(unnamed)} of the optimizer's {total} parameters; "
        f"the others (param group, index in it, shape): {shown}."
        f"{empty} Pass model.named_parameters() of the model whose parameters the optimizer "
        "holds (or leave named_parameters out)")


def check_contiguous(params: list[torch.Tensor], names: dict) -> None:
    """Horovod's allreduce takes contiguous tensors only, and a gradient takes its parameter's
    memory layout: a parameter in another layout (``channels_last``) would fail at the first
    backward, in Horovod's hook. Refused here, by name, on every rank."""
    bad = [names.get(p, f"parameter {i}") for i, p in enumerate(params) if not p.is_contiguous()]
    if bad:
        raise not_contiguous(bad, "")


def check_job(param_groups: list[dict], names: dict, config: OneBitConfig,
              process_set: hvd.ProcessSet, world: int) -> None:
    """Raise on every rank if the ranks' parameters or options differ (one small allgather).
    Elastic workers join running jobs, so a collective there could not be matched: skipped."""
    if world > 1 and os.environ.get("HOROVOD_ELASTIC") != "1":
        check_same_parameters(param_groups, names, config, process_set)


def connect(config: OneBitConfig, process_set: hvd.ProcessSet, device: torch.device,
            world: int) -> HorovodJob:
    """The transport of the compression phase ("auto" decided from what every rank sees
    alike), set up now on every rank together: a network that cannot carry torch.distributed
    fails at construction, not at the freeze, and "auto" then stays with Horovod (the failure
    is agreed, so every rank does). The engine gets it as an object; its name is
    ``opt.transport``."""
    if config.hierarchical is True and world > 1 and not is_homogeneous():
        # what every rank's Horovod says alike; the topology's allgather would refuse it at
        # the first step
        raise ValueError(
            f"hierarchical=True needs every node to run the same number of ranks, and this "
            f"job's nodes do not (this rank's node runs {hvd.local_size()} of the "
            f"{hvd.size()}): launch as many ranks on every host, or pass hierarchical='auto', "
            f"which stays flat on such a job")
    transport = resolve_transport(config.transport, process_set, device, config.hierarchical)
    if transport == "torch" and config.compressor == "onebit" and world > 1:
        try:
            init_torch_distributed(device)
        except (TorchRendezvousError, TorchConnectError) as exc:
            if config.transport != "auto":
                raise
            warnings.warn(f"hvd_onebit: transport='auto' uses Horovod: {exc}")
            transport = "horovod"
    if config.hierarchical is not False and config.intra_node == "shared_memory":
        shared_memory_inside_nodes(config.intra_node, transport, device)  # raises if it cannot
    return HorovodJob(transport, process_set)


@dataclass(frozen=True)
class Parts:
    """What one optimizer's face delegates to."""

    schedule: Schedule
    telemetry: Telemetry
    engine: CompressedStep
    phases: Phases
    warmup: Warmup  # the warmup's allreduce, whose hooks the face installs
    transport: str


def in_process_set(config: OneBitConfig, process_set: hvd.ProcessSet) -> OneBitConfig:
    """The options on ``process_set``: a set Horovod no longer knows is refused, and on a set
    other than the global one ``hierarchical=True`` is refused and "auto" stays flat (the
    nodes' layout is read over every Horovod rank, which ranks outside the set do not
    join)."""
    if process_set.process_set_id is None:
        raise ValueError("process_set is not registered with Horovod (removed with "
                         "hvd.remove_process_set, or never added): pass a registered one")
    if process_set.process_set_id == 0 or config.hierarchical is False:
        return config
    if config.hierarchical is True:
        raise ValueError("hierarchical=True reads the nodes' layout over every Horovod rank, "
                         "and this optimizer averages over a process set: leave hierarchical "
                         "out (or 'auto', which stays flat on a process set)")
    return replace(config, hierarchical=False)


def flat_on_its_transport(config: OneBitConfig, several_nodes: bool) -> OneBitConfig:
    """``hierarchical="auto"`` on a transport without the hierarchical collective (``"mpi"``)
    stays flat, with a warning where it would have turned on (``several_nodes``: nodes of
    several ranks); ``True`` there is refused by :func:`~hvd_onebit.job.check_options`."""
    if config.hierarchical != "auto" or supports(config.transport, "hierarchical"):
        return config
    if several_nodes:
        warnings.warn(f"hvd_onebit: hierarchical='auto' stays flat: transport="
                      f"{config.transport!r} has no hierarchical collective (it runs on "
                      f"transport={either(supporting('hierarchical'))})")
    return replace(config, hierarchical=False)


def build(view: HorovodView, config: OneBitConfig, process_set: hvd.ProcessSet) -> Parts:
    """Adam's state, the checks against the job, the transport, the engine and the phases of
    the optimizer ``view`` sees, in the order every rank runs their collectives."""
    config = in_process_set(config, process_set)
    config = flat_on_its_transport(config, 1 < hvd.local_size() < hvd.size())
    schedule = Schedule(view, config)
    schedule.freeze_step = None if config.auto else config.freeze_step
    telemetry = Telemetry()
    init_adam_state(view.adam.param_groups, view.adam.state)
    world = process_set_size(process_set)
    check_job(view.adam.param_groups, view.names, config, process_set, world)
    device = next((p.device for p in view.adam.parameters()), torch.device("cpu"))
    transport = connect(config, process_set, device, world)
    engine = CompressedStep(config, view.adam.state, view.adam.decoupled, process_set,
                            transport=transport, names=view.names)
    warmup = Warmup(view, schedule, telemetry, engine)
    phases = Phases(view, config, schedule, telemetry, engine, warmup,
                    lambda steps: check_parameters_identical(view.adam.param_groups, process_set,
                                                             steps, config.check_every))
    return Parts(schedule, telemetry, engine, phases, warmup, transport.name)
