"""Worker functions for the compression phase on real models' shapes: several buckets, float16,
bfloat16, sparse embeddings, options checked at construction. Each returns data; the tests assert."""
from __future__ import annotations

import warnings

import horovod.torch as hvd
import torch
import torch.nn as nn

import hvd_onebit
from hvd_onebit import Experimental
from tests.scenarios import run_scenarios
from tests.workers_optimizer import params_hash


def _snapshot(opt, model) -> dict:
    """Everything a skipped step must leave alone: parameters, momenta, step counts, and each
    bucket's error feedback (rank-local)."""
    params = [p.detach().clone() for p in model.parameters()]
    return {
        "params": params,
        "momenta": [opt.state[p]["exp_avg"].clone() for p in model.parameters()],
        "steps": [int(opt.state[p]["step"]) for p in model.parameters()],
        "errors": {key: (c.worker_error.clone(), c.server_error.clone())
                   for key, c in opt.compressed_step.saved_comms().items()},
    }


def _changed(before: dict, after: dict) -> dict:
    """Names of what differs between two snapshots."""
    out = {k: [i for i, (a, b) in enumerate(zip(before[k], after[k])) if not torch.equal(a, b)]
           for k in ("params", "momenta")}
    out["steps"] = [i for i, (a, b) in enumerate(zip(before["steps"], after["steps"])) if a != b]
    out["errors"] = sorted(k for k in before["errors"] if k not in after["errors"] or any(
        not torch.equal(x, y) for x, y in zip(before["errors"][k], after["errors"][k])))
    return out


def _three_layers():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 64))


def _batch(step):
    g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
    x = torch.randn(16, 64, generator=g)
    return x, torch.sin(x)


def nonfinite_in_one_bucket(layer: int, scaler: bool, bad_step: int = 6, steps: int = 10,
                            freeze_step: int = 3, skip_instead: bool = False) -> dict:
    """Five buckets (0.01 MiB each, the layers cut across them); rank 1 puts an inf into layer ``layer``'s weight gradient at
    ``bad_step``. With ``skip_instead`` no rank calls step() at ``bad_step`` (the reference run a
    skipped step must equal)."""
    model = _three_layers()
    opt = hvd_onebit.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                          named_parameters=model.named_parameters(),
                                          freeze_step=freeze_step, bucket_size_mb=0.01, variance_refresh=None)
    amp = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaler else None
    weights = [m.weight for m in model if isinstance(m, nn.Linear)]
    out = {"skipped": [], "changed_at_bad_step": None, "hashes": [], "error": None,
           "scales": []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(steps):
            if step == bad_step and skip_instead:
                continue
            opt.zero_grad()
            x, y = _batch(step)
            loss = nn.functional.mse_loss(model(x), y)
            (amp.scale(loss) if amp else loss).backward()
            if step == bad_step:
                if hvd.rank() == 1:
                    weights[layer].grad[3, 5] = float("inf")
                before = _snapshot(opt, model)
            skipped_before = opt.skipped_steps
            try:
                if amp:
                    amp.step(opt)
                    amp.update()
                    out["scales"].append(float(amp.get_scale()))
                else:
                    opt.step()
            except Exception as exc:  # reported as data: the test names it
                out["error"] = f"step {step}: {type(exc).__name__}: {exc}"
                break
            out["skipped"].append(opt.skipped_steps > skipped_before)
            if step == bad_step:
                out["changed_at_bad_step"] = _changed(before, _snapshot(opt, model))
            out["hashes"].append(params_hash(model))
    out["buckets"] = len(opt.compressed_step.buckets or [])
    out["steps"] = opt.steps
    out["nonfinite_params"] = {name: int((~torch.isfinite(p)).sum())
                               for name, p in model.named_parameters()
                               if not bool(torch.isfinite(p).all())}
    return out


def _controlled_gradient_run(dtype: torch.dtype, grad_scale: float, compressor: str = "onebit",
                             steps: int = 8, freeze_step: int = 3, lr: float = 1e-2) -> dict:
    """Linear(256, 256) in ``dtype`` whose gradients are fixed tensors of size ~``grad_scale``
    (different on each rank and step), so the same values reach every precision."""
    torch.manual_seed(0)
    lin = nn.Linear(256, 256).to(dtype)
    start = [p.detach().float().clone() for p in lin.parameters()]
    opt = hvd_onebit.DistributedOptimizer(torch.optim.Adam(lin.parameters(), lr=lr, eps=1e-4),
                                          named_parameters=lin.named_parameters(),
                                          freeze_step=freeze_step,
                                          experimental=Experimental(compressor=compressor), variance_refresh=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + hvd.rank())
            # mean grad_scale: with 10, a float16 sum of the weight's gradient would be ~6.6e5,
            # past float16's 65504
            targets = [((torch.randn(p.shape, generator=g) + 1) * grad_scale).to(dtype)
                       for p in lin.parameters()]
            opt.zero_grad()
            sum((p * t).sum() for p, t in zip(lin.parameters(), targets)).backward()
            opt.step()
            if step == freeze_step - 1:
                v_at_freeze = [opt.state[p]["exp_avg_sq"].clone() for p in lin.parameters()]
    return {"params": [p.detach().float().clone() for p in lin.parameters()], "start": start,
            "v": v_at_freeze, "v_dtype": str(opt.state[lin.weight]["exp_avg_sq"].dtype),
            "phase": opt.phase, "steps": opt.steps, "skipped": opt.skipped_steps,
            "held_warnings": [str(w.message) for w in caught
                              if "received no gradient" in str(w.message)]}


def low_precision() -> dict:
    """float16 and bfloat16 against float32, with small (1e-3) and large (10) gradients."""
    out = {}
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        for size_name, scale in (("small", 1e-3), ("large", 10.0)):
            out[f"{name}_{size_name}"] = _controlled_gradient_run(dtype, scale)
    for size_name, scale in (("small", 1e-3), ("large", 10.0)):
        out[f"fp32_{size_name}"] = _controlled_gradient_run(torch.float32, scale)
    out["fp16_small_none"] = _controlled_gradient_run(torch.float16, 1e-3, compressor="none")
    out["fp32_small_none"] = _controlled_gradient_run(torch.float32, 1e-3, compressor="none")
    return out


def sparse_embedding(sparse: bool, steps: int = 8, freeze_step: int = 3) -> dict:
    """nn.Embedding(sparse=...) + Linear, sparse_as_dense=True, through the freeze."""
    torch.manual_seed(0)
    emb, head = nn.Embedding(50, 8, sparse=sparse), nn.Linear(8, 1)
    params = [emb.weight, head.weight, head.bias]
    opt = hvd_onebit.DistributedOptimizer(
        torch.optim.Adam(params, lr=1e-2), freeze_step=freeze_step, sparse_as_dense=True,
        named_parameters=[("emb", emb.weight), ("w", head.weight), ("b", head.bias)], variance_refresh=None)
    phases = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rows no rank used in the warmup are held (a warning)
        for step in range(steps):
            g = torch.Generator().manual_seed(10 * step + hvd.rank())
            idx = torch.randint(0, 50, (32,), generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(head(emb(idx)), torch.randn(32, 1, generator=g)).backward()
            opt.step()
            phases.append(opt.phase)
    return {"params": [p.detach().clone() for p in params], "phases": phases, "steps": opt.steps}


def construction_errors() -> dict:
    """Each bad option must raise at construction, on every rank, naming what is wrong."""
    def make(params=None, **kw):
        params = params if params is not None else list(nn.Linear(4, 4).parameters())
        kw.setdefault("freeze_step", 2)
        return hvd_onebit.DistributedOptimizer(torch.optim.Adam(params), **kw, variance_refresh=None)

    cases = {
        "block_size_12": lambda: make(block_size=12),
        "block_size_0": lambda: make(block_size=0),
        "block_size_float": lambda: make(block_size=64.0),
        "transport": lambda: make(transport="tcp"),
        "kernel_backend": lambda: make(kernel_backend="cuda"),
        "native_on_meta": lambda: make(params=[nn.Parameter(torch.zeros(4, device="meta"))],
                                       kernel_backend="native"),
        "bucket_zero": lambda: make(bucket_size_mb=0),
        "bucket_nan": lambda: make(bucket_size_mb=float("nan")),
        "bucket_str": lambda: make(bucket_size_mb="64"),
        "compressor": lambda: make(experimental=Experimental(compressor="twobit")),
        "float64": lambda: make(params=list(nn.Linear(4, 4).double().parameters())),
        "complex": lambda: make(params=[nn.Parameter(torch.zeros(4, dtype=torch.complex64))]),
        "mpi_transport_under_gloo": lambda: make(transport="mpi"),
        "check_every": lambda: make(check_every=-1),
        "intra_node": lambda: make(experimental=Experimental(intra_node="nvlink")),
        "intra_node_horovod": lambda: make(hierarchical=True, transport="horovod",
                                           experimental=Experimental(intra_node="shared_memory")),
        "passes": lambda: make(backward_passes_per_step=0),
    }
    errors = {}
    for name, fn in cases.items():
        try:
            fn()
            errors[name] = None
        except (TypeError, ValueError, RuntimeError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    return errors


def mask_elsewhere(steps: int = 8, freeze_step: int = 3) -> dict:
    """An exp_avg_mask on another device (CUDA where there is one) and in another dtype than its
    parameter, as after hvd.broadcast_optimizer_state: it must mask on the parameter's device."""
    torch.manual_seed(0)
    emb, lin = nn.Embedding(10, 4, padding_idx=0), nn.Linear(4, 1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mask = torch.ones(10, 4, dtype=torch.float64, device=device)
    mask[0] = 0
    opt = hvd_onebit.DistributedOptimizer(
        torch.optim.Adam([{"params": [emb.weight], "exp_avg_mask": mask},
                          {"params": list(lin.parameters())}], lr=1e-2),
        named_parameters=[("emb", emb.weight), ("w", lin.weight), ("b", lin.bias)],
        freeze_step=freeze_step, variance_refresh=None)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for step in range(steps):
        g = torch.Generator().manual_seed(step * 10 + hvd.rank())
        idx = torch.randint(0, 10, (32,), generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(lin(emb(idx)), torch.randn(32, 1, generator=g)).backward()
        opt.step()
    return {"mask_device": str(opt.param_groups[0]["exp_avg_mask"].device), "phase": opt.phase,
            "pad_row": emb.weight[0].detach().clone(),
            "pad_momentum": opt.state[emb.weight]["exp_avg"][0].clone(),
            "rows_moved": int((emb.weight[1:].detach() != 0).any(1).sum())}


def _nonfinite_runs() -> dict:
    out = {}
    for scaler in (False, True):
        for layer in (0, 1, 2):
            out[(layer, scaler)] = nonfinite_in_one_bucket(layer, scaler)
        out[("reference", scaler)] = nonfinite_in_one_bucket(0, scaler, skip_instead=True)
    return out


def one_node(hierarchical, steps: int = 5, freeze_step: int = 2) -> dict:
    """This job's ranks on one host (one node): hierarchical=True has no 1-bit stage to run."""
    model = _three_layers()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = hvd_onebit.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                              named_parameters=model.named_parameters(),
                                              freeze_step=freeze_step, hierarchical=hierarchical,
                                              variance_refresh=None)
        for step in range(steps):
            opt.zero_grad()
            x, y = _batch(step)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return {"warnings": [str(w.message) for w in caught if "hierarchical" in str(w.message)],
            "hash": params_hash(model), "phase": opt.phase}


def suite() -> dict:
    """Every scenario in one job; one that raises is reported as data (tests/scenarios.py)."""
    return run_scenarios({
        "nonfinite": _nonfinite_runs,
        "low_precision": low_precision,
        "sparse": lambda: sparse_embedding(sparse=True),
        "dense": lambda: sparse_embedding(sparse=False),
        "errors": construction_errors,
        "mask": mask_elsewhere,
        "one_node_hierarchical": lambda: one_node(True),
        "one_node_auto": lambda: one_node("auto"),
    }, rank=hvd.rank())


def mpi_transport_error() -> dict:
    """transport='mpi' in this job: the error at construction (None if it was accepted), and the
    MPI thread level the job has."""
    from mpi4py import MPI
    try:
        hvd_onebit.DistributedOptimizer(torch.optim.Adam(nn.Linear(4, 4).parameters()),
                                        freeze_step=2, transport="mpi", variance_refresh=None)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    return {"error": error, "thread_level": MPI.Query_thread(),
            "multiple": MPI.THREAD_MULTIPLE}
