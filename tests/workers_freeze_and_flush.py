"""Worker functions for freeze_step="auto" and flush_error_feedback. They return data;
the tests assert."""
from __future__ import annotations

import copy
import logging
import threading
import warnings
from pathlib import Path
from typing import Optional

import horovod.torch as hvd
import torch
import torch.nn as nn

import hvd_onebit
from hvd_onebit.engine import CompressedStep
from hvd_onebit.config import OneBitConfig
from hvd_onebit import Experimental
from tests.scenarios import run_scenarios
from tests.workers_compressed_step import BETAS, EPS, LR, WARM_STEPS, gradient, initial_state
from tests.workers_optimizer import batch, make_model, params_bytes, val_loss


def _changed(before: list, after: list) -> list:
    """``[(index, max |diff|), ...]`` for the tensors of ``after`` that are not torch.equal to
    those of ``before`` (inf where an element turned non-finite or a shape changed)."""
    out = []
    for i, (a, b) in enumerate(zip(before, after)):
        if not torch.equal(a, b):
            diff = float((a.double() - b.double()).abs().nan_to_num(nan=float("inf")).max()) \
                if a.shape == b.shape and a.numel() else float("inf")
            out.append((i, diff))
    return out

# Small enough for the toy model to decide after a few checks, by the tolerance, not max_steps.
AUTO = dict(window=2, tolerance=0.15, patience=2, min_steps=4, max_steps=40)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _train(model, opt, steps, record=None, data_ranks=None):
    """``data_ranks``: the global batch is that many ranks' batches, whatever the world size
    (each rank takes every size()-th of them), so runs at different sizes see the same data."""
    for step in steps:
        if record is not None:
            record.append((opt.phase, opt.freeze_step))
        opt.zero_grad()
        mine = range(hvd.rank(), data_ranks, hvd.size()) if data_ranks else [hvd.rank()]
        x, y = (torch.cat(t) for t in zip(*(batch(step, q) for q in mine)))
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _save(opt, model, where: Path) -> None:
    where.mkdir(parents=True, exist_ok=True)
    if hvd.rank() == 0:
        torch.save(model.state_dict(), where / "model.pt")
        torch.save(opt.state_dict(), where / "optimizer.pt")
    torch.save(opt.error_feedback_state_dict(), where / f"ef.rank{hvd.rank()}.pt")


def _load(opt, model, where: Path, error_feedback: bool = True) -> None:
    model.load_state_dict(torch.load(where / "model.pt"))
    opt.load_state_dict(torch.load(where / "optimizer.pt"))
    if error_feedback:
        opt.load_error_feedback_state_dict(torch.load(where / f"ef.rank{hvd.rank()}.pt"))


def auto_freeze_run(ckpt_dir, total=30, resume_from: Optional[int] = None, save_every=False,
                    broadcast: Optional[int] = None):
    """freeze_step="auto" on the toy model. ``save_every``: a checkpoint after every step (under
    ckpt_dir/step<k>); ``resume_from=k``: start from that checkpoint in this new job, loaded on
    every rank, or with ``broadcast=r`` on rank r and sent on with Horovod's
    hvd.broadcast_parameters and hvd.broadcast_optimizer_state."""
    handler = _Records()
    logging.getLogger("hvd_onebit").addHandler(handler)
    logging.getLogger("hvd_onebit").setLevel(logging.INFO)
    model = make_model()
    opt = hvd_onebit.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                          named_parameters=model.named_parameters(),
                                          freeze_step="auto",
                                          experimental=Experimental(auto_freeze=AUTO))
    ckpt = Path(ckpt_dir)
    if resume_from is not None and broadcast is None:
        _load(opt, model, ckpt / f"step{resume_from}")
    elif resume_from is not None:
        if hvd.rank() == broadcast:
            _load(opt, model, ckpt / f"step{resume_from}", error_feedback=False)
        hvd.broadcast_parameters(model.state_dict(), root_rank=broadcast)
        hvd.broadcast_optimizer_state(opt, root_rank=broadcast)
    seen, start = [], opt.steps
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(start, total):
            _train(model, opt, [step], seen)
            if save_every:
                _save(opt, model, ckpt / f"step{opt.steps}")
    hvd.allreduce(torch.zeros(1), name="saved")  # every file written before anyone exits
    logging.getLogger("hvd_onebit").removeHandler(handler)
    decision = opt.freeze_decision
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # its own state, saved and loaded
    return {"start": start, "seen": seen, "freeze_step": opt.freeze_step,
            "decision": decision, "reloaded": opt.freeze_decision, "phase": opt.phase,
            "log": handler.messages,
            "params": params_bytes(model), "steps": opt.steps,
            "warnings": [str(w.message) for w in caught if "freeze_step='auto'" in str(w.message)]}


def auto_freeze_suite(ckpt_dir, total=30) -> dict:
    """One job for the auto-freeze tests: the uninterrupted run with a checkpoint after every
    step, then, with a fresh model and optimizer each, resumed from the checkpoint one step
    before its decision and from three steps after it (loaded on every rank, or on one rank and
    broadcast). Each fails on its own (a failed full
    run fails the resumed ones too: they need its decision)."""
    full = {}

    def uninterrupted():
        full["run"] = auto_freeze_run(ckpt_dir, total, save_every=True)
        return full["run"]

    return run_scenarios({
        "full": uninterrupted,
        "before": lambda: auto_freeze_run(ckpt_dir, total,
                                          resume_from=full["run"]["freeze_step"] - 1),
        "after": lambda: auto_freeze_run(ckpt_dir, total,
                                         resume_from=full["run"]["freeze_step"] + 3),
        "broadcast": lambda: auto_freeze_run(ckpt_dir, total, broadcast=0,
                                             resume_from=full["run"]["freeze_step"] - 3),
        "broadcast_from_1": lambda: auto_freeze_run(ckpt_dir, total, broadcast=1,
                                                    resume_from=full["run"]["freeze_step"] - 3),
        "broadcast_after": lambda: auto_freeze_run(ckpt_dir, total, broadcast=0,
                                                   resume_from=full["run"]["freeze_step"] + 3),
    }, hvd.rank())


# ---- flush_error_feedback ------------------------------------------------------------------------

DATA_RANKS = 4  # checkpoints of a 4-rank job, resumed at 2 and 4 ranks on the same global batches

def _buckets(opt):
    engine = opt.compressed_step
    comms = [engine.collectives.of(b) for b in engine.buckets]
    return engine, comms


def _denominators(engine, group: dict) -> Optional[list]:
    """Each bucket's frozen denominators, in its element order, when the engine compresses the
    preconditioned momentum (the units its errors are in); None otherwise."""
    if not engine.preconditioned:
        return None
    import math

    from hvd_onebit.kernels.fused_reference import frozen_denominator

    out = []
    for b in engine.buckets:
        d = torch.empty(b.numel)
        for i, seg in enumerate(b.segments):
            st = engine.state[seg.param]
            sqrt_bc2 = math.sqrt(1 - group["betas"][1] ** st["frozen_variance_step"])
            d[seg.offset:seg.offset + seg.numel] = frozen_denominator(
                b.piece(i, st["exp_avg_sq"]).reshape(-1), sqrt_bc2, group["eps"])
        out.append(d)
    return out


def _snapshot(opt) -> dict:
    engine, comms = _buckets(opt)
    return {"momenta": [b.momentum.clone() for b in engine.buckets],
            "worker_errors": [c.worker_error for c in comms],
            "server_errors": [c.server_error for c in comms],
            "chunks": [c.layout.chunk for c in comms],
            "denominators": _denominators(engine, opt.param_groups[0])}


def _flush_opt(freeze_step=3, flush_on_commit=False):
    model = make_model()
    opt = hvd_onebit.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                          named_parameters=model.named_parameters(),
                                          freeze_step=freeze_step, bucket_size_mb=0.002,
                                          flush_on_commit=flush_on_commit,
                                          variance_refresh=None)
    return model, opt


def flush_in_warmup(steps=8, flush_at=2):
    """A flush in the warmup changes nothing: the run matches one without it, bit for bit."""
    runs = {}
    for flush in (False, True):
        model, opt = _flush_opt(freeze_step=5)
        nbytes = None
        for step in range(steps):
            _train(model, opt, [step])
            if flush and step == flush_at:
                before = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
                nbytes = opt.flush_error_feedback()
                changed = _changed(before, [opt.state[p]["exp_avg"] for p in model.parameters()])
        runs[flush] = {"params": params_bytes(model), "phase": opt.phase}
    return {"bytes": nbytes, "momentum_changed": changed, "with": runs[True],
            "without": runs[False]}


def flush_in_compression(steps=7):
    """After a flush: what each rank held before (to check the fold), what it holds after."""
    model, opt = _flush_opt()
    _train(model, opt, range(steps))
    before = _snapshot(opt)
    nbytes = opt.flush_error_feedback()
    after = _snapshot(opt)
    ef = opt.error_feedback_state_dict()
    _train(model, opt, range(steps, steps + 3))  # training goes on after a flush
    return {"before": before, "after": after, "bytes": nbytes,
            "numel": [b.numel for b in opt.compressed_step.buckets],
            "ef_norms": [float(t.norm()) for b in ef["buckets"].values()
                         for t in (b["worker_error"], b["server_error"])],
            "nonfinite_after": {name: int((~torch.isfinite(p)).sum())
                                for name, p in model.named_parameters()
                                if not bool(torch.isfinite(p).all())}}


def flush_nonfinite(steps=6, bad_rank=1):
    """An inf in one rank's worker error: every rank raises the same error, nothing changes."""
    model, opt = _flush_opt()
    _train(model, opt, range(steps))
    _, comms = _buckets(opt)
    if hvd.rank() == bad_rank:
        comms[-1].errors.worker_y[0] = float("inf")  # its factored form: e_w = y - s*sign(y)
    before = _snapshot(opt)
    try:
        opt.flush_error_feedback()
        error = None
    except FloatingPointError as exc:
        error = f"{type(exc).__name__}: {exc}"
    after = _snapshot(opt)
    changed = {k: _changed(before[k], after[k])
               for k in ("momenta", "worker_errors", "server_errors")}
    return {"error": error, "changed": changed}


def flush_on_commit(steps=6):
    """The elastic state handler folds the error feedback at save() (what commit() calls)."""
    model, opt = _flush_opt(flush_on_commit=True)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=0)
    _train(model, opt, range(steps))
    _, comms = _buckets(opt)
    norms_before = sum(float(c.worker_error.norm()) for c in comms)
    state.save()
    saved = state._handlers["optimizer"]._saved_optimizer_state
    return {"norms_before": norms_before,
            "norms_after": sum(float(c.worker_error.norm() + c.server_error.norm())
                               for c in comms),
            "saved_differs_from_live": _changed(
                [saved["state"][i]["exp_avg"] for i, _ in enumerate(model.parameters())],
                [opt.state[p]["exp_avg"] for p in model.parameters()])}


def restore_without_flush(steps=6):
    """An elastic restore of a state committed with unflushed error feedback (flush_on_commit
    off), then the sync every reset runs: the record says what was unflushed, and training on
    warns nothing about it (a reset drops the errors by design)."""
    model, opt = _flush_opt()
    state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=0)
    _train(model, opt, range(steps))
    state.save()
    committed = opt.state_dict()["onebit"]["unflushed_error_feedback"]
    _train(model, opt, [steps])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state.restore()
        state.sync()
        _train(model, opt, range(steps, steps + 2))
    return {"committed_unflushed": committed, "steps": opt.steps,
            "warnings": [str(w.message) for w in caught]}


def flush_suite():
    return {"warmup": flush_in_warmup(), "compression": flush_in_compression(),
            "nonfinite": flush_nonfinite(), "commit": flush_on_commit(),
            "restore": restore_without_flush()}


def flush_checkpoint_save(ckpt_dir, stop_at=8, total=16, freeze_step=4, lr=1e-2):
    """Train to ``stop_at``; save rank 0's state as it is (dir/reset) and after a flush
    (dir/flush); then put the unflushed state back (bit for bit: the optimizer state and every
    rank's error feedback) and train on to ``total``: the uninterrupted run. Also what the
    state's record said of the error feedback before and after the flush."""
    ckpt = Path(ckpt_dir)
    model, opt = _flush_opt(freeze_step=freeze_step)
    for g in opt.param_groups:
        g["lr"] = lr
    _train(model, opt, range(stop_at), data_ranks=DATA_RANKS)
    for kind in ("reset", "flush"):
        (ckpt / kind).mkdir(parents=True, exist_ok=True)
    kept = copy.deepcopy(opt.state_dict()), opt.error_feedback_state_dict()
    unflushed = [kept[0]["onebit"]["unflushed_error_feedback"]]
    if hvd.rank() == 0:
        torch.save(model.state_dict(), ckpt / "reset" / "model.pt")
        torch.save(opt.state_dict(), ckpt / "reset" / "optimizer.pt")
    nbytes = opt.flush_error_feedback()
    unflushed.append(opt.state_dict()["onebit"]["unflushed_error_feedback"])
    momentum = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    if hvd.rank() == 0:
        torch.save(model.state_dict(), ckpt / "flush" / "model.pt")
        torch.save(opt.state_dict(), ckpt / "flush" / "optimizer.pt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(kept[0])
        opt.load_error_feedback_state_dict(kept[1])
        _train(model, opt, range(stop_at, total), data_ranks=DATA_RANKS)
    hvd.allreduce(torch.zeros(1), name="saved")
    return {"val_loss": val_loss(model), "tensors": [p.detach().clone() for p in model.parameters()],
            "flushed_momentum": momentum, "bytes": nbytes, "unflushed": unflushed,
            "warnings": [str(w.message) for w in caught]}


def flush_checkpoint_resume(ckpt_dir, stop_at=8, total=16, freeze_step=4, lr=1e-2):
    """Resume both checkpoints of flush_checkpoint_save (rank 0's files only) in this job, and
    the flushed one loaded after the other ("reset_flush": it replaces it)."""
    out = {}
    for kind in ("flush", "reset", "reset_flush"):
        model, opt = _flush_opt(freeze_step=freeze_step)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for part in kind.split("_"):
                _load(opt, model, Path(ckpt_dir) / part, error_feedback=False)
            for g in opt.param_groups:
                g["lr"] = lr
            _train(model, opt, range(stop_at, total), data_ranks=DATA_RANKS)
        out[kind] = {"val_loss": val_loss(model), "steps": opt.steps, "phase": opt.phase,
                     "tensors": [p.detach().clone() for p in model.parameters()],
                     "warnings": [str(w.message) for w in caught]}
    return out


# ---- the engine alone, on the in-process transport ---------------------------------------------

def _engine(transport) -> tuple:
    """The parameters, a CompressedStep over their state on ``transport``, its param groups."""
    params, state = initial_state()
    config = OneBitConfig.from_options(freeze_step=WARM_STEPS, bucket_size_mb=0.004)
    engine = CompressedStep(config, state, decoupled=lambda group: False, transport=transport)
    groups = [{"params": params, "lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": 0.0}]
    return params, engine, groups


def flush_engine(transport, steps=3, bad_rank=None):
    """CompressedStep on virtual ranks: a few steps, then a flush. Returns each rank's errors and
    momenta before, its momenta and errors after, or the error every rank raised."""
    params, engine, groups = _engine(transport)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(steps):
            engine.ensure_ready(params)
            engine.step(groups, {p: gradient(step, transport.rank, p.shape) for p in params})
    comms = [engine.collectives.of(b) for b in engine.buckets]
    if bad_rank == transport.rank:
        comms[-1].errors.server_z[0] = float("nan")  # a real element of the last rank's chunk
    before = {"momenta": [b.momentum.clone() for b in engine.buckets],
              "worker_errors": [c.worker_error for c in comms],
              "server_errors": [c.server_error for c in comms],
              "chunks": [c.layout.chunk for c in comms],
              "denominators": _denominators(engine, groups[0])}
    try:
        nbytes = engine.flush_error_feedback(groups)
        error = None
    except FloatingPointError as exc:
        nbytes, error = None, str(exc)
    after = {"momenta": [b.momentum.clone() for b in engine.buckets],
             "worker_errors": [c.worker_error for c in comms],
             "server_errors": [c.server_error for c in comms]}
    return {"before": before, "after": after, "bytes": nbytes, "error": error,
            "numel": [b.numel for b in engine.buckets]}


def unflushed_on_one_rank(transport):
    """On one rank: the warnings when a checkpoint saved with unflushed errors is loaded, and
    what a state saved after records."""
    _, engine, _ = _engine(transport)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.expect_error_feedback(7)
        # then the errors rank 1 of a 2-rank job saved, which one rank cannot take
        engine.load_error_feedback_state_dict({"world_size": 2, "rank": 1, "buckets": {}})
    with warnings.catch_warnings(record=True) as alone:
        warnings.simplefilter("always")
        engine.load_error_feedback_state_dict({"world_size": 2, "rank": 1, "buckets": {}})
    return {"warned": [str(w.message) for w in caught], "unflushed": engine.unflushed,
            "errors_alone": [str(w.message) for w in alone]}


def unflushed_engine(transport, steps=3):
    """What CompressedStep says of its error feedback (``unflushed``) as it steps, flushes and
    restarts, and what the next fusing warns after a checkpoint saved with unflushed errors
    was loaded, without and with this rank's errors given."""
    params, engine, groups = _engine(transport)

    def step(k):
        engine.ensure_ready(params)
        engine.step(groups, {p: gradient(k, transport.rank, p.shape) for p in params})

    seen = {"built": engine.unflushed}
    for k in range(steps):
        step(k)
    seen["stepped"] = engine.unflushed
    engine.flush_error_feedback(groups)
    seen["flushed"] = engine.unflushed
    step(steps)
    seen["stepped_again"] = engine.unflushed
    saved = engine.error_feedback_state_dict()  # restored below at this step count
    engine.restart()
    seen["restarted"] = engine.unflushed
    warned = {}
    # no communication below; one virtual rank at a time (catching warnings is process-wide)
    with _ONE_AT_A_TIME:
        for given in (False, True):
            engine.restart()
            engine.expect_error_feedback(7)
            seen[f"expected_{given}"] = engine.unflushed  # a state saved now records it
            if given:
                engine.load_error_feedback_state_dict(saved)
                # loaded, not applied until the fusing: what a save now gets
                seen["saved_before_fusing"] = engine.error_feedback_state_dict() is saved
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.ensure_ready(params)
            warned[given] = [str(w.message) for w in caught]
            seen[f"loaded_{given}"] = engine.unflushed
    return {"seen": seen, "warned": warned}


_ONE_AT_A_TIME = threading.Lock()
