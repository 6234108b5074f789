"""Single-process tests of the layout and the sign-compression kernels (no Horovod job).

Adam's fused prologue and epilogue are tested in tests/test_fused_adam.py."""
import numpy as np
import pytest
import torch

from hvd_onebit import _C, kernels
from hvd_onebit.layout import Layout
from tests.checks import assert_equal_tensors
from tests.onebit_reference import _compress

CASES = [(1, 2, None), (7, 3, None), (31, 4, None), (33, 4, None), (4099, 3, None),
         (1_000_003, 4, None), (5000, 2, 64), (100, 1, None)]


@pytest.fixture(params=["avx512", "avx2"])
def vector_width(request):
    """The native kernels' vector paths in turn: AVX-512 where the CPU has it (what "avx2"
    tests call then), and AVX2 with it forbidden; both must give the scalar code's bits."""
    if request.param == "avx512" and not _C.has_avx512():
        pytest.skip("this CPU has no AVX-512")
    allowed = _C.set_avx512(request.param == "avx512")
    yield request.param
    _C.set_avx512(allowed)


def test_layout_pads_to_multiple_of_8n_and_aligns_rows():
    L = Layout.build(33, 4)
    assert (L.chunk, L.padded, L.block, L.nblocks) == (16, 64, 16, 1)
    assert L.row_bytes == 4 + 4 + 4, f"row_bytes {L.row_bytes}, expected 12 (a multiple of 4)"
    assert Layout.build(0, 4).wire_bytes == 0
    B = Layout.build(5000, 2, block_size=64)
    assert B.chunk % 64 == 0 and B.nblocks == B.chunk // 64, \
        f"block 64: chunk {B.chunk} (expected a multiple of 64), {B.nblocks} blocks"
    with pytest.raises(ValueError, match="multiple of 8"):
        Layout.build(10, 2, block_size=12)
    with pytest.raises(ValueError, match="numel"):
        Layout.build(-1, 2)


def test_pack_unpack_round_trip_and_bit_order():
    positive = torch.tensor([True, False, False, False, False, False, False, True] * 2)
    packed = kernels.pack_signs(positive)
    assert packed.tolist() == [0b10000001, 0b10000001]
    assert_equal_tensors(kernels.unpack_signs(packed), positive, "unpack(pack(signs))")


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


def _error_feedback_case(numel, n, block):
    """A layout and the inputs of both compressions from a committed state: (L, x, y_prev,
    prev_send, z_prev, prev_row)."""
    L = Layout.build(numel, n, block)
    g = torch.Generator().manual_seed(numel)
    y_prev, prev_send = _previous_state(L, g)
    x = torch.randn(numel, generator=g)
    z_prev = torch.randn(L.chunk, generator=g)
    prev_row = prev_send[:L.row_bytes].clone()
    return L, x, y_prev, prev_send, z_prev, prev_row


IMPLS = ("torch", "avx2", "scalar")


@pytest.mark.usefixtures("vector_width")
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
    assert_equal_tensors(y_prev, saved[0], f"{impl}: y_prev after a non-finite input")
    assert_equal_tensors(prev_send, saved[1], f"{impl}: prev_send after a non-finite input")
    assert kernels.row_status(send, L, L.n).tolist() == [1.0, 1.0]


def test_zero_block_gives_zero_scale_not_nan():
    L = Layout.build(64, 2)
    zeros_rows = torch.zeros(L.n * L.row_bytes, dtype=torch.uint8)
    ok, send, _, err, _, _, out = _run("avx2", L, torch.zeros(64), torch.zeros(L.padded),
                                       zeros_rows, torch.zeros(L.chunk))
    assert ok, f"an all-zero input reported as non-finite (ok={ok!r})"
    assert_equal_tensors(out, torch.zeros(64), "decoded zero block")
    assert_equal_tensors(err, torch.zeros(L.padded), "error of a zero block")


def test_backend_selection_errors_are_clear():
    with pytest.raises(ValueError, match="kernel backend must be one of"):
        kernels.resolve_backend("cuda-magic", torch.device("cpu"))
    with pytest.raises(ValueError, match="CPU tensors only"):
        kernels.resolve_backend("native", torch.device("cuda"))
    # auto on CUDA: the triton kernels where triton is installed, the torch twins elsewhere
    expect = "triton" if kernels.triton_available() else "torch"
    assert kernels.resolve_backend("auto", torch.device("cuda")) == expect
    if kernels.triton_available() and not kernels._triton_interpreted():
        with pytest.raises(ValueError, match="CUDA tensors"):
            kernels.resolve_backend("triton", torch.device("cpu"))


def _compress_modes(impl, L, x, y_prev, prev_send, z_prev, prev_row):
    """Worker and server compression with y (z) into a spare buffer, not stored, and in place:
    (y, send, z, row) of each, as bytes."""
    def worker(y_out, y_from):
        send = torch.full((L.n * L.row_bytes,), 0xAB, dtype=torch.uint8)
        if impl == "torch":
            kernels.worker_compress(x, y_from, prev_send, y_out, send, L, "torch")
        else:
            _C.worker_compress(x, y_from, prev_send, y_out, send, *L.as_args(), impl == "avx2")
        return send

    def server(send, z_out, z_from):
        row = torch.full((L.row_bytes,), 0xCD, dtype=torch.uint8)
        if impl == "torch":
            kernels.server_compress(send, z_from, prev_row, z_out, row, L, "torch")
        else:
            _C.server_compress(send, z_from, prev_row, z_out, row, *L.as_args(), impl == "avx2")
        return row

    b = lambda t: t.numpy().tobytes()  # noqa: E731
    spare_y, spare_z = torch.full((L.padded,), 1.0), torch.full((L.chunk,), 1.0)
    send = worker(spare_y, y_prev)
    row = server(send, spare_z, z_prev)
    modes = {"spare": (b(spare_y), b(send), b(spare_z), b(row))}
    send_only, row_only = worker(None, y_prev), server(send, None, z_prev)
    modes["none"] = (b(spare_y), b(send_only), b(spare_z), b(row_only))
    y, z = y_prev.clone(), z_prev.clone()
    send_in_place = worker(y, y)
    row_in_place = server(send, z, z)
    modes["in place"] = (b(y), b(send_in_place), b(z), b(row_in_place))
    return modes


@pytest.mark.usefixtures("vector_width")
@pytest.mark.parametrize("numel,n,block", [(4099, 3, None), (5000, 2, 64),
                                           ((1 << 21) + 5, 2, None)])
def test_y_and_z_not_stored_or_updated_in_place_give_the_same_bits(numel, n, block):
    """How the collective keeps one error buffer: the rows alone first (y_out=None), then the
    same pass with y updated in place, must give the bits of y written to a spare buffer (the
    large case takes the native kernels' streaming-store path)."""
    L, x, y_prev, prev_send, z_prev, prev_row = _error_feedback_case(numel, n, block)
    saved = (y_prev.clone(), z_prev.clone())
    runs = {impl: _compress_modes(impl, L, x, y_prev, prev_send, z_prev, prev_row)
            for impl in IMPLS}
    assert_equal_tensors(y_prev, saved[0], "y_prev after the compressions")
    assert_equal_tensors(z_prev, saved[1], "z_prev after the compressions")
    for impl, modes in runs.items():
        for mode, got in modes.items():
            assert got == runs["torch"]["spare"], (impl, mode)


def test_an_output_overlapping_the_previous_state_is_refused():
    L = Layout.build(100, 2)
    buf = torch.zeros(2 * L.padded)
    send, prev = (torch.zeros(L.n * L.row_bytes, dtype=torch.uint8) for _ in range(2))
    with pytest.raises(RuntimeError, match="y_prev itself or not overlap it"):
        _C.worker_compress(torch.zeros(100), buf[:L.padded], prev, buf[8:8 + L.padded], send,
                           *L.as_args(), True)
    with pytest.raises(RuntimeError, match="send must not alias prev_send"):
        _C.worker_compress(torch.zeros(100), buf[:L.padded], prev, None, prev, *L.as_args(), True)


def test_hvd_onebit_native_avx2_loads_the_kernels_with_avx512_forbidden(monkeypatch):
    from hvd_onebit.kernels import native_loader

    allowed = _C.set_avx512(True)
    try:
        monkeypatch.setenv(native_loader.ENV, "avx2")
        native_loader.load_native.cache_clear()
        kernels = native_loader.load_native()
        assert kernels.module is _C and kernels.origin == "installed", kernels
        # set_avx512 returns what was allowed before: the loader had forbidden the 16-lane paths
        from hvd_onebit_tools.bench.kernel import native_vector_path
        assert native_vector_path() == "avx2", native_vector_path()  # as bench kernel records it
        assert _C.set_avx512(True) is False, "HVD_ONEBIT_NATIVE=avx2 left AVX-512 allowed"
    finally:
        native_loader.load_native.cache_clear()
        _C.set_avx512(allowed)
