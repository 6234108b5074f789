"""Worker functions for variance_refresh: full-precision refresh steps of the
variance inside the compression phase. They return data; tests/test_variance_refresh.py asserts."""
from __future__ import annotations

import copy
import io
import math
import warnings
from dataclasses import replace
from typing import Optional

import horovod.torch as hvd
import torch
import torch.nn as nn

import hvd_onebit
from hvd_onebit.variance_refresh import RefreshSchedule
from hvd_onebit import Experimental
from tests.scenarios import run_scenarios
from tests.workers_freeze_and_flush import AUTO, _buckets, _denominators
from tests.workers_optimizer import batch, make_model, params_hash
from tests.workers_optimizer import params_bytes

# gaps 1, 1, 2, 2, 4, 4, 8, ...: updates at 0, 1, 2, 4, 6, 10, 14, ...; frozen at 3, the
# refreshes are the steps taken with 4, 6 and 10 steps behind them (of 13)
SCHEDULE = {"first_interval": 1, "growth": 2, "updates_per_interval": 2}
FREEZE, STEPS, LR, BETAS, EPS = 3, 13, 1e-2, (0.9, 0.999), 1e-8


class Gated(nn.Module):
    """The test model plus ``extra``, which gets an exactly zero gradient while ``gate`` is 0."""

    def __init__(self):
        super().__init__()
        self.body = make_model()
        self.extra = nn.Parameter(torch.zeros(4))
        self.gate = 1.0

    def forward(self, x):
        return self.body(x) + self.gate * (x[:, :4] * self.extra).sum(1, keepdim=True)


def _errors(opt) -> dict:
    engine, comms = _buckets(opt)
    return {"worker": [c.worker_error.clone() for c in comms],
            "server": [c.server_error.clone() for c in comms],
            "chunks": [c.layout.chunk for c in comms],
            "denominators": _denominators(engine, opt.param_groups[0])}


def _opt(model, **options):
    """The optimizer of these scenarios: refreshes on SCHEDULE unless ``options`` say otherwise."""
    options = {"freeze_step": FREEZE, "variance_refresh": "doubling", "bucket_size_mb": 0.002,
               **options}
    knobs = options.get("experimental") or Experimental()
    if options["variance_refresh"] is not None and knobs.refresh_schedule is None:
        options["experimental"] = replace(knobs, refresh_schedule=SCHEDULE)
    return hvd_onebit.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=LR,
                                                            betas=BETAS, eps=EPS),
                                           named_parameters=model.named_parameters(),
                                           **options)


def run(steps: int = STEPS, start: int = 0, gated: bool = False, scaler: bool = False,
        inf_at: Optional[int] = None, probe_at: Optional[int] = None,
        save_at: tuple = (), resume: Optional[dict] = None, flush_at: Optional[int] = None,
        **options) -> dict:
    """Train the test model ``steps`` iterations; per iteration the step count before it, the
    parameters' hash, the refresh count and the bytes after it. ``gated``: ``extra`` gets no
    gradient before the freeze. ``inf_at``: rank 1's loss is inf at that iteration.
    ``probe_at``: the error feedback and denominators around that iteration's step.
    ``save_at``: checkpoints (serialized) once that many steps are taken; ``resume``: start
    from one. ``flush_at``: flush_error_feedback() after that iteration."""
    model = Gated()
    opt = _opt(model, **options)
    amp = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaler else None
    if resume is not None:
        model.load_state_dict(torch.load(io.BytesIO(resume["model"])))
        opt.load_state_dict(torch.load(io.BytesIO(resume["opt"])))
        opt.load_error_feedback_state_dict(torch.load(io.BytesIO(resume["ef"])))
    out = {"before": [], "hashes": [], "refreshes": [], "bytes": [], "saved": {},
           "probe": None, "flushed": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for it in range(start, start + steps):
            if opt.steps in save_at and opt.steps not in out["saved"]:
                out["saved"][opt.steps] = _checkpoint(model, opt)
            model.gate = 0.0 if gated and opt.phase == "warmup" else 1.0
            out["before"].append(opt.steps)
            opt.zero_grad()
            x, y = batch(it, hvd.rank())
            loss = nn.functional.mse_loss(model(x), y)
            if it == inf_at and hvd.rank() == 1:
                loss = loss * math.inf
            (amp.scale(loss) if amp else loss).backward()
            probe = _errors(opt) if it == probe_at else None
            if amp:
                amp.step(opt)
                amp.update()
            else:
                opt.step()
            if probe is not None:
                out["probe"] = {"before": probe, "after": _errors(opt)}
            if it == flush_at:
                nbytes = opt.flush_error_feedback()
                out["flushed"] = {"bytes": nbytes, "norm": max(
                    float(e.abs().max()) for e in _errors(opt)["worker"])}
            out["hashes"].append(params_hash(model))
            out["refreshes"].append(opt.telemetry()["refreshes"])
            out["bytes"].append(opt.last_step_bytes)
    state = opt.state[model.extra]
    out.update(steps=opt.steps, telemetry=opt.telemetry(), params=params_bytes(model),
               arrays=[p.detach().numpy().copy() for p in model.parameters()],
               extra=model.extra.detach().clone(), n=int(state["frozen_variance_step"]),
               t=int(state["step"]), numel=sum(p.numel() for p in model.parameters()),
               buckets=len(opt.compressed_step.buckets or []), freeze_step=opt.freeze_step,
               scale=None if amp is None else float(amp.get_scale()),
               warnings=sorted({str(w.message)[:70] for w in caught}))
    return out


def _checkpoint(model, opt) -> dict:
    def ser(obj):
        buf = io.BytesIO()
        torch.save(copy.deepcopy(obj), buf)
        return buf.getvalue()

    return {"model": ser(model.state_dict()), "opt": ser(opt.state_dict()),
            "ef": ser(opt.error_feedback_state_dict())}


def reference(steps: int = STEPS, update: str = "gap",
              bc2_counts_every_step: bool = False) -> dict:
    """Adam with variance refreshes by hand on the exactly averaged gradients: m every step, v
    in the warmup and at refreshes, bc1 from the step count; no step bound. ``update="gap"``: a
    refresh k steps after v's last update weighs g^2 by 1 - beta2^k and bc2 counts steps;
    "single" (0/1 Adam's): one update of weight 1 - beta2, bc2 counting v's updates (or, to
    show the test can tell, ``bc2_counts_every_step``). The final parameters."""
    model = Gated()
    params = list(model.parameters())
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    schedule = RefreshSchedule.from_option(SCHEDULE)
    n, last = [0] * len(params), [0] * len(params)  # per parameter: v's updates, its last step
    b1, b2 = BETAS
    for step in range(steps):
        model.zero_grad()
        x, y = batch(step, hvd.rank())
        nn.functional.mse_loss(model(x), y).backward()
        refresh = schedule.is_refresh(step, FREEZE)
        full = step < FREEZE or refresh
        t = step + 1
        bc1 = 1 - b1 ** t
        with torch.no_grad():
            for i, p in enumerate(params):
                g = hvd.allreduce(p.grad, name=f"ref.{step}.{i}.{update}.{bc2_counts_every_step}")
                m[i].mul_(b1).add_(g, alpha=1 - b1)
                if full:
                    a = 1 - b2 ** (t - last[i]) if update == "gap" else 1 - b2
                    v[i] = v[i] * (1 - a) + a * g * g
                    n[i], last[i] = n[i] + 1, t
                counted = last[i] if update == "gap" or bc2_counts_every_step else n[i]
                bc2 = 1 - b2 ** (t if bc2_counts_every_step else counted)
                p.sub_(LR / bc1 * m[i] / (v[i].sqrt() / math.sqrt(bc2) + EPS))
    return {"params": [p.detach().clone() for p in params]}


def _arrays(ref: dict) -> list:
    return [p.numpy() for p in ref["params"]]


def resumed(at: int, saved: dict, **options) -> dict:
    return run(steps=STEPS - at, start=at, resume=saved, **options)


def suite() -> dict:
    full = {}

    def checkpointed(key: str, **options) -> dict:
        full[key] = run(save_at=(6, 7), **options)
        return full[key]

    scenarios = {
        "overlap": lambda: run(),
        "no_overlap": lambda: run(overlap=False),
        "memory_lean": lambda: run(memory="lean", probe_at=6),
        "gated": lambda: run(gated=True, probe_at=4),
        "gated_frozen": lambda: run(gated=True, variance_refresh=None),
        "fold": lambda: run(probe_at=6,
                            variance_refresh="doubling",
                            experimental=Experimental(refresh_schedule={**SCHEDULE, "error_feedback": "fold"})),
        "exact": lambda: {"opt": run(experimental=Experimental(compressor="none", step_bound=None))["arrays"],
                          "ref": _arrays(reference()),
                          "wrong": _arrays(reference(update="single"))},
        "exact_single": lambda: {
            "opt": run(variance_refresh="doubling",
                       experimental=Experimental(compressor="none", step_bound=None, refresh_schedule={**SCHEDULE, "variance_update": "single"}))["arrays"],
            "ref": _arrays(reference(update="single")),
            "wrong": _arrays(reference(update="single", bc2_counts_every_step=True))},
        "single": lambda: run(variance_refresh="doubling",
                              experimental=Experimental(refresh_schedule={**SCHEDULE, "variance_update": "single"})),
        "checkpointed": lambda: checkpointed("always"),
        "resumed_before": lambda: resumed(6, full["always"]["saved"][6]),
        "resumed_after": lambda: resumed(7, full["always"]["saved"][7]),
        "flush": lambda: run(flush_at=7),
        "inf": lambda: run(inf_at=6),
        "scaler_inf": lambda: run(scaler=True, inf_at=6),
        "fp16": lambda: run(compression=hvd.Compression.fp16),
        "auto": lambda: run(steps=20, freeze_step="auto",
                            experimental=Experimental(auto_freeze=AUTO)),
    }
    out = run_scenarios(scenarios, hvd.rank())
    for r in out.values():  # the serialized checkpoints stay here
        if isinstance(r, dict):
            r.pop("saved", None)
    return out


def hierarchical_run() -> dict:
    """2 "nodes" (hosts of this machine): the 1-bit stage between them, with refreshes."""
    return run_scenarios({"hier": lambda: run(hierarchical=True, probe_at=6)}, hvd.rank())

