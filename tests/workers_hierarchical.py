"""Worker functions for the hierarchical 1-bit allreduce (2 nodes x 2 ranks under horovodrun)."""
from __future__ import annotations

import os
from typing import Optional

import horovod.torch as hvd
import torch

from hvd_onebit.comm.hierarchical import HierarchicalOneBitAllreduce
from hvd_onebit.comm.protocol import NonFiniteInputError
from hvd_onebit.comm.topology import Topology
from hvd_onebit.comm.transaction import synchronize_all
from hvd_onebit import Experimental
from tests.scenarios import run_scenarios
from tests.workers_collective import rank_input


def _ready(transport: str) -> None:
    if transport == "torch":
        from hvd_onebit.transport.rendezvous import init_torch_distributed

        init_torch_distributed()


def outputs(numel: int, calls: int = 3, block_size=None, bad_call: int = -1,
            bad_rank: int = -1, transport: str = "horovod") -> dict:
    """``calls`` allreduces of tests.workers_collective.rank_input; ``bad_rank`` puts an inf into
    its input at ``bad_call``. Per call: the output (or the error) and the error feedback."""
    transport, intra = _transport_and_intra(transport)
    _ready(transport)
    topo = Topology.from_horovod()
    comm = HierarchicalOneBitAllreduce(numel, topo, block_size=block_size,
                                       name=f"t.hier.{numel}", transport=transport, intra=intra)
    out = {"topology": topo.signature(), "outputs": [], "errors": [], "worker_error": [],
           "intra": comm.intra}
    for call in range(calls):
        x = torch.from_numpy(rank_input(call, hvd.rank(), numel))
        if call == bad_call and hvd.rank() == bad_rank:
            x[numel // 2] = float("inf")
        try:
            out["outputs"].append(comm.allreduce(x).numpy().copy())
            out["errors"].append(None)
        except NonFiniteInputError as exc:
            out["outputs"].append(None)
            out["errors"].append(str(exc))
        out["worker_error"].append(comm.worker_error.numpy().copy())
    out["wire_bytes"], out["intra_bytes"] = comm.wire_bytes, comm.intra_bytes
    out["flat_wire_bytes_between_nodes"] = _flat_wire_bytes(numel)
    return out


def _transport_and_intra(name: str) -> tuple[str, str]:
    """"torch-shm": torch's transport between nodes, shared memory inside them."""
    return ("torch", "shared_memory") if name == "torch-shm" else (name, "network")


def _flat_wire_bytes(numel: int) -> int:
    """Bytes a rank of flat 1-bit sends to the other nodes per call: of the n-1 rows of each
    stage, those to the n - local_size ranks outside its node."""
    from hvd_onebit.layout import Layout

    return 2 * (hvd.size() - hvd.local_size()) * Layout.build(numel, hvd.size()).row_bytes


def outputs_for_sizes(sizes, transports=("horovod",), **kwargs) -> dict:
    return {(numel, t): outputs(numel, transport=t, **kwargs) for t in transports
            for numel in sizes}


def collective_suite(sizes, transports) -> dict:
    """Every collective-level scenario of tests/test_hierarchical.py in one job (a launch of
    four ranks costs more than the scenarios), each failing on its own: the outputs for
    ``sizes`` per transport, finer blocks, and per transport a non-finite input and an
    all-or-nothing group of calls."""
    scenarios = {"sizes": lambda: outputs_for_sizes(sizes, transports),
                 "finer_blocks": lambda: outputs(5000, block_size=64),
                 "bad_inputs": bad_inputs}
    for t in transports:
        scenarios[f"nonfinite[{t}]"] = lambda t=t: outputs(1001, calls=4, bad_call=1,
                                                           bad_rank=1, transport=t)
        scenarios[f"all_or_nothing[{t}]"] = lambda t=t: group_all_or_nothing(transport=t)
    return run_scenarios(scenarios, hvd.rank())


# what a caller can get wrong: per case, (input, out)
BAD_INPUTS = {
    "not a tensor": lambda n: ([0.0] * n, None),
    "int64": lambda n: (torch.zeros(n, dtype=torch.int64), None),
    "other numel": lambda n: (torch.zeros(n + 1), None),
    "sparse": lambda n: (torch.zeros(n).to_sparse(), None),
    "other device": lambda n: (torch.empty(n, device="meta"), None),
    "out of another dtype": lambda n: (torch.zeros(n), torch.zeros(n, dtype=torch.float16)),
    "out of another size": lambda n: (torch.zeros(n), torch.zeros(n + 1)),
    "out not contiguous": lambda n: (torch.zeros(n), torch.zeros(2 * n)[::2]),
}


def bad_inputs(numel: int = 1001) -> dict:
    """Each of BAD_INPUTS and a second call while one is in flight, given to the flat and the
    hierarchical collective; per collective the error each raised (type, message), then one
    good call's output (a refused call must leave the collective as it was)."""
    from hvd_onebit import OneBitAllreduce

    topo = Topology.from_horovod()
    comms = {"flat": OneBitAllreduce(numel, name="t.bad.flat"),
             "hierarchical": HierarchicalOneBitAllreduce(numel, topo, name="t.bad.hier")}
    good = torch.from_numpy(rank_input(0, hvd.rank(), numel))
    result = {}
    for kind, comm in comms.items():
        errors = {}
        for case, make in BAD_INPUTS.items():
            tensor, out = make(numel)
            try:
                comm.allreduce_async(tensor, out=out)
                errors[case] = None  # a call started on one rank only: the test fails first
            except Exception as exc:  # noqa: BLE001 - the type is what the test compares
                errors[case] = (type(exc).__name__, str(exc))
        handle = comm.allreduce_async(good)
        try:
            comm.allreduce_async(good)
            errors["in flight"] = None
        except Exception as exc:  # noqa: BLE001
            errors["in flight"] = (type(exc).__name__, str(exc))
        comm.synchronize(handle)
        result[kind] = {"errors": errors, "after": comm.allreduce(good).numpy().copy()}
    return result


def _max_change(before: torch.Tensor, after: torch.Tensor) -> float:
    """0.0 where torch.equal(before, after); else max |after - before|, inf where a value turned
    non-finite (or stayed NaN)."""
    if torch.equal(before, after):
        return 0.0
    return float((after.double() - before.double()).abs().nan_to_num(nan=float("inf")).max())


def group_all_or_nothing(numel: int = 1000, transport: str = "horovod") -> dict:
    """Two hierarchical collectives in one transaction; rank 3 puts an inf into the second's
    input at call 1: neither commits anywhere (outputs and error feedback untouched). Also
    counts the host reads of tensor values while the transaction finishes (one expected)."""
    from tests.sync_counter import HostReads

    transport, intra = _transport_and_intra(transport)
    _ready(transport)
    topo = Topology.from_horovod()
    comms = [HierarchicalOneBitAllreduce(numel, topo, name=f"t.group{i}", transport=transport,
                                         intra=intra) for i in range(2)]
    outs = [torch.zeros(numel) for _ in comms]
    record = []
    for call in range(3):
        xs = [torch.from_numpy(rank_input(call * 2 + i, hvd.rank(), numel)) for i in range(2)]
        if call == 1 and hvd.rank() == 3:
            xs[1][0] = float("nan")
        before = [o.clone() for o in outs], [c.worker_error.clone() for c in comms]
        handles = [c.allreduce_async(x, out=o) for c, x, o in zip(comms, xs, outs)]
        with HostReads() as reads:
            try:
                synchronize_all(list(zip(comms, handles)))
                error = None
            except NonFiniteInputError as exc:
                error = str(exc)
        record.append({
            "error": error, "host_reads": sum(map(len, reads.calls.values())),
            "host_reads_where": [w for c in reads.calls.values() for w in c],
            # max |after - before| per collective (inf where a NaN came or went): 0.0 = unchanged
            "outputs_changed": [_max_change(a, b) for a, b in zip(before[0], outs)],
            "errors_changed": [_max_change(a, c.worker_error) for a, c in zip(before[1], comms)],
        })
    return {"calls": record, "final": [o.numpy().copy() for o in outs]}


def optimizer_run(hierarchical, steps: int = 16, freeze_step: int = 4,
                  transport: str = "auto", intra_node: str = "auto",
                  variance_refresh: Optional[str] = None) -> dict:
    """The test model trained with hvd_onebit; per step the parameters' hash and the loss."""
    import warnings

    import torch.nn as nn

    import hvd_onebit
    from tests.workers_optimizer import batch, make_model, params_hash, val_loss

    model = make_model()
    opt = hvd_onebit.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                          named_parameters=model.named_parameters(),
                                          freeze_step=freeze_step, hierarchical=hierarchical,
                                          transport=transport,
                                          experimental=Experimental(intra_node=intra_node),
                                          variance_refresh=variance_refresh)
    hashes, losses = [], []
    told = [opt.telemetry()["hierarchical"]]  # before the first compressed step, then after it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            if step == freeze_step + 1:
                told.append(opt.telemetry()["hierarchical"])
            opt.zero_grad()
            x, y = batch(step, hvd.rank())
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            hashes.append(params_hash(model))
            losses.append(float(loss))
    intra = [getattr(c, "intra", None) for c in opt.compressed_step.comms.values()]
    topology = opt.compressed_step.topology()
    saved = opt.error_feedback_state_dict()
    active = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    with warnings.catch_warnings(record=True) as same_role:
        warnings.simplefilter("always")
        opt.load_error_feedback_state_dict(saved)
        opt.compressed_step.ensure_ready(active)  # the next step's fusing applies them
    norm_after_same = float(next(iter(opt.compressed_step.comms.values())).worker_error.norm())
    moved = {**saved, "buckets": {k: {**v, "topology": [4, 1, 0, 0]} if "topology" in v else v
                                  for k, v in saved["buckets"].items()}}
    with warnings.catch_warnings(record=True) as other_role:
        warnings.simplefilter("always")
        opt.load_error_feedback_state_dict(moved)
        opt.compressed_step.ensure_ready(active)
    return {"hashes": hashes, "losses": losses, "val_loss": val_loss(model),
            "topology": None if topology is None else topology.signature(), "told": told,
            "bytes": opt.last_step_bytes, "phase": opt.phase,
            "refreshes": opt.telemetry()["refreshes"], "transport": opt.transport,
            "intra": intra, "warnings": [str(w.message) for w in caught],
            "same_role_warnings": [str(w.message) for w in same_role],
            "norm_after_same_role": norm_after_same,
            "other_role_warnings": [str(w.message) for w in other_role],
            "norm_after_other_role": float(
                next(iter(opt.compressed_step.comms.values())).worker_error.norm())}


def optimizer_paths() -> dict:
    out = {mode: optimizer_run(mode) for mode in (True, False, "auto")}
    out["horovod"] = optimizer_run(True, transport="horovod")
    out["network"] = optimizer_run(True, intra_node="network")
    for mode in (True, False):  # the default refresh schedule: a refresh every step at first
        out[f"refresh_{mode}"] = optimizer_run(mode, freeze_step=2, variance_refresh="doubling")
    return out


def uneven_nodes() -> dict:
    """On nodes of unequal rank counts: what building the optimizer with hierarchical=True
    raised (None: nothing), and whether "auto" trains."""
    import hvd_onebit
    from tests.workers_optimizer import make_model

    result = {}
    model = make_model()
    try:  # built, no step taken
        hvd_onebit.DistributedOptimizer(torch.optim.Adam(model.parameters()), freeze_step=4,
                                        named_parameters=model.named_parameters(),
                                        hierarchical=True)
        result["true"] = None
    except ValueError as exc:
        result["true"] = str(exc)
    auto = optimizer_run("auto", steps=6)
    result["auto"] = {"phase": auto["phase"], "hash": auto["hashes"][-1],
                      "warnings": [w for w in auto["warnings"] if "hierarchical" in w]}
    return result


def without_shared_memory(intra_node: str, node: Optional[int] = None) -> dict:
    """A hierarchical run where the nodes cannot share memory (HVD_ONEBIT_SHM_DIR set to a
    missing folder by the test), or, with ``node``, where that node alone cannot: what
    happened, or the error."""
    before = os.environ.get("HVD_ONEBIT_SHM_DIR")
    if node is not None and hvd.cross_rank() == node:
        os.environ["HVD_ONEBIT_SHM_DIR"] = "/nonexistent/hvd_onebit"
    try:
        return optimizer_run(True, steps=6, intra_node=intra_node)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        if before is None:
            os.environ.pop("HVD_ONEBIT_SHM_DIR", None)
        else:
            os.environ["HVD_ONEBIT_SHM_DIR"] = before
