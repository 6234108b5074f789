"""Single-process tests of the layout and the sign-compression kernels (no Horovod job)."""
import math

import numpy as np
import pytest
import torch

from hvd_onebit import _C, kernels
from hvd_onebit.layout import Layout
from tests.onebit_reference import _compress

CASES = [(1, 2, None), (7, 3, None), (31, 4, None), (33, 4, None), (4099, 3, None),
         (1_000_003, 4, None), (5000, 2, 64), (100, 1, None)]


def test_layout_pads_to_multiple_of_8n_and_aligns_rows():
    L = Layout.build(33, 4)
    assert (L.chunk, L.padded, L.block, L.nblocks) == (16, 64, 16, 1)
    assert L.row_bytes % 4 == 0 and L.row_bytes == 4 + 4 + 4
    assert Layout.build(0, 4).wire_bytes == 0
    B = Layout.build(5000, 2, block_size=64)
    assert B.chunk % 64 == 0 and B.nblocks == B.chunk // 64
    with pytest.raises(ValueError, match="multiple of 8"):
        Layout.build(10, 2, block_size=12)
    with pytest.raises(ValueError, match="numel"):
        Layout.build(-1, 2)


def test_pack_unpack_round_trip_and_bit_order():
    positive = torch.tensor([True, False, False, False, False, False, False, True] * 2)
    packed = kernels.pack_signs(positive)
    assert packed.tolist() == [0b10000001, 0b10000001]
    assert torch.equal(kernels.unpack_signs(packed), positive)


def _worker(impl, L, x, y_prev, prev_send):
    send = torch.full((L.n * L.row_bytes,), 0xAB, dtype=torch.uint8)
    y_out = torch.full((L.padded,), 123.0)
    if impl == "torch":
        ok = kernels.worker_compress(x, y_prev, prev_send, y_out, send, L, "torch")
    else:
        ok = _C.worker_compress(x, y_prev, prev_send, y_out, send, *L.as_args(), impl == "avx2")
    return ok, y_out, send


def _run(impl, L, x, y_prev, prev_send, es):
    ok, y_out, send = _worker(impl, L, x, y_prev, prev_send)
    # the server error es in factored form: z = es, a previous row with zero scales, all signs +
    prev_row = torch.empty(L.row_bytes, dtype=torch.uint8)
    kernels.set_identity_rows(prev_row, L, 1)
    z_out = torch.full((L.chunk,), 123.0)
    row = torch.full((L.row_bytes,), 0xCD, dtype=torch.uint8)
    out = torch.empty(L.numel)
    if impl == "torch":
        kernels.server_compress(send, es, prev_row, z_out, row, L, "torch")
        kernels.decode(send, out, L, "torch")
    else:
        simd = impl == "avx2"
        _C.server_compress(send, es, prev_row, z_out, row, *L.as_args(), simd)
        _C.decode(send, out, *L.as_args(), simd)
    return (ok, send, y_out, kernels.worker_error(y_out, send, L),
            kernels.server_error(z_out, row, L), row, out)


def _previous_state(L, g):
    """A realistic factored worker error: one compression of random data from zero state."""
    y_prev = torch.zeros(L.padded)
    prev_send = torch.zeros(L.n * L.row_bytes, dtype=torch.uint8)
    _, y, send = _worker("torch", L, torch.randn(L.numel, generator=g), y_prev, prev_send)
    return y, send


IMPLS = ("torch", "avx2", "scalar")


@pytest.mark.parametrize("numel,n,block", CASES)
def test_native_scalar_and_torch_kernels_give_identical_bits(numel, n, block):
    L = Layout.build(numel, n, block)
    g = torch.Generator().manual_seed(numel)
    y_prev, prev_send = _previous_state(L, g)
    x = torch.randn(numel, generator=g)
    es = torch.randn(L.chunk, generator=g) * 0.1
    runs = {impl: _run(impl, L, x, y_prev, prev_send, es) for impl in IMPLS}
    ref = runs["torch"]
    for impl in ("avx2", "scalar"):
        for a, b in zip(ref[1:], runs[impl][1:]):
            assert a.numpy().tobytes() == b.numpy().tobytes(), impl
        assert runs[impl][0] is True


@pytest.mark.parametrize("numel,n,block", CASES)
def test_worker_compression_matches_numpy_reference(numel, n, block):
    L = Layout.build(numel, n, block)
    g = torch.Generator().manual_seed(1)
    y_prev, prev_send = _previous_state(L, g)
    err = kernels.worker_error(y_prev, prev_send, L)
    x = torch.randn(numel, generator=g)
    _, send, _, new_err, _, _, _ = _run("avx2", L, x, y_prev, prev_send, torch.zeros(L.chunk))
    y = np.zeros(L.padded, np.float32)
    y[:numel] = x.numpy()
    y = (y + err.numpy()).astype(np.float32)
    decoded = torch.empty(L.padded)
    full = Layout(numel=L.padded, n=L.n, chunk=L.chunk, block=L.block)
    kernels.decode(send, decoded, full, "torch")
    for j in range(n):
        part = slice(j * L.chunk, (j + 1) * L.chunk)
        _, _, approx, e = _compress(y[part], L.block)
        np.testing.assert_allclose(decoded.numpy()[part], approx, rtol=1e-6)
        np.testing.assert_allclose(new_err.numpy()[part], e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_non_finite_input_is_reported_and_old_state_is_untouched(impl):
    L = Layout.build(1000, 2)
    g = torch.Generator().manual_seed(2)
    y_prev, prev_send = _previous_state(L, g)
    saved = (y_prev.clone(), prev_send.clone())
    x = torch.randn(1000, generator=g)
    x[500] = float("inf")
    ok, send, *_ = _run(impl, L, x, y_prev, prev_send, torch.zeros(L.chunk))
    assert ok is False
    assert torch.equal(y_prev, saved[0]) and torch.equal(prev_send, saved[1])
    assert kernels.row_status(send, L, L.n).tolist() == [1.0, 1.0]


def test_zero_block_gives_zero_scale_not_nan():
    L = Layout.build(64, 2)
    zeros_rows = torch.zeros(L.n * L.row_bytes, dtype=torch.uint8)
    ok, send, _, err, _, _, out = _run("avx2", L, torch.zeros(64), torch.zeros(L.padded),
                                       zeros_rows, torch.zeros(L.chunk))
    assert ok and torch.equal(out, torch.zeros(64)) and torch.equal(err, torch.zeros(L.padded))


def test_backend_selection_errors_are_clear():
    with pytest.raises(ValueError, match="kernel backend must be one of"):
        kernels.resolve_backend("cuda-magic", torch.device("cpu"))
    with pytest.raises(ValueError, match="CPU tensors only"):
        kernels.resolve_backend("native", torch.device("cuda"))
    assert kernels.resolve_backend("auto", torch.device("cuda")) == "torch"


@pytest.mark.parametrize("sizes,n", [([5, 0, 13, 1000, 7], 4), ([64, 64], 3), ([1], 2),
                                     ([4099], 1), ([300_001, 3, 200_000], 4)])
def test_momentum_input_compressed_in_one_pass_equals_materialised(sizes, n):
    """beta1*m + (1-beta1)*g computed inside the compression (AVX2 and scalar) gives the same
    bits as torch computing x first, across gradient boundaries that split 8-element groups and
    with missing gradients (zeros)."""
    numel = sum(sizes)
    L = Layout.build(numel, n, None)
    g = torch.Generator().manual_seed(numel)
    y_prev, prev_send = _previous_state(L, g)
    m = torch.randn(numel, generator=g)
    m[:1] = -0.0  # a negative zero times beta1 plus (1-beta1)*0 is +0 in both paths
    grads = [None if i % 3 == 1 else torch.randn(s, generator=g) for i, s in enumerate(sizes)]
    src = kernels.MomentumInput(m, grads, sizes, 0.9)
    x = src.materialize()
    expect = x.clone()
    for i, (grad, start) in enumerate(zip(grads, [sum(sizes[:k]) for k in range(len(sizes))])):
        if grad is not None:
            expect[start:start + sizes[i]] = 0.9 * m[start:start + sizes[i]] + 0.1 * grad
    torch.testing.assert_close(x, expect, rtol=1e-6, atol=1e-7)
    runs = []
    for impl in ("avx2", "scalar", "torch", "materialised"):
        y_out = torch.empty(L.padded)
        send = torch.empty(L.n * L.row_bytes, dtype=torch.uint8)
        if impl == "materialised":
            ok = kernels.worker_compress(x, y_prev, prev_send, y_out, send, L, "native")
        elif impl == "torch":
            ok = kernels.worker_compress_momentum(src, y_prev, prev_send, y_out, send, L, "torch")
        else:
            ok = _C.worker_compress_momentum(m, grads, sizes, 0.9, y_prev, prev_send, y_out, send,
                                             *L.as_args(), impl == "avx2")
        runs.append((ok, y_out.numpy().tobytes(), send.numpy().tobytes()))
    assert all(r == runs[0] for r in runs[1:])
    assert runs[0][0] is True


def test_momentum_input_rejects_mismatched_gradients():
    L = Layout.build(10, 2, None)
    args = (torch.zeros(L.padded), torch.zeros(L.n * L.row_bytes, dtype=torch.uint8),
            torch.empty(L.padded), torch.empty(L.n * L.row_bytes, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="gradient has 3 elements, needs 4"):
        _C.worker_compress_momentum(torch.zeros(10), [torch.zeros(3), torch.zeros(6)], [4, 6],
                                    0.9, *args, *L.as_args(), True)
    with pytest.raises(RuntimeError, match="gradients hold 9 elements, momentum 10"):
        _C.worker_compress_momentum(torch.zeros(10), [None, None], [4, 5], 0.9, *args,
                                    *L.as_args(), True)


@pytest.mark.parametrize("sizes,n", [([5, 0, 13, 1000, 7], 4), ([64, 64], 3), ([1], 2),
                                     ([300_001, 3, 200_000], 4)])
def test_decode_fused_with_adam_update_equals_torch(sizes, n):
    """Decode + ``w = w*decay + (step*m)/denom`` in one pass (AVX2 and scalar) gives the bits of
    torch's decode, ``w.mul_(decay)`` and ``w.addcdiv_(m, denom, value=step)``; parameters given
    as None are only decoded. Elements with an infinite denominator (held fixed) keep their weight
    (times decay) and get a zero momentum, in vector groups and in the scalar tails alike."""
    numel = sum(sizes)
    L = Layout.build(numel, n, None)
    g = torch.Generator().manual_seed(numel)
    rows = torch.randint(0, 255, (L.n * L.row_bytes,), dtype=torch.uint8, generator=g)
    kernels.row_scales(rows, L, L.n).copy_(torch.rand(L.n, L.nblocks, generator=g))
    weights = [None if i % 3 == 1 else torch.randn(s, generator=g) for i, s in enumerate(sizes)]
    denoms = [None if w is None else torch.rand(s, generator=g) + 0.01
              for w, s in zip(weights, sizes)]
    held = [None if d is None else torch.rand(d.shape, generator=g) < 0.3 for d in denoms]
    for d, h in zip(denoms, held):
        if d is not None:
            d[h] = math.inf
    steps = [-1e-3 / 0.9 * (i + 1) for i in range(len(sizes))]
    decays = [1 - 1e-5 if i % 2 else 1.0 for i in range(len(sizes))]
    results = []
    for impl in ("torch", "avx2", "scalar"):
        w = [None if t is None else t.clone() for t in weights]
        m = torch.full((numel,), float("nan"))
        update = kernels.AdamUpdate(w, denoms, sizes, steps, decays)
        if impl == "torch":
            kernels.decode(rows, m, L, "torch")
            update.apply(m)
        else:
            _C.decode_update(rows, m, w, denoms, sizes, steps, decays, *L.as_args(), impl == "avx2")
        results.append((m.numpy().tobytes(), [None if t is None else t.numpy().tobytes() for t in w]))
    assert results[1] == results[0] and results[2] == results[0]
    before = [None if t is None else t.numpy().tobytes() for t in weights]
    assert all(a != b for a, b in zip(results[0][1], before) if a is not None)
    m = torch.frombuffer(bytearray(results[1][0]), dtype=torch.float32)
    start = 0
    for i, (h, w0, decay) in enumerate(zip(held, weights, decays)):
        if h is not None and h.any():
            assert torch.all(m[start:start + sizes[i]][h] == 0)
            w1 = torch.frombuffer(bytearray(results[1][1][i]), dtype=torch.float32)
            assert torch.equal(w1[h], w0[h] * decay if decay != 1 else w0[h])
        start += sizes[i]
