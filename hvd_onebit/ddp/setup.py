"""What the DDP face decides once, when the optimizer is built: the checks against the model
and the job (each a clear error on every rank, before anything is registered), then the parts
the face delegates to and its hook on the model."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..config import OneBitConfig, validate_masks
from ..consistency import (JobSignature, check_same_job, parameter_bit_sums, raise_if_diverged,
                           refused_on_every_rank)
from ..engine import CompressedStep
from ..job import check_options, check_parameters
from ..phases.driver import Phases
from ..state.adam_state import init_adam_state
from ..state.schedule import Schedule
from ..state.telemetry import Telemetry
from ..transport.torch_distributed import all_gather_single
from ..transport.torch_job import TorchJob
from .hook import PYTHON_REDUCER, CommHook, check_unhooked
from .view import DDPView
from .warmup import DDPWarmup


FACE = "hvd_onebit.ddp.DistributedOptimizer"  # how the shared checks and messages name this face

_DDP_DECIDES = ("DDP decides it: DDP averages the gradients in the warmup and the refresh "
                "steps, and this optimizer holds DDP's one communication hook")
# The Horovod face's keywords that mean nothing under DDP, with what a DDP script does instead.
HOROVOD_ONLY = {
    "transport": "the momentum travels on torch.distributed, on the DDP model's group (or "
                 "process_group)",
    "flush_on_commit": "it flushes at Horovod elastic's commits; under torchrun, call "
                       "opt.flush_error_feedback() before saving, or save each rank's "
                       "opt.error_feedback_state_dict() (docs/ddp.md, checkpoints)",
    "backward_passes_per_step": "accumulate gradients with model.no_sync(), as with DDP + Adam",
    "named_parameters": "the DDP model names its parameters",
    "process_set": "pass process_group, a torch.distributed group",
    **{name: _DDP_DECIDES for name in ("compression", "op", "gradient_predivide_factor",
                                       "num_groups", "groups", "sparse_as_dense")},
}


def refuse_horovod_only(keywords) -> None:
    """A TypeError naming the first of ``keywords`` that only the Horovod face takes, with what
    to do under DDP instead; other unknown keywords are left to the shared option parser."""
    for name in keywords:
        if name in HOROVOD_ONLY:
            raise TypeError(f"{FACE} takes no {name} ({HOROVOD_ONLY[name]})")


def ddp_model_of(model):
    """The DDP model ``model`` is, or that ``model`` compiles (``torch.compile(ddp_model)``
    calls the DDP model, whose hooks then act as they do uncompiled); anything else as it is,
    for :func:`check` to refuse."""
    inner = getattr(model, "_orig_mod", None)
    if isinstance(model, torch.nn.Module) and isinstance(inner, DistributedDataParallel):
        return inner
    return model


def finds_unused(model) -> bool:
    """Whether DDP looks for unused parameters in every backward (``find_unused_parameters``).
    With it every bucket starts in step(), after backward: in the steps DDP synchronises, it
    allreduces which parameters were used after the last bucket's hook, on the group the 1-bit
    stages run on, and a model that needs it has parameters without a gradient on some ranks,
    whose buckets the ranks would start at different points."""
    return bool(getattr(model, "find_unused_parameters", False))


def module_names(model) -> dict:
    """Every parameter of the wrapped module, by its name there."""
    return {p: name for name, p in model.module.named_parameters()}


def ignored_names(model) -> set:
    """The names of the parameters DDP was told to ignore."""
    return set(getattr(model, "parameters_to_ignore", ()))


def model_names(model) -> dict:
    """Each parameter DDP averages, by its name in the wrapped module: the ones that require a
    gradient and that DDP was not told to ignore."""
    ignored = ignored_names(model)
    return {p: name for p, name in module_names(model).items()
            if p.requires_grad and name not in ignored}


def refusals_agreed(model, optimizer):
    """:func:`~hvd_onebit.consistency.refused_on_every_rank` on the DDP model's own group (the
    job's where ``model`` is not a DDP model): what one rank refuses in the block, every rank
    raises."""
    def gather():
        if not (dist.is_available() and dist.is_initialized()):
            return None
        ddp = ddp_model_of(model)
        group = ddp.process_group if isinstance(ddp, DistributedDataParallel) else dist.group.WORLD
        if dist.get_world_size(group) < 2:
            return None
        param_groups = getattr(optimizer, "param_groups", [])
        return lambda mine: gather_rows(mine, param_groups, group)
    return refused_on_every_rank(gather, FACE)


ALONE = (". This process is not in a job of several ranks: on one process the frameworks "
         "leave the model unwrapped (Accelerate's prepare(), Lightning), and there is nothing to "
         "compress; use plain Adam there")
NESTED = (f"{FACE}: the DDP model wraps another DDP model (DDP around DDP, as Accelerate's "
          "prepare() makes of a model already in DDP): the inner one averages every gradient "
          "in full precision at every step, so 1-bit Adam would save nothing. Wrap the module "
          "in DDP once (hand prepare() the module itself)")


def check(model, param_groups: list[dict], process_group, config: OneBitConfig):
    """The model, the optimizer's parameters, the group and the options, each rank's own (in
    :func:`refusals_agreed`'s block); returns the process group the 1-bit collective runs on."""
    if not isinstance(model, DistributedDataParallel):
        alone = not dist.is_initialized() or dist.get_world_size() == 1
        raise TypeError("hvd_onebit.ddp.DistributedOptimizer takes the DDP model "
                        "(torch.nn.parallel.DistributedDataParallel) as its second argument, got "
                        f"{type(model).__module__}.{type(model).__name__}: wrap it first, "
                        "model = DDP(model), or pass the DDP model a trainer built and runs "
                        "(PyTorch Lightning: self.trainer.strategy.model, in "
                        "configure_optimizers; Accelerate: what prepare(model) returns; Hugging "
                        "Face Trainer: a DDP model of your own, set as trainer.model_wrapped); a "
                        "second DDP wrapper of your own would average every step in full "
                        "precision" + (ALONE if alone else ""))
    if isinstance(model.module, DistributedDataParallel):
        raise ValueError(NESTED)
    names = model_names(model)
    strangers = [(gi, tuple(p.shape)) for gi, g in enumerate(param_groups) for p in g["params"]
                 if p.requires_grad and p not in names]
    ignored, ours = ignored_names(model), {p for g in param_groups for p in g["params"]}
    everything = module_names(model)
    skipped = [name for p, name in everything.items()
               if name in ignored and p.requires_grad and p in ours]
    if skipped:
        raise ValueError(
            f"{FACE}: {len(skipped)} of the optimizer's trainable parameters are among those "
            f"DDP was told to ignore ({', '.join(skipped[:4])}"
            f"{' ...' if len(skipped) > 4 else ''}); it trains only what the DDP model "
            "averages. Train them with an optimizer of their own, or take them off DDP's "
            "ignore list")
    if strangers:  # before the hook: another optimizer's model passed by mistake is this
        raise ValueError(
            f"{FACE}: {len(strangers)} of the optimizer's parameters "
            f"are not parameters the DDP model averages (param group, shape: "
            f"{strangers[:4]}{' ...' if len(strangers) > 4 else ''}); build the optimizer from "
            "model.parameters() of the DDP model you pass")
    check_unhooked(model)
    if getattr(model, "_use_python_reducer", False):  # DDP's choice when it was built
        raise ValueError(f"{FACE}: {PYTHON_REDUCER}")
    group = model.process_group if process_group is None else process_group
    ours, ddps = (dist.get_process_group_ranks(g) for g in (group, model.process_group))
    if sorted(ours) != sorted(ddps):
        raise ValueError(f"process_group holds ranks {short(ours)}, the DDP model averages over "
                         f"{short(ddps)}: they must be the same ranks (else DDP's averaging and "
                         "the 1-bit exchange mix replicas of different groups)")
    if config.hierarchical is True and not on_every_rank(group):
        raise ValueError(f"hierarchical 1-bit runs on every rank of the job: the group has "
                         f"{dist.get_world_size(group)} of {dist.get_world_size()}")
    if config.hierarchical == "auto" and not on_every_rank(group):
        warnings.warn(f"{FACE}: hierarchical='auto' stays flat on a group of "
                      f"{dist.get_world_size(group)} of the job's {dist.get_world_size()} ranks "
                      "(the node layout is read over every rank of the job)")
    validate_masks(param_groups)
    check_options(config)
    check_parameters(config, [p for g in param_groups for p in g["params"]], FACE, everything)
    return group


def check_job(model, param_groups: list[dict], group, config: OneBitConfig) -> None:
    """Raise on every rank unless the ranks' optimizers hold the same parameters and options
    (one allgather), or unless this one holds every parameter the DDP model averages."""
    names = model_names(model)
    if dist.get_world_size(group) > 1:
        check_same_job(JobSignature.of(param_groups, names, config),
                       lambda mine: gather_rows(mine, param_groups, group), FACE)
    # after the ranks were found to hold the same optimizer: raised alike on every rank
    ours = {p for g in param_groups for p in g["params"]}
    others = [name for p, name in names.items() if p not in ours]
    if others:
        raise ValueError(
            f"{FACE}: {len(others)} parameter(s) the DDP model "
            f"averages are not in this optimizer ({', '.join(others[:4])}"
            f"{' ...' if len(others) > 4 else ''}): in compressed steps DDP averages no "
            "gradient of the model, so another optimizer would train them on each rank's own "
            "gradients and the ranks would part. Give them to this optimizer (a param group "
            "of their own for their own lr), set requires_grad=False on those not trained, or "
            "wrap the modules another optimizer trains in a DDP model of their own")


def on_every_rank(group) -> bool:
    """Whether ``group`` holds every rank of the job (hierarchical reads the node layout over
    all of them)."""
    return dist.get_world_size(group) == dist.get_world_size()


def short(ranks: list) -> str:
    """A group's ranks for a message: the first eight, and how many more."""
    return str(ranks[:8])[:-1] + (f", ... {len(ranks)} in all]" if len(ranks) > 8 else "]")


def gather_rows(mine: torch.Tensor, param_groups: list[dict], group) -> torch.Tensor:
    """Every rank's ``mine`` (int64 [1, k]), one row per rank in rank order (one allgather on
    the parameters' device: the group's backend may take only that device's tensors)."""
    device = next((p.device for g in param_groups for p in g["params"]), torch.device("cpu"))
    mine = mine.to(device)
    everyone = torch.empty((dist.get_world_size(group), mine.shape[1]), dtype=mine.dtype,
                           device=device)
    all_gather_single(everyone, mine, group=group)
    return everyone.cpu()


def check_identical(param_groups: list[dict], group, steps: int, every: int) -> None:
    """Raise on every rank if the parameters differ between ranks (one small allgather)."""
    everyone = gather_rows(parameter_bit_sums(param_groups, steps), param_groups, group)
    raise_if_diverged(everyone, steps, every)


@dataclass(frozen=True)
class Parts:
    """What one DDP-face optimizer delegates to."""

    schedule: Schedule
    telemetry: Telemetry
    engine: CompressedStep
    phases: Phases
    hook: CommHook


def build(view: DDPView, config: OneBitConfig, group, model) -> Parts:
    """Adam's state, the engine on ``group``, the phases, and the hook registered on ``model``
    (last: a refusal leaves the model as it was)."""
    schedule = Schedule(view, config)
    schedule.freeze_step = None if config.auto else config.freeze_step
    telemetry = Telemetry()
    init_adam_state(view.adam.param_groups, view.adam.state)
    hierarchical = config.hierarchical if on_every_rank(group) else False  # check() said why
    engine = CompressedStep(config, view.adam.state, view.adam.decoupled,
                            transport=TorchJob(group, hierarchical), names=view.names)
    # the hook is built last (below); the warmup calls it only from step()
    warmup = DDPWarmup(view, schedule, telemetry, engine,
                       lambda params: hook.average_if_local(params))
    phases = Phases(view, config, schedule, telemetry, engine, warmup,
                    lambda steps: check_identical(view.adam.param_groups, group, steps,
                                                  config.check_every),
                    view.refuse_unaveraged)
    hook = CommHook(group, lambda: not phases.compressing() or phases.refreshing(),
                    phases.compression.overlap if config.overlap else None,
                    phases.watch_begin, phases.watch_end,
                    lambda optimizer: id(optimizer) == view.adam.optimizer_id)
    hook.register(model)
    return Parts(schedule, telemetry, engine, phases, hook)
