"""`bench train`'s DDP methods: ``torch.nn.parallel.DistributedDataParallel`` over Gloo, set up
inside the Horovod job (:func:`hvd_onebit.transport.rendezvous.init_torch_distributed`) or by
torchrun's rank entry where Horovod is not installed, with
DDP's own allreduce (``ddp_adam``), the DDP face of 1-bit Adam with the paper's settings
(``ddp_onebit``: ``onebit``'s freeze, ``variance_refresh=None``) or with the library's defaults
(``ddp_onebit_refresh``: ``onebit_refresh``'s ``variance_refresh`` and early freeze, its refresh
steps their own phase, ``refresh``), or PowerSGD's hook (``ddp_powersgd``), and what the summary
says of them: the DDP face against DDP Adam, against the Horovod face's own gain over Horovod
Adam in the same run, and the defaults' whole run against DDP Adam's and ``ddp_onebit``'s.
"""
from __future__ import annotations

import inspect

from .refresh import freeze_step_for, optimizer_options, refresh_run_figures

DDP_METHODS = ("ddp_adam", "ddp_onebit", "ddp_onebit_refresh", "ddp_powersgd")
#: The DDP face's methods: the paper's settings, and the library's defaults.
DDP_ONEBIT_METHODS = ("ddp_onebit", "ddp_onebit_refresh")


def ddp_onebit_arguments(steps: int, warmup_frac: float, onebit_options: dict,
                         method: str = "ddp_onebit", variance_refresh=None,
                         refresh_freeze_frac: float = 0.05) -> dict:
    """``hvd_onebit.ddp.DistributedOptimizer``'s keyword arguments for a method of the DDP
    face: for ``ddp_onebit`` the ``onebit`` method's freeze step and ``variance_refresh=None``,
    for ``ddp_onebit_refresh`` ``onebit_refresh``'s ``variance_refresh`` and freeze
    (``refresh_freeze_frac * steps``); and of the other options only those the DDP face takes
    (it has no ``transport``: the momentum travels on the DDP model's torch.distributed
    group)."""
    from hvd_onebit.ddp import DistributedOptimizer

    if method not in DDP_ONEBIT_METHODS:
        raise ValueError(f"not a method of the DDP face: {method!r}, choose from "
                         f"{DDP_ONEBIT_METHODS}")
    takes = set(inspect.signature(DistributedOptimizer).parameters)
    options = {k: v for k, v in onebit_options.items() if k in takes}
    refreshed = method == "ddp_onebit_refresh"
    frac = refresh_freeze_frac if refreshed else warmup_frac
    options["freeze_step"] = freeze_step_for(frac, steps)
    return optimizer_options(variance_refresh if refreshed else None, **options)


def onebit_phase(opt, variance_refresh, counter: dict):
    """phase() of a 1-bit method, either face: the optimizer's phase, and with
    ``variance_refresh`` set a refresh step (full precision inside the compression phase, from
    the schedule at ``counter["it"]`` steps taken) as its own phase, "refresh"."""
    from hvd_onebit.variance_refresh import RefreshSchedule

    schedule = RefreshSchedule.from_option(variance_refresh)
    if schedule is None:
        return lambda: opt.phase

    def phase():
        p = opt.phase
        return ("refresh" if p == "compression"
                and schedule.is_refresh(counter["it"], opt.freeze_step) else p)
    return phase


def make_ddp_method(method: str, model, base, steps: int, warmup_frac: float,
                    powersgd_start: int, onebit_options: dict, counter: dict,
                    gradient_as_bucket_view: bool = False, variance_refresh=None,
                    refresh_freeze_frac: float = 0.05):
    """(the DDP model, the optimizer, phase()) of a DDP method; ``base`` is the fused Adam of
    ``model``'s parameters, ``counter["it"]`` the steps taken. ``gradient_as_bucket_view`` is
    DDP's own option, for every DDP method alike: the gradients are views into DDP's buckets, so
    its reducer copies none of them in or back in a step. ``variance_refresh`` and
    ``refresh_freeze_frac`` are ``ddp_onebit_refresh``'s."""
    import torch
    import torch.distributed as dist

    from hvd_onebit.transport.torch_distributed import settle_at_exit

    if not dist.is_initialized():  # a Horovod job; torchrun's rank entry set Gloo up already
        from hvd_onebit.transport.rendezvous import init_torch_distributed

        init_torch_distributed()
    settle_at_exit()  # every DDP method's Gloo threads finish with its last allreduce at exit
    if method == "ddp_powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        # One bucket for the whole model: PowerSGD's hook waits on a second allreduce inside a
        # future callback, which on Gloo's two worker threads deadlocks when two buckets'
        # callbacks block at once.
        model_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        net = torch.nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=model_mb + 1, gradient_as_bucket_view=gradient_as_bucket_view)
        start = max(2, powersgd_start)
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                       start_powerSGD_iter=start)
        net.register_comm_hook(state, powersgd.powerSGD_hook)

        def phase():  # PowerSGD's own warm-up uses plain allreduce
            return "warmup" if counter["it"] < start else "compression"
        return net, base, phase
    # DDP as a user builds it: its own buckets, its own allreduce overlapping backward
    net = torch.nn.parallel.DistributedDataParallel(
        model, gradient_as_bucket_view=gradient_as_bucket_view)
    if method == "ddp_adam":
        return net, base, (lambda: "n/a")
    if method in DDP_ONEBIT_METHODS:
        import hvd_onebit.ddp

        options = ddp_onebit_arguments(steps, warmup_frac, onebit_options, method,
                                       variance_refresh, refresh_freeze_frac)
        opt = hvd_onebit.ddp.DistributedOptimizer(base, net, **options)
        refresh = variance_refresh if method == "ddp_onebit_refresh" else None
        return net, opt, onebit_phase(opt, refresh, counter)
    raise ValueError(f"not a DDP method: {method!r}, choose from {DDP_METHODS}")


def ddp_summary(by: dict) -> dict:
    """The DDP rows' figures (:func:`face_figures`, then :func:`refresh_figures`), by method
    name; a figure whose rows the run lacks is left out."""
    return {**face_figures(by), **refresh_figures(by)}


def face_figures(by: dict) -> dict:
    """The DDP rows against each other and against the Horovod face:

    * ``ddp_onebit_compression_step_speedup_vs_ddp_adam``: DDP Adam's step over the DDP face's
      compressed step; ``onebit_compression_step_speedup_vs_fp32`` is the Horovod face's over
      Horovod Adam, and ``ddp_face_speedup_vs_horovod_face`` the first over the second (both
      faces' gains over their own framework's Adam, in one run);
    * ``ddp_onebit_run_speedup_vs_ddp_adam``, ``..._vs_ddp_powersgd``: whole runs;
    * ``ddp_onebit_measured_bytes_vs_ddp_adam``: the DDP face's compressed step's bytes on rank
      0's emulated link over DDP Adam's step's, and ``ddp_onebit_bytes_vs_ddp_adam`` the same
      from the computed figures (the 1-bit wire bytes over the fp32 ring allreduce's).
    """
    out: dict = {}
    adam, face, psgd = by.get("ddp_adam"), by.get("ddp_onebit"), by.get("ddp_powersgd")
    fp32, onebit = by.get("horovod_fp32"), by.get("onebit")
    if adam and fp32:
        out["ddp_adam_step_vs_horovod_fp32"] = adam["all_step_s"] / fp32["all_step_s"]
    if face and onebit and "compression_step_s" in face and "compression_step_s" in onebit:
        out["ddp_onebit_compression_step_vs_onebit"] = (face["compression_step_s"]
                                                        / onebit["compression_step_s"])
    if not face:
        return out
    if adam and "compression_step_s" in face:
        speedup = adam["all_step_s"] / face["compression_step_s"]
        out["ddp_onebit_compression_step_speedup_vs_ddp_adam"] = speedup
        out["ddp_onebit_warmup_step_speedup_vs_ddp_adam"] = (adam["all_step_s"]
                                                             / face["warmup_step_s"])
        if fp32 and onebit and "compression_step_s" in onebit:
            horovod = fp32["all_step_s"] / onebit["compression_step_s"]
            out["ddp_face_speedup_vs_horovod_face"] = speedup / horovod
    if adam:
        out["ddp_onebit_run_speedup_vs_ddp_adam"] = adam["run_seconds"] / face["run_seconds"]
        pairs = {"ddp_onebit_measured_bytes_vs_ddp_adam":  # absent off the emulator
                 ("compression_measured_tx_bytes_per_step", "all_measured_tx_bytes_per_step"),
                 "ddp_onebit_bytes_vs_ddp_adam": ("compression_bytes_per_step", "bytes_per_step")}
        for key, (mine, theirs) in pairs.items():
            if face.get(mine) and adam.get(theirs):
                out[key] = face[mine] / adam[theirs]
    if psgd:
        out["ddp_onebit_run_speedup_vs_ddp_powersgd"] = psgd["run_seconds"] / face["run_seconds"]
    return out


def refresh_figures(by: dict) -> dict:
    """``ddp_onebit_refresh`` (the library's defaults) over whole runs, as the summary sets
    ``onebit_refresh`` against Horovod Adam and ``onebit``:

    * ``ddp_onebit_refresh_run_speedup_vs_ddp_adam``, ``..._vs_ddp_onebit``: DDP Adam's and the
      paper's setting's run time over the defaults';
    * ``ddp_onebit_refresh_bytes_vs_ddp_onebit``: the run's computed bytes per rank over
      ``ddp_onebit``'s, and ``ddp_onebit_refresh_measured_bytes_vs_ddp_onebit`` those on rank
      0's emulated link (absent off the emulator);
    * :func:`.refresh.whole_run_ceilings` against ``ddp_onebit``, each key with ``ddp_`` before
      it (``ddp_onebit_refresh_speedup_any_schedule``, ...).
    """
    return refresh_run_figures("ddp_onebit_refresh", by.get("ddp_onebit_refresh"),
                               by.get("ddp_onebit"), by.get("ddp_adam"),
                               ("ddp_adam", "ddp_onebit"), ceilings_prefix="ddp_")
