"""Worker functions for the DistributedOptimizer tests; each runs in every rank after hvd.init()."""
from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass

import horovod.torch as hvd
import torch
import torch.nn as nn

import hvd_onebit
from hvd_onebit import Experimental
from tests.onebit_reference import adam_bound
from tests.scenarios import run_scenarios


def make_model(seed=0, width=32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, 1))


def batch(step, rank, n=16):
    g = torch.Generator().manual_seed(10_000 * rank + step)
    x = torch.randn(n, 8, generator=g)
    y = torch.sin(x.sum(1, keepdim=True)) + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


def params_bytes(model):
    return [p.detach().numpy().tobytes() for p in model.parameters()]


def val_loss(model, dtype=torch.float32):
    """MSE on a held-out batch, the same on every rank."""
    x, y = batch(10_000, 99, n=256)
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x.to(dtype)).float(), y))


def params_arrays(model):
    return [p.detach().float().numpy().copy() for p in model.parameters()]


def params_hash(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def train(model, opt, steps, passes=1, start=0, hashes=None, closure_style=False,
          losses=None):
    """``steps`` steps of ``passes`` backward passes each; with ``closure_style`` through
    ``opt.step(closure)``, whose returned losses go into ``losses``."""
    loss_fn = nn.MSELoss()

    def closure():
        opt.zero_grad()
        for k in range(passes):
            x, y = batch(step * passes + k, hvd.rank())
            loss = loss_fn(model(x), y)
            loss.backward()
        return float(loss)

    for step in range(start, start + steps):
        if closure_style:
            loss = opt.step(closure)
            if losses is not None:
                losses.append(loss)
        else:
            closure()
            opt.step()
        if hashes is not None:
            hashes.append(params_hash(model))
    return model


def closure_steps(steps=10, freeze_step=3) -> dict:
    """The same run with ``opt.step(closure)`` and with backward before ``opt.step()``, through
    the warmup, refresh steps and compressed steps: parameter hashes per step, and the losses
    step(closure) returned."""
    out = {}
    for style in (False, True):
        model = make_model()
        opt = hvd_onebit.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                              named_parameters=model.named_parameters(),
                                              freeze_step=freeze_step)
        hashes, losses = [], []
        train(model, opt, steps, hashes=hashes, closure_style=style, losses=losses)
        out["closure" if style else "plain"] = hashes
        if style:
            out["losses"] = losses
        out["refreshes"] = opt.telemetry()["refreshes"]
    return out


@dataclass(frozen=True)
class Skips:
    """One run of :func:`skipped_batch`: the steps whose batch is skipped after its backward,
    and how the run trains."""

    steps: frozenset = frozenset()
    overlap: bool = True
    synchronize: bool = True  # synchronize() before the skip's zero_grad(), Horovod's way
    set_to_none: bool = True
    after_passes: int = 1  # backward passes of the skipped batch before its zero_grad()
    passes: int = 1  # backward_passes_per_step
    scaler: bool = False  # a GradScaler: scaler.step(opt), scaler.update()
    reference: str = "plain"  # the run that never computed the skipped batches


def skip_plans(steps: int, freeze_step: int, skip_at: int) -> dict:
    one = frozenset({skip_at})
    return {"plain": Skips(), "skip": Skips(one), "skip_in_place": Skips(one, set_to_none=False),
            "every": Skips(frozenset(range(freeze_step, steps))),
            "no_overlap": Skips(one, overlap=False, synchronize=False),
            "accumulate": Skips(passes=2, reference="accumulate"),
            "accumulate_skip": Skips(one, after_passes=2, passes=2, reference="accumulate"),
            "accumulate_skip_half": Skips(one, passes=2, reference="accumulate"),
            "scaler": Skips(scaler=True, reference="scaler"),
            "scaler_skip": Skips(one, scaler=True, reference="scaler")}


def skipped_batch(steps=12, freeze_step=3, skip_at=8) -> dict:
    """Batches skipped after their backward in compressed steps (zero_grad() before step(),
    Horovod's way: synchronize() first), each run against one that never computed them
    (:func:`skip_plans`): parameter hashes per step, the buckets started early at the skip and
    after it, the restarts and the warnings."""
    out = {}
    for run, plan in skip_plans(steps, freeze_step, skip_at).items():
        model = make_model()
        opt = hvd_onebit.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                              named_parameters=model.named_parameters(),
                                              freeze_step=freeze_step, bucket_size_mb=0.002,
                                              variance_refresh=None, overlap=plan.overlap,
                                              backward_passes_per_step=plan.passes)
        amp = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if plan.scaler else None

        def backward(seed, passes):
            for k in range(passes):
                x, y = batch(seed * plan.passes + k, hvd.rank())
                loss = nn.functional.mse_loss(model(x), y)
                (amp.scale(loss) if amp else loss).backward()

        hashes, got = [], {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(steps):
                if step in plan.steps:
                    opt.zero_grad()
                    backward(1000 + step, plan.after_passes)
                    if step == skip_at:
                        got["started"] = opt.compressed_step.started
                        before = opt.compressed_step.early_starts
                    if plan.synchronize:
                        opt.synchronize()
                    opt.zero_grad(set_to_none=plan.set_to_none)
                opt.zero_grad()
                backward(step, plan.passes)
                if amp:
                    amp.step(opt)
                    amp.update()
                else:
                    opt.step()
                hashes.append(params_hash(model))
        got.update(hashes=hashes, restarts=opt.compressed_step.restarts,
                   early_after=(opt.compressed_step.early_starts - before
                                if plan.steps else None),
                   buckets=len(opt.compressed_step.buckets), reference=plan.reference,
                   warnings=[str(w.message) for w in caught])
        out[run] = got
    return out


def warmup_matches_horovod(steps=4, passes=1, fp16=False, adamw=False):
    """Same script under hvd.DistributedOptimizer and hvd_onebit (still in warmup); returns
    both runs' final parameters, {"horovod": [arrays], "onebit": [arrays]}."""
    compression = hvd.Compression.fp16 if fp16 else hvd.Compression.none
    out = []
    for wrapper in ("horovod", "onebit"):
        model = make_model()
        cls = torch.optim.AdamW if adamw else torch.optim.Adam
        base = cls(model.parameters(), lr=1e-2, weight_decay=0.01)
        kw = dict(named_parameters=model.named_parameters(), compression=compression,
                  backward_passes_per_step=passes)
        if wrapper == "horovod":
            opt = hvd.DistributedOptimizer(base, **kw)
        else:
            opt = hvd_onebit.DistributedOptimizer(base, freeze_step=steps + 10, **kw, variance_refresh=None)
        train(model, opt, steps, passes=passes)
        out.append(params_arrays(model))
    return {"horovod": out[0], "onebit": out[1]}


def branches_by_rank(steps=6, freeze_steps=(20, 3)):
    """Each rank trains one of two branches (ranks of even index branch a, of odd index branch
    b), so each rank's hooks start allreduces the other ranks start only when they
    synchronize. Under hvd.DistributedOptimizer, and under hvd_onebit with each of
    ``freeze_steps`` (the first past the run: a warmup only); each run's parameter hash by step."""
    out = {}
    for wrapper, freeze_step in [("horovod", None)] + [("onebit", f) for f in freeze_steps]:
        torch.manual_seed(0)
        trunk, head = nn.Linear(8, 16), nn.Linear(16, 1)
        branches = [nn.Linear(16, 16), nn.Linear(16, 16)]
        modules = [trunk, *branches, head]
        named = [(f"m{i}.{n}", p) for i, m in enumerate(modules) for n, p in m.named_parameters()]
        base = torch.optim.Adam([p for _, p in named], lr=1e-2)
        if wrapper == "horovod":
            opt = hvd.DistributedOptimizer(base, named_parameters=named)
        else:
            opt = hvd_onebit.DistributedOptimizer(base, named_parameters=named,
                                                  freeze_step=freeze_step)
        hashes = []
        for step in range(steps):
            opt.zero_grad()
            x, y = batch(step, hvd.rank())
            h = torch.tanh(trunk(x))
            h = h + torch.tanh(branches[hvd.rank() % 2](h))
            nn.functional.mse_loss(head(h), y).backward()
            opt.step()
            hashes.append(hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                                  for _, p in named)).hexdigest()[:16])
        out[wrapper if freeze_step is None else f"onebit_freeze_{freeze_step}"] = hashes
    return out


def frozen_variance_reference(freeze_step=3, steps=8, weight_decay=0.0, adamw=False, bounded=True):
    """compressor='none' vs a hand-written Adam-with-frozen-variance on averaged gradients, each
    step clamped at lr times Adam's own bound (``bounded``) or not (step_bound=None). Returns the
    largest difference, the smallest distance moved, and the fraction of element steps clamped."""
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    model = make_model()
    opt = hvd_onebit.DistributedOptimizer(cls(model.parameters(), lr=1e-2, weight_decay=weight_decay),
                                          named_parameters=model.named_parameters(),
                                          freeze_step=freeze_step,
                                          experimental=Experimental(compressor="none", step_bound="adam" if bounded else None), variance_refresh=None)
    train(model, opt, steps)

    ref = make_model()
    ref_opt = cls(ref.parameters(), lr=1e-2, weight_decay=weight_decay)
    loss_fn = nn.MSELoss()
    beta1, beta2, eps, lr = 0.9, 0.999, 1e-8, 1e-2
    clamped = total = 0
    for step in range(steps):
        ref_opt.zero_grad()
        x, y = batch(step, hvd.rank())
        loss_fn(ref(x), y).backward()
        for i, p in enumerate(ref.parameters()):
            p.grad = hvd.allreduce(p.grad, op=hvd.Average, name=f"ref.{step}.{i}")
        if step < freeze_step:
            ref_opt.step()
            continue
        with torch.no_grad():
            for p in ref.parameters():
                st = ref_opt.state[p]
                g = p.grad if adamw else p.grad.add(p, alpha=weight_decay)
                st["exp_avg"].lerp_(g, 1 - beta1)
                t = step + 1
                bc1 = 1 - beta1 ** t
                bc2 = 1 - beta2 ** freeze_step
                denom = (st["exp_avg_sq"].sqrt() / bc2 ** 0.5).add_(eps)
                if adamw:
                    p.mul_(1 - lr * weight_decay)
                upd = st["exp_avg"] * (-lr / bc1) / denom
                if bounded:
                    limit = lr * adam_bound(t)
                    clamped += int((upd.abs() > limit).sum())
                    upd = upd.clamp(-limit, limit)
                total += upd.numel()
                p.add_(upd)
    diffs = [float((a.detach() - b.detach()).abs().max()) for a, b in zip(model.parameters(), ref.parameters())]
    moved = [float((a.detach() - b.detach()).abs().max()) for a, b in zip(model.parameters(), make_model().parameters())]
    return max(diffs), min(moved), clamped / total


def onebit_consistency(steps=30, freeze_step=5, passes=1, bucket_size_mb=64.0):
    """Hashes of the parameters after every step, plus telemetry snapshots."""
    model = make_model()
    opt = hvd_onebit.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                          named_parameters=model.named_parameters(),
                                          freeze_step=freeze_step, backward_passes_per_step=passes,
                                          bucket_size_mb=bucket_size_mb, variance_refresh=None)
    hashes, phases, bytes_per_step, v_by_step = [], [], [], []
    loss_fn = nn.MSELoss()
    for step in range(steps):
        phases.append(opt.phase)
        opt.zero_grad()
        for k in range(passes):
            x, y = batch(step * passes + k, hvd.rank())
            loss_fn(model(x), y).backward()
        opt.step()
        hashes.append(params_hash(model))
        bytes_per_step.append(opt.last_step_bytes)
        v_by_step.append(opt.state[next(model.parameters())]["exp_avg_sq"].clone().numpy())
    return {"hashes": hashes, "phases": phases, "bytes": bytes_per_step,
            "telemetry": opt.telemetry(), "v_by_step": v_by_step,
            "buckets": len(opt.compressed_step.buckets or []),
            "nonfinite": sum(int((~torch.isfinite(p)).sum()) for p in model.parameters())}


def missing_grads_and_requires_grad(steps=12, freeze_step=4, compressor="onebit"):
    """Rank 1 skips a branch (no grad there); a layer is frozen then unfrozen mid-compression,
    and a bias inside the warmup (trainable again at a step Horovod allreduces)."""
    torch.manual_seed(0)
    trunk, branch, head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1)
    params = list(trunk.parameters()) + list(branch.parameters()) + list(head.parameters())
    start_val = val_loss(lambda x: head(torch.tanh(trunk(x)) + torch.tanh(
        branch(torch.tanh(trunk(x))))))
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    opt = hvd_onebit.DistributedOptimizer(torch.optim.Adam(params, lr=1e-2),
                                          named_parameters=named, freeze_step=freeze_step,
                                          experimental=Experimental(compressor=compressor), variance_refresh=None)
    hashes, seen = [], {}
    # step -> (name, parameter, requires_grad from then on): a bias frozen and unfrozen inside
    # the warmup, the head's weight in the compression phase
    toggles = {1: ("bias", branch.bias, False), 2: ("bias", branch.bias, True),
               7: ("head", head.weight, False), 9: ("head", head.weight, True)}
    for step in range(steps):
        if step in toggles:
            name, p, trainable = toggles[step]
            seen[f"{name}_at_{'unfreeze' if trainable else 'freeze'}"] = p.detach().clone()
            p.requires_grad_(trainable)
        opt.zero_grad()
        x, y = batch(step, hvd.rank())
        h = torch.tanh(trunk(x))
        if hvd.rank() != 1 or step % 2 == 0:
            h = h + torch.tanh(branch(h))
        nn.functional.mse_loss(head(h), y).backward()
        opt.step()
        hashes.append(hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in params)).hexdigest())
    return {"hashes": hashes, **seen, "head_end": head.weight.detach().clone(),
            "bias_end": branch.bias.detach().clone(),
            "val_loss": val_loss(lambda x: head(torch.tanh(trunk(x)) + torch.tanh(
                branch(torch.tanh(trunk(x)))))), "start_val_loss": start_val}


def groups_masks_and_schedules(steps=10, freeze_step=3):
    """Per-group lr/wd, AdamW, an exp_avg_mask on padding rows, and an LR scheduler."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, padding_idx=0)  # row 0 is padding: zero, with zero gradient
    lin = nn.Linear(4, 1)
    mask = torch.ones(10, 4)
    mask[0] = 0
    base = torch.optim.AdamW([
        {"params": [emb.weight], "lr": 1e-2, "weight_decay": 0.0, "exp_avg_mask": mask},
        {"params": list(lin.parameters()), "lr": 5e-3, "weight_decay": 0.1},
    ])
    opt = hvd_onebit.DistributedOptimizer(
        base, named_parameters=[("emb", emb.weight), ("w", lin.weight), ("b", lin.bias)],
        freeze_step=freeze_step, variance_refresh=None)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(steps):
        opt.zero_grad()
        g = torch.Generator().manual_seed(step * 10 + hvd.rank())
        idx = torch.randint(0, 10, (32,), generator=g)
        y = torch.randn(32, 1, generator=g)
        nn.functional.mse_loss(lin(emb(idx)), y).backward()
        opt.step()
        sched.step()
    return {"pad_row": emb.weight[0].detach().clone().numpy(),
            "pad_momentum": opt.state[emb.weight]["exp_avg"][0].clone().numpy(),
            "lrs": [g["lr"] for g in opt.param_groups],
            "hash": hashlib.sha256(emb.weight.detach().numpy().tobytes()
                                   + lin.weight.detach().numpy().tobytes()).hexdigest()}


def single_rank_is_plain_adam(steps=8, freeze_step=3):
    model, ref = make_model(), make_model()
    opt = hvd_onebit.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                          named_parameters=model.named_parameters(),
                                          freeze_step=freeze_step, variance_refresh=None)
    train(model, opt, steps)
    train(ref, torch.optim.Adam(ref.parameters(), lr=1e-2), steps)
    return {"onebit": params_arrays(model), "adam": params_arrays(ref),
            "total_bytes": opt.total_bytes}


def skip_without_synchronize(steps=8, freeze_step=3):
    """Every step inside ``skip_synchronize()`` with no ``synchronize()`` (a misuse): the
    full-precision steps (warmup, refresh steps at 3 and 6) average all the same, with a
    warning, so the ranks stay identical; a refresh step stepped on each rank's own
    gradients."""
    model = make_model()
    opt = hvd_onebit.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2), named_parameters=model.named_parameters(),
        freeze_step=freeze_step, variance_refresh="doubling",
        experimental=hvd_onebit.Experimental(
            refresh_schedule={"first_interval": 3, "updates_per_interval": 2}))
    loss_fn = nn.MSELoss()
    hashes = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            opt.zero_grad()
            x, y = batch(step, hvd.rank())
            loss_fn(model(x), y).backward()
            with opt.skip_synchronize():
                opt.step()
            hashes.append(params_hash(model))
    told = [str(w.message) for w in caught if "without optimizer.synchronize()" in str(w.message)]
    return {"hashes": hashes, "told": len(told), "refreshes": opt.telemetry()["refreshes"]}


def broadcasts_and_helpers(freeze_step=3):
    """broadcast_parameters/optimizer_state, zero_grad, synchronize + skip_synchronize."""
    model = make_model(seed=hvd.rank())  # different on purpose: the broadcast must fix it
    opt = hvd_onebit.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                          named_parameters=model.named_parameters(),
                                          freeze_step=freeze_step, variance_refresh=None)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    res = {"steps_after_broadcast": opt.steps, "hash0": params_hash(model)}
    loss_fn = nn.MSELoss()
    for step in range(6):  # synchronize / clip / skip_synchronize, through both phases
        opt.zero_grad(set_to_none=(step % 2 == 0))
        x, y = batch(step, hvd.rank())
        loss_fn(model(x), y).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with opt.skip_synchronize():
            opt.step()
        res.setdefault("comm_seconds", []).append(opt.telemetry()["last_step_comm_seconds"])
        res.setdefault("phases", []).append(opt.phase)
    opt.zero_grad(set_to_none=False)  # per parameter: None, or its gradient's largest |value|
    res["zero_grads"] = [None if p.grad is None else float(p.grad.abs().max())
                         for p in model.parameters()]
    opt.zero_grad(set_to_none=True)  # per parameter: what its .grad is
    res["none_grads"] = [type(p.grad).__name__ for p in model.parameters()]
    if hvd.size() > 1:  # error feedback exists only with more than one rank
        res["worker_error_norm"] = float(next(iter(opt.compressed_step.comms.values())).worker_error.norm())
    res["steps"] = opt.steps
    res["hash"] = params_hash(model)
    return res


def broadcast_mid_compression(broadcast, steps=10, freeze_step=3, at=6):
    """Train through the freeze; with ``broadcast``, hvd.broadcast_optimizer_state and
    broadcast_parameters at step ``at`` (compression phase). Every rank already holds the same
    shared state, so the broadcast must change nothing, rank-local error feedback included:
    the final parameters must equal those of the run without it. Returns them."""
    model = make_model()
    opt = hvd_onebit.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                          named_parameters=model.named_parameters(),
                                          freeze_step=freeze_step, variance_refresh=None)
    loss_fn = nn.MSELoss()
    for step in range(steps):
        if broadcast and step == at:
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(opt, root_rank=0)
        opt.zero_grad()
        x, y = batch(step, hvd.rank())
        loss_fn(model(x), y).backward()
        opt.step()
    return params_arrays(model)


def bad_arguments():
    model = make_model()
    errors = {}
    consumed = model.named_parameters()  # a generator read before the optimizer is built
    list(consumed)
    cases = {
        "sgd": lambda: hvd_onebit.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                       freeze_step=2, variance_refresh=None),
        "amsgrad": lambda: hvd_onebit.DistributedOptimizer(
            torch.optim.Adam(model.parameters(), amsgrad=True), freeze_step=2, variance_refresh=None),
        "freeze0": lambda: hvd_onebit.DistributedOptimizer(torch.optim.Adam(model.parameters()),
                                                           freeze_step=0, variance_refresh=None),
        "freeze_float": lambda: hvd_onebit.DistributedOptimizer(
            torch.optim.Adam(model.parameters()), freeze_step=2.5, variance_refresh=None),
        "adasum": lambda: hvd_onebit.DistributedOptimizer(torch.optim.Adam(model.parameters()),
                                                          freeze_step=2, op=hvd.Adasum, variance_refresh=None),
        "predivide_sum": lambda: hvd_onebit.DistributedOptimizer(
            torch.optim.Adam(model.parameters()), freeze_step=2, op=hvd.Sum,
            gradient_predivide_factor=2.0),
        "predivide_zero": lambda: hvd_onebit.DistributedOptimizer(
            torch.optim.Adam(model.parameters()), freeze_step=2, gradient_predivide_factor=0.0),
        "compression_name": lambda: hvd_onebit.DistributedOptimizer(
            torch.optim.Adam(model.parameters()), freeze_step=2, compression="fp16"),
        "mask_shape": lambda: hvd_onebit.DistributedOptimizer(torch.optim.Adam(
            [{"params": [model[0].weight], "exp_avg_mask": torch.ones(3, 3)}]), freeze_step=2, variance_refresh=None),
        # what differs between ranks: the parameters' order (groups built from a set()), the
        # freeze step
        "reordered": lambda: hvd_onebit.DistributedOptimizer(torch.optim.Adam(
            list(model.parameters())[::1 if hvd.rank() == 0 else -1]), freeze_step=2),
        "freeze_step": lambda: hvd_onebit.DistributedOptimizer(
            torch.optim.Adam(model.parameters()), freeze_step=2 + hvd.rank()),
        # what the last rank alone refuses (its own option, amsgrad) every rank raises
        "bad_on_last": lambda: hvd_onebit.DistributedOptimizer(
            torch.optim.Adam(model.parameters()), freeze_step=2,
            block_size=7 if hvd.rank() == hvd.size() - 1 else 512),
        "amsgrad_on_last": lambda: hvd_onebit.DistributedOptimizer(
            torch.optim.Adam(model.parameters(), amsgrad=hvd.rank() == hvd.size() - 1),
            freeze_step=2),
        "no_freeze_step": lambda: hvd_onebit.DistributedOptimizer(
            torch.optim.Adam(model.parameters()), named_parameters=model.named_parameters()),
        "wrapped_twice": lambda: hvd_onebit.DistributedOptimizer(
            hvd.DistributedOptimizer(torch.optim.Adam(other.parameters()),
                                     named_parameters=other.named_parameters()),
            named_parameters=other.named_parameters(), freeze_step=2),
        "named_dict": lambda: hvd_onebit.DistributedOptimizer(
            torch.optim.Adam(model.parameters()), named_parameters=dict(model.named_parameters()),
            freeze_step=2),
        "named_partial": lambda: hvd_onebit.DistributedOptimizer(
            torch.optim.Adam(model.parameters()),
            named_parameters=list(model.named_parameters())[:-1], freeze_step=2),
        "named_consumed": lambda: hvd_onebit.DistributedOptimizer(
            torch.optim.Adam(model.parameters()), named_parameters=consumed, freeze_step=2),
        "own_synchronize": lambda: hvd_onebit.DistributedOptimizer(
            OwnSynchronize(mine.parameters()), named_parameters=mine.named_parameters(),
            freeze_step=2),
        "channels_last": lambda: hvd_onebit.DistributedOptimizer(
            torch.optim.Adam(conv.parameters()), named_parameters=conv.named_parameters(),
            freeze_step=2),
        "channels_last_later": lambda: steps_after_channels_last(0),
        # after the freeze: the compressed steps take any layout; the next refresh step is
        # allreduced by Horovod, and refused by name before it starts
        "channels_last_at_refresh": lambda: steps_after_channels_last(3),
        # a parameter frozen (requires_grad=False) before the conversion is not allreduced
        "frozen_then_channels_last": lambda: steps_after_channels_last(1, freeze_first=True),
        # converted between the two backward passes of one step
        "channels_last_between_passes": lambda: channels_last_between_passes(),
        # amsgrad brought in after construction: by a state dict, by a param group added
        "amsgrad_loaded": lambda: amsgrad_later("loaded"),
        "amsgrad_added": lambda: amsgrad_later("added"),
        "stepped_original": lambda: stepped_original(),
        "wrapper_copy": lambda: through_a_wrapper_copy(),
    }
    other = make_model()  # Horovod's wrapper hooks its gradients: a model of its own
    mine = make_model()  # and so does the one optimizer built here

    class OwnSynchronize(torch.optim.Adam):  # an Adam of one's own, not a distributed wrapper
        def synchronize(self):
            pass

    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 2, 1)).to(
        memory_format=torch.channels_last)

    def amsgrad_later(how: str):
        """A plain Adam(amsgrad=True)'s state dict loaded, or a param group with amsgrad=True
        added: refused, the optimizer's groups as they were (else the warmup ran AMSGrad and
        the compression phase froze exp_avg_sq, not its running maximum)."""
        net = make_model()
        opt = hvd_onebit.DistributedOptimizer(torch.optim.Adam(net[0].parameters()),
                                              named_parameters=net[0].named_parameters(),
                                              freeze_step=2)
        before = [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups]
        try:
            if how == "loaded":
                plain = torch.optim.Adam(net[0].parameters(), amsgrad=True)
                opt.load_state_dict(plain.state_dict())
            else:
                opt.add_param_group({"params": list(net[2].parameters()), "amsgrad": True})
        finally:
            after = [dict((k, v) for k, v in g.items() if k != "params")
                     for g in opt.param_groups]
            assert after == before, f"the refused {how} changed the groups: {after}"

    def through_a_wrapper_copy():
        """zero_grad(), add_param_group() and step() through an object of a subclass of the
        optimizer's class that reads the optimizer's attributes (Lightning's wrapper), against
        the optimizer itself: the same bits."""
        from tests.workers_ddp import WrapperCopy

        runs = []
        for copied in (False, True):
            net = make_model()
            opt = hvd_onebit.DistributedOptimizer(
                torch.optim.Adam(net[0].parameters()), named_parameters=net.named_parameters(),
                freeze_step=2)
            stepper = WrapperCopy(opt) if copied else opt
            for step in range(5):
                if step == 1:
                    stepper.add_param_group({"params": list(net[2:].parameters())})
                stepper.zero_grad()
                x, y = batch(step, hvd.rank())
                nn.functional.mse_loss(net(x), y).backward()
                stepper.step()
            runs.append(params_hash(net))
        assert runs[0] == runs[1] and opt.phase == "compression", \
            f"through the copy: {runs}, phase {opt.phase}"

    def stepped_original():
        """The Adam the face wrapped, stepped itself after a backward (a script stepping the
        wrong name): refused before it changes anything; the face's optimizer steps after it."""
        net = make_model()
        adam = torch.optim.Adam(net.parameters())
        opt = hvd_onebit.DistributedOptimizer(adam, named_parameters=net.named_parameters(),
                                              freeze_step=2)
        before = [p.detach().clone() for p in net.parameters()]
        net(batch(0, hvd.rank())[0]).square().mean().backward()
        try:
            adam.step()
        except ValueError:
            changed = [i for i, (b, p) in enumerate(zip(before, net.parameters()))
                       if not torch.equal(b, p)]
            assert not changed and not adam.state, \
                f"the refused step changed parameters {changed}, state {len(adam.state)}"
            opt.step()
            assert opt.steps == 1, f"the face's optimizer took {opt.steps} steps after it"
            raise

    def channels_last_between_passes():
        """backward_passes_per_step=2, the one (4-D) parameter made channels_last between the
        step's two backward passes: refused at the second pass's hook."""
        one = nn.Conv2d(3, 2, 3, bias=False)
        opt = hvd_onebit.DistributedOptimizer(torch.optim.Adam(one.parameters()),
                                              named_parameters=one.named_parameters(),
                                              freeze_step=2, backward_passes_per_step=2)
        opt.zero_grad()
        one(torch.ones(2, 3, 6, 6)).square().mean().backward()
        one.to(memory_format=torch.channels_last)
        one(torch.ones(2, 3, 6, 6).to(memory_format=torch.channels_last)).square().mean().backward()

    def steps_after_channels_last(contiguous_steps: int, freeze_first: bool = False):
        """Built on a contiguous model, converted to channels_last after ``contiguous_steps``
        steps (freeze_step=2, the default refresh): up to 16 steps more. Its error is raised
        once the script has gone on: the model made contiguous again, 3 more steps.
        ``freeze_first``: the one parameter that turns non-contiguous is frozen first."""
        later = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 2, 1))
        opt = hvd_onebit.DistributedOptimizer(torch.optim.Adam(later.parameters()),
                                              named_parameters=later.named_parameters(),
                                              freeze_step=2)
        x = torch.ones(2, 3, 6, 6)

        def train(steps):
            for _ in range(steps):
                opt.zero_grad()
                later(x).square().mean().backward()
                opt.step()

        train(contiguous_steps)
        if freeze_first:
            later[0].weight.requires_grad_(False)
        later.to(memory_format=torch.channels_last)
        x = x.to(memory_format=torch.channels_last)
        try:
            train(16)
        except ValueError as exc:
            later.to(memory_format=torch.contiguous_format)
            x = x.contiguous()
            train(3)
            raise exc
    for name, make in cases.items():
        try:
            make()
            errors[name] = None
        except (TypeError, ValueError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    return errors


def half_precision_and_mixed_betas(steps=20, freeze_step=3, compressor="onebit"):
    """Paths beside the fused fp32 one: float16 parameters (float32 state, the torch
    materialisation of the momentum and the torch update), and param groups with different
    beta1 sharing a bucket (the momentum built per member into the work buffer)."""
    out = {}
    fp16 = make_model().to(torch.float16)
    start = [p.detach().clone() for p in fp16.parameters()]
    opt = hvd_onebit.DistributedOptimizer(torch.optim.Adam(fp16.parameters(), lr=1e-2, eps=1e-4),
                                          named_parameters=fp16.named_parameters(),
                                          freeze_step=freeze_step,
                                          experimental=Experimental(compressor=compressor), variance_refresh=None)
    loss_fn = nn.MSELoss()
    for step in range(steps):
        x, y = batch(step, hvd.rank())
        opt.zero_grad()
        loss_fn(fp16(x.to(torch.float16)), y.to(torch.float16)).backward()
        opt.step()
    out["fp16_params"] = [p.detach().float() for p in fp16.parameters()]
    out["fp16_start"] = [s0.float() for s0 in start]
    out["fp16_val_loss"] = val_loss(fp16, torch.float16)
    out["start_val_loss"] = val_loss(make_model())
    out["fp16_phase"] = opt.phase

    model = make_model()
    layers = list(model.parameters())
    groups = [{"params": layers[:2], "betas": (0.9, 0.999)},
              {"params": layers[2:], "betas": (0.8, 0.999)}]
    opt = hvd_onebit.DistributedOptimizer(torch.optim.Adam(groups, lr=1e-2),
                                          named_parameters=model.named_parameters(),
                                          freeze_step=freeze_step,
                                          experimental=Experimental(compressor=compressor), variance_refresh=None)
    out["betas_start"] = [p.detach().clone() for p in model.parameters()]
    hashes = []
    train(model, opt, steps, hashes=hashes)
    out["betas_hashes"] = hashes
    out["betas_buckets"] = len(opt.compressed_step.buckets or [])
    out["betas_params"] = [p.detach().clone() for p in model.parameters()]
    out["betas_val_loss"] = val_loss(model)
    return out


def suite():
    """Every scenario of the module's one job; a scenario that raises comes back as its
    traceback (tests/scenarios.py), so only its tests fail."""
    scenarios = {
        "warmup_identical": warmup_matches_horovod,
        "warmup_identical_passes2_fp16_adamw":
            lambda: warmup_matches_horovod(passes=2, fp16=True, adamw=True),
        "frozen_adam": lambda: frozen_variance_reference(weight_decay=0.01),
        "frozen_adamw": lambda: frozen_variance_reference(weight_decay=0.01, adamw=True),
        "frozen_adam_unbounded":
            lambda: frozen_variance_reference(weight_decay=0.01, bounded=False),
        "consistency": onebit_consistency,
        "consistency_passes2_buckets":
            lambda: onebit_consistency(steps=12, passes=2, bucket_size_mb=0.002),
        "missing": missing_grads_and_requires_grad,
        "closure": closure_steps,
        "skipped_batch": skipped_batch,
        "branches_by_rank": branches_by_rank,
        "missing_none": lambda: missing_grads_and_requires_grad(compressor="none"),
        "groups": groups_masks_and_schedules,
        "helpers": broadcasts_and_helpers,
        "skip_unsynchronized": skip_without_synchronize,
        "broadcast_mid_compression": lambda: [broadcast_mid_compression(b) for b in (False, True)],
        "bad": bad_arguments,
        "other_paths": half_precision_and_mixed_betas,
        "other_paths_none": lambda: half_precision_and_mixed_betas(compressor="none"),
    }
    if hvd.size() == 1:
        scenarios["single"] = single_rank_is_plain_adam
    return run_scenarios(scenarios, rank=hvd.rank())
