"""Single-process tests of the layout and the sign-compression kernels (no Horovod job).

Adam's fused prologue and epilogue are tested in tests/test_fused_adam.py."""
import numpy as np
import pytest
import torch

from hvd_onebit import _C, kernels
from hvd_onebit.kernels import reference
from hvd_onebit.kernels.rows import decoded, row_bits
from hvd_onebit.layout import Layout
from tests.checks import assert_equal_tensors, assert_same_bits
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


def _worker(impl, L, x, y_prev, prev_scales):
    send = torch.full((L.n * L.row_bytes,), 0xAB, dtype=torch.uint8)
    y_out = torch.full((L.padded,), 123.0)
    if impl == "torch":
        ok = kernels.worker_compress(x, y_prev, prev_scales, y_out, send, L, "torch")
    else:
        ok = _C.worker_compress(x, y_prev, prev_scales, y_out, send, *L.as_args(),
                                impl == "avx2")
    return ok, y_out, send


def scales_of(rows, L, count):
    """The scales of ``count`` rows as a factored error keeps them: float32 [count * nblocks]."""
    return kernels.row_scales(rows, L, count).reshape(-1).clone()


def _run(impl, L, x, y_prev, prev_scales, es):
    ok, y_out, send = _worker(impl, L, x, y_prev, prev_scales)
    # the server error es in factored form: z = es with zero scales
    zero_scales = torch.zeros(L.nblocks)
    z_out = torch.full((L.chunk,), 123.0)
    row = torch.full((L.row_bytes,), 0xCD, dtype=torch.uint8)
    out = torch.empty(L.numel)
    if impl == "torch":
        kernels.server_compress(send, es, zero_scales, z_out, row, L, "torch")
        kernels.decode(send, out, L, "torch")
    else:
        simd = impl == "avx2"
        _C.server_compress(send, es, zero_scales, z_out, row, *L.as_args(), simd)
        _C.decode(send, out, *L.as_args(), simd)
    return (ok, send, y_out, kernels.worker_error(y_out, scales_of(send, L, L.n), L),
            kernels.server_error(z_out, scales_of(row, L, 1), L), row, out)


def _previous_state(L, g):
    """A realistic factored worker error: one compression of random data from zero state,
    (y, the scales of the rows sent)."""
    _, y, send = _worker("torch", L, torch.randn(L.numel, generator=g), torch.zeros(L.padded),
                         torch.zeros(L.n * L.nblocks))
    return y, scales_of(send, L, L.n)


def _error_feedback_case(numel, n, block):
    """A layout and the inputs of both compressions from a committed state: (L, x, y_prev,
    prev_scales, z_prev, prev_server_scales)."""
    L = Layout.build(numel, n, block)
    g = torch.Generator().manual_seed(numel)
    y_prev, prev_scales = _previous_state(L, g)
    x = torch.randn(numel, generator=g)
    z_prev = torch.randn(L.chunk, generator=g)
    return L, x, y_prev, prev_scales, z_prev, prev_scales[:L.nblocks].clone()


IMPLS = ("torch", "avx2", "scalar")


@pytest.mark.usefixtures("vector_width")
@pytest.mark.parametrize("numel,n,block", CASES)
def test_native_scalar_and_torch_kernels_give_identical_bits(numel, n, block):
    L = Layout.build(numel, n, block)
    g = torch.Generator().manual_seed(numel)
    y_prev, prev_scales = _previous_state(L, g)
    x = torch.randn(numel, generator=g)
    es = torch.randn(L.chunk, generator=g) * 0.1
    runs = {impl: _run(impl, L, x, y_prev, prev_scales, es) for impl in IMPLS}
    ref = runs["torch"]
    for impl in ("avx2", "scalar"):
        for a, b in zip(ref[1:], runs[impl][1:]):
            assert a.numpy().tobytes() == b.numpy().tobytes(), impl
        assert runs[impl][0] is True


@pytest.mark.usefixtures("vector_width")
@pytest.mark.parametrize("impl", IMPLS)
def test_the_rows_carry_y_own_signs_so_their_scales_alone_rebuild_the_error(impl):
    """Why a factored error keeps only its rows' scales: every sign bit sent is ``y >= 0`` of
    the y (z) stored, signed zeros included, so ``y - s * sign(y)`` is ``y - decode(rows)``
    (what keeping the whole rows gave) bit for bit, call after call."""
    L = Layout.build(5003, 3, 64)
    g = torch.Generator().manual_seed(5)
    y_prev, scales = torch.zeros(L.padded), torch.zeros(L.n * L.nblocks)
    y_prev[::5] = -0.0  # with x = -0.0 there and a zero scale, y = -0.0 + -0.0 = -0.0
    z_prev, z_scales = torch.zeros(L.chunk), torch.zeros(L.nblocks)
    negative_zeros = 0
    for call in range(3):
        x = torch.randn(L.numel, generator=g)
        x[::5], x[1::5] = -0.0, 0.0
        _, y, send = _worker(impl, L, x, y_prev, scales)
        z, row = torch.empty(L.chunk), torch.empty(L.row_bytes, dtype=torch.uint8)
        if impl == "torch":
            kernels.server_compress(send, z_prev, z_scales, z, row, L, "torch")
        else:
            _C.server_compress(send, z_prev, z_scales, z, row, *L.as_args(), impl == "avx2")
        negative_zeros += int((torch.signbit(y) & (y == 0)).sum())
        for what, v, rows, count in (("worker", y, send, L.n), ("server", z, row, 1)):
            signs = kernels.unpack_signs(row_bits(rows, L, count)).reshape(-1)
            assert_same_bits(signs, v >= 0, f"{impl}, call {call}: the {what}'s sign bits")
            assert_same_bits(reference.factored_error(v, scales_of(rows, L, count), L, count),
                             v - decoded(rows, L, count).reshape(-1),
                             f"{impl}, call {call}: the {what} error from its scales")
        y_prev, scales = y, scales_of(send, L, L.n)
        z_prev, z_scales = z, scales_of(row, L, 1)
    assert negative_zeros > 0, "no y was -0.0: the signed-zero case went untested"


@pytest.mark.parametrize("numel,n,block", CASES)
def test_worker_compression_matches_numpy_reference(numel, n, block):
    L = Layout.build(numel, n, block)
    g = torch.Generator().manual_seed(1)
    y_prev, prev_scales = _previous_state(L, g)
    err = kernels.worker_error(y_prev, prev_scales, L)
    x = torch.randn(numel, generator=g)
    _, send, _, new_err, _, _, _ = _run("avx2", L, x, y_prev, prev_scales, torch.zeros(L.chunk))
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
    y_prev, prev_scales = _previous_state(L, g)
    saved = (y_prev.clone(), prev_scales.clone())
    x = torch.randn(1000, generator=g)
    x[500] = float("inf")
    ok, send, *_ = _run(impl, L, x, y_prev, prev_scales, torch.zeros(L.chunk))
    assert ok is False
    assert_equal_tensors(y_prev, saved[0], f"{impl}: y_prev after a non-finite input")
    assert_equal_tensors(prev_scales, saved[1], f"{impl}: prev_scales after a non-finite input")
    assert kernels.row_status(send, L, L.n).tolist() == [1.0, 1.0]


def test_zero_block_gives_zero_scale_not_nan():
    L = Layout.build(64, 2)
    ok, send, _, err, _, _, out = _run("avx2", L, torch.zeros(64), torch.zeros(L.padded),
                                       torch.zeros(L.n * L.nblocks), torch.zeros(L.chunk))
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


def _compress_modes(impl, L, x, y_prev, prev_scales, z_prev, prev_server_scales):
    """Worker and server compression with y (z) into a spare buffer, not stored, and in place:
    (y, send, z, row) of each, as bytes."""
    def worker(y_out, y_from):
        send = torch.full((L.n * L.row_bytes,), 0xAB, dtype=torch.uint8)
        if impl == "torch":
            kernels.worker_compress(x, y_from, prev_scales, y_out, send, L, "torch")
        else:
            _C.worker_compress(x, y_from, prev_scales, y_out, send, *L.as_args(), impl == "avx2")
        return send

    def server(send, z_out, z_from):
        row = torch.full((L.row_bytes,), 0xCD, dtype=torch.uint8)
        if impl == "torch":
            kernels.server_compress(send, z_from, prev_server_scales, z_out, row, L, "torch")
        else:
            _C.server_compress(send, z_from, prev_server_scales, z_out, row, *L.as_args(),
                               impl == "avx2")
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
    case = _error_feedback_case(numel, n, block)
    L, x, y_prev, _, z_prev, _ = case
    saved = (y_prev.clone(), z_prev.clone())
    runs = {impl: _compress_modes(impl, *case) for impl in IMPLS}
    assert_equal_tensors(y_prev, saved[0], "y_prev after the compressions")
    assert_equal_tensors(z_prev, saved[1], "z_prev after the compressions")
    for impl, modes in runs.items():
        for mode, got in modes.items():
            assert got == runs["torch"]["spare"], (impl, mode)


def test_an_output_overlapping_the_previous_state_or_previous_rows_for_scales_are_refused():
    L = Layout.build(100, 2, 16)
    buf = torch.zeros(2 * L.padded)
    send = torch.zeros(L.n * L.row_bytes, dtype=torch.uint8)
    scales = torch.zeros(L.n * L.nblocks)
    with pytest.raises(RuntimeError, match="y_prev itself or not overlap it"):
        _C.worker_compress(torch.zeros(100), buf[:L.padded], scales, buf[8:8 + L.padded], send,
                           *L.as_args(), True)
    # the scales alone are kept, one float32 per block: whole rows in their place are refused
    with pytest.raises(RuntimeError, match="prev_scales must be Float"):
        _C.worker_compress(torch.zeros(100), buf[:L.padded], send.clone(), None, send,
                           *L.as_args(), True)
    with pytest.raises(RuntimeError, match=f"prev_scales has 1 elements, needs {L.nblocks}"):
        _C.server_compress(send, torch.zeros(L.chunk), torch.zeros(1), None,
                           torch.zeros(L.row_bytes, dtype=torch.uint8), *L.as_args(), True)


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


@pytest.mark.parametrize("seconds, noticed", [(0.0, False), (0.4, True)])
def test_a_load_at_first_use_is_quiet_unless_it_compiles(
        monkeypatch, capfd, seconds, noticed):
    """A load from torch's extension cache is quiet; one that takes longer than
    COMPILE_NOTICE_S (a build: another torch, another source) says what a compile costs."""
    import time

    import torch.utils.cpp_extension
    from hvd_onebit.kernels import native_loader

    def load(**kwargs):  # a build that takes ``seconds``
        time.sleep(seconds)
        return _C

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    monkeypatch.setattr(native_loader, "COMPILE_NOTICE_S", 0.1)
    assert native_loader._compile() is _C
    time.sleep(0.2)  # past the notice's time: a cancelled notice stays quiet
    err = capfd.readouterr().err
    assert ("the first use compiles them against this torch" in err) == noticed, \
        f"load of {seconds} s, notice after 0.1 s: stderr {err!r}"
