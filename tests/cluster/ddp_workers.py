"""The DDP face with ``hierarchical=True`` in a torchrun job on the emulated cluster (one torchrun
per node, Gloo on the emulated links, Horovod blocked): each scenario returns data (bit
differences, digests, link bytes, error messages) that tests/test_ddp_cluster.py asserts on."""
from __future__ import annotations

import hashlib
import os
import socket
import warnings
from contextlib import contextmanager
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hvd_onebit.ddp
from hvd_onebit_tools.cluster.network import IFACE
from tests.scenarios import run_scenarios
from tests.workers_ddp import differences

WIDTH = 1024  # the model holds about a million parameters: the link bytes are the payload's
LR = 1e-3
FREEZE = 3
COMPRESSED = 4
BUCKET_MB = 2.0  # the momentum spans several buckets
COLLECTIVE_NUMEL = 1001


class Wide(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(WIDTH, WIDTH)
        self.out = torch.nn.Linear(WIDTH, 4)

    def forward(self, x):
        return self.out(torch.tanh(self.inner(x)))


def make_model() -> DDP:
    torch.manual_seed(0)
    return DDP(Wide())


def onebit(model: DDP, hierarchical=True, **options):
    return hvd_onebit.ddp.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=LR), model, freeze_step=FREEZE,
        hierarchical=hierarchical, variance_refresh=None, bucket_size_mb=BUCKET_MB, **options)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1009 * step + 97 * rank)
    return torch.randn(8, WIDTH, generator=g), torch.randn(8, 4, generator=g)


def link_tx_bytes() -> int:
    """Bytes this node's emulated interface has sent (its namespace's ``/proc/net/dev``)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == IFACE:
                return int(counters.split()[8])
    raise RuntimeError(f"no interface {IFACE} in this namespace: not on the emulated cluster")


def params_of(params: list[torch.Tensor]) -> list[np.ndarray]:
    return [p.detach().clone().numpy() for p in params]


def digest(arrays: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(a.tobytes())
    return h.hexdigest()


def train() -> dict:
    """FREEZE warmup steps and COMPRESSED compressed ones of the face: the state at the freeze,
    each compressed step's local gradients and the parameters after it, and the bytes this
    node's link sent in each step (a barrier on either side)."""
    rank = dist.get_rank()
    model = make_model()
    params = list(model.module.parameters())
    opt = onebit(model)
    rec: dict = {"grads": [], "params": [], "tx": [], "step_bytes": [], "phases": []}
    for step in range(FREEZE + COMPRESSED):
        if step == FREEZE:
            rec["params0"] = params_of(params)
            rec["state"] = [{"exp_avg": opt.state[p]["exp_avg"].clone(),
                             "exp_avg_sq": opt.state[p]["exp_avg_sq"].clone(),
                             "step": float(opt.state[p]["step"])} for p in params]
        dist.barrier()
        before = link_tx_bytes()
        opt.zero_grad()
        x, y = batch(step, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if step >= FREEZE:
            rec["grads"].append([p.grad.clone() for p in params])
        opt.step()
        dist.barrier()
        rec["tx"].append(link_tx_bytes() - before)
        rec["step_bytes"].append(opt.telemetry()["last_step_bytes"])
        rec["phases"].append(opt.phase)
        if step >= FREEZE:
            rec["params"].append(params_of(params))
    comms = list(opt.compressed_step.comms.values())
    rec.update(topology=opt.compressed_step.topology().signature(),
               kinds=sorted({type(c).__name__ for c in comms}),
               intra=sorted({getattr(c, "intra", "flat") for c in comms}),
               buckets=len(opt.compressed_step.buckets), numel=sum(p.numel() for p in params))
    return rec


def replay(rec: dict, hierarchical, intra_node: str = "network") -> list[list[np.ndarray]]:
    """The engine alone on this job's group, fed the state and local gradients ``rec`` holds,
    every bucket started in step(): the parameters after each step."""
    from hvd_onebit.config import Experimental, OneBitConfig
    from hvd_onebit.engine import NOT_FROZEN, CompressedStep
    from hvd_onebit.transport.torch_job import TorchJob

    params = [torch.from_numpy(v).clone() for v in rec["params0"]]
    state = {p: {"step": torch.tensor(st["step"]), "exp_avg": st["exp_avg"].clone(),
                 "exp_avg_sq": st["exp_avg_sq"].clone(), "frozen_variance_step": NOT_FROZEN}
             for p, st in zip(params, rec["state"])}
    groups = [{"params": params, "lr": LR, "betas": (0.9, 0.999), "eps": 1e-8,
               "weight_decay": 0.0}]
    config = OneBitConfig.from_options(FREEZE, bucket_size_mb=BUCKET_MB, transport="torch",
                                       overlap=False, hierarchical=hierarchical,
                                       experimental=Experimental(intra_node=intra_node))
    engine = CompressedStep(config, state, lambda group: False,
                            transport=TorchJob(dist.group.WORLD, hierarchical))
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for grads in rec["grads"]:
            engine.begin_step()
            engine.ensure_ready(params)
            engine.step(groups, dict(zip(params, grads)))
            out.append(params_of(params))
    return out


def hierarchical_training() -> dict:
    """The face's run, against the engine alone (hierarchical, the node's stages on its links
    rather than shared memory) and the flat engine, on the same state and gradients."""
    rec = train()
    alone, flat = replay(rec, True), replay(rec, False)
    steps = range(COMPRESSED)
    return {
        "phases": rec["phases"], "topology": rec["topology"], "kinds": rec["kinds"],
        "intra": rec["intra"], "buckets": rec["buckets"], "numel": rec["numel"],
        "tx": rec["tx"], "step_bytes": rec["step_bytes"],
        "digests": [digest(p) for p in rec["params"]],
        "finite": all(bool(np.isfinite(a).all()) for p in rec["params"] for a in p),
        "face_vs_alone": [d for s in steps
                          for d in differences(rec["params"][s], alone[s], f"step {s}")],
        "face_vs_flat": [d for s in steps
                         for d in differences(rec["params"][s], flat[s], f"step {s}")],
        "environment": {k: os.environ.get(k) for k in
                        ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "WORLD_SIZE",
                         "MASTER_ADDR")},
        "hostname": socket.gethostname(),
    }


def rank_input(call: int, rank: int, numel: int) -> np.ndarray:
    """The float32 [numel] input of ``rank`` for ``call`` (the test rebuilds every rank's)."""
    rng = np.random.default_rng(1000 * call + rank)
    return (rng.standard_normal(numel) * (1 + rank)).astype(np.float32)


def collective(numel: int = COLLECTIVE_NUMEL, calls: int = 3) -> dict:
    """The hierarchical collective on the layout torchrun gave (read by TorchJob), the node's
    stages in shared memory: each call's output, for the NumPy reference of the scheme."""
    from hvd_onebit.comm.hierarchical import HierarchicalOneBitAllreduce
    from hvd_onebit.comm.topology import Topology
    from hvd_onebit.transport.torch_job import TorchJob

    topology = Topology.from_layout(*TorchJob(dist.group.WORLD, True).node_places())
    comm = HierarchicalOneBitAllreduce(numel, topology, transport="torch", intra="shared_memory")
    outputs = [comm.allreduce(torch.from_numpy(rank_input(c, dist.get_rank(), numel))).numpy()
               for c in range(calls)]
    return {"topology": topology.signature(), "outputs": outputs, "intra": comm.intra}


@contextmanager
def environment(**values: Optional[str]):
    """Process environment variables set (None: removed) for the block, then restored."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def uneven_layout() -> dict:
    """The last rank says its node runs 3 ranks: the face refuses hierarchical on every rank,
    before anything is registered on the model (it takes a flat face afterwards)."""
    last = dist.get_rank() == dist.get_world_size() - 1
    model = make_model()
    with environment(LOCAL_WORLD_SIZE="3" if last else os.environ["LOCAL_WORLD_SIZE"]):
        try:
            onebit(model)
            refused = "accepted"
        except ValueError as exc:
            refused = f"ValueError: {exc}"
    opt = onebit(model, hierarchical=False)
    return {"refused": refused, "after": opt.phase}


def suite() -> dict:
    return run_scenarios({"hierarchical": hierarchical_training, "collective": collective,
                          "uneven": uneven_layout}, dist.get_rank())
