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


def nonfinite_then_recover(bad_rank=1, numel=1001):
    """Rank ``bad_rank`` sends a NaN: every rank must raise, keep its errors, then carry on."""
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
    untouched = (torch.equal(before["worker_error"], after["worker_error"])
                 and torch.equal(before["server_error"], after["server_error"]))
    # inf on every rank is caught too
    inf_raised = False
    try:
        comm.allreduce(torch.full((numel,), float("inf")))
    except NonFiniteInputError:
        inf_raised = True
    recovered = comm.allreduce(x)
    return {"raised": raised, "untouched": untouched, "inf_raised": inf_raised,
            "recovered_finite": bool(torch.isfinite(recovered).all())}


def async_and_dtypes(numel=4099):
    """allreduce_async == allreduce; fp16/bf16 in, same dtype out; in-place out= works."""
    x = torch.from_numpy(rank_input(3, hvd.rank(), numel))
    a = OneBitAllreduce(numel, name="a")
    b = OneBitAllreduce(numel, name="b")
    sync_out = a.allreduce(x)
    async_out = b.synchronize(b.allreduce_async(x))
    res = {"async_equal": torch.equal(sync_out, async_out)}
    for dtype in (torch.float16, torch.bfloat16):
        c = OneBitAllreduce(numel, name=f"d.{dtype}")
        xd = x.to(dtype)
        out = c.allreduce(xd.view(17, -1) if numel % 17 == 0 else xd)
        res[str(dtype)] = (out.dtype == dtype, out.shape == xd.shape,
                           xd.float().numpy(), out.float().numpy())
    d = OneBitAllreduce(numel, name="inplace")
    y = x.clone()
    ret = d.allreduce(y, out=y)
    res["inplace"] = ret.data_ptr() == y.data_ptr() and torch.equal(y, sync_out)
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
    res["update_fused"] = (torch.equal(w, w_ref) and torch.equal(m, m_ref)
                           and bool((m[::5] == 0).all()) and torch.equal(w[::5], w0[::5])
                           and bool((w[1::5] != w0[1::5]).all()))
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


def fixed_input_outputs(sizes, calls=3, transport="horovod"):
    """Outputs for rank_input through ``transport`` (a name or a transport object): edge sizes,
    finer blocks, and both kernel backends."""
    return {
        "sizes": outputs_for_sizes(sizes, calls=calls, transport=transport),
        "blocks": outputs_for_sizes([5000], calls=2, block_size=64, transport=transport),
        "torch_backend": outputs_for_sizes([4099], calls=2, backend="torch", transport=transport),
        "native_backend": outputs_for_sizes([4099], calls=2, backend="native", transport=transport),
    }


def suite(sizes, calls=3):
    """Everything one launch checks, so each world size costs a single job start."""
    return {
        **fixed_input_outputs(sizes, calls=calls),
        "ef": error_feedback_convergence(),
        "nonfinite": nonfinite_then_recover(),
        "async": async_and_dtypes(),
        "mismatch": mismatched_numel(),
        "mismatch_deferred": mismatched_numel_deferred(),
    }
