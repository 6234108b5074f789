"""The DDP face under torchrun: one suite of scenarios per world (Gloo, CPU, Horovod blocked).
Each scenario returns data (mismatches with their figures, recorded gradients and parameters,
error messages); the tests in tests/test_ddp.py assert on it."""
from __future__ import annotations

import collections
import contextlib
import copy
import functools
import gc
import io
import os
import threading
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_onebit.ddp
from tests.scenarios import run_scenarios
from tests.sync_counter import HostReads

BUCKET_MB = 0.0005  # the model's momentum spans two buckets
LRS = (1e-2, 5e-3)  # two param groups
FREEZE = 3
# DDP's options and the steps' shapes each scenario runs with: (DDP keywords, the steps'
# pattern); "micro": backward passes per step (all but the last under no_sync), "extra": which
# (step, rank) use a branch the others leave without a gradient; "clip": the gradients' norm is
# clipped to this before step() (in the compression phase each rank clips its own); "compile":
# the module compiled with torch.compile (that backend) before DDP wraps it; "compile_ddp": the
# DDP model compiled (the face is handed the compiled model).
VARIANTS = {
    "plain": ({}, {}),
    "no_sync": ({}, {"micro": 2}),
    "unused": ({"find_unused_parameters": True}, {"extra": lambda step, rank: (step + rank) % 3 == 0}),
    "static_graph": ({"static_graph": True}, {}),
    "bucket_view": ({"gradient_as_bucket_view": True}, {}),
    "clip": ({}, {"clip": 0.05}),
    "compiled": ({"compile": "aot_eager"}, {}),
    "compiled_ddp": ({"compile_ddp": "aot_eager"}, {}),
}


class Net(torch.nn.Module):
    """Two layers; ``extra``: a third one that forward uses only when told to."""

    def __init__(self, extra: bool = False):
        super().__init__()
        self.inner = torch.nn.Linear(6, 16)
        self.out = torch.nn.Linear(16, 4)
        self.extra = torch.nn.Linear(16, 4) if extra else None

    def forward(self, x, extra: bool = False):
        h = torch.tanh(self.inner(x))
        y = self.out(h)
        return y + self.extra(h) if extra and self.extra is not None else y


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32, compile: Optional[str] = None,
               compile_ddp: Optional[str] = None, **ddp_options) -> DDP:
    """The DDP model of :class:`Net`; with ``compile_ddp``, ``torch.compile`` of it, which
    passes ``module``, ``no_sync()`` and the parameters through to the DDP model."""
    torch.manual_seed(seed)
    net = Net(extra=ddp_options.get("find_unused_parameters", False)).to(dtype)
    if compile is not None:
        net = torch.compile(net, backend=compile)
    model = DDP(net, **ddp_options)
    return model if compile_ddp is None else torch.compile(model, backend=compile_ddp)


def adam(model: DDP | torch.nn.Module) -> torch.optim.Adam:
    """Adam over two param groups of ``model`` (a DDP model's module, or the module itself)."""
    m = getattr(model, "module", model)
    m = getattr(m, "_orig_mod", m)  # a compiled module's own
    return torch.optim.Adam([{"params": list(m.inner.parameters()), "lr": LRS[0]},
                             {"params": [p for n, p in m.named_parameters()
                                         if not n.startswith("inner.")], "lr": LRS[1]}])


def onebit(model: DDP, freeze_step: int = FREEZE, **options):
    """The DDP face over :func:`adam`; the variance stays frozen unless a scenario asks for a
    refresh (these runs are a few steps long: the default schedule would refresh every one)."""
    options.setdefault("variance_refresh", None)
    return hvd_onebit.ddp.DistributedOptimizer(adam(model), model, freeze_step=freeze_step,
                                               bucket_size_mb=BUCKET_MB, **options)


def batch(step: int, rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1009 * step + 97 * rank + 13 * micro)
    return torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)


def train_step(model: DDP, opt, step: int, pattern: Optional[dict] = None, scaler=None,
               poison: bool = False, zero_model: bool = False) -> float:
    """One optimizer step: ``micro`` backward passes (all but the last under no_sync), the
    loss made inf on this rank with ``poison``, the gradients zeroed by ``model.zero_grad()``
    with ``zero_model`` (else the optimizer's); returns the last pass's loss."""
    pattern = pattern or {}
    rank = dist.get_rank()
    micro = pattern.get("micro", 1)
    extra = pattern.get("extra", lambda step, rank: False)(step, rank)
    (model if zero_model else opt).zero_grad()
    for k in range(micro):
        with model.no_sync() if k < micro - 1 else contextlib.nullcontext():
            x, y = batch(step, rank, k)
            loss = torch.nn.functional.mse_loss(model(x, extra=extra), y)
            if poison:
                loss = loss * float("inf")
            (loss if scaler is None else scaler.scale(loss)).backward()
    if "clip" in pattern:
        torch.nn.utils.clip_grad_norm_(model.parameters(), pattern["clip"])
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)
        scaler.update()
    return float(loss)


def params_of(model: DDP) -> list[np.ndarray]:
    return [p.detach().clone().numpy() for p in model.module.parameters()]


def differences(a: list[np.ndarray], b: list[np.ndarray], what: str) -> list[str]:
    """Where two lists of arrays differ in any bit: the index, how many elements, the largest
    |difference|."""
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x.tobytes() != y.tobytes():
            out.append(f"{what} param {i}: {int((x != y).sum())} of {x.size} elements differ, "
                       f"max |diff| {float(np.abs(x - y).max()):.3g}")
    return out


# ---- scenarios -----------------------------------------------------------------------------------

def warmup_is_ddp_adam(variant: str, steps: int = 4, scaled: bool = False) -> list[str]:
    """DDP + Adam against DDP + the face (freeze far away) over the same steps, each with its
    own GradScaler with ``scaled``: the bits that differ, per step (none expected)."""
    options, pattern = VARIANTS[variant]
    ref_model, face_model = make_model(**options), make_model(**options)
    ref_opt, face_opt = adam(ref_model), onebit(face_model, freeze_step=1000)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaled else None
               for _ in range(2)]
    found = []
    for step in range(steps):
        train_step(ref_model, ref_opt, step, pattern, scaler=scalers[0])
        train_step(face_model, face_opt, step, pattern, scaler=scalers[1])
        found += differences(params_of(ref_model), params_of(face_model), f"step {step}")
        if scaled and scalers[0].get_scale() != scalers[1].get_scale():
            found.append(f"step {step}: scales {[s.get_scale() for s in scalers]}")
    if face_opt.steps != steps or face_opt.phase != "warmup":
        found.append(f"face at {face_opt.steps} steps in {face_opt.phase}")
    return found


def state_of(opt, model: DDP) -> list[dict]:
    """Adam's state per parameter (model order), as numpy."""
    out = []
    for p in model.module.parameters():
        st = opt.state[p]
        out.append({"exp_avg": st["exp_avg"].clone().numpy(),
                    "exp_avg_sq": st["exp_avg_sq"].clone().numpy(), "step": float(st["step"])})
    return out


def compression_record(variant: str, steps: int = 4, **options) -> dict:
    """FREEZE warmup steps, then ``steps`` compressed ones: the state at the freeze, each
    compressed step's local gradients (None: no gradient) and the parameters after it."""
    ddp_options, pattern = VARIANTS[variant]
    model = make_model(**ddp_options)
    opt = onebit(model, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a parameter without a warmup gradient is held
        for step in range(FREEZE):
            train_step(model, opt, step, pattern)
        record = {"params0": params_of(model), "state": state_of(opt, model), "grads": [],
                  "params": [], "phases": []}
        original_step = opt.step

        def step_recording(*args, **kwargs):  # the local gradients the step takes
            record["grads"].append([None if p.grad is None else p.grad.clone().numpy()
                                    for p in model.module.parameters()])
            return original_step(*args, **kwargs)

        opt.step = step_recording
        for step in range(FREEZE, FREEZE + steps):
            train_step(model, opt, step, pattern)
            record["params"].append(params_of(model))
            record["phases"].append(opt.phase)
    telemetry = opt.telemetry()
    record.update(steps=opt.steps, buckets=len(opt.compressed_step.buckets),
                  local_steps=opt._hook.local_steps,
                  early_starts=opt.compressed_step.early_starts,
                  restarts=opt.compressed_step.restarts, total_bytes=telemetry["total_bytes"],
                  last_step_bytes=telemetry["last_step_bytes"],
                  graphs=compiled_graphs())
    return record


def compiled_graphs() -> int:
    """The graphs torch.compile has captured in this process so far (a module's is captured
    once, at its first call in the process)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def replay(rank: int, transport, record: dict, world: int) -> list[list[np.ndarray]]:
    """The engine alone, fed the state and the gradients ``record`` holds for ``rank`` (every
    rank's record in ``world``), on the in-process transport: the parameters after each step."""
    from hvd_onebit.config import OneBitConfig
    from hvd_onebit.engine import NOT_FROZEN, CompressedStep

    mine = record[rank]
    params = [torch.from_numpy(value).clone() for value in mine["params0"]]
    state = {p: {"step": torch.tensor(st["step"]), "exp_avg": torch.from_numpy(st["exp_avg"]).clone(),
                 "exp_avg_sq": torch.from_numpy(st["exp_avg_sq"]).clone(),
                 "frozen_variance_step": NOT_FROZEN}
             for p, st in zip(params, mine["state"])}
    groups = [{"params": params[:2], "lr": LRS[0], "betas": (0.9, 0.999), "eps": 1e-8,
               "weight_decay": 0.0},
              {"params": params[2:], "lr": LRS[1], "betas": (0.9, 0.999), "eps": 1e-8,
               "weight_decay": 0.0}]
    config = OneBitConfig.from_options(FREEZE, bucket_size_mb=BUCKET_MB, transport="torch",
                                       overlap=False)
    engine = CompressedStep(config, state, lambda group: False, transport=transport)
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for grads in mine["grads"]:
            engine.begin_step()
            engine.ensure_ready(params)
            engine.step(groups, {p: None if g is None else torch.from_numpy(g)
                                 for p, g in zip(params, grads)})
            out.append([p.clone().numpy() for p in params])
    return out


def checkpoint_resumes(before: int = 2, after: int = 3) -> dict:
    """A compression-phase checkpoint (optimizer, error feedback, model) resumed by a fresh model
    and optimizer: the bits that differ from the uninterrupted run (none expected), and from a
    resume without the error feedback (some expected)."""
    model = make_model()
    opt = onebit(model)
    for step in range(FREEZE + before):
        train_step(model, opt, step)
    saved = copy.deepcopy({"opt": opt.state_dict(), "ef": opt.error_feedback_state_dict(),
                           "model": model.module.state_dict()})
    for step in range(FREEZE + before, FREEZE + before + after):
        train_step(model, opt, step)
    want = params_of(model)

    def resumed(with_errors: bool) -> list[np.ndarray]:
        fresh = make_model(seed=1)
        fresh.module.load_state_dict(saved["model"])
        fresh_opt = onebit(fresh)
        fresh_opt.load_state_dict(copy.deepcopy(saved["opt"]))
        if with_errors:
            fresh_opt.load_error_feedback_state_dict(copy.deepcopy(saved["ef"]))
        for step in range(FREEZE + before, FREEZE + before + after):
            train_step(fresh, fresh_opt, step)
        return params_of(fresh)

    return {"differ": differences(want, resumed(True), "resumed"),
            "differ_without_errors": differences(want, resumed(False), "no error feedback"),
            "phase": opt.phase}


def flushed_after_taken(before: int = 2, after: int = 3) -> dict:
    """The state taken, then the error feedback flushed at the same step, then the state saved
    (as Lightning takes the state before on_save_checkpoint, where a script flushes): resumed,
    the warnings of the resume and the bits that differ from the state taken after the flush,
    resumed."""
    model = make_model()
    opt = onebit(model)
    for step in range(FREEZE + before):
        train_step(model, opt, step)
    taken = opt.state_dict()
    opt.flush_error_feedback()
    blobs = {}
    for name, sd in (("taken", taken), ("after", opt.state_dict())):
        blobs[name] = io.BytesIO()
        torch.save({"opt": sd, "model": model.module.state_dict()}, blobs[name])
    out, runs = {}, {}
    for name, blob in blobs.items():
        blob.seek(0)
        saved = torch.load(blob, weights_only=False)
        fresh = make_model(seed=1)
        fresh.module.load_state_dict(saved["model"])
        fresh_opt = onebit(fresh)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fresh_opt.load_state_dict(saved["opt"])
            for step in range(FREEZE + before, FREEZE + before + after):
                train_step(fresh, fresh_opt, step)
        out[f"{name}_warnings"] = [str(w.message) for w in caught
                                   if "error feedback" in str(w.message)]
        runs[name] = params_of(fresh)
    out["differ"] = differences(runs["after"], runs["taken"], "taken before the flush")
    return out


def dcp_checkpoint_resumes(before: int = 2, after: int = 3) -> dict:
    """Checkpoints through torch.distributed.checkpoint, which keeps the optimizer's ``state``
    and ``param_groups`` alone: a compression-phase one resumed by a fresh model and optimizer
    with each rank's error feedback (the bits that differ from the uninterrupted run) and
    without it (the warnings of its first steps); and a warmup one of ``freeze_step="auto"``
    (the warnings of its load); and one written without the record (as before it travelled in
    param group 0) loaded with ``allow_partial_load`` into an optimizer of another freeze step
    (the freeze step and phase it resumes in)."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from hvd_onebit.config import Experimental

    where = [tempfile.mkdtemp(prefix="hvd_onebit_dcp_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where, src=0)
    auto = {"freeze_step": "auto", "experimental": Experimental(
        auto_freeze={"window": 2, "patience": 2, "min_steps": 2, "max_steps": 50})}

    def save(model, opt, name: str, record: bool = True) -> None:
        model_state, opt_state = get_state_dict(model, opt)
        if not record:
            opt_state["param_groups"][0].pop("onebit_record")
        dcp.save({"model": model_state, "optim": opt_state}, checkpoint_id=f"{where[0]}/{name}")

    def load(name: str, partial: bool = False, **options):
        model = make_model(seed=1)
        opt = onebit(model, **options)
        model_state, opt_state = get_state_dict(model, opt)
        loaded = {"model": model_state, "optim": opt_state}
        planner = dcp.DefaultLoadPlanner(allow_partial_load=True) if partial else None
        dcp.load(loaded, checkpoint_id=f"{where[0]}/{name}", planner=planner)
        set_state_dict(model, opt, model_state_dict=loaded["model"],
                       optim_state_dict=loaded["optim"])
        return model, opt

    model = make_model()
    opt = onebit(model)
    for step in range(FREEZE + before):
        train_step(model, opt, step)
    save(model, opt, "compression")
    save(model, opt, "without_record", record=False)
    errors = copy.deepcopy(opt.error_feedback_state_dict())
    for step in range(FREEZE + before, FREEZE + before + after):
        train_step(model, opt, step)
    out = {"phase": opt.phase}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, old = load("without_record", partial=True, freeze_step=FREEZE + 10)
    out["without_record"] = {"steps": old.steps, "freeze_step": old.freeze_step,
                             "phase": old.phase}
    for name, with_errors in (("with_errors", True), ("without_errors", False)):
        fresh, fresh_opt = load("compression")
        if with_errors:
            fresh_opt.load_error_feedback_state_dict(copy.deepcopy(errors))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(FREEZE + before, FREEZE + before + after):
                train_step(fresh, fresh_opt, step)
        out[name] = {"differ": differences(params_of(model), params_of(fresh), name),
                     "warnings": [str(w.message) for w in caught
                                  if str(w.message).startswith("hvd_onebit")]}
    model = make_model()
    opt = onebit(model, **auto)
    for step in range(2):
        train_step(model, opt, step)
    save(model, opt, "warmup_auto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, resumed = load("warmup_auto", **auto)
    out["auto"] = {"steps": resumed.steps, "phase": resumed.phase,
                   "warnings": [str(w.message) for w in caught
                                if str(w.message).startswith("hvd_onebit")]}
    decided = {"freeze_step": "auto", "experimental": Experimental(
        auto_freeze={"window": 2, "patience": 2, "min_steps": 2, "max_steps": 4})}
    model = make_model()
    opt = onebit(model, **decided)
    for step in range(5):
        train_step(model, opt, step)
    save(model, opt, "decided_auto")
    _, resumed = load("decided_auto", **decided)
    out["decided"] = {"saved": opt.freeze_decision, "resumed": resumed.freeze_decision,
                      "phases": [opt.phase, resumed.phase]}
    dist.barrier()
    if dist.get_rank() == 0:
        import shutil
        shutil.rmtree(where[0])
    return out


def flushed_checkpoint(path: str, save: bool, steps: int = 3) -> dict:
    """``save``: FREEZE + ``steps`` steps, the error feedback flushed, rank 0's checkpoint
    written to ``path``. Otherwise: that checkpoint resumed on this world, ``steps`` more."""
    if save:
        model = make_model()
        opt = onebit(model)
        for step in range(FREEZE + steps):
            train_step(model, opt, step)
        flushed = opt.flush_error_feedback()
        if dist.get_rank() == 0:
            torch.save({"opt": opt.state_dict(), "model": model.module.state_dict()}, path)
        dist.barrier()
        return {"flushed_bytes": flushed, "steps": opt.steps, "phase": opt.phase,
                "params": params_of(model)}
    saved = torch.load(path, weights_only=False)
    model = make_model(seed=1)
    model.module.load_state_dict(saved["model"])
    opt = onebit(model)
    opt.load_state_dict(saved["opt"])
    loaded = {"steps": opt.steps, "phase": opt.phase, "params_loaded": params_of(model)}
    losses = [train_step(model, opt, step) for step in range(FREEZE + steps, FREEZE + 2 * steps)]
    return {**loaded, "losses": losses, "params": params_of(model), "steps_after": opt.steps,
            "phase_after": opt.phase, "one_rank": resumed_on_one_rank(saved, steps)}


def resumed_on_one_rank(saved: dict, steps: int) -> Optional[dict]:
    """The checkpoint resumed by a job of one rank (rank 0 on a group of its own): the DDP face
    there steps as Adam, from the variance ``torch_adam_state_dict`` gives. Its parameters
    after ``steps`` steps against plain Adam's loaded with that state, and the first step's
    largest move of each (None on the other ranks)."""
    one = dist.new_group([0])  # every rank makes every group
    if dist.get_rank() != 0:
        return None
    model = DDP(Net(), process_group=one)
    model.module.load_state_dict(saved["model"])
    opt = onebit(model)
    opt.load_state_dict(saved["opt"])
    net = Net()
    net.load_state_dict(saved["model"])
    plain = adam(net)
    plain.load_state_dict(hvd_onebit.torch_adam_state_dict(saved["opt"]))
    start = [p.detach().clone() for p in net.parameters()]
    moves = []
    for k, step in enumerate(range(FREEZE + steps, FREEZE + 2 * steps)):
        train_step(model, opt, step)
        train_step(net, plain, step)
        if k == 0:
            moves = [max(float((a - b).abs().max()) for a, b in zip(m.parameters(), start))
                     for m in (model.module, net)]
    mine = params_of(model)
    theirs = [p.detach().clone().numpy() for p in net.parameters()]
    return {"differences": differences(mine, theirs, "one rank vs plain Adam"),
            "first_moves": moves}


def unfrozen_later(at: int, added: bool = False) -> dict:
    """``inner`` is frozen when the DDP model is built and unfrozen before step ``at`` (DDP does
    not average it), or with ``added`` a parameter that is not the model's is added to the
    optimizer (``add_param_group``) instead: that step is refused, changing nothing."""
    torch.manual_seed(0)
    net = Net()
    net.inner.requires_grad_(added)
    model = DDP(net)
    opt = onebit(model)
    for step in range(at):
        train_step(model, opt, step)
    if added:
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    else:
        net.inner.requires_grad_(True)
    before = params_of(model)
    try:
        train_step(model, opt, at)
        error = "accepted"
    except ValueError as exc:
        error = f"ValueError: {exc}"
    return {"error": error, "steps": opt.steps, "phase": opt.phase,
            "changed": differences(params_of(model), before, "params")}


def sparse_embedding_step() -> None:
    """One step of a DDP model whose embedding has sparse gradients."""
    torch.manual_seed(0)
    model = DDP(torch.nn.Embedding(10, 4, sparse=True))
    opt = hvd_onebit.ddp.DistributedOptimizer(torch.optim.Adam(model.parameters()), model,
                                              freeze_step=FREEZE)
    model(torch.tensor([1, 2, 3])).sum().backward()
    opt.step()


def refused(build: Callable, *errors: type) -> str:
    """What ``build()`` raised (a TypeError or ValueError, or one of ``errors``), as "Type:
    message"; or "accepted"."""
    try:
        build()
    except (TypeError, ValueError, *errors) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def rebuilt(before: int = FREEZE + 2, after: int = 3, **ddp_options) -> dict:
    """The optimizer built again mid-run as the refusal says: the module wrapped in DDP again
    (with ``ddp_options``), the optimizer on that, the old state and this rank's error feedback
    loaded, against the run that went on. The old optimizer's hooks stay on the module's
    parameters; they must start nothing on its engine. The new DDP model's first iteration is
    a compressed step's."""
    reference = make_model(**ddp_options)
    ref_opt = onebit(reference)
    for step in range(before + after):
        train_step(reference, ref_opt, step)
    model = make_model(**ddp_options)
    old = onebit(model)
    for step in range(before):
        train_step(model, old, step)
    again = refused(lambda: onebit(model))
    model = DDP(model.module, **ddp_options)
    opt = onebit(model)
    opt.load_state_dict(old.state_dict())
    opt.load_error_feedback_state_dict(old.error_feedback_state_dict())
    for step in range(before, before + after):
        train_step(model, opt, step)
    return {"again": again, "steps": opt.steps, "phase": opt.phase, "params": params_of(model),
            "old_started": old._engine.started,
            "differences": differences(params_of(reference), params_of(model),
                                       "the run with the optimizer built again")}


@dataclass(frozen=True)
class Skip:
    """One run of :func:`skipped_batch`."""

    zero: Optional[str] = None  # the skip's zero_grad: "opt" or "model"; None: no skip
    micro: int = 1  # backward passes per step, all but the last under no_sync()
    passes: int = 1  # backward passes of the skipped batch before it is zeroed
    scaler: bool = False  # a GradScaler: scaler.step(opt), scaler.update()

    @property
    def reference(self) -> "Skip":
        """The run that never computed the skipped batch."""
        return Skip(micro=self.micro, scaler=self.scaler)


SKIPS = {"opt": Skip("opt"), "model": Skip("model"),
         "accumulate": Skip("opt", micro=2, passes=2),
         "accumulate_half": Skip("opt", micro=2, passes=1),  # zeroed inside no_sync()
         "scaler": Skip("opt", scaler=True)}


def skipped_batch(steps: int = FREEZE + 5) -> dict:
    """A batch skipped after its backward (zero_grad() and on to the next batch) in a compressed
    step whose buckets the gradient hooks started (:data:`SKIPS`): the step after it is the same
    bits as in a run that never computed that batch (against such a run), and the buckets of
    the steps after that still start during backward."""
    out, references = {}, {}
    plans = [(plan.reference, None) for plan in SKIPS.values()] + list(
        (plan, name) for name, plan in SKIPS.items())
    for plan, name in plans:
        if name is None and plan in references:
            continue
        model = make_model()
        opt = onebit(model)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if plan.scaler else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(steps):
                if step == FREEZE and plan.zero:
                    opt.zero_grad()
                    for k in range(plan.passes):
                        with model.no_sync() if k < plan.micro - 1 else contextlib.nullcontext():
                            x, y = batch(1000 + step, dist.get_rank(), k)
                            loss = torch.nn.functional.mse_loss(model(x), y)
                            (loss if scaler is None else scaler.scale(loss)).backward()
                    started = opt.compressed_step.started
                    before = opt.compressed_step.early_starts
                    (opt if plan.zero == "opt" else model).zero_grad()
                train_step(model, opt, step, pattern={"micro": plan.micro}, scaler=scaler,
                           zero_model=plan.zero == "model")
        if name is None:
            references[plan] = params_of(model)
            continue
        buckets = len(opt.compressed_step.buckets)
        out[name] = {
            "started": started, "buckets": buckets,
            "early_after": opt.compressed_step.early_starts - before,
            "restarts": opt.compressed_step.restarts,
            "overlap_warnings": [str(w.message) for w in caught
                                 if "overlap off" in str(w.message)],
            "differences": differences(references[plan.reference], params_of(model),
                                       "the run with a batch skipped")}
    return out


def overlap_warnings(caught: list) -> list[str]:
    """The caught warnings about the overlap: buckets started again, or the overlap off."""
    return [str(w.message) for w in caught if "overlap off" in str(w.message)
            or "changed between backward and step()" in str(w.message)]


def forward_without_backward(steps: int = FREEZE + 4) -> dict:
    """The warmup's last step taken without a backward (its gradients zeroed), after a forward
    with autograd on: the forward arms DDP's reducer, which then reduces in the first compressed
    step's backward although that step's sync is off. Against the same step without the
    forward: the differences, the buckets started during backward in the compressed steps, and
    the warnings about the overlap."""
    runs, out = [], {}
    for extra in (False, True):
        model = make_model()
        opt = onebit(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(steps):
                if step == FREEZE:
                    before = opt.compressed_step.early_starts
                if step == FREEZE - 1:
                    opt.zero_grad()
                    if extra:
                        model(batch(500, dist.get_rank())[0])
                    opt.step()
                    continue
                train_step(model, opt, step)
        runs.append(params_of(model))
        out["extra" if extra else "plain"] = {
            "early": opt.compressed_step.early_starts - before,
            "restarts": opt.compressed_step.restarts,
            "warnings": overlap_warnings(caught)}
    out["differences"] = differences(runs[0], runs[1], "the run with a forward and no backward")
    return out


def forward_raises(iterations: int = 6) -> dict:
    """A forward that raises in the compression phase (a batch of the wrong width; a script
    that skips a batch on running out of memory sees the same), caught before two steps in a
    row, a compressed one and a refresh step, and the run goes on (variance_refresh refreshes
    every other step here). Against the same run without them: the differences, and whether
    DDP's gradient sync was on after each."""
    from hvd_onebit.config import Experimental

    runs, out = [], {"sync_after": [], "errors": []}
    for failing in (False, True):
        model = make_model()
        opt = onebit(model, variance_refresh="doubling",
                     experimental=Experimental(refresh_schedule={"first_interval": 2}))
        for step in range(FREEZE + iterations):
            if failing and step in (FREEZE + 1, FREEZE + 2):
                try:
                    model(torch.zeros(8, 5))
                except RuntimeError as exc:
                    out["errors"].append(type(exc).__name__)
                out["sync_after"].append(model.require_backward_grad_sync)
            train_step(model, opt, step)
        runs.append(params_of(model))
        out["refreshes"] = opt.telemetry()["refreshes"]
    out["differences"] = differences(runs[0], runs[1], "the run with failed forwards")
    return out


class Renormed(Net):
    """:class:`Net` with an embedding whose forward renormalises its rows in place
    (``max_norm``), as ``nn.Embedding(max_norm=...)`` does."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(8, 16, max_norm=0.5)

    def forward(self, x, extra: bool = False):
        return self.out(torch.tanh(self.inner(x)) + self.table(torch.arange(x.shape[0]) % 8))


def written_in_forward(passes: int = 2, steps: int = FREEZE + 3) -> dict:
    """A forward that writes a parameter in place, two passes a step without no_sync(): the
    second pass of a compressed step is not taken for another optimizer's step."""
    torch.manual_seed(0)
    model = DDP(Renormed())
    opt = onebit(model)
    for step in range(steps):
        opt.zero_grad()
        for k in range(passes):
            x, y = batch(step, dist.get_rank(), k)
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {"phase": opt.phase, "local_steps": opt._hook.local_steps, "params": params_of(model)}


def accumulated_without_no_sync(passes: tuple = (2, 2, 3, 4, 4, 1, 1)) -> dict:
    """Gradient accumulation without no_sync(), every backward pass with DDP's sync on: two
    passes a step through the warmup, then ``passes`` a compressed step. Against the same run
    with overlap=False: the differences, the buckets started during each compressed step's
    backward, the restarts and the warnings about the overlap."""
    runs, out = [], {}
    for overlap in (False, True):
        model = make_model()
        opt = onebit(model, overlap=overlap)
        early = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(FREEZE + len(passes)):
                before = opt.compressed_step.early_starts
                opt.zero_grad()
                for k in range(2 if step < FREEZE else passes[step - FREEZE]):
                    x, y = batch(step, dist.get_rank(), k)
                    torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                if step >= FREEZE:
                    early.append(opt.compressed_step.early_starts - before)
        runs.append(params_of(model))
        out["overlap" if overlap else "off"] = {
            "early": early, "restarts": opt.compressed_step.restarts,
            "warnings": overlap_warnings(caught)}
    out["differences"] = differences(runs[0], runs[1], "overlap=False")
    return out


class WrapperCopy:
    """An optimizer wrapper built as PyTorch Lightning builds its LightningOptimizer: its class
    a subclass of the optimizer's, step() passed on, other attributes read from the optimizer
    (zero_grad, add_param_group and the rest found on the optimizer's class, run on the
    wrapper)."""

    def __init__(self, optimizer):
        self._optimizer = optimizer
        self.__class__ = type(f"Copied{type(optimizer).__name__}",
                              (WrapperCopy, type(optimizer)), {})

    def step(self, closure=None, **kwargs):
        return self._optimizer.step(closure, **kwargs)

    def __getattr__(self, item):
        return getattr(self._optimizer, item)


def another_wrapper_runs(steps: int = FREEZE + 2) -> dict:
    """The optimizer given one DDP model while the script runs the forward of another DDP
    wrapper of the same module (a trainer's own): the warnings of the run, and of a run that
    gives it the wrapper it runs."""
    out = {}
    for given in ("other", "run"):
        model = make_model()
        run = DDP(model.module)
        opt = onebit(model if given == "other" else run)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(steps):
                train_step(run, opt, step)
        out[given] = [str(w.message) for w in caught if "has run no forward" in str(w.message)]
        out[f"{given}_phase"] = opt.phase
    return out


def through_a_wrapper_copy(steps: int = FREEZE + 3) -> dict:
    """The same run with zero_grad() and step() called on the optimizer and on a
    :class:`WrapperCopy` of it (Lightning's ``self.optimizers()``): the differences, the phase
    reached."""
    runs = {}
    for copied in (False, True):
        model = make_model()
        opt = onebit(model)
        stepper = WrapperCopy(opt) if copied else opt
        for step in range(steps):
            train_step(model, stepper, step)
        runs[copied] = params_of(model)
    return {"differences": differences(runs[False], runs[True], "params"), "phase": opt.phase}


def handed_to_adam(before: int = FREEZE + 3, after: int = 3) -> dict:
    """Compressed steps, the error feedback flushed, then plain Adam on the same DDP model from
    the 1-bit optimizer's state (``torch_adam_state_dict``): once the script drops the 1-bit
    optimizer, or with the module wrapped in DDP again; and with the 1-bit optimizer kept, what
    DDP + Adam's steps raised and how many were taken. The parameters of each run after
    ``after`` more steps (DDP + Adam's), and the differences between the two (a fresh DDP
    model's first iteration sums in another bucket order: the last bit may differ at more than
    two ranks)."""
    runs = {}
    for how in ("dropped", "rewrapped"):
        model = make_model()
        inner = adam(model)
        opt = hvd_onebit.ddp.DistributedOptimizer(inner, model, freeze_step=FREEZE,
                                                  bucket_size_mb=BUCKET_MB, variance_refresh=None)
        for step in range(before):
            train_step(model, opt, step)
        opt.flush_error_feedback()
        state = hvd_onebit.torch_adam_state_dict(opt.state_dict())
        if how == "dropped":  # the Adam it wrapped steps again
            del opt
            gc.collect()
            plain = inner
        else:
            model = DDP(model.module)
            plain = adam(model)
        plain.load_state_dict(state)
        for step in range(before, before + after):
            train_step(model, plain, step)
        runs[how] = params_of(model)
    # the 1-bit optimizer kept (an LR scheduler refers to it): DDP + Adam's second step is
    # refused at its forward, the first one having stepped on each rank's own gradients
    model = make_model()
    opt = onebit(model)
    kept = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    for step in range(before):
        train_step(model, opt, step)
    plain = adam(model)
    plain.load_state_dict(hvd_onebit.torch_adam_state_dict(opt.state_dict()))
    taken, error = 0, "accepted"
    try:
        for step in range(before, before + after):
            train_step(model, plain, step)
            taken += 1
    except ValueError as exc:
        error = f"ValueError: {exc}"
    again = refused(lambda: train_step(model, plain, before + after))  # the script retries
    del kept
    return {"params": runs["dropped"], "rewrapped": runs["rewrapped"],
            "differences": differences(runs["dropped"], runs["rewrapped"], "rewrapped"),
            "kept": {"error": error, "taken": taken, "again": again},
            "clipped": clipped_between_steps(before + after)}


def clipped_between_steps(steps: int, bound: float = 0.3) -> dict:
    """The script's own write to the weights (a WGAN critic's clip under no_grad) before each
    step, after a forward with gradients that no step followed (an evaluation without
    no_grad), the gradients zeroed by the model's zero_grad() (the WGAN critic's loop): no
    other optimizer's step, so nothing is refused. What the steps raised, how many were taken,
    and the parameters."""
    model, taken, error = make_model(), 0, "accepted"
    opt = onebit(model)
    try:
        for step in range(steps):
            with torch.no_grad():
                for p in model.parameters():
                    p.clamp_(-bound, bound)
            train_step(model, opt, step, zero_model=True)
            taken += 1
            model(batch(step, dist.get_rank(), 1)[0])  # evaluated, gradients on
    except ValueError as exc:
        error = f"ValueError: {exc}"
    return {"error": error, "taken": taken, "steps": steps, "params": params_of(model)}


def bucket_views(passes: tuple = (1, 1, 2, 1, 1)) -> dict:
    """gradient_as_bucket_view=True with zero_grad(set_to_none=False): the gradients stay views
    of DDP's buckets (one version counter each bucket's), in compressed steps too, which take
    ``passes`` backward passes each without no_sync() (a pass more than the last step's adds
    to every gradient after its bucket started). Against overlap=False: the differences, the
    buckets started during backward, the restarts, the warnings, and how many storages hold
    the gradients at the end."""
    out, runs = {}, []
    for overlap in (False, True):
        torch.manual_seed(0)  # four layers in one DDP bucket, in three of the optimizer's: the
        # first starts while the gradients of the first two layers still accumulate into theirs
        model = DDP(torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(4))),
                    gradient_as_bucket_view=True)
        opt = hvd_onebit.ddp.DistributedOptimizer(
            torch.optim.Adam(model.parameters(), lr=1e-2), model, freeze_step=FREEZE,
            variance_refresh=None, bucket_size_mb=0.002, overlap=overlap)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(FREEZE + len(passes)):
                opt.zero_grad(set_to_none=False)
                for k in range(1 if step < FREEZE else passes[step - FREEZE]):
                    x, _ = batch(step, dist.get_rank(), k)
                    model(x.repeat(1, 3)[:, :16]).square().mean().backward()
                opt.step()
        runs.append(params_of(model))
        out["overlap" if overlap else "off"] = {
            "early": opt.compressed_step.early_starts, "restarts": opt.compressed_step.restarts,
            "warnings": overlap_warnings(caught),
            "storages": len({p.grad.untyped_storage().data_ptr()
                             for p in model.parameters()})}
    out["differences"] = differences(runs[0], runs[1], "overlap=False")
    return out


class WithEmpty(torch.nn.Module):
    """Two layers and a parameter of no elements that the loss uses (its gradient is empty)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                          torch.nn.Linear(16, 4))
        self.empty = torch.nn.Parameter(torch.zeros(0))

    def forward(self, x):
        return self.layers(x) + self.empty.sum()


def odd_parameters(compressed: int = 4) -> dict:
    """A parameter of no elements in a DDP bucket kept as the gradients' storage
    (gradient_as_bucket_view=True), and a param group listing a parameter twice (torch warns and
    trains it): the buckets started during backward, the restarts and the overlap's warnings
    over ``compressed`` compressed steps."""
    torch.manual_seed(0)
    model = DDP(WithEmpty(), gradient_as_bucket_view=True)
    params = list(model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = hvd_onebit.ddp.DistributedOptimizer(
            torch.optim.Adam([{"params": params + params[:1]}], lr=1e-2), model,
            freeze_step=FREEZE, variance_refresh=None, bucket_size_mb=BUCKET_MB)
        for step in range(FREEZE + compressed):
            opt.zero_grad(set_to_none=False)
            x, y = batch(step, dist.get_rank())
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return {"early": opt.compressed_step.early_starts, "restarts": opt.compressed_step.restarts,
            "buckets": len(opt.compressed_step.buckets), "warnings": overlap_warnings(caught)}


# What a script changes between a compressed step's backward and its step() (every rank alike):
# the step before the change is FREEZE + 1, the one after FREEZE + 3 (requires_grad set back).
MID_STEP_CHANGES = {
    "requires_grad": lambda model, opt, step: [p.requires_grad_(step != FREEZE + 1)
                                               for p in model.module.out.parameters()],
    "flush": lambda model, opt, step: opt.flush_error_feedback() if step == FREEZE + 1 else None,
    "decoupled": lambda model, opt, step: opt.param_groups[1].__setitem__(
        "decoupled_weight_decay", step >= FREEZE + 1),
    "data": lambda model, opt, step: setattr(model.module.inner.weight, "data",
                                             model.module.inner.weight.data * 0.99)
    if step == FREEZE + 1 else None,
}


def changed_mid_step(steps: int = FREEZE + 4) -> dict:
    """Each of :data:`MID_STEP_CHANGES` made between backward and step() at the steps after the
    freeze, with the overlap on and off (Adam's L2 decay on: its input reads the weights): the
    parameters' differences and the overlap's warnings; then Adam's state replaced by another
    mapping (``opt.state = defaultdict(dict)``): what step() and state_dict() raise."""
    out = {}
    for name, change in MID_STEP_CHANGES.items():
        runs, warned = [], []
        for overlap in (True, False):
            model = make_model()
            opt = onebit(model, overlap=overlap)
            for group in opt.param_groups:
                group["weight_decay"] = 0.1
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for step in range(steps):
                    opt.zero_grad()
                    x, y = batch(step, dist.get_rank())
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    if step > FREEZE:
                        change(model, opt, step)
                    opt.step()
            runs.append(params_of(model))
            warned.append(overlap_warnings(caught))
        out[name] = {"differences": differences(runs[0], runs[1], f"{name}: overlap=False"),
                     "warnings": warned[0]}
    model = make_model()
    opt = onebit(model)
    for step in range(FREEZE + 1):
        train_step(model, opt, step)
    kept = opt.state
    opt.state = collections.defaultdict(dict)
    out["replaced"] = {"step": refused(lambda: train_step(model, opt, FREEZE + 1), RuntimeError),
                       "state_dict": refused(opt.state_dict, RuntimeError)}
    opt.state = kept  # put back: then an entry removed between backward and step()
    w = model.module.out.weight
    opt.zero_grad()
    x, y = batch(FREEZE + 1, dist.get_rank())
    torch.nn.functional.mse_loss(model(x), y).backward()
    entry = opt.state.pop(w)
    said = refused(opt.step, RuntimeError)
    opt.state[w] = entry
    before = opt.compressed_step.early_starts
    for step in range(FREEZE + 2, FREEZE + 4):  # on, starting during backward again
        train_step(model, opt, step)
    out["popped"] = {"step": said, "early": opt.compressed_step.early_starts - before,
                     "buckets": len(opt.compressed_step.buckets), "params": params_of(model)}
    return out


def copied_model(steps: int = FREEZE + 4) -> dict:
    """A deep copy of the DDP model (an EMA's or a teacher's), run forward with gradients on
    before each training forward and without between it and its backward, against the same
    run without the copy; then the model and the optimizer through torch.save, and a second
    optimizer built on the copy."""
    runs = []
    for copied in (False, True):
        model = make_model()
        opt = onebit(model)
        ema = copy.deepcopy(model) if copied else None
        for step in range(steps):
            x, y = batch(step, dist.get_rank())
            opt.zero_grad()
            if ema is not None:
                ema(x).sum()
            loss = torch.nn.functional.mse_loss(model(x), y)
            if ema is not None:
                with torch.no_grad():
                    ema(x)
            loss.backward()
            opt.step()
            if ema is not None:
                with torch.no_grad():
                    for e, p in zip(ema.parameters(), model.parameters()):
                        e.lerp_(p, 0.1)
        runs.append(params_of(model))
    saved = io.BytesIO()
    torch.save(model, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    before = opt.compressed_step.early_starts
    loaded(batch(0, dist.get_rank())[0]).sum().backward()
    def join_the_copy():
        with ema.join():
            pass

    copy_join = refused(join_the_copy)  # the copy is plain DDP: its join() is DDP's
    second = refused(lambda: onebit(ema, freeze_step=1))
    return {"differences": differences(runs[0], runs[1], "with a copy"),
            "loaded": differences(params_of(loaded), runs[1], "loaded"),
            "early_starts_by_the_loaded": opt.compressed_step.early_starts - before,
            "pickled_opt": refused(lambda: torch.save(opt, io.BytesIO())),
            "copied_opt": refused(lambda: copy.deepcopy(opt)), "second_on_the_copy": second,
            "copy_join": copy_join}


def rolled_back_mid_step(at: int = FREEZE + 2) -> str:
    """A rollback between a compressed step's backward and its step(): the model and the
    optimizer load a state saved at the freeze, with no zero_grad() between, then the next
    batch's forward, backward and step(): what they raised, or "accepted" (the parameters moved
    by this optimizer's load, not by another optimizer's step)."""
    model = make_model()
    opt = onebit(model)
    rank = dist.get_rank()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the saved error feedback was not flushed
        for step in range(at):
            train_step(model, opt, step)
            if step == FREEZE:
                saved = copy.deepcopy((model.module.state_dict(), opt.state_dict()))
        x, y = batch(at, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        model.module.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])
        try:
            x, y = batch(at + 1, rank)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        except ValueError as exc:
            return f"ValueError: {exc}"
    return "accepted"


def closure_steps(steps: int = FREEZE + 4) -> dict:
    """opt.step(closure) against backward + opt.step() through the warmup, refresh steps and
    compressed steps: the differences, and the losses step(closure) returned."""
    runs, losses = [], []
    for closure_style in (False, True):
        model = make_model()
        opt = onebit(model, variance_refresh="doubling")
        for step in range(steps):
            if not closure_style:
                train_step(model, opt, step)
                continue

            def closure():
                opt.zero_grad()
                x, y = batch(step, dist.get_rank())
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                return float(loss)

            losses.append(opt.step(closure))
        runs.append(params_of(model))
    return {"losses": losses, "refreshes": opt.telemetry()["refreshes"],
            "differences": differences(runs[0], runs[1], "step(closure)")}


def refusals() -> dict:
    """The errors of what the face refuses (each raised alike on every rank)."""
    out = {}
    torch.manual_seed(0)
    plain = Net()
    out["not_ddp"] = refused(lambda: hvd_onebit.ddp.DistributedOptimizer(
        torch.optim.Adam(plain.parameters()), plain, freeze_step=FREEZE))
    model = make_model()
    out["other_params"] = refused(lambda: hvd_onebit.ddp.DistributedOptimizer(
        torch.optim.Adam(Net().parameters()), model, freeze_step=FREEZE))
    hooked = make_model()

    def noop(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    hooked.register_comm_hook(None, noop)
    out["hooked"] = refused(lambda: onebit(hooked))
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):  # compiled autograd's
        python_reducer = make_model()
    out["python_reducer"] = refused(lambda: onebit(python_reducer))
    nested = DDP(make_model())  # Accelerate's prepare() of a model already in DDP
    out["nested"] = refused(lambda: hvd_onebit.ddp.DistributedOptimizer(
        torch.optim.Adam(nested.parameters()), nested, freeze_step=FREEZE))
    # what differs between ranks is refused on every rank: the optimizer's parameters in
    # another order (param groups built from a set()), one of them left out, another freeze_step
    last = dist.get_rank() == dist.get_world_size() - 1
    shared = make_model()
    ps = list(shared.parameters())

    def on_last(mine, theirs):
        return lambda: hvd_onebit.ddp.DistributedOptimizer(
            torch.optim.Adam(mine if last else ps), shared, freeze_step=theirs if last else FREEZE)

    out["reordered"] = refused(on_last(ps[::-1], FREEZE))
    out["subset"] = refused(on_last(ps[:-1], FREEZE))
    out["freeze_step"] = refused(on_last(ps, FREEZE + 1))
    out["options"] = refused(lambda: onebit(shared, check_every=1 if last else 0))
    # what one rank alone refuses (its own option, its optimizer's class) every rank raises
    out["bad_on_last"] = refused(lambda: onebit(shared, block_size=7 if last else 512))
    out["sgd_on_last"] = refused(lambda: hvd_onebit.ddp.DistributedOptimizer(
        (torch.optim.SGD(ps, lr=0.1) if last else torch.optim.Adam(ps)), shared,
        freeze_step=FREEZE))
    out["parameters"] = len(ps)
    out["transport"] = refused(lambda: onebit(shared, transport="torch"))
    out["process_group"] = refused(lambda: onebit(shared, process_group="world"))
    out["sgd"] = refused(lambda: hvd_onebit.ddp.DistributedOptimizer(
        torch.optim.SGD(shared.parameters(), lr=0.1), shared, freeze_step=FREEZE))
    out["float64"] = refused(lambda: onebit(make_model(dtype=torch.float64)))
    torch.manual_seed(0)
    net = Net()
    DDP._set_params_and_buffers_to_ignore_for_model(net, ["inner.bias"])
    ignoring = DDP(net)
    out["ignored"] = refused(lambda: onebit(ignoring))
    torch.manual_seed(0)
    frozen = Net()
    frozen.inner.bias.requires_grad_(False)
    DDP._set_params_and_buffers_to_ignore_for_model(frozen, ["inner.bias"])
    frozen = DDP(frozen)
    out["ignored_frozen"] = refused(lambda: onebit(frozen))
    gc.collect()
    out["amsgrad_set"] = amsgrad_set_later()
    # checkpoints handed to the wrong load
    loading = onebit(shared)
    out["model_state"] = refused(lambda: loading.load_state_dict(shared.module.state_dict()))
    out["optimizer_state_as_errors"] = refused(
        lambda: loading.load_error_feedback_state_dict(loading.state_dict()))
    out["none_as_errors"] = refused(lambda: loading.load_error_feedback_state_dict(None))
    del loading
    gc.collect()
    # the model's last parameter left to another optimizer, on every rank
    split = make_model()
    out["split_name"] = list(split.module.named_parameters())[-1][0]
    out["split"] = refused(lambda: hvd_onebit.ddp.DistributedOptimizer(
        torch.optim.Adam(list(split.parameters())[:-1]), split, freeze_step=FREEZE))
    out["unfrozen"] = [unfrozen_later(at) for at in (1, FREEZE + 1)]
    out["added"] = unfrozen_later(1, added=True)
    out["sparse"] = refused(sparse_embedding_step)
    stepped = make_model()
    inner = adam(stepped)
    stepped_opt = hvd_onebit.ddp.DistributedOptimizer(inner, stepped, freeze_step=FREEZE)
    before = [p.detach().clone() for p in stepped.parameters()]
    out["original"] = refused(lambda: train_step(stepped, inner, 0))  # Accelerate's way
    out["original_changed"] = [i for i, (b, p) in enumerate(zip(before, stepped.parameters()))
                               if not torch.equal(b, p)]
    train_step(stepped, stepped_opt, 0)
    out["after_original"] = stepped_opt.steps
    # another model's optimizer given this one (a GAN's discriminator's built on the generator)
    out["wrong_model"] = refused(lambda: hvd_onebit.ddp.DistributedOptimizer(
        torch.optim.Adam(Net().parameters()), stepped, freeze_step=FREEZE))
    joined = make_model()
    joined_opt = onebit(joined)
    train_step(joined, joined_opt, 0)

    def uneven_inputs():
        with joined.join():
            train_step(joined, joined_opt, 1)

    out["join"] = refused(uneven_inputs)
    out["after_join"] = joined_opt.steps
    with torch.no_grad():  # evaluation after join() is left alone
        joined(batch(0, 0)[0])
    if dist.get_world_size() == 4:
        out["pairs"] = pairs_of_replicas()
    # the refusals left the model as it was: it takes the face afterwards
    opt = onebit(model)
    train_step(model, opt, 0)
    out["after"] = opt.steps
    return out


class Shared(torch.nn.Module):
    """One layer applied three times, each under reentrant activation checkpointing: its
    parameters take their gradient in three parts, one per checkpointed segment's backward."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(6, 16)
        self.block = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x, extra: bool = False):
        from torch.utils.checkpoint import checkpoint

        h = self.first(x)
        for _ in range(3):
            h = checkpoint(lambda t: torch.tanh(self.block(t)), h, use_reentrant=True)
        return self.out(h)


def reentrant_checkpointing(steps: int = FREEZE + 4) -> dict:
    """The warnings the compressed steps of :class:`Shared` give (static_graph=True, as DDP
    needs for it) and their parameters, with the overlap on and off."""
    out = {}
    for overlap in (True, False):
        torch.manual_seed(0)
        model = DDP(Shared(), static_graph=True)
        opt = hvd_onebit.ddp.DistributedOptimizer(
            torch.optim.Adam(model.parameters(), lr=LRS[0]), model, freeze_step=FREEZE,
            bucket_size_mb=BUCKET_MB, variance_refresh=None, overlap=overlap)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(steps):
                train_step(model, opt, step)
        out[overlap] = {"warnings": [str(w.message) for w in caught
                                     if "hvd_onebit" in str(w.message)],
                        "phase": opt.phase, "params": params_of(model)}
        del opt
        gc.collect()
    return out


def amsgrad_set_later() -> dict:
    """amsgrad=True set on a param group after the freeze: step() refuses it, changing
    nothing; set back to False, the steps go on."""
    model = make_model()
    opt = onebit(model)
    for step in range(FREEZE + 1):
        train_step(model, opt, step)
    opt.param_groups[0]["amsgrad"] = True
    before = params_of(model)
    error = refused(lambda: train_step(model, opt, FREEZE + 1))
    out = {"error": error, "steps": opt.steps,
           "changed": differences(params_of(model), before, "refused")}
    opt.param_groups[0]["amsgrad"] = False
    opt.zero_grad()
    train_step(model, opt, FREEZE + 1)
    out["after"] = opt.steps
    del opt
    gc.collect()
    return out


def scheduler_on_the_wrapped_adam(steps: int = FREEZE + 3) -> dict:
    """A scheduler built on the Adam the face wraps (as docs/ddp.md allows), the face's
    state_dict() loaded back into it mid-run (a resume): the learning rates the scheduler sets
    afterwards, as the wrapped Adam and the face see them, and the steps' parameters against
    an optimizer never reloaded."""
    out = {}
    for reload in (False, True):
        model = make_model()
        inner = adam(model)
        scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 0.5 ** s)
        opt = hvd_onebit.ddp.DistributedOptimizer(inner, model, freeze_step=FREEZE,
                                                  bucket_size_mb=BUCKET_MB, variance_refresh=None)
        for step in range(steps):
            if step == FREEZE + 1:  # flushed in both runs, reloaded in one
                opt.flush_error_feedback()
                if reload:
                    opt.load_state_dict(opt.state_dict())
            train_step(model, opt, step)
            scheduler.step()
        out["reloaded" if reload else "kept"] = {
            "inner_lrs": [g["lr"] for g in inner.param_groups],
            "face_lrs": [g["lr"] for g in opt.param_groups],
            "params": params_of(model)}
        del opt
        gc.collect()
    return out


def compiled_step(steps: int = FREEZE + 3) -> dict:
    """Zero_grad, forward, backward and ``opt.step()`` in one ``torch.compile``'d function, as
    torch's docs compile Adam's step, against the same steps run eagerly: whether the two
    runs' parameters are the same bits, and the phase reached."""
    runs = []
    for compiled in (False, True):
        model = make_model()
        opt = onebit(model)

        def one(step):
            train_step(model, opt, step)

        stepper = torch.compile(one, backend="eager") if compiled else one
        for step in range(steps):
            stepper(step)
        runs.append(params_of(model))
    return {"differences": differences(runs[0], runs[1], "compiled step vs eager"),
            "phase": opt.phase}


def one_node_hierarchical() -> dict:
    """hierarchical=True with every rank on this one host, past the freeze: the warnings about
    it and the phase reached; outside torchrun (no node layout), the refusal."""
    model = make_model()
    if os.environ.get("TORCHELASTIC_RUN_ID") is None:
        return {"refused": refused(lambda: onebit(model, hierarchical=True))}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = onebit(model, hierarchical=True)
        for step in range(FREEZE + 2):
            train_step(model, opt, step)
    return {"warnings": [str(w.message) for w in caught if "hierarchical" in str(w.message)],
            "phase": opt.phase}


def pairs_of_replicas() -> dict:
    """At 4 ranks, DDP over the pairs {0, 1} and {2, 3} (two replicas of a model, as in 2-D
    parallelism): a process_group of other ranks, or one that does not hold this rank, and
    hierarchical=True are refused; "auto" warns and trains the pair flat. Whether each pair's
    parameters are then the same bits."""
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    crossed = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    solo = dist.new_group([0])  # NON_GROUP_MEMBER on ranks 1 to 3
    mine = pairs[rank // 2]
    torch.manual_seed(0)
    model = DDP(Net(), process_group=mine)
    out = {"crossed": refused(lambda: onebit(model, process_group=crossed[rank % 2])),
           "not_member": refused(lambda: onebit(model, process_group=solo)),
           "hierarchical": refused(lambda: onebit(model, hierarchical=True))}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = onebit(model, hierarchical="auto")
    for step in range(FREEZE + 2):
        train_step(model, opt, step)
    out["auto"] = [str(w.message) for w in caught if "hierarchical" in str(w.message)]
    out["phase"] = opt.phase
    flat = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
    both = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(both, flat, group=mine)
    out["pair_identical"] = bool(torch.equal(both[0], both[1]))
    return out


def averaged_gradient_poisoned(iterations: int = 8, poisoned: tuple = (1, 5)) -> list[dict]:
    """At each iteration in ``poisoned`` the last rank writes an inf into its gradient after
    backward, DDP's average in full-precision steps (1: the warmup; 5: a variance refresh
    step): per iteration the step count, phase, skipped steps, refreshes and the parameters."""
    model = make_model()
    opt = onebit(model, variance_refresh="doubling")
    last = dist.get_world_size() - 1
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for it in range(iterations):
            opt.zero_grad()
            x, y = batch(it, dist.get_rank(), 0)
            torch.nn.functional.mse_loss(model(x), y).backward()
            if it in poisoned and dist.get_rank() == last:
                next(model.parameters()).grad.view(-1)[0] = float("inf")
            opt.step()
            t = opt.telemetry()
            out.append({"steps": opt.steps, "phase": opt.phase, "skipped": t["skipped_steps"],
                        "refreshes": t["refreshes"],
                        "params": b"".join(p.tobytes() for p in params_of(model))})
    return out


def host_reads(steps: int = FREEZE + 4) -> dict:
    """The reads of tensor values by the library's own lines per step (each a device-to-host
    sync on a GPU; torch's Adam's own left out), with lr and betas given as floats and, from
    the freeze on, as tensors of the same values (torch's own Adam steps otherwise on tensor
    options than on floats), and with floats through a GradScaler: per run the (backward,
    step()) counts of each step and the parameters."""
    me, out = threading.get_ident(), {}
    for run in ("floats", "tensors", "scaled"):
        tensors = run == "tensors"
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if run == "scaled" else None
        model = make_model()
        opt = onebit(model)
        for group in opt.param_groups:  # the values float32 rounds them to
            group["lr"] = torch.tensor(group["lr"]).item()
            group["betas"] = tuple(torch.tensor(group["betas"]).tolist())
        counts = []
        with HostReads() as reads:
            for step in range(steps):
                if tensors and step == FREEZE:
                    for group in opt.param_groups:
                        group["lr"] = torch.tensor(group["lr"])
                        group["betas"] = torch.tensor(group["betas"]).unbind()
                before = reads.count_ours(me)
                opt.zero_grad()
                x, y = batch(step, dist.get_rank())
                loss = torch.nn.functional.mse_loss(model(x), y)
                (loss if scaler is None else scaler.scale(loss)).backward()
                middle = reads.count_ours(me)
                if scaler is None:
                    opt.step()
                else:
                    scaler.step(opt)
                    scaler.update()
                counts.append((middle - before, reads.count_ours(me) - middle))
        out[run] = {"counts": counts, "params": params_of(model)}
    return out


def grad_scaler_skips(iterations: int = 8, poisoned: tuple = (1, 5)) -> list[dict]:
    """A GradScaler through scaler.step(opt); at each iteration in ``poisoned`` the last rank's
    loss is inf (iteration 1 in the warmup, 5 in the compression phase): per iteration the
    step count, phase, scale, skipped steps and a digest of the parameters."""
    model = make_model()
    opt = onebit(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1000)
    last = dist.get_world_size() - 1
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for it in range(iterations):
            train_step(model, opt, it, scaler=scaler,
                       poison=it in poisoned and dist.get_rank() == last)
            out.append({"steps": opt.steps, "phase": opt.phase, "scale": scaler.get_scale(),
                        "skipped": opt.telemetry()["skipped_steps"],
                        "params": b"".join(p.tobytes() for p in params_of(model))})
    return out


def grad_scaler_through_a_wrapper(steps: int = FREEZE + 3) -> dict:
    """GradScaler.step() through a wrapper of opt.step that hides its grad_scaler argument (as
    Accelerate's fp16 wraps it): what a warmup step and a compressed step raised, the steps
    taken, and whether the run then goes on (the wrapper given step()'s signature) as one
    that never met it."""
    runs, out = [], {"errors": []}
    for wrapped in (False, True):
        model = make_model()
        opt = onebit(model)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        own = opt.step
        for step in range(steps):
            if wrapped and step in (0, FREEZE):  # a warmup step, the first compressed step
                opt.step = lambda *args, **kwargs: own(*args, **kwargs)
                try:
                    train_step(model, opt, step, scaler=scaler)
                except RuntimeError as exc:
                    out["errors"].append(str(exc))
                out.setdefault("steps_after_refusal", []).append(opt.steps)
                opt.step = functools.wraps(own)(lambda *args, **kwargs: own(*args, **kwargs))
            train_step(model, opt, step, scaler=scaler)
        runs.append(params_of(model))
    model = make_model()  # a warmup step (torch's Adam's) through scaler.step(opt) itself, with
    opt = onebit(model)  # the attributes a step whose closure raised leaves behind
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    opt.grad_scale, opt.found_inf = torch.full((1,), 2.0 ** 8), torch.zeros(1)
    try:
        train_step(model, opt, 0, scaler=scaler)
        out["after_leftovers"] = opt.steps
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["after_leftovers"] = f"{type(exc).__name__}: {exc}"
    out["differences"] = differences(runs[0], runs[1], "refused first")
    out["max_diff"] = max(float(np.abs(a - b).max()) for a, b in zip(*runs))
    return out


def low_precision(dtype: str, steps: int = 3) -> dict:
    """float16 / bfloat16 parameters through both phases: float32 Adam state, finite
    parameters, the same on every rank."""
    model = make_model(dtype=getattr(torch, dtype))
    opt = onebit(model)
    rank = dist.get_rank()
    for step in range(FREEZE + steps):
        opt.zero_grad()
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x.to(getattr(torch, dtype))).float(), y)
        loss.backward()
        opt.step()
    state_dtypes = sorted({str(opt.state[p][k].dtype) for p in model.module.parameters()
                           for k in ("exp_avg", "exp_avg_sq")})
    return {"params": [p.detach().float().numpy() for p in model.module.parameters()],
            "dtypes": sorted({str(p.dtype) for p in model.module.parameters()}),
            "state_dtypes": state_dtypes, "steps": opt.steps, "phase": opt.phase}


def variance_refresh(variant: str = "plain", iterations: int = 6,
                     second_steps: bool = False) -> dict:
    """variance_refresh="doubling" (refreshes every other step here): the refresh steps take
    DDP's averaged gradients, the others travel in 1 bit. ``variant``: DDP's options and the
    steps' pattern (:data:`VARIANTS`; "unused": find_unused_parameters=True, a branch used on
    some (step, rank) only, so a refresh step's backward, averaged by DDP, follows compressed
    steps' local ones that used the branch where this one does not, its gradient None since
    zero_grad). ``second_steps``: a second step() without a backward after every other
    iteration's; those that refresh take gradients a compressed step's backward left local."""
    from hvd_onebit.config import Experimental

    kwargs, pattern = VARIANTS[variant]
    model = make_model(**kwargs)
    opt = onebit(model, variance_refresh="doubling",
                 experimental=Experimental(refresh_schedule={"first_interval": 2}))
    extra_steps = extra_refreshes = 0
    for step in range(FREEZE + iterations):
        train_step(model, opt, step, pattern)
        if second_steps and step % 2 == 0:
            before = opt.telemetry()["refreshes"]
            opt.step()
            extra_steps += 1
            extra_refreshes += opt.telemetry()["refreshes"] - before
    return {"params": params_of(model), "steps": opt.steps, "phase": opt.phase,
            "refreshes": opt.telemetry()["refreshes"], "local_steps": opt._hook.local_steps,
            "iterations": FREEZE + iterations, "extra_steps": extra_steps,
            "extra_refreshes": extra_refreshes}


def horovod_unused() -> dict:
    """After every other scenario of a rank that cannot import Horovod (torchrun's worlds): the
    Horovod modules loaded (none expected), and what asking for the Horovod face raises."""
    import sys

    import hvd_onebit

    loaded = sorted(m for m in sys.modules if m.startswith("horovod") and sys.modules[m])
    try:
        hvd_onebit.DistributedOptimizer
        refused = "accepted"
    except ImportError as exc:
        refused = f"ImportError: {exc}"
    return {"loaded": loaded, "horovod_face": refused}


def suite(scratch: Optional[str] = None, stage: Optional[str] = None) -> dict:
    """Every scenario of one world; ``stage`` "save" (the first world) writes the flushed
    checkpoint into ``scratch``, "load" (a later world, another size) resumes it, None: no
    flushed checkpoint. In torchrun's worlds (Horovod blocked) a last scenario says whether
    anything imported Horovod."""
    rank = dist.get_rank()
    scenarios = {f"warmup_{v}": partial(warmup_is_ddp_adam, v) for v in VARIANTS}
    scenarios["warmup_grad_scaler"] = partial(warmup_is_ddp_adam, "plain", scaled=True)
    scenarios.update({f"compression_{v}": partial(compression_record, v) for v in VARIANTS})
    scenarios["compression_check_every"] = partial(compression_record, "plain", check_every=1)
    scenarios.update({f"low_precision_{d}": partial(low_precision, d)
                      for d in ("float16", "bfloat16")})
    scenarios.update(averaged_poisoned=averaged_gradient_poisoned)
    scenarios.update(checkpoint=checkpoint_resumes, dcp=dcp_checkpoint_resumes,
                     flushed_after_taken=flushed_after_taken,
                     refresh=variance_refresh, refusals=refusals,
                     inner_scheduler=scheduler_on_the_wrapped_adam,
                     reentrant=reentrant_checkpointing,
                     one_node_hierarchical=one_node_hierarchical, compiled_step=compiled_step,
                     refresh_second_steps=partial(variance_refresh, second_steps=True),
                     refresh_unused=partial(variance_refresh, "unused", iterations=8),
                     refresh_unused_second_steps=partial(variance_refresh, "unused",
                                                         iterations=8, second_steps=True),
                     rebuilt=rebuilt, rebuilt_static=partial(rebuilt, static_graph=True),
                     skipped_batch=skipped_batch, closure=closure_steps,
                     forward_without_backward=forward_without_backward,
                     forward_raises=forward_raises, written_in_forward=written_in_forward,
                     accumulated=accumulated_without_no_sync,
                     handed_to_adam=handed_to_adam, wrapper_copy=through_a_wrapper_copy,
                     another_wrapper=another_wrapper_runs,
                     rolled_back=rolled_back_mid_step, copied=copied_model,
                     bucket_views=bucket_views, odd_parameters=odd_parameters,
                     changed_mid_step=changed_mid_step,
                     scaler_wrapped=grad_scaler_through_a_wrapper,
                     grad_scaler=grad_scaler_skips, host_reads=host_reads)
    if stage is not None:
        scenarios["flushed"] = partial(flushed_checkpoint, f"{scratch}/flushed.pt",
                                       stage == "save")
    if os.environ.get("TORCHELASTIC_RUN_ID") is not None:  # under torchrun, Horovod blocked
        scenarios["horovod_unused"] = horovod_unused
    return run_scenarios(scenarios, rank)
