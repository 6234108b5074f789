"""Worker functions for starting buckets from the gradient hooks (overlap): each runs a short
training in every rank and returns what the tests compare with the same run started in step()."""
from __future__ import annotations

import contextlib
import warnings

import horovod.torch as hvd
import torch
import torch.nn as nn

import hvd_onebit
from tests.workers_optimizer import params_hash


class FourLayers(nn.Module):
    """Four Linear layers and one the forward pass never uses (no gradient, ever)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(32, 64)
        self.unused = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 64)
        self.d = nn.Linear(64, 8)

    def forward(self, x):
        return self.d(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))))


def _batch(step: int, k: int = 0):
    g = torch.Generator().manual_seed(1000 * hvd.rank() + 10 * step + k)
    x = torch.randn(16, 32, generator=g)
    return x, torch.sin(x[:, :8])


def run(overlap: bool, steps: int = 9, freeze_step: int = 3, passes: int = 1,
        clip: bool = False, scaler: bool = False, transport: str = "auto",
        zero_grad_between: bool = False, clip_alone: bool = False,
        variance_refresh=None, change_between: str = "") -> dict:
    """One training run; returns per-step parameter hashes and the engine's counters."""
    model = FourLayers()
    groups = [{"params": [p for n, p in model.named_parameters() if n.startswith("c.")],
               "betas": (0.8, 0.999)},
              {"params": [p for n, p in model.named_parameters() if not n.startswith("c.")]}]
    opt = hvd_onebit.DistributedOptimizer(
        torch.optim.Adam(groups, lr=1e-2), named_parameters=model.named_parameters(),
        freeze_step=freeze_step, bucket_size_mb=0.01, backward_passes_per_step=passes,
        overlap=overlap, transport=transport, variance_refresh=variance_refresh)
    amp = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaler else None
    out = {"hashes": [], "warnings": [], "error": None, "zero_grad_error": None, "norms": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            opt.zero_grad()
            for k in range(passes):
                x, y = _batch(step, k)
                loss = nn.functional.mse_loss(model(x), y)
                (amp.scale(loss) if amp else loss).backward()
            if zero_grad_between and opt.phase == "compression":
                try:
                    opt.zero_grad()
                except AssertionError as exc:
                    out["zero_grad_error"] = str(exc)
                zero_grad_between = False
            if clip:  # Horovod's recipe: the gradients are final once synchronize() returns
                opt.synchronize()
                if amp:
                    amp.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            if change_between and opt.phase == "compression":  # as OneCycleLR's step() does
                group = opt.param_groups[1]
                beta1, beta2 = group["betas"]
                if change_between == "eps":
                    group["eps"] = 1e-3
                else:
                    group["betas"] = (0.85, beta2) if change_between == "beta1" else (beta1, 0.99)
                change_between = ""
            if clip_alone and opt.phase == "compression" and hvd.rank() == 1:
                # no synchronize(): rank 1 alone clips its own gradients, in place
                out["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                                         1e-3)))
            with opt.skip_synchronize() if clip else contextlib.nullcontext():
                if amp:
                    amp.step(opt)
                    amp.update()
                else:
                    opt.step()
            out["hashes"].append(params_hash(model))
    engine = opt.compressed_step
    out["warnings"] = sorted({str(w.message) for w in caught if "hvd_onebit" in str(w.message)
                              and "no gradient" not in str(w.message)})
    out["buckets"] = len(engine.buckets)
    out["early_starts"] = engine.early_starts
    out["restarts"] = engine.restarts
    out["breakdown"] = opt.last_step_breakdown
    out["transport"] = opt.transport
    out["refreshes"] = opt.telemetry()["refreshes"]
    return out


def suite() -> dict:
    cases = {
        "plain": {},
        "passes2": {"passes": 2},
        "clip": {"clip": True},
        "scaler": {"scaler": True},
        "scaler_clip": {"scaler": True, "clip": True},
        "beta1": {"change_between": "beta1"},
        "beta2": {"change_between": "beta2"},
        "eps": {"change_between": "eps"},
    }
    out = {}
    for name, kwargs in cases.items():
        for overlap in (True, False):
            out[(name, overlap)] = run(overlap, **kwargs)
    out["horovod_transport"] = run(True, transport="horovod")
    out["zero_grad"] = run(True, zero_grad_between=True, steps=5)
    # refresh steps (the default schedule: every step at first) among the compressed ones
    out["clip_alone"] = run(True, clip_alone=True, variance_refresh="doubling", steps=8)
    out["choice"] = transport_choice()
    return out


def transport_choice() -> dict:
    """What transport="auto" resolves to, and transport="torch"'s refusal, per situation."""
    import os

    from hvd_onebit.transport.registry import check_transport, resolve_transport

    ps, cpu = hvd.global_process_set, torch.device("cpu")
    out = {"plain": resolve_transport("auto", ps, cpu),
           "hierarchical": resolve_transport("auto", ps, cpu, hierarchical="auto"),
           "explicit": resolve_transport("horovod", ps, cpu)}
    os.environ["HOROVOD_ELASTIC"] = "1"
    try:
        out["elastic"] = resolve_transport("auto", ps, cpu)
        try:
            check_transport("torch", ps, cpu)
            out["elastic_torch_error"] = None
        except ValueError as exc:
            out["elastic_torch_error"] = str(exc)
    finally:
        del os.environ["HOROVOD_ELASTIC"]
    return out


def rendezvous_fallback(broken: str = "rendezvous") -> dict:
    """torch.distributed made unusable: its rendezvous unreachable (rank 0's MASTER_ADDR
    nowhere), or, with ``broken="connect"``, the last rank's Gloo connections (an interface it
    does not have) after a rendezvous every rank reaches. With transport="auto" every rank
    stays with Horovod and says why; with "torch" every rank raises."""
    import os

    import torch.distributed as dist

    env = {"HVD_ONEBIT_RENDEZVOUS_S": "3"}
    if broken == "rendezvous":
        env.update(MASTER_ADDR="198.18.255.1", MASTER_PORT="29999")
    elif hvd.rank() == hvd.size() - 1:
        env.update(GLOO_SOCKET_IFNAME="bogus0")
    os.environ.update(env)
    out = {}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = FourLayers()
            opt = hvd_onebit.DistributedOptimizer(torch.optim.Adam(model.parameters()),
                                                  named_parameters=model.named_parameters(),
                                                  freeze_step=2, variance_refresh=None)
        out["auto"] = opt.transport
        out["auto_warnings"] = [str(w.message) for w in caught if "transport='auto'" in str(w.message)]
        other = FourLayers()  # its own hooks: never the first model's
        try:
            hvd_onebit.DistributedOptimizer(torch.optim.Adam(other.parameters()),
                                            named_parameters=other.named_parameters(),
                                            freeze_step=2, transport="torch", variance_refresh=None)
            out["torch_error"] = None
        except RuntimeError as exc:
            out["torch_error"] = f"{type(exc).__name__}: {exc}"
        # the job goes on through Horovod: a step of the fallback optimizer
        x, y = _batch(0)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        out["steps"] = opt.steps
        out["initialized"] = dist.is_initialized()
    finally:
        for key in env:
            os.environ.pop(key, None)
    return out


def host_interfaces() -> dict[str, str]:
    """This host's IPv4 addresses and the interfaces that hold them, as ``ip`` lists them."""
    import subprocess

    lines = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    return {fields[3].split("/")[0]: fields[1] for fields in map(str.split, lines)}


def rendezvous_interface() -> dict:
    """mpirun sets no HOROVOD_GLOO_IFACE: torch.distributed's Gloo then takes the interface
    that routes to rank 0's address (MASTER_ADDR, here an address of this host's own that is
    not a loopback one), where it took the host name's address (a loopback one on many
    hosts, which other nodes cannot reach)."""
    import os

    import torch.distributed as dist

    interfaces = host_interfaces()
    outward = next(((ip, name) for ip, name in interfaces.items() if name != "lo"), None)
    if outward is None or dist.is_initialized():
        return {"skipped": f"interfaces {interfaces}, torch.distributed set up already: "
                           f"{dist.is_initialized()}"}
    os.environ.pop("HOROVOD_GLOO_IFACE", None)  # horovodrun --gloo sets it; mpirun does not
    os.environ.update({"MASTER_ADDR": outward[0], "MASTER_PORT": "0"})
    try:
        model = FourLayers()
        opt = hvd_onebit.DistributedOptimizer(torch.optim.Adam(model.parameters()),
                                              named_parameters=model.named_parameters(),
                                              freeze_step=2, variance_refresh=None)
        for step in range(4):
            opt.zero_grad()
            x, y = _batch(step)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return {"skipped": None, "interface": outward[1],
                "gloo": os.environ.get("GLOO_SOCKET_IFNAME"), "transport": opt.transport,
                "phase": opt.phase, "hash": params_hash(model)}
    finally:
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key, None)
