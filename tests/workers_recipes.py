"""Horovod's own training recipes on Horovod's MNIST network, in a real job: mixed precision
(GradScaler with synchronize/skip_synchronize), clipping, and a checkpoint written without a
step bound resumed with one. Returns data; tests/test_recipes.py asserts."""
from __future__ import annotations

import warnings

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvd_onebit
from hvd_onebit import Experimental
from hvd_onebit_tools.bench.zoo.data import mnist_like_digits
from hvd_onebit_tools.bench.zoo.models import HorovodMnistNet

BATCH = 32


def _data():
    return mnist_like_digits(0, n_train=2048, n_held=256)


def _batch(split, step: int):
    g = torch.Generator().manual_seed(1000 * step + hvd.rank())
    idx = torch.randint(len(split.x_train), (BATCH,), generator=g)
    return split.x_train[idx], split.y_train[idx]


def _held_loss(model, split) -> float:
    model.eval()
    with torch.no_grad():
        loss = float(F.nll_loss(model(split.x_held), split.y_held))
    model.train()
    return loss


def _optimizer(model, kind: str, freeze_step: int, **options):
    adam = torch.optim.Adam(model.parameters(), lr=1e-3 * hvd.size())
    if kind == "adam":
        return hvd.DistributedOptimizer(adam, named_parameters=model.named_parameters())
    return hvd_onebit.DistributedOptimizer(adam, named_parameters=model.named_parameters(),
                                           freeze_step=freeze_step, **options, variance_refresh=None)


def recipe(kind: str, how: str, steps: int = 40, freeze_step: int = 10, **options) -> dict:
    """``steps`` of Horovod's MNIST Net with Horovod's recipe ``how``: "amp" (CPU autocast
    float16, ``scaler.scale(loss).backward()``, ``optimizer.synchronize()``,
    ``scaler.unscale_(optimizer)``, ``with optimizer.skip_synchronize(): scaler.step(optimizer)``,
    ``scaler.update()``), "clip" (synchronize, ``clip_grad_norm_(1.0)``, skip_synchronize, step)
    or "scaler_step" (GradScaler through ``step()`` alone); "eager" and "compiled" (the model's
    forward through ``torch.compile``): backward, then step; "compiled_step": zero_grad,
    forward, backward and step in one ``torch.compile``'d function. ``kind``: "adam" (Horovod's own
    optimizer) or "onebit". Returns the held-out loss, the loss scales, whether every
    parameter stayed finite, and the phase at the end."""
    torch.manual_seed(0)
    split = _data()
    model = HorovodMnistNet()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = _optimizer(model, kind, freeze_step, **options)
    forward = torch.compile(model, backend="aot_eager") if how == "compiled" else model

    @torch.compile(backend="eager")
    def compiled_step(x, y):
        opt.zero_grad()
        loss = F.nll_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    scaler = torch.amp.GradScaler("cpu") if how in ("amp", "scaler_step") else None
    scales = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(steps):
            x, y = _batch(split, step)
            if how == "compiled_step":
                compiled_step(x, y)
                continue
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=how == "amp"):
                loss = F.nll_loss(forward(x), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                if how == "amp":
                    opt.synchronize()
                    scaler.unscale_(opt)
                    with opt.skip_synchronize():
                        scaler.step(opt)
                else:
                    scaler.step(opt)
                scaler.update()
                scales.append(float(scaler.get_scale()))
            elif how in ("eager", "compiled"):
                loss.backward()
                opt.step()
            else:
                loss.backward()
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                with opt.skip_synchronize():
                    opt.step()
    return {"held_loss": _held_loss(model, split), "scales": scales,
            "params": [p.detach().clone().numpy() for p in model.parameters()],
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
            "phase": getattr(opt, "phase", "adam")}


def resume_unbounded_checkpoint(steps: int = 24, freeze_step: int = 10, at: int = 14) -> dict:
    """Train with the paper's scheme (``step_bound=None, precondition=False``) into
    the compression phase; at step ``at`` save the state and error feedback as that code wrote
    them (no "step_bound" and no error "space" entry), load them into a fresh optimizer with
    the defaults, and train on. Returns the load's warnings, whether the momentum came back bit
    for bit, the error feedback after the load (reset: its units changed), and the end."""
    torch.manual_seed(0)
    split = _data()
    model = HorovodMnistNet()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = _optimizer(model, "onebit", freeze_step,
                     experimental=Experimental(step_bound=None, precondition=False))
    out: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(at):
            x, y = _batch(split, step)
            opt.zero_grad()
            F.nll_loss(model(x), y).backward()
            opt.step()
    saved = opt.state_dict()
    del saved["onebit"]["step_bound"]  # as written before the bound existed
    errors = opt.error_feedback_state_dict()
    del errors["space"]
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    saved = {"state": {k: {n: t.clone() if torch.is_tensor(t) else t for n, t in s.items()}
                       for k, s in saved["state"].items()},
             "param_groups": saved["param_groups"], "onebit": saved["onebit"]}

    model2 = HorovodMnistNet()
    model2.load_state_dict(weights)
    opt2 = _optimizer(model2, "onebit", freeze_step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt2.load_state_dict(saved)
        opt2.load_error_feedback_state_dict(errors)
        # build the buckets and collectives now (the next step would): the saved errors go in
        opt2.compressed_step.ensure_ready(list(model2.parameters()))
    out["load_warnings"] = [str(w.message) for w in caught]
    out["errors_saved_nonzero"] = _nonzero(errors)
    out["errors_after_load_nonzero"] = _nonzero(opt2.error_feedback_state_dict())
    out["phase_after_load"] = opt2.phase
    momenta_equal = all(torch.equal(opt2.state[p]["exp_avg"], saved["state"][i]["exp_avg"])
                        for i, p in enumerate(model2.parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(at, steps):
            x, y = _batch(split, step)
            opt2.zero_grad()
            F.nll_loss(model2(x), y).backward()
            opt2.step()
    out["momenta_equal"] = momenta_equal
    out["steps"] = opt2.steps
    out["finite"] = all(bool(torch.isfinite(p).all()) for p in model2.parameters())
    return out


def _nonzero(tree) -> bool:
    """Whether a state tree holds any non-zero float tensor element."""
    return any(bool(x.abs().sum() > 0) for x in _tensors(tree) if x.is_floating_point())


def _tensors(tree):
    if torch.is_tensor(tree):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


def _scenario(fn, *args, **kwargs) -> dict:
    """One scenario's result, or its error as data: each test then fails on its own."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # reported to the test that reads this scenario
        return {"error": f"{type(exc).__name__}: {exc}"}


def suite() -> dict:
    out = {}
    for how in ("amp", "clip"):
        out[f"adam_{how}"] = _scenario(recipe, "adam", how)
        out[f"bounded_{how}"] = _scenario(recipe, "onebit", how)
        out[f"unbounded_momentum_{how}"] = _scenario(
            recipe, "onebit", how,
            experimental=Experimental(step_bound=None, precondition=False))
    out["bounded_scaler_step"] = _scenario(recipe, "onebit", "scaler_step")
    for how in ("eager", "compiled", "compiled_step"):
        out[how] = _scenario(recipe, "onebit", how)
    out["resume"] = _scenario(resume_unbounded_checkpoint)
    return out
