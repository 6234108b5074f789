"""The two faces side by side in a Horovod job: ``hvd_onebit.DistributedOptimizer`` over a plain
module, ``hvd_onebit.ddp.DistributedOptimizer`` over a DDP copy of it on a Gloo group set up
beside Horovod (as ``bench train``'s ``ddp_powersgd`` sets it up). Both start from the same
weights and take the same per-rank batches, so the two backward passes give every rank the same
local gradients; each step's parameters and gradients are compared bit for bit.

Where a face averages gradients (the warmup, a variance refresh step), each does it its own
framework's way: the Horovod face with Horovod's allreduce, one tensor at a time here (op
Average: the sum, then times 1/n), the DDP face as DDP's reducer does (each gradient times 1/n,
then torch.distributed's sum over DDP's bucket, a flat buffer of several gradients). At two
ranks these are the same bits (halving is exact, a sum of two is one addition). At three they
are not: Horovod's average of a tensor differs from DDP's in the last bit of some elements
(where the 1/n is applied: Horovod's sum of the gradients times 1/n is DDP's average), and
with the 1/n applied first some still differ (the order of the sum, it seems, which can follow
an element's place in the buffer reduced). So ``sync_at_freeze`` hands the DDP face the Horovod
face's checkpoint (model and optimizer) once the warmup is over, and from that common state
every 1-bit step is compared.
"""
from __future__ import annotations

import copy
import warnings

import horovod.torch as hvd
import numpy as np
import torch

import hvd_onebit
from hvd_onebit.config import Experimental
from tests.scenarios import run_scenarios
from tests.workers_ddp import BUCKET_MB, FREEZE, Net, adam, batch, differences, make_model, onebit

COMPRESSED = 5  # steps after the freeze in each scenario


def _grads(module: torch.nn.Module) -> list[np.ndarray]:
    return [p.grad.detach().clone().numpy() for p in module.parameters()]


def _params(module: torch.nn.Module) -> list[np.ndarray]:
    return [p.detach().clone().numpy() for p in module.parameters()]


def faces_side_by_side(sync_at_freeze: bool = False, refresh: bool = False) -> dict:
    """FREEZE warmup steps and COMPRESSED more through both faces, the same batches: per step,
    each face's phase, where the gradients the steps took (averaged in the warmup and at a
    refresh, local otherwise) differ, and where the parameters after it differ. ``refresh``:
    variance refresh steps (every other step after the freeze)."""
    from hvd_onebit.transport.rendezvous import init_torch_distributed

    init_torch_distributed()
    options = ({"variance_refresh": "doubling",
                "experimental": Experimental(refresh_schedule={"first_interval": 2})}
               if refresh else {"variance_refresh": None})
    torch.manual_seed(0)
    net = Net()
    horovod_face = hvd_onebit.DistributedOptimizer(
        adam(net), named_parameters=net.named_parameters(), freeze_step=FREEZE,
        bucket_size_mb=BUCKET_MB, transport="torch", **options)
    model = make_model()
    ddp_face = onebit(model, **options)
    rank = hvd.rank()
    out: dict = {"phases": [], "grads": [], "params": [], "synced": None,
                 "initial": differences(_params(net), _params(model.module), "initial")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Gloo group beside Horovod, held elements
        for step in range(FREEZE + COMPRESSED):
            if step == FREEZE and sync_at_freeze:
                # copies: torch's load_state_dict keeps the tensors it is given, and the two
                # faces would then share Adam's state (its step counts) in this process
                model.module.load_state_dict(copy.deepcopy(net.state_dict()))
                ddp_face.load_state_dict(copy.deepcopy(horovod_face.state_dict()))
                out["synced"] = differences(_params(net), _params(model.module), "synced")
            x, y = batch(step, rank)
            horovod_face.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            horovod_face.step()
            ddp_face.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            ddp_face.step()
            out["phases"].append((horovod_face.phase, ddp_face.phase))
            out["grads"].append(differences(_grads(net), _grads(model.module), f"step {step}"))
            out["params"].append(differences(_params(net), _params(model.module),
                                             f"step {step}"))
    out.update(steps=(horovod_face.steps, ddp_face.steps),
               refreshes=(horovod_face.telemetry()["refreshes"],
                          ddp_face.telemetry()["refreshes"]),
               buckets=(len(horovod_face.compressed_step.buckets),
                        len(ddp_face.compressed_step.buckets)),
               local_steps=ddp_face._hook.local_steps,
               digest=b"".join(p.tobytes() for p in _params(model.module)))
    return out


def suite() -> dict:
    """The faces side by side with Horovod's default averaging from a state common at the
    freeze, through 1-bit steps."""
    return run_scenarios({"from_freeze": lambda: faces_side_by_side(sync_at_freeze=True)},
                         rank=hvd.rank())


def through() -> dict:
    """The faces side by side with Horovod's default averaging, through the warmup, the freeze,
    1-bit and refresh steps; for a world of two ranks, where the two averages are the same
    bits."""
    return faces_side_by_side(refresh=True)


def ddp_suite() -> dict:
    """The DDP face's own scenarios (tests/workers_ddp.py) on a Gloo group beside Horovod: a
    world of three ranks, where DDP's averaging and a hook's can differ in the last bit."""
    from hvd_onebit.transport.rendezvous import init_torch_distributed

    from tests import workers_ddp

    init_torch_distributed()
    return workers_ddp.suite()
