"""Worker functions for the OneBitAllreduce tests; each runs inside every rank after hvd.init().

Inputs are generated from seeds that every rank knows, so the parent test can rebuild all ranks'
inputs and check the outputs against the NumPy reference.
"""
from __future__ import annotations

import horovod.torch as hvd
import numpy as np
import torch

from hvd_onebit import NonFiniteInputError, OneBitAllreduce
from hvd_onebit.kernels.fused_adam import AdamUpdate
from tests.scenarios import run_scenarios


def rank_input(seed: int, rank: int, numel: int) -> np.ndarray:
    """The float32 [numel] input of ``rank`` for call ``seed`` (shared by workers and tests)."""
    rng = np.random.default_rng(1000 * seed + rank)
    return (rng.standard_normal(numel) * (1 + rank)).astype(np.float32)


def outputs_for_sizes(sizes, calls=3, block_size=None, transport="horovod", backend="auto"):
    """For each size: ``calls`` allreduces of rank_input; returns {numel: [outputs], ...}.

    ``transport`` is a name (in a Horovod job) or a transport object (e.g. a virtual rank of
    an in-process world): the same inputs and calls either way, so their bits can be compared.
    """
    results = {}
    for numel in sizes:
        comm = OneBitAllreduce(numel, block_size=block_size, transport=transport, backend=backend,
                               name=f"sizes.{numel}")
        outs = []
        for call in range(calls):
            x = torch.from_numpy(rank_input(call, comm.rank, numel))
            outs.append(comm.allreduce(x).numpy().copy())
        results[numel] = {"outputs": outs, "wire_bytes": comm.wire_bytes,
                          "row_bytes": comm.layout.row_bytes}
    return results


def error_feedback_convergence(numel=1000, calls=300):
    """Fixed inputs; returns (error of one call, error of the running mean after ``calls``)."""
    comm = OneBitAllreduce(numel, name="ef")
    x = torch.from_numpy(rank_input(7, hvd.rank(), numel))
    true_mean = hvd.allreduce(x, op=hvd.Average, name="ef.true")
    total = torch.zeros(numel)
    first_err = None
    for t in range(calls):
        out = comm.allreduce(x)
        total += out
        if first_err is None:
            first_err = float((out - true_mean).norm() / true_mean.norm())
    running_err = float((total / calls - true_mean).norm() / true_mean.norm())
    return first_err, running_err


def changed_elements(before: torch.Tensor, after: torch.Tensor) -> int:
    """How many elements differ (a NaN that appeared counts)."""
    return int((before != after).sum())


def nonfinite_then_recover(bad_rank=1, numel=1001):
    """Rank ``bad_rank`` sends a NaN: every rank must raise, keep its errors, then carry on.

    Returns what happened: the error (message, ranks) of the NaN call, how many elements of each
    error-feedback buffer it changed, the error of an all-inf call, and how many elements of the
    next finite call's output are not finite."""
    comm = OneBitAllreduce(numel, name="nf")
    x = torch.from_numpy(rank_input(0, hvd.rank(), numel))
    comm.allreduce(x)  # non-zero error feedback to protect
    before = comm.state_dict()
    bad = x.clone()
    if hvd.rank() == bad_rank:
        bad[numel // 2] = float("nan")
    raised = None
    try:
        comm.allreduce(bad)
    except NonFiniteInputError as exc:
        raised = (str(exc), exc.ranks)
    after = comm.state_dict()
    changed = {key: changed_elements(before[key], after[key])
               for key in ("worker_error", "server_error")}
    # inf on every rank is caught too
    inf_raised = None
    try:
        comm.allreduce(torch.full((numel,), float("inf")))
    except NonFiniteInputError as exc:
        inf_raised = str(exc)
    recovered = comm.allreduce(x)
    return {"raised": raised, "changed": changed, "sizes": {k: before[k].numel() for k in changed},
            "inf_raised": inf_raised,
            "recovered_nonfinite": int((~torch.isfinite(recovered)).sum())}


def async_and_dtypes(numel=4099):
    """allreduce_async == allreduce; fp16/bf16 in, same dtype out; in-place out= works; an Adam
    update as synchronize's epilogue. Returns the tensors (as arrays) for the test to compare."""
    x = torch.from_numpy(rank_input(3, hvd.rank(), numel))
    a = OneBitAllreduce(numel, name="a")
    b = OneBitAllreduce(numel, name="b")
    sync_out = a.allreduce(x)
    async_out = b.synchronize(b.allreduce_async(x))
    res = {"sync": sync_out.numpy().copy(), "async": async_out.numpy().copy()}
    for dtype in (torch.float16, torch.bfloat16):
        c = OneBitAllreduce(numel, name=f"d.{dtype}")
        xd = x.to(dtype)
        inp = xd.view(17, -1) if numel % 17 == 0 else xd
        out = c.allreduce(inp)
        res[str(dtype)] = {"in_dtype": str(inp.dtype), "out_dtype": str(out.dtype),
                           "in_shape": tuple(inp.shape), "out_shape": tuple(out.shape),
                           "input": xd.float().numpy(), "output": out.float().numpy()}
    d = OneBitAllreduce(numel, name="inplace")
    y = x.clone()
    ret = d.allreduce(y, out=y)
    res["inplace"] = {"returned_ptr": ret.data_ptr(), "out_ptr": y.data_ptr(),
                      "out": y.numpy().copy()}
    two_in_flight = None
    h = d.allreduce_async(x)
    try:
        d.allreduce_async(x)
    except RuntimeError as exc:
        two_in_flight = str(exc)
    d.synchronize(h)
    res["two_in_flight"] = two_in_flight
    # An Adam update handed to synchronize as its epilogue is applied in the decode pass (native
    # fused kernel): the same bits as decoding, then AdamUpdate.apply's torch ops; held elements
    # (inf denominator) keep their weight and get a zero momentum.
    g = torch.Generator().manual_seed(7)
    w = torch.randn(numel, generator=g)
    var = torch.rand(numel, generator=g) * 1e-4
    var[::5] = 0.0  # held: infinite denominator
    w0, w_ref, m_ref = w.clone(), w.clone(), sync_out.clone()
    AdamUpdate([w_ref], [var], [numel], [-1e-3], [1.0], [0.3], [1e-8]).apply(m_ref)
    e = OneBitAllreduce(numel, name="update")
    m = torch.empty(numel)
    e.synchronize(e.allreduce_async(x, out=m),
                  epilogue=AdamUpdate([w], [var], [numel], [-1e-3], [1.0], [0.3], [1e-8]))
    res["update_fused"] = {"w": w.numpy().copy(), "w_ref": w_ref.numpy().copy(),
                           "w0": w0.numpy().copy(), "m": m.numpy().copy(),
                           "m_ref": m_ref.numpy().copy()}
    return res


def mismatched_numel():
    """Ranks disagree on numel: every rank must get a clear ValueError."""
    try:
        OneBitAllreduce(100 + hvd.rank(), name="mismatch")
    except ValueError as exc:
        return str(exc)
    return None


def mismatched_numel_deferred():
    """The same with the check deferred: construction returns, the first call raises."""
    comm = OneBitAllreduce(100 + hvd.rank(), name="mismatch.deferred", defer_check=True)
    try:
        comm.allreduce(torch.zeros(100 + hvd.rank()))
    except ValueError as exc:
        return str(exc)
    return None


def transports_agree(numel=100003):
    """The mpi4py transport gives the same bits as the Horovod one."""
    x = torch.from_numpy(rank_input(5, hvd.rank(), numel))
    outs = {}
    for transport in ("horovod", "mpi"):
        comm = OneBitAllreduce(numel, transport=transport, name=f"t.{transport}")
        outs[transport] = [comm.allreduce(x).numpy().copy() for _ in range(2)]
    return outs


def mpi_transport_without_mpi():
    try:
        OneBitAllreduce(10, transport="mpi", name="nompi")
    except RuntimeError as exc:
        return str(exc)
    return None


def fixed_input_scenarios(sizes, calls=3, transport="horovod"):
    """The scenarios of outputs for rank_input through ``transport`` (a name or a transport
    object): edge sizes, finer blocks, and both kernel backends."""
    return {
        "sizes": lambda: outputs_for_sizes(sizes, calls=calls, transport=transport),
        "blocks": lambda: outputs_for_sizes([5000], calls=2, block_size=64, transport=transport),
        "torch_backend": lambda: outputs_for_sizes([4099], calls=2, backend="torch",
                                                   transport=transport),
        "native_backend": lambda: outputs_for_sizes([4099], calls=2, backend="native",
                                                    transport=transport),
    }


def fixed_input_outputs(sizes, calls=3, transport="horovod"):
    """Every fixed_input_scenarios result (a scenario that raises is returned as its error)."""
    return run_scenarios(fixed_input_scenarios(sizes, calls, transport),
                         rank=getattr(transport, "rank", None))


def suite(sizes, calls=3):
    """Everything one launch checks, so each world size costs a single job start. Each scenario
    that raises comes back as its traceback (tests/scenarios.py): only its tests fail."""
    return run_scenarios({
        **fixed_input_scenarios(sizes, calls=calls),
        "ef": error_feedback_convergence,
        "nonfinite": nonfinite_then_recover,
        "async": async_and_dtypes,
        "mismatch": mismatched_numel,
        "mismatch_deferred": mismatched_numel_deferred,
    }, rank=hvd.rank())
