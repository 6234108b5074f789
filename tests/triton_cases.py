"""The Triton kernels (hvd_onebit.triton_kernels) under Triton's interpreter, on CPU tensors:
the bits of the torch twins and of the native kernels, and the NumPy reference through the
collective (n virtual ranks as threads).

Not collected by the suite itself: tests/test_triton_kernels.py runs this file in a subprocess
with ``TRITON_INTERPRET=1``, which must be set before triton is first imported (triton's own
``tl.sum``/``tl.max`` are jitted at its import), so the variable never reaches other tests. To run
it directly: ``TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/triton_cases.py``.

Tolerances: the kernels are compared bit for bit with the torch twins and the native kernels
(same fp32 operations in the same order, no FMA). Block scales are float(sqrt(sum in float64)),
whose float64 sum is taken in a different order by each implementation; the squares are exact,
so the orders differ only within float64 rounding and the float32 scale agrees unless the root
lies within ~1e-16 relative of a float32 rounding boundary: with these fixed seeds it never does,
so the comparisons stay exact. Against the NumPy reference (float64 pairwise sums, numpy's own
operation order) the collective's outputs are compared with the tolerance test_inprocess.py
uses (rtol 1e-5, atol 1e-6).
"""
import os

import numpy as np
import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 from the start (tests/test_triton_kernels.py sets it)",
                allow_module_level=True)

from hvd_onebit import OneBitAllreduce, _C, kernels  # noqa: E402
from hvd_onebit.kernels import triton as tk  # noqa: E402
from hvd_onebit.kernels.fused_adam import (AdamUpdate, MomentumInput, decode_update,  # noqa: E402
                                   worker_compress_momentum)
from hvd_onebit.layout import Layout  # noqa: E402
from hvd_onebit.transport.inprocess import run_threads  # noqa: E402
from tests.checks import assert_equal_tensors  # noqa: E402
from tests.onebit_reference import ReferenceOneBit  # noqa: E402
from tests.test_fused_adam import preconditioning, update_case  # noqa: E402
from tests.test_kernels import _error_feedback_case, _previous_state  # noqa: E402
from tests.workers_collective import rank_input  # noqa: E402

assert tk.INTERPRETED, "the Triton kernels must run in the interpreter here (TRITON_INTERPRET)"


def _bytes(t):
    return None if t is None else t.contiguous().view(torch.uint8).numpy().tobytes()


def _counted(monkeypatch, name):
    """The calls of ``tk.<name>``, each as its number of positional arguments: the fused_adam
    hooks fall back to the torch twin where Triton cannot run (a plain ``tk.decode(rows, out,
    layout)`` then torch's update), so a bit-for-bit match alone would not show that the fused
    Triton kernel ran."""
    calls = []
    kernel = getattr(tk, name)

    def counted(*args, **kwargs):
        calls.append(len(args))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(tk, name, counted)
    return calls


# sizes not a multiple of 8, n = 1..4, one block per chunk and several (block 24: not a power
# of two; block 4096 and chunk 5000: blocks split over several programs' tiles)
CASES = [(7, 3, None), (33, 4, None), (100, 1, None), (4099, 3, None), (5000, 2, 64),
         (5001, 3, 24), (10_003, 2, None), (20_001, 4, 4096)]


def _three_kernels(impl, L, x, y_prev, prev_scales, z_prev, prev_server_scales):
    """worker compress, server step (on the rows just sent) and decode with one implementation;
    every output buffer starts as garbage."""
    send = torch.full((L.n * L.row_bytes,), 0xAB, dtype=torch.uint8)
    y_out = torch.full((L.padded,), 123.0)
    z_out = torch.full((L.chunk,), 5.0)
    row = torch.full((L.row_bytes,), 0xCD, dtype=torch.uint8)
    out = torch.full((L.numel,), 7.0)
    if impl == "avx2":
        ok = _C.worker_compress(x, y_prev, prev_scales, y_out, send, *L.as_args(), True)
        ok_s = _C.server_compress(send, z_prev, prev_server_scales, z_out, row, *L.as_args(), True)
        _C.decode(send, out, *L.as_args(), True)
    else:
        ok = kernels.worker_compress(x, y_prev, prev_scales, y_out, send, L, impl)
        ok_s = kernels.server_compress(send, z_prev, prev_server_scales, z_out, row, L, impl)
        kernels.decode(send, out, L, impl)
    return [bool(ok), bool(ok_s)] + [_bytes(t) for t in (y_out, send, z_out, row, out)]


@pytest.mark.parametrize("numel,n,block", CASES)
def test_kernels_give_the_bits_of_the_torch_twins_and_native(numel, n, block):
    L = Layout.build(numel, n, block)
    g = torch.Generator().manual_seed(numel)
    y_prev, prev_scales = _previous_state(L, g)
    x = torch.randn(numel, generator=g)
    z_prev = torch.randn(L.chunk, generator=g)
    prev_server_scales = prev_scales[:L.nblocks].clone()  # a realistic factored server error
    runs = {impl: _three_kernels(impl, L, x, y_prev, prev_scales, z_prev, prev_server_scales)
            for impl in ("torch", "avx2", "triton")}
    runs["triton again"] = _three_kernels("triton", L, x, y_prev, prev_scales, z_prev,
                                          prev_server_scales)
    assert runs["torch"][:2] == [True, True]
    for impl in ("avx2", "triton", "triton again"):
        assert runs[impl] == runs["torch"], impl


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_collective_on_triton_matches_the_numpy_reference(n):
    """OneBitAllreduce(backend="triton") with n virtual ranks: ranks identical, the native
    backend's bits, the reference within test_inprocess.py's tolerance."""
    numel = 4099

    def calls(t, backend):
        comm = OneBitAllreduce(numel, transport=t, backend=backend, name=f"tt.{backend}")
        return [comm.allreduce(torch.from_numpy(rank_input(c, t.rank, numel))).numpy().copy()
                for c in range(3)]

    per_rank = run_threads(n, lambda t: calls(t, "triton"))
    native = run_threads(n, lambda t: calls(t, "native"))
    for got in per_rank[1:] + native:
        assert [a.tobytes() for a in got] == [a.tobytes() for a in per_rank[0]]
    ref = ReferenceOneBit(numel, n)
    for call, got in enumerate(per_rank[0]):
        want = ref.allreduce([rank_input(call, r, numel) for r in range(n)])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"call {call}")


def _compressions(src, y_prev, prev_scales, L):
    """``src``'s worker compression by the torch, Triton and native kernels, each into garbage
    buffers: {impl: (status, y bytes, row bytes)}."""
    runs = {}
    for impl in ("torch", "triton", "native"):
        y_out = torch.full((L.padded,), 9.0)
        send = torch.full((L.n * L.row_bytes,), 0xEE, dtype=torch.uint8)
        ok = worker_compress_momentum(src, y_prev, prev_scales, y_out, send, L, impl)
        runs[impl] = (bool(ok), _bytes(y_out), _bytes(send))
    return runs


SEGMENTS = [([5, 0, 13, 1000, 7], 4), ([64, 64], 3), ([1], 2), ([4099], 1),
            ([3001, 3, 2000, 9000, 11], 2)]


@pytest.mark.parametrize("precondition", [False, True], ids=["momentum", "preconditioned"])
@pytest.mark.parametrize("sizes,n", SEGMENTS)
def test_momentum_update_inside_the_compression(sizes, n, precondition, monkeypatch):
    """beta1*m + (1-beta1)*g computed in the compression pass across gradient boundaries that
    split 8-element groups and tiles, with missing (None) and float16/bfloat16 gradients: the
    torch twin's bits (materialise, then compress), and native's where it can run.
    Preconditioned, x / denom (+-0 where the variance is 0), denom per segment."""
    numel = sum(sizes)
    L = Layout.build(numel, n, None)
    g = torch.Generator().manual_seed(numel)
    y_prev, prev_scales = _previous_state(L, g)
    m = torch.randn(numel, generator=g)
    m[:1] = -0.0
    grads = [None if i % 3 == 1 else torch.randn(s, generator=g) for i, s in enumerate(sizes)]
    low = [None if gr is None else gr.to([torch.float32, torch.float16, torch.bfloat16][i % 3])
           for i, gr in enumerate(grads)]
    extra = preconditioning(sizes, g) if precondition else {}
    calls = _counted(monkeypatch, "worker_compress_momentum")
    for label, grad_list in (("float32", grads), ("low precision", low)):
        runs = _compressions(MomentumInput(m, grad_list, sizes, 0.9, **extra), y_prev,
                             prev_scales, L)
        assert len(calls) == (2 if label == "low precision" else 1), "Triton's kernel did not run"
        assert runs["torch"][0] is True
        for impl in ("triton", "native"):
            for k, what in enumerate(("status", "y", "rows")):
                assert runs[impl][k] == runs["torch"][k], \
                    f"{impl}, {label} gradients: {what} differs from torch's"


# Segment starts all multiples of 8: each tensor allocated apart sits at an aligned offset from
# the momentum (torch's CPU allocations are 64-byte aligned), except those given one element
# past their allocation's start.
VECTOR_SIZES = [4096, 4104, 4096, 3000, 8192]
VECTOR_KINDS = [torch.float32, torch.float16, torch.bfloat16, None, "float32 off by one"]


def _placed(t, kind):
    """``t`` as ``kind``: a dtype, None, or a float32 copy one element into its allocation."""
    if kind is None:
        return None
    if kind == "float32 off by one":
        return torch.cat([torch.zeros(1), t.float()])[1:]
    return t.to(kind)


@pytest.mark.parametrize("precondition", [False, True], ids=["momentum", "preconditioned"])
def test_vector_path_of_each_kind_and_the_general_path_beside_it(precondition, monkeypatch):
    """Tiles inside one segment load its gradient (and variance) as vectors at an aligned
    offset from the momentum; a tensor off alignment takes the general path. Float32, float16,
    bfloat16 and missing gradients, and a misaligned float32 gradient and variance, with a scale
    per 512 elements: the compression gives the torch twin's bits, and native's, and the
    decode with Adam's update too (weights of the same kinds)."""
    sizes, n = VECTOR_SIZES, 2
    numel = sum(sizes)
    L = Layout.build(numel, n, 512)
    g = torch.Generator().manual_seed(7)
    y_prev, prev_scales = _previous_state(L, g)
    m = torch.randn(numel, generator=g)
    grads = [_placed(torch.randn(s, generator=g), k) for s, k in zip(sizes, VECTOR_KINDS)]
    extra = preconditioning(sizes, g) if precondition else {}
    if precondition:
        extra["variances"][4] = _placed(extra["variances"][4], "float32 off by one")
        offsets = tk.launch.aligned_offsets(m, extra["variances"], sizes)
        assert [q == tk.device.NOT_ALIGNED.value for q in offsets] == [False] * 4 + [True], \
            f"the variances' aligned offsets {offsets}: only the last should be unaligned"
    offsets = tk.launch.aligned_offsets(m, grads, sizes)
    assert [q == tk.device.NOT_ALIGNED.value for q in offsets] == [False] * 4 + [True], \
        f"the gradients' aligned offsets {offsets}: only the last should be unaligned"
    calls = _counted(monkeypatch, "worker_compress_momentum")
    runs = _compressions(MomentumInput(m, grads, sizes, 0.9, **extra), y_prev, prev_scales, L)
    assert len(calls) == 1, "Triton's kernel did not run"
    for impl in ("triton", "native"):
        for k, what in enumerate(("status", "y", "rows")):
            assert runs[impl][k] == runs["torch"][k], f"{impl}: {what} differs from torch's"

    rows, _, _, _, steps, decays, sqrt_bc2s, eps, bounds = update_case(sizes, L)
    weights = [_placed(torch.randn(s, generator=g), k) for s, k in zip(sizes, VECTOR_KINDS)]
    variances = [None if w is None and not precondition else v
                 for w, v in zip(weights, preconditioning(sizes, g)["variances"])]
    variances[4] = _placed(variances[4], "float32 off by one")
    calls = _counted(monkeypatch, "decode")
    results = {}
    for impl in ("torch", "triton", "native"):
        w = [None if t is None else t.clone() for t in weights]
        out = torch.full((numel,), float("nan"))
        decode_update(rows, out, L, AdamUpdate(w, variances, sizes, steps, decays, sqrt_bc2s,
                                               eps, bounds, preconditioned=precondition), impl)
        results[impl] = [_bytes(out)] + [_bytes(t) for t in w]
    assert len(calls) == 1 and calls[0] > 3, f"Triton's fused update did not run: {calls}"
    for impl in ("triton", "native"):
        diff = [i for i, (a, b) in enumerate(zip(results[impl], results["torch"])) if a != b]
        assert not diff, f"{impl}: momentum (0) or weights (1..) {diff} differ from torch's"


@pytest.mark.parametrize("precond", [False, True], ids=["momentum", "preconditioned"])
@pytest.mark.parametrize("sizes,n", SEGMENTS)
def test_decode_with_adam_update(sizes, n, precond, monkeypatch):
    """Decode + w = w*decay + clamp((step*m)/denom) in one pass: the torch twin's bits, float32,
    float16 and bfloat16 weights (updated in float32, rounded once), parameters given as None
    only decoded, held elements (denominator +inf) keep w*decay and get a +0 momentum.
    Preconditioned, the rows carry u = m/denom: m = u*denom is stored and the step is
    clamp(step*u); a variance may come without its weight (its momentum converted only)."""
    numel = sum(sizes)
    L = Layout.build(numel, n, None)
    rows, weights, variances, held, steps, decays, sqrt_bc2s, eps, bounds = update_case(
        sizes, L, (torch.float32, torch.float32, torch.float16, torch.bfloat16),
        unweighted_variances=precond)
    calls = _counted(monkeypatch, "decode")
    results = {}
    for impl in ("torch", "triton", "native"):
        w = [None if t is None else t.clone() for t in weights]
        m = torch.full((numel,), float("nan"))
        decode_update(rows, m, L, AdamUpdate(w, variances, sizes, steps, decays, sqrt_bc2s, eps,
                                             bounds, preconditioned=precond), impl)
        results[impl] = (m, w)
    assert len(calls) == 1 and calls[0] > 3, f"Triton's fused update did not run: {calls}"
    ref_m, ref_w = results["torch"]
    for impl in ("triton", "native"):
        m, w = results[impl]
        assert _bytes(m) == _bytes(ref_m), f"{impl}: momentum differs from torch's"
        for i, (t, ref) in enumerate(zip(w, ref_w)):
            assert _bytes(t) == _bytes(ref), \
                f"{impl}: weight {i} ({None if ref is None else ref.dtype}) differs from torch's"
    start = 0
    for i, (h, w0) in enumerate(zip(held, weights)):
        if h is not None and h.any():
            seg = ref_m[start:start + sizes[i]]
            assert torch.all(seg[h] == 0) and not torch.signbit(seg[h]).any(), \
                f"parameter {i}: a held element's momentum is not +0"
            if w0 is not None:
                expect = w0.float()[h] * decays[i] if decays[i] != 1.0 else w0.float()[h]
                assert torch.equal(ref_w[i][h], expect.to(w0.dtype)), \
                    f"parameter {i}: a held weight moved"
        start += sizes[i]


def test_non_finite_input_sets_every_status_and_leaves_the_old_state():
    L = Layout.build(3000, 3, 64)
    g = torch.Generator().manual_seed(2)
    y_prev, prev_scales = _previous_state(L, g)
    saved = (y_prev.clone(), prev_scales.clone())
    x = torch.randn(3000, generator=g)
    x[1500] = float("nan")
    send = torch.empty(L.n * L.row_bytes, dtype=torch.uint8)
    ok = kernels.worker_compress(x, y_prev, prev_scales, torch.empty(L.padded), send, L, "triton")
    equals_false = ok == False  # noqa: E712 - DeviceFlag's __eq__ is under test
    assert isinstance(ok, tk.DeviceFlag) and not ok and equals_false, \
        f"a NaN input gave {ok!r} ({type(ok).__name__}), expected a false DeviceFlag"
    assert kernels.row_status(send, L, L.n).tolist() == [1.0] * 3
    assert_equal_tensors(y_prev, saved[0], "y_prev after a non-finite input")
    assert_equal_tensors(prev_scales, saved[1], "prev_scales after a non-finite input")


def test_zero_input_gives_zero_scales_and_an_identity_error():
    L = Layout.build(64, 2)
    send = torch.empty(L.n * L.row_bytes, dtype=torch.uint8)
    y = torch.empty(L.padded)
    ok = kernels.worker_compress(torch.zeros(64), torch.zeros(L.padded),
                                 torch.zeros(L.n * L.nblocks), y, send, L, "triton")
    assert ok, f"an all-zero input reported as non-finite ({ok!r})"
    assert_equal_tensors(kernels.row_scales(send, L, L.n), torch.zeros(L.n, 1), "row scales")
    assert_equal_tensors(kernels.worker_error(y, kernels.row_scales(send, L, L.n).reshape(-1), L),
                         torch.zeros(L.padded), "worker error")


def test_a_step_with_the_tensors_of_the_last_reuses_its_tables_on_the_device():
    """The segment and coefficient tables of a fused pass are made once per distinct content:
    a second call with the same tensors and coefficients reads the same table objects (no
    table built or copied), the same bits; other tensors get tables of their own."""
    from hvd_onebit.kernels.triton.launch import device_table, segment_table
    tab = segment_table([[11, 12], [13, 14]], [5, 6], "cpu")
    assert tab.tolist() == [0, 5, 11, 11, 12, 13, 14], f"segment table {tab.tolist()}"
    assert segment_table([[11, 12], [13, 14]], [5, 6], "cpu") is tab, "same content, new table"
    assert segment_table([[11, 12], [13, 15]], [5, 6], "cpu") is not tab, "other content, one table"
    sizes = [3001, 3, 2000]
    L = Layout.build(sum(sizes), 2, 512)
    g = torch.Generator().manual_seed(3)
    y_prev, prev_scales = _previous_state(L, g)
    m = torch.randn(L.numel, generator=g)
    grads = [torch.randn(s, generator=g) for s in sizes]
    src = MomentumInput(m, grads, sizes, 0.9, **preconditioning(sizes, g))
    outputs = []
    for call in range(2):
        before = device_table.cache_info()
        send = torch.full((L.n * L.row_bytes,), 0xEE, dtype=torch.uint8)
        worker_compress_momentum(src, y_prev, prev_scales, torch.empty(L.padded), send, L,
                                 "triton")
        after = device_table.cache_info()
        outputs.append(_bytes(send))
        made, reused = after.misses - before.misses, after.hits - before.hits
        assert made + reused == 2 and (call == 0 or (made, reused) == (0, 2)), \
            f"call {call}: {made} tables made, {reused} reused (expected the second to reuse both)"
    assert outputs[0] == outputs[1], "the same call with reused tables sent other rows"


def test_backend_resolution_with_triton():
    assert kernels.resolve_backend("triton", torch.device("cpu")) == "triton"  # interpreted
    assert kernels.resolve_backend("auto", torch.device("cpu")) == "native"
    assert kernels.resolve_backend("auto", torch.device("cuda")) == "triton"


def test_the_cuda_bench_calls_run_on_triton(monkeypatch):
    """bench dev kernel --device cuda's kernel calls (run here on CPU tensors): each runs, the
    fused ones (plain and preconditioned) on Triton's fused kernels, and every call leaves the
    torch twins' bits."""
    from hvd_onebit_tools.bench import kernel as bench
    fused = {"worker_compress_momentum": _counted(monkeypatch, "worker_compress_momentum"),
             "decode": _counted(monkeypatch, "decode")}
    outputs = {}
    for backend in ("torch", "triton"):
        L, b = bench._buffers(4099, 3)
        torch.manual_seed(0)
        calls = {**bench._calls(L, b, backend), **bench._fused_calls(L, b, backend)}
        assert set(calls) == {"compress", "server", "decode", "momentum_compress",
                              "momentum_compress_preconditioned", "decode_update",
                              "decode_update_preconditioned"}
        # what each call writes (the others may still hold torch.empty's garbage)
        written = {"compress": (b.y_next, b.send), "server": (b.server_z_out, b.row),
                   "decode": (b.out,)}
        for name, (fn, count) in calls.items():
            fn()
            assert count >= 4099, name
            outputs[backend, name] = [_bytes(t) for t in written.get(
                name, (b.y_next, b.send) if name.startswith("momentum") else (b.out,))]
    # the decode alone calls tk.decode(rows, out, layout); the fused ones pass the update
    assert len(fused["worker_compress_momentum"]) == 2 and \
        sorted(fused["decode"]) == [3, 12, 12], f"not every fused call ran on Triton: {fused}"
    for name in calls:
        assert outputs["triton", name] == outputs["torch", name], \
            f"{name}: bits differ from torch's"


@pytest.mark.parametrize("numel,n,block", [(4099, 3, None), (20_001, 4, 4096)])
def test_y_and_z_not_stored_or_updated_in_place(numel, n, block):
    """WRITE_Y=False (the rows alone) and y (z) updated in place give the bits of y (z) written
    to a spare buffer: how the collective keeps one error buffer."""
    L, x, y_prev, prev_scales, z_prev, prev_server_scales = _error_feedback_case(numel, n, block)
    ref = _three_kernels("torch", L, x, y_prev, prev_scales, z_prev, prev_server_scales)

    send = torch.full((L.n * L.row_bytes,), 0xAB, dtype=torch.uint8)
    kernels.worker_compress(x, y_prev, prev_scales, None, send, L, "triton")
    row = torch.full((L.row_bytes,), 0xCD, dtype=torch.uint8)
    kernels.server_compress(send, z_prev, prev_server_scales, None, row, L, "triton")
    assert (_bytes(send), _bytes(row)) == (ref[3], ref[5])

    y, z = y_prev.clone(), z_prev.clone()
    send = torch.full((L.n * L.row_bytes,), 0xAB, dtype=torch.uint8)
    kernels.worker_compress(x, y, prev_scales, y, send, L, "triton")
    row = torch.full((L.row_bytes,), 0xCD, dtype=torch.uint8)
    kernels.server_compress(send, z, prev_server_scales, z, row, L, "triton")
    assert [_bytes(t) for t in (y, send, z, row)] == ref[2:6]


def test_the_table_of_a_negative_zero_is_not_that_of_zero():
    """The launch tables are cached by value, and -0.0 == 0.0: a step of -0.0 (lr 0) was served
    the table of 0.0, a sign the CPU kernels keep."""
    from hvd_onebit.kernels.triton.launch import device_table
    cpu = torch.device("cpu")
    plus, minus = (device_table((z, 1.0), torch.float32, cpu) for z in (0.0, -0.0))
    assert not torch.signbit(plus[0]) and torch.signbit(minus[0]), \
        f"the tables of 0.0 and -0.0: signs {torch.signbit(plus).tolist()}, " \
        f"{torch.signbit(minus).tolist()}"
